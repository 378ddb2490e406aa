"""Peak memory of each training stage kind: the training process, its helpers, and the stage's own process.

    python bench/train_memory.py [--steps 4] [--hidden 256] [--layers 4] [--only sft_full,dpo_full,...]

One pipeline on the demo data (data/demo: text, chat, preference), run through `execute_stage` in this
process on a temp store: the data stages, then the tokenizer and every training stage kind that exists
(tasks/<kind>.py): pretrain, sft full / lora / qlora, reward, dpo lora (implicit reference) and full (a
frozen copy as reference), ppo, grpo. The model is a Llama built from a config (default 256 wide, 4 layers,
~3.2M parameters), a few optimizer steps each, one thread.
Columns, per stage:
- stage process: peak RSS of this process while the stage ran (VmHWM, reset before each stage through
  /proc/self/clear_refs). It runs the config checks and preflight (transformers config, an empty "meta"
  model) and publishes the artifact; the tokenizer stage trains in it;
- training process: the stage's own `peak_memory_mb` (the child's peak RSS on CPU, or torch's peak
  allocated GPU memory on a GPU);
- process tree: the largest sum of RSS over the training process and its children (DataLoader workers,
  torchrun ranks), sampled every 0.1 s; shared pages count once per process, and a spike between two
  samples is missed.
Issue 4: "peak memory per stage, reported".
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, add_ints, model_config, plan_run, start  # noqa: E402

DEMO = REPO / "data" / "demo"


def stages(args) -> dict[str, dict]:
    """Training stages by name; a stage whose kind has no tasks/<kind>.py yet is left out by the caller."""
    model = {"config": model_config(args.hidden, args.layers, 128)}
    common = {"max_steps": args.steps, "batch_size_per_device": 8, "max_length_tokens": 64, "learning_rate": 1e-3,
              "logging_steps": 2, "evaluate": False, "control_prompts": [], "retries": 0, "cpu_threads": args.threads}
    lora = {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
    sft = {"kind": "sft", "inputs": ["shard_chat", "tokenizer"], "base_model": model, **common}
    rl = {k: v for k, v in common.items() if k != "evaluate"}
    return {
        "pretrain": {"kind": "pretrain", "inputs": ["shard_text", "tokenizer"], "base_model": model, **common},
        "sft_full": {**sft, "method": "full"},
        "sft_lora": {**sft, "method": "lora", "lora": lora},
        "sft_qlora": {**sft, "method": "qlora", "lora": lora},
        "reward": {"kind": "reward", "inputs": ["shard_pairs", "sft_full"], "method": "lora", "lora": lora, **common},
        "dpo_lora": {"kind": "dpo", "inputs": ["shard_pairs", "sft_full"], "method": "lora", "lora": lora, **common},
        "dpo_full": {"kind": "dpo", "inputs": ["shard_pairs", "sft_full"], "method": "full", **common},
        "ppo": {"kind": "ppo", "inputs": ["shard_pairs", "sft_full", "reward"], "method": "lora", "lora": lora,
                **rl, "max_length_tokens": 64, "max_new_tokens": 16, "max_validation_prompts": 8},
        "grpo": {"kind": "grpo", "inputs": ["shard_pairs", "sft_full"], "method": "lora", "lora": lora, **rl,
                 "reward_functions": ["trainer.rewards:sum_correct"], "num_generations": 4,
                 "max_completion_tokens": 16, "max_validation_prompts": 8},
    }


def data_stages() -> dict[str, dict]:
    return {
        "ingest_text": {"kind": "ingest", "inputs": ["text"]},
        "shard_text": {"kind": "shard", "inputs": ["ingest_text"], "validation_fraction": 0.05},
        "ingest_chat": {"kind": "ingest", "inputs": ["chat"]},
        "shard_chat": {"kind": "shard", "inputs": ["ingest_chat"], "validation_fraction": 0.05},
        "ingest_pairs": {"kind": "ingest", "inputs": ["pairs"]},
        "shard_pairs": {"kind": "shard", "inputs": ["ingest_pairs"], "validation_fraction": 0.05},
        "tokenizer": {"kind": "tokenizer", "inputs": ["shard_text", "shard_chat"], "vocab_size": 400},
    }


def reset_peak() -> None:
    """Start this process's peak RSS (VmHWM) over from its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class TreeSampler:
    """The largest sum of RSS over this process's descendants, sampled in a thread."""

    def __init__(self, every_s: float = 0.1):
        self.every_s, self.peak_mb = every_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in me.children(recursive=True):
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_mb = max(self.peak_mb, total / 2**20)
            self._stop.wait(self.every_s)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_ints(ap, steps=4, hidden=256, layers=4)
    ap.add_argument("--threads", type=int, default=1, help="math threads of each training process (cpu_threads)")
    ap.add_argument("--only", help="comma-separated stage names (default: every one whose kind exists)")
    args = ap.parse_args()

    tmp = start("lmforge-bench-mem-", args.threads)
    import logging

    logging.getLogger("trainer.child").setLevel(logging.ERROR)  # library deprecation warnings of every child
    from lmforge.executor import execute_stage
    from tasks import REGISTRY

    wanted = stages(args)
    if args.only:
        wanted = {k: v for k, v in wanted.items() if k in args.only.split(",") or k == "sft_full"}
    missing = sorted({v["kind"] for v in wanted.values() if v["kind"] not in REGISTRY})
    training = {k: v for k, v in wanted.items() if v["kind"] in REGISTRY}
    if "ppo" in training and "reward" not in training:
        training.pop("ppo")
    raw = {"name": "bench-mem", "store": str(tmp / "artifacts"),
           "datasets": {"text": {"path": str(DEMO / "text.jsonl"), "kind": "text"},
                        "chat": {"path": str(DEMO / "chat.jsonl"), "kind": "chat"},
                        "pairs": {"path": str(DEMO / "preference.jsonl"), "kind": "preference"}},
           "stages": {**data_stages(), **training}}
    try:
        plan, ctx = plan_run(raw, tmp)
        t0 = time.perf_counter()
        for name in ("ingest_text", "shard_text", "ingest_chat", "shard_chat", "ingest_pairs", "shard_pairs"):
            execute_stage(ctx, name)
        print(f"data stages: {time.perf_counter() - t0:.1f}s", flush=True)

        rows = []
        failed: set[str] = set()
        for name in ["tokenizer", *training]:
            spec = raw["stages"][name]
            row = {"stage": name, "kind": spec["kind"], "method": spec.get("method", "")}
            blocked = [i for i in spec["inputs"] if i in failed]
            if blocked:
                rows.append({**row, "error": f"skipped: input {', '.join(blocked)} failed"})
                failed.add(name)
                continue
            reset_peak()
            t = time.perf_counter()
            try:
                with TreeSampler() as tree:
                    execute_stage(ctx, name)
            except Exception as e:  # noqa: BLE001  a stage under construction elsewhere: report it, go on
                rows.append({**row, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:100]}"})
                failed.add(name)
                print(f"  {name}: FAILED {rows[-1]['error']}", flush=True)
                continue
            sp = plan.stages[name]
            result = plan.store.require(sp.kind, sp.artifact_id).result
            rows.append({**row, "seconds": time.perf_counter() - t, "steps": result.get("steps"),
                         "parent_mb": peak_mb(), "child_mb": result.get("peak_memory_mb"), "tree_mb": tree.peak_mb})
            print(f"  {name}: {rows[-1]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    cfg = model_config(args.hidden, args.layers, 128)
    print(f"\npeak memory per stage: llama {cfg['hidden_size']}x{cfg['num_hidden_layers']} from a config, batch 8 x "
          f"<= 64 tokens, {args.steps} steps, {args.threads} thread(s), CPU; load {os.getloadavg()[0]:.2f}\n")
    print(f"{'stage':<10} {'kind':<9} {'method':<6} {'steps':>5} {'seconds':>8} {'stage process MB':>17} "
          f"{'training process MB':>20} {'process tree MB':>16}")
    for r in rows:
        if "error" in r:
            print(f"{r['stage']:<10} {r['kind']:<9} {r['method']:<6} {r['error']}")
            continue
        child = f"{r['child_mb']:,.0f}" if r["child_mb"] is not None else "(in process)"
        tree = f"{r['tree_mb']:,.0f}" if r["tree_mb"] > 0 else "-"
        print(f"{r['stage']:<10} {r['kind']:<9} {r['method']:<6} {r['steps'] or '':>5} {r['seconds']:>8.1f} "
              f"{r['parent_mb']:>17,.0f} {child:>20} {tree:>16}")
    if missing:
        print(f"\nnot measured: no stage kind {', '.join(missing)} (tasks/<kind>.py) in this checkout")
    print(json.dumps({"rows": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in rows],
                      "missing_kinds": missing, "loadavg": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
