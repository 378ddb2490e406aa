"""Cancelling the flow run of `lmforge run` through Prefect (`prefect flow-run cancel`, as the UI's Cancel does)
stops it as SIGTERM does: the training process checkpoints and stops, nothing is retried, the run exits 3 leaving no
process behind, the MLflow parent run is KILLED, the flow run ends Cancelled, and the rerun resumes.

Prefect tells a flow run that a plain Python call started (as `lmforge run` does) nothing about a cancellation: the
run watches its own state (flows/pipeline.py `_stop_on_cancellation`). So this needs a real Prefect server, which
the user cancels through with the user's own command.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys

import psutil
import pytest

from tests.helpers import assert_stopped_then_resumed, start_training_run

STEPS = 600


@contextlib.contextmanager
def _ended(proc: subprocess.Popen, family: list[psutil.Process]):
    """Whatever fails in between, `lmforge run` and its training process end with the test."""
    try:
        yield
    finally:
        for p in [proc, *family]:
            with contextlib.suppress(psutil.Error, OSError):
                p.kill()
        proc.wait(timeout=10)


@pytest.mark.slow  # the stop, checkpoint, exit 3 and resume are tests/test_signals.py's SIGTERM test; this adds Prefect's cancel
def test_prefect_flow_run_cancel_stops_lmforge_run_like_sigterm_and_the_flow_run_ends_cancelled(
        tmp_path, prefect_server, monkeypatch):
    from prefect.client.orchestration import SyncPrefectClient

    monkeypatch.setenv("PREFECT_API_URL", prefect_server)  # for `lmforge run`: it reports to the server
    # a longer training than test_signals': the cancel command itself takes seconds to start on a busy machine
    proc, family = start_training_run(tmp_path, max_steps=STEPS)
    with SyncPrefectClient(prefect_server) as client, _ended(proc, family):
        def mine():  # the server is shared with other tests: this test's flow runs are those of its config
            return [r for r in client.read_flow_runs() if str(r.parameters.get("config_path", "")).startswith(
                str(tmp_path))]

        [flow_run] = mine()  # the run just started
        assert flow_run.state.name == "Running"
        cancel = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", str(flow_run.id)],
                                capture_output=True, text=True, timeout=120)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert " ".join(cancel.stdout.split()) == \
            f"Flow run '{flow_run.id}' was successfully scheduled for cancellation."

        out = assert_stopped_then_resumed(tmp_path, proc, family, "a cancellation through Prefect", STEPS)
        assert ("lmforge run: pipeline train: stopped by a cancellation through Prefect; stages not finished: sft. "
                "Finished stages and uploaded checkpoints are kept: rerun the same command to resume.") in out
        cancelled = client.read_flow_run(flow_run.id).state
        assert (cancelled.type.value, cancelled.name) == ("CANCELLED", "Cancelled")  # not left Cancelling, not Failed
        assert cancelled.message.startswith("pipeline train: stopped by a cancellation through Prefect")
        assert sorted(r.state.name for r in mine()) == ["Cancelled", "Completed"]  # and the rerun
