"""The memory estimate of every training stage of a pipeline, against the measured peak of that stage on CPU.

    python bench/estimate_pipeline.py [--config configs/smollm2_lora.yaml] [--store DIR] [--steps 3] [--json FILE]

For each training stage of the config (sft, reward, dpo, ppo, grpo, pretrain) the script adds a `preflight` stage
(tasks/preflight.py): `steps` real optimizer steps of that stage, on its own planned settings, inputs and data, in
its own training child, which measures its peak RSS above its non-model RSS at the start of training, and
trainer/estimate.py's estimate of the same settings on CPU (the `comparable` part; docs/results.md#estimate says
what each side holds). Then it runs the pipeline with `lmforge run`. With `--store` pointing at the store of a
finished run of the same config (a bench/demo_sweep.py sweep's `artifacts`, or the project's own), every other
stage is cached, so only the preflights run (a preflight does not change its stage's artifact id). On an empty
store the whole pipeline runs first. The preflights are read from the store by their planned ids, so a run whose
eval gates fail still reports them.

Prints, per training stage, the row length the estimate was taken at (the mean padded row the preflight measured;
ppo, which has no padding meter: max_length_tokens), the estimate, the measured peak, the error in percent (target:
within +-15%), the estimate at max_length_tokens (what `lmforge estimate` plans with, an upper bound) and the whole
`lmforge estimate` figure for a GPU (bf16 weights; what a user reads before renting).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TRAINING_KINDS = ("pretrain", "sft", "reward", "dpo", "ppo", "grpo")


def main() -> int:
    from bench.demo_sweep import cpu_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "smollm2_lora.yaml"))
    ap.add_argument("--store", help="the store of a finished run of this config (default: a new temp folder)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps of each preflight")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    config = Path(args.config).resolve()
    cfg = yaml.safe_load(config.read_text())
    training = [n for n, s in cfg["stages"].items() if s["kind"] in TRAINING_KINDS]
    work = Path(tempfile.mkdtemp(prefix="lmforge-estimate-"))
    store = Path(args.store).resolve() if args.store else work / "artifacts"
    sets = [f"store={store}", f"tracking=sqlite:///{work / 'mlflow.db'}"]
    sets += [f"stages.preflight_{n}={{kind: preflight, stage: {n}, steps: {args.steps}}}" for n in training]
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config)]
    for s in sets:
        cmd += ["-o", s]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(work / "prefect")}
    print(f"estimate_pipeline: {config.name}, preflights of {', '.join(training)}, store {store}, log "
          f"{work / 'log.txt'}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(work / "log.txt", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - t0
    from bench.demo_sweep import ids

    planned = ids(sets, config)  # a run whose eval gates failed writes no summary; its preflights are in the store
    rows = []
    for n in training:
        path = store / "preflight" / planned[f"preflight_{n}"] / "preflight.json"
        if not path.exists():
            rows.append({"stage": n, "error": f"preflight_{n}: not run (see the log)"})
            continue
        pf = json.loads(path.read_text())
        rows.append({"stage": n, "kind": pf["kind"], "method": pf["method"],
                     "estimate_mb": pf["estimate_compared_mb"], "measured_mb": pf["peak_above_baseline_mb"],
                     "error_pct": pf["estimate_error_pct"], "peak_rss_mb": pf["peak_memory_mb"],
                     "row_tokens": pf.get("estimate_row_tokens"),
                     "estimate_at_max_length_mb": pf.get("estimate_at_max_length_mb"),
                     "gpu_estimate_gib": round(pf["estimate_mb"] / 1024, 3) if pf.get("estimate_mb") else None,
                     "step_s": pf["step_time_s"]})
    print(f"Estimate against the measured peak, {config.relative_to(REPO) if config.is_relative_to(REPO) else config}"
          f", {time.strftime('%Y-%m-%d')}, {cpu_name()}, {args.steps} steps per stage, {wall:.0f} s "
          f"(`python bench/estimate_pipeline.py`)\n")
    print("| stage | kind, method | row tokens | estimate MB | measured MB (peak above baseline) | error | "
          "estimate at max_length_tokens MB | peak RSS MB | step s |\n|---|---|---|---|---|---|---|---|---|")
    ok = rc == 0
    for r in rows:
        if "error" in r:
            print(f"| {r['stage']} | {r['error']} | | | | | | | |")
            ok = False
            continue
        inside = r["error_pct"] is not None and abs(r["error_pct"]) <= 15
        ok &= inside
        at_max = r["estimate_at_max_length_mb"]
        print(f"| {r['stage']} | {r['kind']}, {r['method']} | {r['row_tokens'] or ''} | {r['estimate_mb']:,.1f} | "
              f"{r['measured_mb']:,.1f} | {r['error_pct']:+.1f}%{'' if inside else ' **outside +-15%**'} | "
              f"{f'{at_max:,.1f}' if at_max is not None else ''} | {r['peak_rss_mb']:,.0f} | {r['step_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(f"\n{'every stage within +-15%' if ok else 'NOT every stage within +-15%'} (lmforge run exit {rc})",
          file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
