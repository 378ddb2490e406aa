"""The demo over a sweep of seeds and thread counts: does every run land inside the bands configs/demo.yaml declares?

    python bench/demo_sweep.py [--config configs/demo.yaml] [--runs 8] [--threads alternate|config] [--parallel 1]
                               [--out DIR] [--json FILE] [-o KEY=VALUE ...] [--report]

One machine is bit-reproducible with itself, so it can never show that a result is robust: another CPU sums floats
in another order. A sweep is the stand-in for "another machine". Run k (k = 0 .. runs-1) is `lmforge run
configs/demo.yaml` with every training stage's `seed` set to k (the model init, LoRA init, data order and dropout)
and `cpu_threads` 2 for even k, 1 for odd k (run 0 is the shipped config). All runs share one artifact store, so
the data stages and the tokenizer run once; each run has its own MLflow file. `-o KEY=VALUE` overrides go to every
run (for example `-o stages.sft.learning_rate=1e-2`, to see the bands catch a broken setting).

`--config configs/smollm2_lora.yaml --threads config` sweeps the SmolLM2 pipeline the same way (seeds only: each
training stage keeps the cpu_threads its config gives it, which decide its wall time there).

The bands come from one place, the eval stage's `expect:` in the config; the eval stage fails a run that
lands outside one, and tests/test_demo.py holds a fresh demo to them. The script prints, in Markdown:
- per banded metric: its band, the min and max over the sweep, and whether every run is inside;
- per must-beat gate: the smallest improvement over the sweep, in stderrs of the difference (the gate asks > 2);
- the decontaminate stages' matches (held-out questions found in training data: expected 0);
- per run: seed, threads, wall time and the headline figures.
Its tables go into docs/results.md (the demo-bands section), with the date and CPU it ran on; the README shows the
bands alone.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "demo.yaml"
TRAINING_KINDS = ("pretrain", "sft", "reward", "dpo", "ppo", "grpo")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def training_stages(cfg: dict) -> list[str]:
    return [n for n, s in cfg["stages"].items() if s["kind"] in TRAINING_KINDS]


def headline(cfg: dict) -> list[str]:
    """The banded metrics, in the config's order (a config without bands yet: its gates' metrics)."""
    ev = cfg["stages"]["eval"]
    return list(dict.fromkeys(e["metric"] for e in ev.get("expect") or ev.get("gates", [])))


def run_one(k: int, out: Path, overrides: list[str], config: Path = CONFIG, threads_mode: str = "alternate") -> dict:
    """`lmforge run` of the config with seed k on every training stage; the summary, read back."""
    cfg = yaml.safe_load(config.read_text())
    threads: int | str = (2 if k % 2 == 0 else 1) if threads_mode == "alternate" else "config"
    sets = [f"store={out / 'artifacts'}", f"tracking=sqlite:///{out / f'mlflow-{k}.db'}"]
    sets += [f"stages.{s}.seed={k}" for s in training_stages(cfg)]
    if threads_mode == "alternate":
        sets += [f"stages.{s}.cpu_threads={threads}" for s in training_stages(cfg)]
    sets += overrides
    cmd = [sys.executable, "-m", "flows.cli", "run", str(config)]
    for s in sets:
        cmd += ["-o", s]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(out / f"prefect-{k}")}
    t0 = time.monotonic()
    with open(out / f"log-{k}.txt", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - t0
    print(f"run {k} (seed {k}, {threads} thread(s)): exit {rc} in {wall:.0f}s", file=sys.stderr, flush=True)
    run = {"k": k, "seed": k, "threads": threads, "exit": rc, "wall_seconds": round(wall, 1),
           "ids": ids(sets, config)}
    (out / f"run-{k}.json").write_text(json.dumps(run))
    return run


def ids(sets: list[str], config: Path = CONFIG) -> dict[str, str]:
    """Each stage's artifact id under these overrides (the plan's; a failed run writes no summary, and an eval
    stage whose gates or bands fail still publishes its artifact)."""
    from lmforge.config import load_config
    from lmforge.plan import make_plan
    from tasks import REGISTRY

    plan = make_plan(load_config(config, REGISTRY, sets), REGISTRY)
    return {n: sp.artifact_id for n, sp in plan.stages.items()}


def manifest(out: Path, cfg: dict, name: str, run: dict) -> dict | None:
    path = out / "artifacts" / cfg["stages"][name]["kind"] / run["ids"][name] / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def value(scores: dict, path: str) -> float | None:
    model, task, metric = path.split("/")
    return scores.get(model, {}).get(task, {}).get(metric)


def band_text(lo: float | None, hi: float | None) -> str:
    if lo is None:
        return f"≤ {hi:g}"
    if hi is None:
        return f"≥ {lo:g}"
    return f"{lo:g}–{hi:g}"


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def report(runs: list[dict], cfg: dict, out: Path, config: Path = CONFIG, threads_mode: str = "alternate") \
        -> tuple[str, bool]:
    ev_cfg = cfg["stages"]["eval"]
    heads = headline(cfg)
    rel = config.resolve().relative_to(REPO) if config.resolve().is_relative_to(REPO) else config
    flags = "" if rel == CONFIG.relative_to(REPO) else f" --config {rel} --threads {threads_mode}"
    tag = "demo-bands" if rel == CONFIG.relative_to(REPO) else f"{cfg['name']}-bands"
    evals = {}
    for r in runs:
        m = manifest(out, cfg, "eval", r)
        evals[r["k"]] = m["result"] if m else None
    ok = all(r["exit"] == 0 for r in runs) and all(evals.values())  # exit 1: a gate or band failed
    lines = [f"Sweep of {len(runs)} runs of {rel}, {dt.date.today().isoformat()}, {cpu_name()}, "
             f"`python bench/demo_sweep.py{flags} --runs {len(runs)}`", "",
             f"<!-- {tag}: made by bench/demo_sweep.py; the bands are {rel}'s eval `expect:` -->",
             "| held-out metric | band | sweep min–max | every run inside |", "|---|---|---|---|"]
    for e in ev_cfg.get("expect", []):
        vals = [value(res["eval"], e["metric"]) for res in evals.values() if res]
        got = [v for v in vals if v is not None]
        inside = len(got) == len(runs) and all((e.get("min") is None or v >= e["min"]) and
                                               (e.get("max") is None or v <= e["max"]) for v in got)
        ok &= inside
        lines.append(f"| `{e['metric']}` | {band_text(e.get('min'), e.get('max'))} | "
                     f"{fmt(min(got) if got else None)}–{fmt(max(got) if got else None)} | "
                     f"{'yes' if inside else '**no**'} |")
    lines += [f"<!-- /{tag} -->", "", "| must-beat gate | smallest improvement | in stderrs (gate: > 2) | "
              "every run passed |", "|---|---|---|---|"]
    for g in ev_cfg.get("gates", []):
        if g.get("min_improvement") is None:
            continue
        rows = [next((x for x in res["gates"] if x["metric"] == g["metric"] and x["against"] == g["against"]), {})
                for res in evals.values() if res]
        imp = [x["improvement"] for x in rows if "improvement" in x]
        zs = [x["improvement"] / x["stderr"] for x in rows if x.get("stderr")]
        passed = len(rows) == len(runs) and all(x.get("passed") for x in rows)
        ok &= passed
        lines.append(f"| `{g['metric']}` > {g['against']} | {fmt(min(imp) if imp else None)} | "
                     f"{f'{min(zs):.1f}' if zs else '-'} | {'yes' if passed else '**no**'} |")
    decon = [n for n, s in cfg["stages"].items() if s["kind"] == "decontaminate"]
    found = {n: sorted({(manifest(out, cfg, n, r) or {}).get("result", {}).get("dropped", {})
                        .get("contaminated", 0) for r in runs}) for n in decon}
    lines += ["", "Held-out questions found in training data (decontaminate stages, records removed): " +
              ", ".join(f"{n} {'/'.join(map(str, v))}" for n, v in found.items()), "",
              "| run | seed | threads | exit | wall s | " + " | ".join(f"`{h}`" for h in heads) + " |",
              "|---" * (5 + len(heads)) + "|"]
    for r in runs:
        res = evals[r["k"]]
        vals = [fmt(value(res["eval"], h)) if res else "-" for h in heads]
        lines.append(f"| {r['k']} | {r['seed']} | {r['threads']} | {r['exit']} | {r['wall_seconds']:.0f} | "
                     + " | ".join(vals) + " |")
    return "\n".join(lines), ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(CONFIG), help="the pipeline to sweep (default: configs/demo.yaml)")
    ap.add_argument("--runs", type=int, default=8, help="perturbed runs (seeds 0..runs-1)")
    ap.add_argument("--threads", choices=("alternate", "config"), default="alternate",
                    help="alternate: cpu_threads 2 for even runs, 1 for odd ones (every training stage); config: "
                    "each stage keeps its config's")
    ap.add_argument("--parallel", type=int, default=1, help="runs at a time (wall times then overlap)")
    ap.add_argument("--out", help="folder for the store, logs and summaries (default: a new temp folder)")
    ap.add_argument("--json", help="also write every run's figures here")
    ap.add_argument("-o", "--override", action="append", default=[], help="KEY=VALUE for every run")
    ap.add_argument("--report", action="store_true", help="only print the tables of the sweep already in --out")
    args = ap.parse_args()
    config = Path(args.config).resolve()
    out = Path(args.out or tempfile.mkdtemp(prefix="lmforge-sweep-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"sweep: {args.runs} runs in {out}", file=sys.stderr, flush=True)
    if args.report:
        runs = [json.loads((out / f"run-{k}.json").read_text()) for k in range(args.runs)]
    else:  # the first run alone: it makes the data stages and the tokenizer every other run reuses
        runs = [run_one(0, out, args.override, config, args.threads)]
        with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
            runs += list(pool.map(lambda k: run_one(k, out, args.override, config, args.threads),
                                  range(1, args.runs)))
    cfg = yaml.safe_load(config.read_text())
    text, ok = report(runs, cfg, out, config, args.threads)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{**r, "eval": (manifest(out, cfg, "eval", r) or {}).get("result", {}).get("eval")} for r in runs],
            indent=2))
    print(f"\n{'every run inside every band' if ok else 'NOT every run inside its bands'}; logs in {out}",
          file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
