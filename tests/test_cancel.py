"""Cancelling the flow run of `lmforge run` through Prefect (`prefect flow-run cancel`, as the UI's Cancel does)
stops it as SIGTERM does: the training process checkpoints and stops, nothing is retried, the run exits 3 leaving no
process behind, the MLflow parent run is KILLED, the flow run ends Cancelled, and the rerun resumes.

Prefect tells a flow run that a plain Python call started (as `lmforge run` does) nothing about a cancellation: the
run watches its own state (flows/pipeline.py `_stop_on_cancellation`). So this needs a real Prefect server, which
the user cancels through with the user's own command.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from tests.test_signals import assert_stopped_then_resumed, start_training_run
from trainer.launch import free_port

STEPS = 600


@pytest.fixture
def prefect_server(tmp_path_factory):
    """`prefect server start` on a free port with its own home and sqlite database; yields its API URL."""
    home = tmp_path_factory.mktemp("prefect-server")
    log = home / "server.log"
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "1", "PREFECT_SERVER_UI_ENABLED": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180  # ~10 s on an idle 2-core machine, far more under load
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.read() == b"true":
                        break
            except OSError:
                time.sleep(0.5)
        yield url
    finally:  # by its pid: the server and whatever it started
        if proc.poll() is None:
            children = psutil.Process(proc.pid).children(recursive=True)
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for p in psutil.wait_procs(children, timeout=10)[1]:
                p.kill()

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


def test_prefect_flow_run_cancel_stops_lmforge_run_like_sigterm_and_the_flow_run_ends_cancelled(
        tmp_path, prefect_server, monkeypatch):
    from prefect.client.orchestration import SyncPrefectClient

    monkeypatch.setenv("PREFECT_API_URL", prefect_server)  # for `lmforge run`: it reports to the server
    # a longer training than test_signals': the cancel command itself takes seconds to start on a busy machine
    proc, family = start_training_run(tmp_path, max_steps=STEPS)
    with SyncPrefectClient(prefect_server) as client, _ended(proc, family):
        [flow_run] = client.read_flow_runs()  # a fresh server: the run just started
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
        assert sorted(r.state.name for r in client.read_flow_runs()) == ["Cancelled", "Completed"]  # and the rerun
