"""Leases: one builder per artifact, on a local store and on S3.

Two `lmforge run` of one config at once: each stage executes exactly once across both, counted from their logs
(they built all 9 data stages and eval twice before). A holder that stops renewing (SIGKILLed) blocks others only
until its lease expires; then a waiter takes over. A holder that lost its lease does not publish.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

from lmforge.lease import Lease, LeaseLost
from lmforge.store import ArtifactStore
from tests.helpers import REPO, chat_rows, prefect_home, sft, train_pipeline, write_jsonl


def _exclusive_then_handover(store: ArtifactStore) -> None:
    a, b = Lease(store, "k", "id1", run="A", ttl=30), Lease(store, "k", "id1", run="B", ttl=30)
    assert a.acquire(done=lambda: False)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(b.acquire(done=lambda: False)))
    t.start()
    time.sleep(1.0)
    assert got == [] and a.read()["run"] == "A"  # B waits while A holds it
    a.release()
    t.join(30)
    assert got == [True] and b.read()["run"] == "B"
    b.check()
    b.release()
    assert b.read() is None


def test_a_lease_is_exclusive_and_handed_over_on_release(tmp_path, monkeypatch):
    monkeypatch.setattr("lmforge.lease.POLL_SECONDS", 0.05)
    _exclusive_then_handover(ArtifactStore(str(tmp_path / "store")))


@pytest.mark.s3
def test_a_lease_is_exclusive_on_s3(s3, monkeypatch):
    monkeypatch.setattr("lmforge.lease.POLL_SECONDS", 0.05)
    _exclusive_then_handover(ArtifactStore("s3://lmforge-test/leases"))


def test_an_expired_lease_is_taken_over_and_the_old_holder_cannot_publish(tmp_path, monkeypatch):
    monkeypatch.setattr("lmforge.lease.POLL_SECONDS", 0.05)
    store = ArtifactStore(str(tmp_path / "store"))
    stale = Lease(store, "k", "id2", run="killed", ttl=1.0)
    assert stale.acquire(done=lambda: False)
    stale._stop.set()  # as if SIGKILLed: no more heartbeats, no release
    t0 = time.monotonic()
    waiter = Lease(store, "k", "id2", run="waiter", ttl=30)
    assert waiter.acquire(done=lambda: False)
    assert 0.5 < time.monotonic() - t0 < 10  # it waited for the expiry, not longer
    assert waiter.read()["run"] == "waiter"
    with pytest.raises(LeaseLost, match="took the artifact over; not publishing"):
        stale.check()
    waiter.check()
    waiter.release()


def test_a_waiter_stops_waiting_when_the_artifact_is_published(tmp_path, monkeypatch):
    monkeypatch.setattr("lmforge.lease.POLL_SECONDS", 0.05)
    store = ArtifactStore(str(tmp_path / "store"))
    holder = Lease(store, "k", "id3", run="holder", ttl=30)
    assert holder.acquire(done=lambda: False)
    published = threading.Event()
    threading.Timer(0.5, published.set).start()
    assert Lease(store, "k", "id3", run="other").acquire(done=published.is_set) is False
    holder.release()


def test_two_concurrent_runs_execute_each_stage_exactly_once(tmp_path):
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(120))
    stages = {"sft": sft(method="full", max_steps=60, checkpoint_every_steps=20, evaluate=False)}
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(train_pipeline(tmp_path, stages), sort_keys=False))
    procs = []
    for i in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": prefect_home(tmp_path / f"prefect{i}"),
               "LMFORGE_LEASE_POLL_SECONDS": "0.2"}
        log = open(tmp_path / f"run{i}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(cfg)], cwd=tmp_path, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    assert [p.wait(timeout=600) for p in procs] == [0, 0], [(tmp_path / f"run{i}.log").read_text()[-2000:]
                                                            for i in range(2)]
    logs = [(tmp_path / f"run{i}.log").read_text() for i in range(2)]
    executed = [n for text in logs for n in re.findall(r"stage (\w+): running ", text)]
    assert sorted(executed) == ["ingest", "sft", "shard", "tokenizer"]  # each exactly once, across both runs
    assert sum(text.count("training in a child process") for text in logs) == 1
    assert "published meanwhile by another run" not in "".join(logs)
    store = ArtifactStore(str(tmp_path / "artifacts"))
    assert [a.kind for a in store.list("sft")] == ["sft"] and not store.fs.glob(f"{store.root}/*/*/_lease.json")


def test_a_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path, monkeypatch):
    """kill -9 of a run, then a rerun on the same machine: no wait for the expiry."""
    monkeypatch.setattr("lmforge.lease.POLL_SECONDS", 0.05)
    store = ArtifactStore(str(tmp_path / "store"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Lease(store, "k", "id4", run="killed", ttl=600)
    assert stale.acquire(done=lambda: False)
    stale._stop.set()
    record = stale.read()
    store._write_json(stale.path, {**record, "pid": dead.pid})  # its process exited without releasing
    t0 = time.monotonic()
    assert Lease(store, "k", "id4", run="rerun").acquire(done=lambda: False)
    assert time.monotonic() - t0 < 5


def test_a_run_that_lost_its_lease_neither_uploads_nor_prunes_checkpoints(tmp_path, monkeypatch):
    """The checkpoints belong to the lease holder: a stale run (its lease expired and was taken over) that reaches
    its next checkpoint fails with LeaseLost before it writes or prunes anything in `_checkpoints/`."""
    from trainer.checkpoint import CheckpointCallback, list_checkpoints

    monkeypatch.setattr("lmforge.lease.POLL_SECONDS", 0.05)
    store = ArtifactStore(str(tmp_path / "store"))
    uri = store.checkpoint_uri("sft", "id4")
    local = tmp_path / "local" / "checkpoint-5"
    local.mkdir(parents=True)
    (local / "weights.bin").write_bytes(b"w" * 64)

    stale = Lease(store, "sft", "id4", run="stale", ttl=1.0)
    assert stale.acquire(done=lambda: False)
    cb = CheckpointCallback(uri, 5, None, keep=1, fence=stale.fence())
    outcome: dict = {}
    cb._upload(local, 5, outcome)  # while it holds the lease: uploaded
    assert "error" not in outcome and [s for s, _, done in list_checkpoints(uri) if done] == [5]

    stale._stop.set()  # it stalls: no heartbeats
    holder = Lease(store, "sft", "id4", run="holder", ttl=30)
    assert holder.acquire(done=lambda: False)  # takes over after the expiry
    (local.parent / "checkpoint-10").mkdir()
    (local.parent / "checkpoint-10" / "weights.bin").write_bytes(b"x" * 64)
    outcome = {}
    cb._upload(local.parent / "checkpoint-10", 10, outcome)
    assert isinstance(outcome["error"], LeaseLost)
    assert "no longer holds the lease" in str(outcome["error"]) and "held by run holder" in str(outcome["error"])
    assert [s for s, _, done in list_checkpoints(uri) if done] == [5]  # not written, and 5 not pruned
    holder.fence().check("the holder")  # the holder's own fence passes
    holder.release()
