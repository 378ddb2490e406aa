"""configs/demo.yaml as shipped, with the training steps cut short and no eval gates (a short run need not pass
them), for tests that run the whole demo through `lmforge run`: determinism and the fault suite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import REPO, mlflow_db, one_thread_per_test, prefect_home

TRAINED = ("tokenizer", "pretrain", "sft", "reward", "dpo", "ppo")
SHORT = {"pretrain": {"max_steps": 30, "checkpoint_every_steps": 10},
         "sft": {"max_steps": 20, "checkpoint_every_steps": 5, "batch_size_per_device": 16},
         "reward": {"max_steps": 20, "batch_size_per_device": 16}, "dpo": {"max_steps": 6},
         "ppo": {"max_steps": 4, "checkpoint_every_steps": 2, "max_validation_prompts": 4, "batch_size_per_device": 8},
         "eval": {"gates": [], "expect": [], "bootstrap_iters": 0, "limit": 48}}


def write(dir: Path) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for d in cfg["datasets"].values():  # absolute: this config lives outside the project
        d["path"] = [str(REPO / p) for p in d["path"]] if isinstance(d["path"], list) else str(REPO / d["path"])
    for name, over in SHORT.items():
        cfg["stages"][name].update(over)
    for name, threads in one_thread_per_test(cfg["stages"]).items():
        cfg["stages"][name]["cpu_threads"] = threads
    cfg["store"], cfg["tracking"] = str(dir / "artifacts"), mlflow_db(dir / "mlflow.db")
    path = dir / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def start(dir: Path, threads: str = "1", *extra: str) -> subprocess.Popen:
    """`lmforge run` of the short demo in `dir`, in its own process group (so a test can kill the whole group)."""
    dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONPATH": str(REPO),
           "PREFECT_HOME": prefect_home(dir / "prefect")}
    cmd = [sys.executable, "-m", "flows.cli", "run", str(write(dir)), "--json", str(dir / "summary.json"), *extra]
    return subprocess.Popen(cmd, cwd=dir, env=env, stdout=open(dir / "log.txt", "a"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def summary(dir: Path) -> dict:
    return json.loads((dir / "summary.json").read_text())


def manifests(dir: Path, summary: dict) -> dict[str, dict]:
    out = {}
    for name, s in summary["stages"].items():
        kind = yaml.safe_load((dir / "demo.yaml").read_text())["stages"][name]["kind"]
        out[name] = json.loads((dir / "artifacts" / kind / s["artifact_id"] / "manifest.json").read_text())
    return out
