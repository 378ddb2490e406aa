"""Checkpoint cost: time to write and upload checkpoints, as a share of the training time between them.

    python bench/checkpoint_cost.py [--checkpoints 2] [--hidden 128] [--layers 4] [--batch 8]

Runs the sft stage (full fine-tuning: the largest checkpoint, weights plus two AdamW states) at the default
`checkpoint_every_steps` (trainer/settings.py), for `--checkpoints` x that many steps plus 10, once with a
local store and once with an S3 store (SeaweedFS on 127.0.0.1, tests/s3server.py; shards are read from it and
checkpoints uploaded to it). The whole pipeline (ingest, shard, tokenizer, sft) runs on each store.
Measured in the training process by `trainer.checkpoint.CheckpointCallback`, which logs per checkpoint
"checkpoint N: written in Xs" and, at its upload's join, the line below (this bench reads them from the log):
- written: from the end of the step that asks for a checkpoint to `on_save`, i.e. the Trainer writing
  checkpoint-N/ (model safetensors, optimizer, scheduler, RNG, trainer_state.json); a log falling on the
  same step (every `logging_steps`, so at 200 too) is inside it, so this is an upper bound;
- uploaded: copy to `{store}/sft/{id}/_checkpoints/checkpoint-N/` with a sha256 per file, DONE, then prune, in
  a background thread ("uploaded and pruned in Ys in the background; the training waited Zs for it");
- waited: how long the training waited for that upload (at the next save, or at the end of training).
Share = (written + waited) / (interval x mean step time), the step time being the train loop's time without
the checkpoints, over the steps. The share depends on the model and batch: checkpoint bytes grow with the
parameters, step time with parameters x tokens per step; with the same batch, a bigger model gives about the
same share (the per-file and per-request costs weigh less), a bigger batch or longer sequences a smaller one.
Target (issue 4): under 2% at the default interval.

Where the time goes: the Trainer's local write; a local store's upload is a copy; an S3 upload is the checkpoint's
PUTs one after the other (the local SeaweedFS shares the cores with the training), makedirs/exists, the DONE marker
and prune's listing; sha256 weighs little. The upload and prune run in a background thread per checkpoint (joined
before the next save, at the end of training and after a SIGTERM's save), so the training loop pays the write, and
the upload only when it is still running at the next save ("waited"). On few cores the upload thread competes with
the training for CPU, which neither share counts: the steps around a checkpoint run a little slower (visible in
train_s against a run without checkpoints). Measured figures: docs/results.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_ints, model_config, plan_run, start, sum_chat_rows, write_jsonl  # noqa: E402

WRITTEN = re.compile(r"checkpoint (\d+): written in ([\d.]+)s")
UPLOADED = re.compile(r"checkpoint (\d+): uploaded and pruned in ([\d.]+)s in the background; the training waited "
                      r"([\d.]+)s")
SIZE = re.compile(r"checkpoint (\d+) uploaded: (\d+) files, ([\d.]+) MB")


class ChildLines(logging.Handler):
    """The training process's log lines, as `trainer.launch` forwards them (logger `trainer.child`)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_pipeline(store: str, data: Path, tmp: Path, args, every: int, lines: ChildLines) -> dict:
    from lmforge.executor import execute_stage
    from lmforge.tracking import Tracker

    steps = args.checkpoints * every + 10  # the final step is no checkpoint: the recipe writes the model itself
    raw = {"name": "bench-ckpt", "store": store, "datasets": {"chat": {"path": str(data), "kind": "chat"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["chat"]},
                      "shard": {"kind": "shard", "inputs": ["ingest"], "validation_fraction": 0.0},
                      "tokenizer": {"kind": "tokenizer", "inputs": ["shard"], "vocab_size": 1024},
                      "sft": {"kind": "sft", "inputs": ["shard", "tokenizer"], "method": "full", "max_steps": steps,
                              "batch_size_per_device": args.batch, "max_length_tokens": args.max_length,
                              "learning_rate": 1e-3, "evaluate": False, "control_prompts": [], "retries": 0,
                              "cpu_threads": args.threads,
                              "base_model": {"config": model_config(args.hidden, args.layers, args.max_length)}}}}
    tracker = Tracker(f"sqlite:///{tmp / 'mlflow.db'}", "bench-ckpt")  # the default `tracking:` kind
    plan, ctx = plan_run(raw, tmp, tracker)
    ctx.parent_run_id = tracker.start_run("pipeline", {})
    for name in ("ingest", "shard", "tokenizer"):
        execute_stage(ctx, name)
    lines.lines.clear()
    t0 = time.perf_counter()
    execute_stage(ctx, "sft")
    stage_s = time.perf_counter() - t0
    r = plan.store.require("sft", plan.stages["sft"].artifact_id).result
    written_at = {int(m.group(1)): float(m.group(2)) for m in map(WRITTEN.search, lines.lines) if m}
    timed = [(float(m.group(1)), written_at[int(m.group(1))], float(m.group(2)), float(m.group(3)))
             for m in map(UPLOADED.search, lines.lines) if m]
    sizes = [float(m.group(3)) for m in map(SIZE.search, lines.lines) if m]
    files = [int(m.group(2)) for m in map(SIZE.search, lines.lines) if m]
    if [int(t[0]) for t in timed] != r["checkpoints_uploaded"]:
        raise RuntimeError(f"checkpoint timings {timed} do not match the uploaded checkpoints "
                           f"{r['checkpoints_uploaded']}; did trainer/checkpoint.py's log line change?")
    written, uploaded, waited = [t[1] for t in timed], [t[2] for t in timed], [t[3] for t in timed]
    ckpt_s = sum(written) + sum(waited)  # what the training loop spent on checkpoints: the upload runs beside it
    step_s = (r["train_seconds"] - ckpt_s) / r["steps"]
    return {"steps": r["steps"], "checkpoints": r["checkpoints_uploaded"], "train_s": r["train_seconds"],
            "stage_s": stage_s, "mb": statistics.mean(sizes), "files": files[0] if files else 0,
            "written_s": statistics.mean(written), "uploaded_s": statistics.mean(uploaded),
            "waited_s": statistics.mean(waited), "step_s": step_s,
            "share": (statistics.mean(written) + statistics.mean(waited)) / (every * step_s),
            "share_of_run": ckpt_s / r["train_seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoints", type=int, default=2, help="checkpoints per run, at the default interval")
    add_ints(ap, hidden=128, layers=4, batch=8, max_length=128, rows=2000)
    ap.add_argument("--threads", type=int, default=1, help="math threads of the training process (cpu_threads)")
    ap.add_argument("--stores", default="local,s3")
    args = ap.parse_args()

    tmp = start("lmforge-bench-ckpt-", args.threads)
    lines = ChildLines()
    child = logging.getLogger("trainer.child")
    child.setLevel(logging.INFO)
    child.addHandler(lines)
    child.propagate = False
    from trainer.settings import TrainSettings

    every = TrainSettings.model_fields["checkpoint_every_steps"].default
    data = write_jsonl(tmp / "chat.jsonl", sum_chat_rows(args.rows))

    rows = {}
    stores = args.stores.split(",")
    try:
        if "local" in stores:
            (tmp / "local").mkdir()
            rows["local"] = run_pipeline(str(tmp / "local" / "artifacts"), data, tmp / "local", args, every, lines)
            print(f"local done: {rows['local']}", flush=True)
        if "s3" in stores:
            from tests.s3server import S3Server

            (tmp / "s3").mkdir()
            with S3Server(tmp / "s3server") as s3:
                os.environ.update(s3.env())
                s3.make_bucket("bench")
                rows["s3"] = run_pipeline("s3://bench/store", data, tmp / "s3", args, every, lines)
            print(f"s3 done: {rows['s3']}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    cfg = model_config(args.hidden, args.layers, args.max_length)
    print(f"\ncheckpoint cost: sft full, llama {cfg['hidden_size']}x{cfg['num_hidden_layers']}, batch {args.batch} x <= "
          f"{args.max_length} tokens, checkpoint every {every} steps (the default), {args.threads} thread(s); "
          f"load {os.getloadavg()[0]:.2f}\n")
    print(f"{'store':<6} {'ckpts':>6} {'MB':>6} {'files':>6} {'write s':>8} {'upload s':>9} {'waited s':>9} "
          f"{'step s':>7} {'share of interval':>18} {'share of run':>13}")
    for k, r in rows.items():
        print(f"{k:<6} {len(r['checkpoints']):>6} {r['mb']:>6.1f} {r['files']:>6} {r['written_s']:>8.3f} "
              f"{r['uploaded_s']:>9.3f} {r['waited_s']:>9.3f} {r['step_s']:>7.3f} {100 * r['share']:>17.2f}% "
              f"{100 * r['share_of_run']:>12.2f}%")
    print("\n(write: step end -> on_save, includes that step's log; upload: copy + sha256 + DONE + prune, in a "
          "background thread; waited: the training's wait for that upload at the next save or the end; "
          "share of interval: (write + waited) / (interval x step time); target < 2%)")
    print(json.dumps({"every_steps": every, **{f"{k}_{m}": (round(v, 4) if isinstance(v, float) else v)
                                               for k, r in rows.items() for m, v in r.items()},
                      "loadavg": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
