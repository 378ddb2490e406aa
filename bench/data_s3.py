"""Data stages on an S3 store against a local store: end-to-end docs/s per core, side by side.

    python bench/data_s3.py [--docs 20000] [--workers 1] [--seed 0] [--rounds 1]

The same pipeline (ingest -> filter -> dedup -> shard) of the filter benchmark's synthetic 1-2 KB documents
(bench/filter.py, about 40% of them tripping a rule) plus 10% exact copies runs twice in this process, without
Prefect: once with the store in a local folder, once with it on S3 (a SeaweedFS `weed mini` started on 127.0.0.1
for the run, tests/s3server.py; the raw input stays a local file in both). Every stage reads its input artifact
from the store and publishes its output there, so the S3 side pays for the uploads, the listings and the
ranged reads. Both runs must give the same artifact ids. docs/s per core = input documents / seconds / worker
processes (stages that take `workers` get `--workers`). `--rounds` repeats both sides, alternating, and keeps each
side's best time.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import add_ints, plan_run, start, write_jsonl  # noqa: E402
from bench.filter import corpus  # noqa: E402

log = logging.getLogger("bench.data_s3")
STAGES = ("ingest", "filter", "dedup", "shard")


def config(store: str, workers: int) -> dict:
    return {
        "name": "bench-data-s3", "store": store,
        "datasets": {"text": {"path": "data/text.jsonl", "kind": "text"}},
        "stages": {
            "ingest": {"kind": "ingest", "inputs": ["text"]},
            "filter": {"kind": "filter", "inputs": ["ingest"], "workers": workers},
            "dedup": {"kind": "dedup", "inputs": ["filter"], "workers": workers},
            "shard": {"kind": "shard", "inputs": ["dedup"]},
        },
    }


def run_side(root: Path, store: str, workers: int) -> tuple[dict[str, float], dict[str, str]]:
    """Each stage's seconds and artifact id, the stages run one after another in this process."""
    from lmforge.executor import execute_stage

    plan, ctx = plan_run(config(store, workers), root)
    seconds, ids = {}, {}
    for name in STAGES:
        t0 = time.perf_counter()
        execute_stage(ctx, name)
        seconds[name] = time.perf_counter() - t0
        ids[name] = plan.stages[name].artifact_id
    return seconds, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_ints(ap, docs=20_000, workers=1, seed=0, rounds=1)
    args = ap.parse_args()
    tmp = start("lmforge-bench-data-s3-", 1)
    logging.getLogger("bench").setLevel(logging.INFO)

    from tests.helpers import aws_environment
    from tests.s3server import S3Server

    docs = corpus(args.docs, args.seed, 2000)
    docs += [dict(d, id=f"{d['id']}-copy") for d in docs[: args.docs // 10]]
    mb = sum(len(d["text"].encode()) for d in docs) / 2**20
    write_jsonl(tmp / "data/text.jsonl", docs)
    log.info("%d documents, %.1f MB", len(docs), mb)

    server = S3Server(tmp / "s3").start()
    best: dict[str, dict[str, float]] = {}
    ids: dict[str, dict[str, str]] = {}
    try:
        with aws_environment(server.env()):
            server.make_bucket("bench")
            for r in range(args.rounds):
                for side in ("local", "s3"):
                    store = str(tmp / f"store-{r}") if side == "local" else f"s3://bench/run-{r}"
                    seconds, ids[side] = run_side(tmp, store, args.workers)
                    if side == "local":
                        shutil.rmtree(tmp / f"store-{r}")
                    prev = best.get(side)
                    if prev is None or sum(seconds.values()) < sum(prev.values()):
                        best[side] = seconds
                    log.info("round %d %s: %.1f s", r, side, sum(seconds.values()))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    assert ids["local"] == ids["s3"], f"artifact ids differ: {ids}"

    n = len(docs)
    procs = {"ingest": 1, "filter": args.workers, "dedup": args.workers, "shard": 1}
    w = sys.stdout.write
    w(f"\ndata stages, local store vs S3 store: {n} docs, {mb:.1f} MB, workers {args.workers}, "
      f"best of {args.rounds}\n\n")
    w(f"{'stage':<10}{'procs':>6}{'local s':>10}{'s3 s':>10}{'local docs/s/core':>19}{'s3 docs/s/core':>16}"
      f"{'s3/local':>10}\n")
    for name in (*STAGES, "total"):
        lo = sum(best["local"].values()) if name == "total" else best["local"][name]
        s3 = sum(best["s3"].values()) if name == "total" else best["s3"][name]
        p = max(procs.values()) if name == "total" else procs[name]
        w(f"{name:<10}{p:>6}{lo:>10.2f}{s3:>10.2f}{n / lo / p:>19.0f}{n / s3 / p:>16.0f}{lo / s3:>10.2f}\n")


if __name__ == "__main__":
    main()
