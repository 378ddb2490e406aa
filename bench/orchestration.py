"""Orchestration overhead: a fully cached rerun of configs/demo.yaml vs a trivial one-task Prefect flow.

    python bench/orchestration.py [--repeats 3]

Both run as fresh processes in the same environment (same interpreter, same temp PREFECT_HOME,
Prefect's ephemeral API), so both pay interpreter start, imports and the temporary API server.
The demo gets its own temp store and MLflow db, run once untimed so every stage is cached.
Target (issue 2): cached rerun / trivial flow <= 1.5.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRIVIAL = """
from prefect import flow, task

@task
def one():
    return 1

@flow
def trivial():
    return one()

trivial()
"""


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-bench-orch-"))
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "DO_NOT_TRACK": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    demo = [sys.executable, "-m", "flows.cli", "run", "configs/demo.yaml", "-o", f"store={tmp / 'artifacts'}",
            "-o", f"tracking=sqlite:///{tmp / 'mlflow.db'}"]
    trivial = [sys.executable, "-c", TRIVIAL]
    timed(trivial, env)  # creates the Prefect database, untimed
    first = timed(demo, env)  # runs every stage, untimed for the ratio
    cached, plain = [], []
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
        cached.append(timed(demo, env))
        plain.append(timed(trivial, env))
    c, p = statistics.median(cached), statistics.median(plain)
    print(f"\norchestration overhead ({args.repeats} runs each, median wall seconds, fresh process each)")
    print(f"{'demo first run (every stage runs)':<40} {first:>7.2f}")
    print(f"{'demo fully cached rerun':<40} {c:>7.2f}   runs: {', '.join(f'{x:.2f}' for x in cached)}")
    print(f"{'trivial one-task Prefect flow':<40} {p:>7.2f}   runs: {', '.join(f'{x:.2f}' for x in plain)}")
    print(f"{'ratio cached / trivial':<40} {c / p:>7.2f}   (target <= 1.5)")
    print(json.dumps({"first_s": round(first, 2), "cached_s": round(c, 2), "trivial_s": round(p, 2),
                      "ratio": round(c / p, 3)}))


if __name__ == "__main__":
    main()
