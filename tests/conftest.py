"""Shared test setup: offline hub settings, a throw-away Prefect home, helpers to write configs.

Environment is set at import time, before any test imports Prefect, so the ephemeral Prefect API
and its database live in a temp folder and nothing reaches a model or dataset hub.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

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

REPO = Path(__file__).resolve().parent.parent


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def write_config(dir: Path, cfg: dict[str, Any], name: str = "pipeline.yaml") -> Path:
    path = dir / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def text_rows(n: int, prefix: str = "doc") -> list[dict[str, str]]:
    return [{"text": f"{prefix} number {i}: the quick brown fox jumps over the lazy dog {i * 7919 % 1000}."}
            for i in range(n)]


def basic_config(tmp: Path, n: int = 50, store: str | None = None, **shard: Any) -> dict[str, Any]:
    """A two-branch pipeline: text and preference data, each ingested then sharded."""
    write_jsonl(tmp / "data" / "text.jsonl", text_rows(n))
    write_jsonl(tmp / "data" / "pairs.jsonl",
                [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(20)])
    return {
        "name": "t",
        "store": store or str(tmp / "artifacts"),
        "tracking": f"sqlite:///{tmp / 'mlflow.db'}",
        "datasets": {"text": {"path": "data/text.jsonl", "kind": "text"},
                     "pairs": {"path": "data/pairs.jsonl", "kind": "preference"}},
        "stages": {
            "ingest": {"kind": "ingest", "inputs": ["text"], "retries": 0},
            "shard": {"kind": "shard", "inputs": ["ingest"], "max_count": 20, "validation_fraction": 0.1,
                      "retries": 0, **shard},
            "ingest_pairs": {"kind": "ingest", "inputs": ["pairs"], "retries": 0},
            "shard_pairs": {"kind": "shard", "inputs": ["ingest_pairs"], "retries": 0},
        },
    }


@pytest.fixture
def kinds():
    from tasks import REGISTRY

    return REGISTRY


@pytest.fixture(scope="module")
def kinds_module():
    """The stage registry, for module-scoped fixtures that build a shared store."""
    from tasks import REGISTRY

    return REGISTRY


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


@contextlib.contextmanager
def aws_environment(env: dict[str, str]):
    """`env`'s AWS_* variables set in this process while inside (s3fs takes endpoint and keys from them), and
    s3fs's cached filesystems dropped on the way in and out (a cached one keeps another server's endpoint)."""
    import s3fs

    keys = [k for k in env if k.startswith("AWS_")]
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: env[k] for k in keys})
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()


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
def short_demo_runs(tmp_path_factory):
    """Two fresh, uninterrupted `lmforge run` of the short demo (tests/short_demo.py) at the same time, into two
    stores, with OMP_NUM_THREADS 1 and 2 exported: [(folder, summary)]. Shared by the determinism test and the fault
    suite (whose reference is the first)."""
    from tests import short_demo

    base = tmp_path_factory.mktemp("short-demo")
    procs = [(base / f"run{i}", short_demo.start(base / f"run{i}", threads)) for i, threads in enumerate(("1", "2"))]
    for d, p in procs:
        assert p.wait(timeout=1200) == 0, (d / "log.txt").read_text()[-4000:]
    return [(d, short_demo.summary(d)) for d, _ in procs]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """`prefect server start` on a free port of 127.0.0.1 with its own PREFECT_HOME and sqlite database, shared by
    the tests that need a real server (cancellation, deployments): it takes 30-60 s to start on a loaded 2-core
    machine. Yields its API URL; stopped by its PID, with whatever it started."""
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
