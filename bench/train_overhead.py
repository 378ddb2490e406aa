"""SFT throughput: the lmforge `sft` stage against a plain TRL SFTTrainer script, same model, data and settings.

    python bench/train_overhead.py [--pairs 3] [--steps 40] [--method full|lora] [--no-tracking]

Setup (built once): chat rows of varied length (1 to 16 numbers to add up, so batches carry padding as real
SFT does) written to a jsonl; the data stages ingest -> shard (no validation split) -> tokenizer (byte-level
BPE, 1024) run through lmforge; the model is a Llama built from a config (default 256 wide, 6 layers, ~5M
parameters: small enough that per-step costs show next to a step's compute on one thread).

The two sides, alternated A B A B ... so drift in the shared machine's load hits both alike:
A  lmforge: `execute_stage` of an sft stage (forced to rerun), as `lmforge run` does it: preflight in this
   process, then the real training child process (`python -m trainer.entry`) that reads the webdataset
   shards, builds the model, trains with the checkpoint and metrics callbacks (MLflow on a sqlite store,
   the default `tracking:`, unless --no-tracking), saves and publishes the artifact with its manifest.
B  plain: a fresh `python` running `plain_script()` below: reads the same jsonl, loads the same tokenizer
   folder, builds the same config with the same seed, SFTTrainer with the same settings (batch, max_length,
   steps, lr and schedule, seed, assistant-only loss, no packing, no activation checkpointing), no callbacks
   of ours, then saves the model.
Both count tokens the same way: the Trainer's `num_input_tokens_seen` with `include_num_input_tokens_seen=
"non_padding"` (lmforge always sets it; the plain script sets it too, it is a sum of the attention mask per
batch), divided by the time of the train loop: for lmforge the stage's own `tokens_per_s` (MetricsCallback,
on_train_begin -> on_train_end), for the plain script `train_runtime` (the Trainer's start of the loop ->
end of training, the same window). Same seed and data order: both sides see the same tokens, and the bench
checks it. End to end (process start, imports, model build, data, training, save) is reported separately.
Target (issue 4): lmforge tokens/s >= 0.97 x the plain script's.

On a shared machine the compute of a step swings with the load far more than any overhead, so both
training processes also time the Trainer's pieces (PROFILE_HOOK below): compute (batch, forward/backward,
clipping, optimizer), the log/save step, the other callbacks, and the rest. The compute is the same code
on the same data on both sides; the bench also prints the ratio with it held equal, which the load does not
blur. Where lmforge's extra time comes from (see the table's columns):
- connecting to MLflow (import, MlflowClient, opening the sqlite store with its schema check, once per run,
  slower under load) happens in MetricsCallback.__init__, before trainer.train(); it used to happen at the first
  on_log, inside the loop, and was most of the gap;
- each log is one synchronous `log_batch` to sqlite every logging_steps; the per-step callbacks (step timing, the
  checkpoint decision) are small against a step; nothing else differs (same data pipeline, same collator, same
  optimizer);
- end to end, on top of that: the stage process's preflight (the first time a process builds the model config
  and empty model; far less after), MLflow's exit hooks in the child, `write_model_info`, publishing the artifact
  (sha256 of every file, manifest, MLflow run and model registry).
Measured figures: docs/results.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_ints, model_config, plan_run, start, sum_chat_rows, write_jsonl  # noqa: E402

#: tokenizer vocabulary; the model's vocab_size is the trained tokenizer's size
VOCAB = 1024


def sft_settings(args) -> dict:
    """The sft stage's settings; the plain script gets the same values."""
    s = {"method": args.method, "max_steps": args.steps, "batch_size_per_device": args.batch,
         "max_length_tokens": args.max_length, "learning_rate": 1e-3, "lr_scheduler": "cosine", "warmup_steps": 2,
         "seed": 0, "logging_steps": 10, "evaluate": False, "assistant_only_loss": True, "packing": False,
         "cpu_threads": args.threads,  # the plain script gets the same count through OMP_NUM_THREADS
         "control_prompts": [],  # the before/after generations check has no counterpart in the plain script
         "base_model": {"config": model_config(args.hidden, args.layers, args.max_length)}}
    if args.method == "lora":
        s["lora"] = {"rank": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"}
    return s


# ----------------------------------------------------------------------------------------------
# B: the plain script. Imports TRL/transformers only (no lmforge), as a user's own script would.


def plain_script(data: str, tokenizer_dir: str, out: str, s: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    train = Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    body = dict(s["base_model"]["config"])
    config = AutoConfig.for_model(body.pop("model_type"), **body, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    set_seed(s["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    peft_config = None
    if s["method"] == "lora":
        from peft import LoraConfig

        lo = s["lora"]
        peft_config = LoraConfig(r=lo["rank"], lora_alpha=lo["alpha"], lora_dropout=lo["dropout"],
                                 target_modules=lo["target_modules"], bias="none", task_type="CAUSAL_LM")
    args = SFTConfig(
        output_dir=f"{out}/checkpoints", seed=s["seed"], data_seed=s["seed"], use_cpu=True, bf16=False,
        activation_checkpointing=False,  # TRL defaults it on; the stage's gradient_checkpointing is false
        max_steps=s["max_steps"], per_device_train_batch_size=s["batch_size_per_device"],
        learning_rate=s["learning_rate"], lr_scheduler_type=s["lr_scheduler"], warmup_steps=s["warmup_steps"],
        optim="adamw_torch",  # the stage's optimizer adamw_torch; transformers 5 would default to adamw_torch_fused
        max_length=s["max_length_tokens"], assistant_only_loss=s["assistant_only_loss"], packing=s["packing"],
        logging_steps=s["logging_steps"], save_strategy="no", report_to="none", disable_tqdm=True,
        include_num_input_tokens_seen="non_padding")
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tok, peft_config=peft_config)
    output = trainer.train()
    trainer.save_model(out)
    tokens = int(trainer.state.num_input_tokens_seen)
    seconds = output.metrics["train_runtime"]
    return {"tokens": tokens, "train_seconds": seconds, "tokens_per_s": tokens / seconds,
            "steps": trainer.state.global_step}


# ----------------------------------------------------------------------------------------------
# where the time of the train loop goes, on both sides alike

#: `sitecustomize.py` put on PYTHONPATH of both training processes (the stage's child and the plain script),
#: never of this one: it times the Trainer's pieces of each step and writes them out at exit. A perf_counter
#: pair around the few calls of a step costs little against the step itself, and both sides pay it.
PROFILE_HOOK = """
import atexit, collections, json, os, time

import torch.optim
import transformers.trainer as _t
import transformers.trainer_callback as _tc

_acc, _marks = collections.defaultdict(float), {}


def _wrap(cls, name, key=None):
    orig = getattr(cls, name)

    def timed(self, *a, **k):
        t = time.perf_counter()
        try:
            return orig(self, *a, **k)
        finally:
            k_ = key or (f"event:{a[0]}" if name == "call_event" else name)
            _acc[k_] += time.perf_counter() - t
            if k_ == "event:on_log" and "first_on_log" not in _acc:
                _acc["first_on_log"] = time.perf_counter() - t
            if k_ in ("event:on_train_begin", "event:on_train_end"):
                _marks[k_] = t

    setattr(cls, name, timed)


for _name in ("get_batch_samples", "training_step", "_clip_grad_norm", "_maybe_log_save_evaluate"):
    _wrap(_t.Trainer, _name)
_wrap(torch.optim.Optimizer, "zero_grad")
_wrap(torch.optim.AdamW, "step", "optimizer_step")
_wrap(_tc.CallbackHandler, "call_event")


@atexit.register
def _dump():
    if "event:on_train_end" in _marks:
        window = _marks["event:on_train_end"] - _marks["event:on_train_begin"]
        with open(os.path.join(os.environ["BENCH_PROFILE_DIR"], f"{os.getpid()}.json"), "w") as f:
            json.dump({"window": window, **_acc}, f)
"""

#: the Trainer's work per step that both sides run identically (same code, same data): load-sensitive compute
COMPUTE = ("get_batch_samples", "training_step", "_clip_grad_norm", "optimizer_step", "zero_grad")


def breakdown(prof: dict) -> dict:
    """Seconds of the train-loop window: compute, logging/saving (`_maybe_log_save_evaluate`: the log, and
    with it every on_log callback, the checkpoint saves and on_save callbacks), the other callback events
    (on_step_begin/end, ...), and the rest (the loop's own bookkeeping: lr scheduler, state, ...)."""
    compute = sum(prof.get(k, 0.0) for k in COMPUTE)
    log_save = prof.get("_maybe_log_save_evaluate", 0.0)
    inside = {"event:on_log", "event:on_save", "event:on_evaluate"}  # run inside _maybe_log_save_evaluate
    callbacks = sum(v for k, v in prof.items() if k.startswith("event:") and k not in inside
                    and k not in ("event:on_train_begin", "event:on_train_end"))
    return {"window": prof["window"], "compute": compute, "log_save": log_save, "on_log": prof.get("event:on_log", 0.0),
            "first_on_log": prof.get("first_on_log", 0.0), "callbacks": callbacks,
            "rest": prof["window"] - compute - log_save - callbacks}


def read_profile(folder: Path) -> dict:
    files = list(folder.glob("*.json"))
    if len(files) != 1:
        raise RuntimeError(f"expected one profile of a training process in {folder}, found {len(files)}")
    prof = json.loads(files[0].read_text())
    files[0].unlink()
    return breakdown(prof)


# ----------------------------------------------------------------------------------------------
# the bench


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=3, help="A B rounds")
    add_ints(ap, steps=40, rows=800)
    ap.add_argument("--method", choices=["full", "lora"], default="full")
    add_ints(ap, hidden=256, layers=6, batch=8, max_length=128)
    ap.add_argument("--threads", type=int, default=1,
                    help="math threads of every training process (cpu_threads; OMP_NUM_THREADS for the plain script)")
    ap.add_argument("--no-tracking", action="store_true", help="no MLflow (the stage then logs nowhere)")
    ap.add_argument("--plain", help=argparse.SUPPRESS)  # worker: json {data, tokenizer, out, settings}
    args = ap.parse_args()
    if args.plain:
        job = json.loads(args.plain)
        print(json.dumps(plain_script(job["data"], job["tokenizer"], job["out"], job["settings"])))
        return

    tmp = start("lmforge-bench-train-", args.threads)
    from lmforge.executor import execute_stage
    from lmforge.tracking import Tracker

    data = write_jsonl(tmp / "data" / "chat.jsonl", sum_chat_rows(args.rows))
    settings = sft_settings(args)
    raw = {"name": "bench-train", "store": str(tmp / "artifacts"),
           "datasets": {"chat": {"path": str(data), "kind": "chat"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["chat"]},
                      "shard": {"kind": "shard", "inputs": ["ingest"], "validation_fraction": 0.0},
                      "tokenizer": {"kind": "tokenizer", "inputs": ["shard"], "vocab_size": VOCAB},
                      "sft": {"kind": "sft", "inputs": ["shard", "tokenizer"], "retries": 0, **settings}}}
    tracker = None if args.no_tracking else Tracker(f"sqlite:///{tmp / 'mlflow.db'}", "bench-train")
    t0 = time.perf_counter()
    plan, ctx = plan_run(raw, tmp, tracker)
    for name in ("ingest", "shard", "tokenizer"):
        execute_stage(ctx, name)
    tok_dir = plan.store.require("tokenizer", plan.stages["tokenizer"].artifact_id).path
    print(f"data stages: {time.perf_counter() - t0:.1f}s ({args.rows} conversations)", flush=True)
    # the stage's preflight imports transformers in this process; `lmforge run` pays that once per pipeline,
    # not per stage, so it is paid here before the rounds
    import transformers  # noqa: F401

    hook, prof_dir = tmp / "hook", tmp / "profile"
    hook.mkdir()
    prof_dir.mkdir()
    (hook / "sitecustomize.py").write_text(PROFILE_HOOK)
    # from here on, for the training processes only (this one is running already)
    os.environ.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
                       "BENCH_PROFILE_DIR": str(prof_dir)})

    def lmforge_run(i: int) -> dict:
        plan, ctx = plan_run(raw, tmp, tracker, force=["sft"])
        if tracker is not None:
            ctx.parent_run_id = tracker.start_run(f"pipeline-{i}", {})
        t = time.perf_counter()
        execute_stage(ctx, "sft")
        e2e = time.perf_counter() - t
        r = plan.store.require("sft", plan.stages["sft"].artifact_id).result
        return {"tokens": r["tokens"], "train_seconds": r["train_seconds"], "tokens_per_s": r["tokens_per_s"],
                "steps": r["steps"], "e2e_seconds": e2e, **read_profile(prof_dir)}

    def plain_run(i: int) -> dict:
        job = {"data": str(data), "tokenizer": tok_dir, "out": str(tmp / f"plain-{i}"), "settings": settings}
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--plain", json.dumps(job)],
                              capture_output=True, text=True, cwd=tmp, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        e2e = time.perf_counter() - t
        if proc.returncode != 0:
            sys.exit(f"plain script failed:\n{proc.stderr[-3000:]}")
        return {**json.loads(proc.stdout.strip().splitlines()[-1]), "e2e_seconds": e2e, **read_profile(prof_dir)}

    def same_weights(i: int) -> bool:
        """The trained weights of both sides, bit for bit."""
        from safetensors.torch import load_file

        name = "model.safetensors" if args.method == "full" else "adapter_model.safetensors"
        a = load_file(f"{plan.store.require('sft', plan.stages['sft'].artifact_id).path}/{name}")
        b = load_file(f"{tmp / f'plain-{i}'}/{name}")
        return sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in a)

    runs: dict[str, list[dict]] = {"lmforge": [], "plain": []}
    identical = []
    try:
        for i in range(args.pairs):
            for side, fn in (("lmforge", lmforge_run), ("plain", plain_run)):
                r = fn(i)
                runs[side].append(r)
                print(f"  round {i + 1} {side:<8} {r['tokens_per_s']:>8,.0f} tokens/s  train {r['train_seconds']:6.2f}s "
                      f"(compute {r['compute']:6.2f}s, log+save {r['log_save']:5.2f}s, callbacks "
                      f"{r['callbacks']:5.3f}s, rest {r['rest']:5.2f}s)  end to end {r['e2e_seconds']:5.1f}s", flush=True)
            identical.append(same_weights(i))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    tokens = {r["tokens"] for rs in runs.values() for r in rs}
    if len(tokens) != 1:  # same seed, same rows, same order: anything else means the sides differ
        print(f"WARNING: the sides saw different token counts {sorted(tokens)}: not the same data or settings")
    keys = ("tokens_per_s", "train_seconds", "e2e_seconds", "compute", "log_save", "on_log", "first_on_log",
            "callbacks", "rest")
    med = {k: {m: median([r[m] for r in rs]) for m in keys} for k, rs in runs.items()}
    ratio = med["lmforge"]["tokens_per_s"] / med["plain"]["tokens_per_s"]
    e2e_ratio = med["plain"]["e2e_seconds"] / med["lmforge"]["e2e_seconds"]
    # The compute is the same code on the same data on both sides; on a shared machine it is also what swings
    # with the load. Holding it fixed (the median over all runs of both sides) and adding each side's own
    # non-compute time gives the ratio the load does not blur.
    compute = median([r["compute"] for rs in runs.values() for r in rs])
    extra = {k: median([r["train_seconds"] - r["compute"] for r in rs]) for k, rs in runs.items()}
    steady = (compute + extra["plain"]) / (compute + extra["lmforge"])
    cfg = settings["base_model"]["config"]
    print(f"\nsft overhead: {args.method}, llama {cfg['hidden_size']}x{cfg['num_hidden_layers']}, {args.steps} steps "
          f"of {args.batch} x <= {args.max_length} tokens, {args.threads} thread(s), tracking "
          f"{'off' if args.no_tracking else 'sqlite'}, {args.pairs} rounds (medians); load {os.getloadavg()[0]:.2f}\n")
    print(f"{'side':<9} {'tokens/s':>9} {'train s':>8} {'compute s':>10} {'log+save s':>11} {'all on_log s':>13} "
          f"{'1st on_log s':>13} {'callbacks s':>12} {'rest s':>7} {'end to end s':>13}")
    for k, m in med.items():
        print(f"{k:<9} {m['tokens_per_s']:>9,.0f} {m['train_seconds']:>8.2f} {m['compute']:>10.2f} "
              f"{m['log_save']:>11.3f} {m['on_log']:>13.3f} {m['first_on_log']:>13.3f} {m['callbacks']:>12.3f} "
              f"{m['rest']:>7.3f} {m['e2e_seconds']:>13.1f}")
    print("(log+save: the Trainer's log/checkpoint step with its on_log/on_save callbacks; all on_log also counts the "
          "final log, which falls in rest)")
    print(f"\ntokens/s lmforge / plain: {ratio:.3f} as measured; {steady:.3f} with the compute held equal "
          f"(target >= 0.97)")
    print(f"end to end plain / lmforge: {e2e_ratio:.3f}")
    print(f"same tokens on both sides: {len(tokens) == 1}; bit-identical trained weights in "
          f"{sum(identical)}/{len(identical)} rounds")
    print(json.dumps({"method": args.method, "steps": args.steps, "tokens": sorted(tokens), "ratio": round(ratio, 4),
                      "ratio_compute_equal": round(steady, 4), "e2e_ratio": round(e2e_ratio, 4),
                      "identical_weights": sum(identical),
                      **{f"{k}_{m}": round(v, 3) for k, d in med.items() for m, v in d.items()},
                      "loadavg": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
