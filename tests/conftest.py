"""Shared test setup: offline hub settings, a throw-away Prefect home, and the fixtures several modules use (the
plain helpers are in tests/helpers.py).

Environment is set at import time, before any test imports Prefect, so the ephemeral Prefect API
and its database live in a temp folder and nothing reaches a model or dataset hub.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest

_STARTED = time.time()  # pytest's start, near enough: before the ML stack is imported

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

# ----------------------------------------------------------------------------------------------
# the suite on two workers, and its time
#
# `make test` runs the suite on 2 pytest-xdist workers, a test file at a time (`--dist loadfile`, so a module's
# fixtures are built once), in the order collected here (`--no-loadscope-reorder`): the longest files first, so no
# long file starts last while the other worker idles. The weights are the seconds each file took in a serial run
# (docs/results.md#suite); a file not listed weighs 0 and keeps its place after them. Only the order depends on them.
FILE_SECONDS: dict[str, float] = {  # the 60 slowest tests of cf52d74's serial run, by file (test_export: alone)
    "test_demo.py": 655, "test_faults.py": 380, "test_signals.py": 144, "test_trainer.py": 132, "test_ppo.py": 104,
    "test_tokenize.py": 97, "test_gpu_check.py": 93, "test_align.py": 91, "test_grpo.py": 90,
    "test_distributed.py": 86, "test_deploy.py": 69, "test_force.py": 57, "test_pretrain.py": 42,
    "test_raw_formats_pipeline.py": 41, "test_lease.py": 40, "test_datastop.py": 40, "test_flow.py": 37,
    "test_registry.py": 37, "test_gc.py": 36, "test_mlflow_view.py": 35, "test_dask_flow.py": 35,
    "test_verified_reads.py": 34, "test_preflight_stage.py": 27, "test_batching.py": 25, "test_telemetry.py": 19,
    "test_monitoring.py": 18, "test_export.py": 40
}
SUITE_TARGET_S = 45 * 60  # past this, the run says so in one line (it does not fail: CI's hard limit is 90 minutes)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0.0))  # stable: a file's own order is kept


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The suite's time, from .ci/run's start (set-up included) when it exported LMFORGE_CI_STARTED, else from
    pytest's; one clear line when it is past the target."""
    if hasattr(config, "workerinput"):
        return
    started = float(os.environ.get("LMFORGE_CI_STARTED") or _STARTED)
    took = time.time() - started
    what = ".ci/run" if os.environ.get("LMFORGE_CI_STARTED") else "pytest"
    terminalreporter.write_line(f"suite time: {took:,.0f} s ({took / 60:.1f} min) for {what}, "
                                f"target {SUITE_TARGET_S // 60} min")
    if took > SUITE_TARGET_S:
        terminalreporter.write_line(f"SUITE TOO SLOW: {took / 60:.1f} min is past the {SUITE_TARGET_S // 60}-minute "
                                    "target; see docs/results.md#suite and make the slowest tests above cheaper",
                                    yellow=True, bold=True)


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
