"""`lmforge status` where no flow run exists answers at once (no temporary Prefect server started) with "no flow
runs found" and exit 1, not a config error; `lmforge artifacts ls` shows the result fields that tell what each
artifact is."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from flows.cli import main
from flows.store_cmd import _short_summary
from tests.helpers import REPO, ingest, text_rows, write_jsonl


def _cli(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect-home")})  # a machine with no runs
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    return p, time.monotonic() - t0


def test_status_without_flow_runs_says_so_at_once(tmp_path):
    latest, seconds = _cli(tmp_path, "status")
    assert latest.returncode == 1, latest.stderr
    assert "no flow runs found" in latest.stderr and "lmforge-pipeline" in latest.stderr
    assert "problem" not in latest.stderr and "pipeline config" not in latest.stderr
    assert seconds < 30  # Prefect's temporary server took ~50 s to start on a loaded machine only to find nothing
    assert not (tmp_path / "prefect-home" / "prefect.db").exists()  # nothing was started
    one, _ = _cli(tmp_path, "status", str(uuid.uuid4()))
    assert one.returncode == 1 and "not found in the Prefect API" in one.stderr, one.stderr
    rerun, _ = _cli(tmp_path, "rerun", str(uuid.uuid4()))  # a rerun of nothing: bad usage
    assert rerun.returncode == 2 and "not found in the Prefect API" in rerun.stderr
    assert "pipeline config" not in rerun.stderr


def test_artifacts_ls_shows_the_fields_that_matter(tmp_path, kinds, capsys):
    write_jsonl(tmp_path / "data" / "t.jsonl", text_rows(12))
    ingest(tmp_path, kinds, "data/t.jsonl")
    assert main(["artifacts", "ls", "--store", str(tmp_path / "artifacts")]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.endswith("data_kind=text, records=12, rows_read=12, bad_records=0"), row  # not bytes_read first

    # a training result: its method, steps and losses; not its memory, threads or timings
    sft = {"baseline_rss_mb": 726.0, "cpu_threads": 1, "deterministic": True, "epochs": 23.5, "eval_loss": 0.0815435,
           "method": "full", "peak_memory_mb": 782.0, "steps": 800, "train_loss_first": 2.61003,
           "train_loss_last": 0.100478, "train_seconds": 33.3}
    assert _short_summary(sft, "sft") == ("method=full, steps=800, train_loss_first=2.61, train_loss_last=0.1005, "
                                          "eval_loss=0.08154")
    assert _short_summary(sft, "a_plugin_kind") == "epochs=23.5, eval_loss=0.08154, method=full, steps=800, " \
                                                   "train_loss_first=2.61"
    # eval: its gates and the gated metrics against their reference
    ev = {"gates_failed": 1, "gates": [
        {"metric": "sft/t/acc", "value": 0.98, "against": "base", "reference": 0.22, "passed": True},
        {"metric": "dpo/t/acc", "value": 0.5, "against": "sft", "reference": 0.98, "passed": False}],
        "eval": {"base": {"t": {"acc": 0.22, "acc_stderr": 0.04}}}}
    assert _short_summary(ev, "eval") == "gates 1/2 passed, sft/t/acc=0.98 (base 0.22), dpo/t/acc=0.5 (sft 0.98)"
