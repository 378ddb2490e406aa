"""Shared test setup: offline hub settings, a throw-away Prefect home, and the fixtures several modules use (the
plain helpers are in tests/helpers.py).

Environment is set at import time, before any test imports Prefect, so the ephemeral Prefect API
and its database live in a temp folder and nothing reaches a model or dataset hub.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_TMP = Path(tempfile.mkdtemp(prefix="lmforge-tests-"))
os.environ.update({
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HOME": str(_TMP / "hf"),
    "PREFECT_HOME": str(_TMP / "prefect"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",  # a loaded 2-core CI machine starts it slowly
    "DO_NOT_TRACK": "1",
    "LMFORGE_WORK_DIR": str(_TMP / "work"),
})
os.environ.pop("PREFECT_API_URL", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)

from tests.helpers import aws_environment, chat_rows, chat_store  # noqa: E402  (after the environment above)


@pytest.fixture
def kinds():
    from tasks import REGISTRY

    return REGISTRY


@pytest.fixture(scope="module")
def kinds_module():
    """The stage registry, for module-scoped fixtures that build a shared store."""
    from tasks import REGISTRY

    return REGISTRY


@pytest.fixture(scope="module")
def root(tmp_path_factory, kinds_module):
    """A store with the chat set's data stages run (tests/helpers.py train_pipeline), once per module; the training
    tests add their stages to it. Modules with other data define their own `root`."""
    return chat_store(tmp_path_factory.mktemp("train"), kinds_module, chat_rows(200))


@pytest.fixture(scope="session", autouse=True)
def _stop_prefect_ephemeral_server():
    """Stop Prefect's temporary API server while pytest's output streams are still open."""
    yield
    import sys

    if "prefect.server.api.server" in sys.modules:
        from prefect.logging.handlers import APILogWorker
        from prefect.server.api.server import SubprocessASGIServer

        APILogWorker.drain_all(timeout=5)  # send buffered logs before the API goes away

        for server in list(SubprocessASGIServer._instances.values()):
            if server.running:
                server.stop()


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real SeaweedFS S3 server on 127.0.0.1 with bucket `lmforge-test`; AWS_* env set while it runs."""
    from tests.s3server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    try:
        with aws_environment(server.env()):
            server.make_bucket("lmforge-test")
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def short_demo_run(tmp_path_factory):
    """One fresh, uninterrupted `lmforge run` of the short demo (tests/short_demo.py): (folder, summary). The fault
    suite's reference: its killed-and-rerun demo must end with this run's weights, from another store."""
    from tests import short_demo

    d = tmp_path_factory.mktemp("short-demo-ref") / "run"
    p = short_demo.start(d)
    assert p.wait(timeout=1200) == 0, (d / "log.txt").read_text()[-4000:]
    return d, short_demo.summary(d)


@pytest.fixture(scope="session")
def short_demo_runs(tmp_path_factory):
    """Two fresh, uninterrupted `lmforge run` of the short demo (tests/short_demo.py) at the same time, into two
    stores, with OMP_NUM_THREADS 1 and 2 exported: [(folder, summary)], for the (slow) determinism test."""
    from tests import short_demo

    base = tmp_path_factory.mktemp("short-demo")
    procs = [(base / f"run{i}", short_demo.start(base / f"run{i}", threads)) for i, threads in enumerate(("1", "2"))]
    for d, p in procs:
        assert p.wait(timeout=1200) == 0, (d / "log.txt").read_text()[-4000:]
    return [(d, short_demo.summary(d)) for d, _ in procs]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """`prefect server start` on a free port of 127.0.0.1 with its own PREFECT_HOME and sqlite database, shared by
    the tests that need a real server (cancellation, deployments): it is slow to start on a loaded machine. Yields
    its API URL; stopped by its PID, with whatever it started."""
    import subprocess
    import sys
    import time
    import urllib.request

    import psutil

    from trainer.launch import free_port

    home = tmp_path_factory.mktemp("prefect-server")
    log = home / "server.log"
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "DO_NOT_TRACK": "1", "PREFECT_SERVER_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180  # far longer under load than idle
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
