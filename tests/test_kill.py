"""A stage killed with SIGKILL midway leaves no manifest; the next run redoes it and completes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from flows.pipeline import pipeline
from lmforge.store import ArtifactStore
from tests.helpers import REPO, basic_config, write_config


@pytest.mark.slow  # tests/test_faults.py kills lmforge run -9 at four points over the demo, a data stage among them
def test_kill_9_midway_leaves_no_manifest_and_rerun_completes(tmp_path):
    raw = basic_config(tmp_path, n=200_000)  # big enough that ingest runs for seconds
    cfg = write_config(tmp_path, raw)
    store = tmp_path / "artifacts"
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(cfg)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        part = None
        while time.monotonic() < deadline and proc.poll() is None:
            parts = list((store / "_staging").glob("ingest-*/out/records/part-*.jsonl"))
            if parts and parts[0].stat().st_size > 1_000_000:
                part = parts[0]
                break
            time.sleep(0.05)
        assert part is not None, "ingest never started writing (or finished too fast to kill)"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI and the Prefect server it started
        proc.wait()
    s = ArtifactStore(str(store))
    assert [a for a in s.list() if a.kind == "ingest" and a.manifest["produced_by"]["stage"] == "ingest"] == []
    assert not list(store.glob("ingest/*/manifest.json")) or all(
        json.loads(p.read_text())["produced_by"]["stage"] != "ingest" for p in store.glob("ingest/*/manifest.json"))

    summary = pipeline(config_path=str(cfg))
    assert summary["stages"]["ingest"]["status"] == "ran" and summary["stages"]["shard"]["status"] == "ran"
    ingest = s.require("ingest", summary["stages"]["ingest"]["artifact_id"])
    assert ingest.result["records"] == 200_000
    ingest.verify()
    shard = s.require("shard", summary["stages"]["shard"]["artifact_id"])
    assert shard.result["train_samples"] + shard.result["validation_samples"] == 200_000
