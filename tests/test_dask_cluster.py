"""The data stages on a Dask cluster of separate processes (`dask scheduler` + 2 `dask worker`, the CLIs, on
127.0.0.1) with the store on the SeaweedFS S3 fixture: the same artifact ids and bytes as a local run, and a worker
killed in the middle of dedup costs nothing (its tasks run again on the other worker; a rerun finds every artifact
complete and verified). tests/test_dask_flow.py covers the same flow on an in-process LocalCluster."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.pipeline import pipeline
from lmforge.store import ArtifactStore
from tests.helpers import REPO, dask_data_config, write_config
from trainer.launch import free_port

# slow: each test runs the data pipeline twice through Prefect (local, then on the cluster; the kill test once more),
# minutes on a loaded 2-core machine. The default suite covers the same flow on an in-process LocalCluster
# (tests/test_dask_flow.py) and the S3 store against a local one (tests/test_s3.py).
pytestmark = [pytest.mark.s3, pytest.mark.slow]
DATA_STAGES = ("ingest", "filter", "dedup", "shard")


def data_config(tmp: Path, store: str, dask_address: str | None = None, n: int = 300,
                partition_records: int = 50) -> dict:
    return dask_data_config(tmp, store, dask_address, name="dask-cluster", n=n, partition_records=partition_records,
                            shard_max_count=100)


def _stop(procs: list[subprocess.Popen]) -> None:
    """Each process group by its leader's PID, the last started first. Every process here starts its own session, and
    what it starts joins its group, so this also stops what a worker started after the worker itself was killed (the
    kill test's worker leaves its Prefect API server behind, orphaned)."""
    def alive(group: int) -> bool:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True

    for p in reversed(procs):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=15)
        deadline = time.monotonic() + 10
        while alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.fixture(scope="module")
def cluster(s3, tmp_path_factory):
    """A `dask scheduler` and 2 `dask worker` processes (1 thread each, no nanny, so a killed worker stays dead) on
    127.0.0.1, with this process's environment (the S3 endpoint and keys, the Prefect home, the work folder).
    Yields (scheduler address, {worker address: Popen})."""
    from distributed import Client

    logs = tmp_path_factory.mktemp("dask")
    dask = str(Path(sys.executable).parent / "dask")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        p = subprocess.Popen([dask, *args], env=env, cwd=REPO, stdout=open(logs / f"{name}.log", "w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        start("scheduler", "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard")
        workers = [start(f"worker{i}", "worker", address, "--host", "127.0.0.1", "--nthreads", "1", "--no-nanny",
                         "--no-dashboard", "--name", f"w{i}") for i in range(2)]
        with Client(address, timeout="60s", set_as_default=False) as c:
            c.wait_for_workers(2, timeout=120)
            pids = c.run(os.getpid)
        by_pid = {p.pid: p for p in workers}
        yield address, {addr: by_pid[pid] for addr, pid in pids.items()}
    except BaseException:
        for f in sorted(logs.iterdir()):
            print(f"--- {f.name}\n{f.read_text()[-3000:]}")
        raise
    finally:
        _stop(procs)


def ids(summary: dict) -> dict[str, str]:
    return {n: summary["stages"][n]["artifact_id"] for n in DATA_STAGES}


def hashes(store: ArtifactStore, summary: dict) -> dict[str, list[str]]:
    """Each data stage's files' sha256 from its manifest, after checking the bytes against it."""
    out = {}
    for n in DATA_STAGES:
        art = store.require(summary["stages"][n]["kind"] if "kind" in summary["stages"][n] else n,
                            summary["stages"][n]["artifact_id"])
        art.verify()
        out[n] = [(f["path"], f["sha256"]) for f in art.manifest["files"]]
    return out


def run_both(tmp: Path, address: str, prefix: str, **data) -> tuple[dict, dict, ArtifactStore]:
    (tmp / "local").mkdir()
    (tmp / "remote").mkdir()
    local = pipeline(config_path=str(write_config(tmp / "local", data_config(
        tmp / "local", str(tmp / "local/artifacts"), **data))))
    url = f"s3://lmforge-test/{prefix}"
    remote_cfg = write_config(tmp / "remote", data_config(tmp / "remote", url, address, **data))
    return local, remote_cfg, ArtifactStore(url)


def test_data_stages_on_cluster_with_s3_store_match_local(tmp_path, cluster):
    address, _ = cluster
    local, remote_cfg, store = run_both(tmp_path, address, "cluster/equal")
    remote = pipeline(config_path=str(remote_cfg))
    assert remote["ran"] == len(DATA_STAGES)
    assert ids(remote) == ids(local)
    assert hashes(store, remote) == hashes(ArtifactStore(str(tmp_path / "local/artifacts")), local)
    assert store.require("dedup", remote["stages"]["dedup"]["artifact_id"]).result["dropped"]["exact_duplicate"] == 40


def test_worker_killed_mid_dedup_loses_nothing(tmp_path, cluster):
    """SIGKILL the worker that does not hold the dedup stage's own task as soon as it runs a dedup map task: the
    scheduler gives its tasks to the other worker, and the stage ends with the bytes of a local run."""
    from distributed import Client

    address, workers = cluster
    data = {"n": 1500, "partition_records": 20}  # many small map tasks, so one is caught running
    local, remote_cfg, store = run_both(tmp_path, address, "cluster/killed", **data)
    outcome: dict = {}

    def run():
        try:
            outcome["summary"] = pipeline(config_path=str(remote_cfg))
        except BaseException as e:  # reported below: the stage must fail clearly or succeed
            outcome["error"] = e

    killed = None
    with Client(address, set_as_default=False) as c:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        deadline = time.monotonic() + 300
        while killed is None and t.is_alive() and time.monotonic() < deadline:
            busy = c.processing()
            stage_worker = {w for w, keys in busy.items() if any("dedup" in str(k) for k in keys)}
            for w, keys in busy.items():
                if w not in stage_worker and any(str(k).startswith("_map_partition") for k in keys) \
                        and len(workers) > 1 and w in workers:
                    workers[w].kill()
                    workers[w].wait()
                    killed = w
                    break
            time.sleep(0.01)
        t.join(timeout=600)
    assert not t.is_alive(), "the pipeline did not end after a worker was killed"
    assert killed is not None, "no dedup map task was seen running on a worker: nothing was killed"
    del workers[killed]
    print(f"killed {killed}; first run: {'failed: ' + str(outcome['error']) if 'error' in outcome else 'completed'}")
    if "error" in outcome:  # a clear failure is allowed; it must name the stage
        assert "dedup" in str(outcome["error"]), outcome["error"]
    rerun = pipeline(config_path=str(remote_cfg))  # on the surviving worker
    assert ids(rerun) == ids(local)
    assert hashes(store, rerun) == hashes(ArtifactStore(str(tmp_path / "local/artifacts")), local)
    for art in store.list():  # nothing half-written is visible: every listed artifact verifies
        art.verify()
