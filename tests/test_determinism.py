"""Deterministic artifacts: the demo's training stages, run by two `lmforge run` processes at the same time into
two fresh stores, give byte-identical weights.

The two runs differ in everything that must not matter: the store, the working directory, the OMP_NUM_THREADS
their shell exported (each training process sets its own thread count), and the load on the machine (each runs
while the other trains). The steps are cut short; everything else is configs/demo.yaml as shipped.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO

TRAINED = ("tokenizer", "pretrain", "sft", "reward", "dpo", "ppo")
SHORT = {"pretrain": {"max_steps": 30, "checkpoint_every_steps": 10}, "sft": {"max_steps": 20},
         "reward": {"max_steps": 20}, "dpo": {"max_steps": 6}, "ppo": {"max_steps": 4, "checkpoint_every_steps": 2}}
WEIGHTS = (".safetensors", ".bin", ".pt")


def _short_demo(dir: Path) -> Path:
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for d in cfg["datasets"].values():  # absolute: this config lives outside the project
        d["path"] = [str(REPO / p) for p in d["path"]] if isinstance(d["path"], list) else str(REPO / d["path"])
    del cfg["stages"]["eval"]
    for name, over in SHORT.items():
        cfg["stages"][name].update(over)
    cfg["store"], cfg["tracking"] = str(dir / "artifacts"), f"sqlite:///{dir / 'mlflow.db'}"
    path = dir / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _weights(store: Path, summary: dict) -> dict[str, str]:
    """{stage/file: sha256} of every weight file of the trained stages, from their manifests."""
    out = {}
    for name in TRAINED:
        s = summary["stages"][name]
        kind = name  # each stage of the demo is named as its kind
        manifest = json.loads((store / kind / s["artifact_id"] / "manifest.json").read_text())
        for f in manifest["files"]:
            if f["path"].endswith(WEIGHTS) or f["path"] == "tokenizer.json":
                out[f"{name}/{f['path']}"] = f["sha256"]
        assert manifest["deterministic"] is True, (name, manifest.get("nondeterminism"))
    return out


def test_two_concurrent_fresh_runs_give_byte_identical_weights(tmp_path):
    procs = []
    for i, threads in enumerate(("1", "2")):
        d = tmp_path / f"run{i}"
        d.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PREFECT_HOME": str(d / "prefect")}
        cmd = [sys.executable, "-m", "flows.cli", "run", str(_short_demo(d)), "--json", str(d / "summary.json")]
        procs.append((d, subprocess.Popen(cmd, cwd=d, env={**env, "PYTHONPATH": str(REPO)},
                                          stdout=open(d / "log.txt", "w"), stderr=subprocess.STDOUT)))
    for d, p in procs:
        assert p.wait(timeout=900) == 0, (d / "log.txt").read_text()[-4000:]
    (a, _), (b, _) = procs
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert {n: s["status"] for n, s in sa["stages"].items()} == {n: s["status"] for n, s in sb["stages"].items()}
    assert all(s["status"] == "ran" for s in sa["stages"].values())
    assert {n: s["artifact_id"] for n, s in sa["stages"].items()} == {n: s["artifact_id"] for n, s in
                                                                      sb["stages"].items()}
    wa, wb = _weights(a / "artifacts", sa), _weights(b / "artifacts", sb)
    assert {k.split("/")[0] for k in wa} == set(TRAINED)  # every trained stage has weights (the tokenizer its vocab)
    assert wa == wb
