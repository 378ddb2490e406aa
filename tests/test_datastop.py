"""A stop request reaches the data stages: Ctrl-C (SIGINT) to `lmforge run` while dedup's process pool works stops the stage
between its tasks, ends the pool's workers, publishes nothing, and the run exits 3 leaving no process behind; the
rerun builds the same artifact and keeps the stages that had finished. Below that: each data stage, asked to stop
mid-loop, raises `Interrupted` at its next check; `lmforge.parallel`, asked while a pool maps, raises at once and ends
the workers mid-task.

The signal goes to the CLI process, as a scheduler or a user sends it, never to a child.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from lmforge import interrupt
from lmforge.config import parse_config
from lmforge.executor import RunContext, execute_stage
from lmforge.log import Progress
from lmforge.parallel import Mapper, ProcessPoolMapper, make_mapper
from lmforge.plan import make_plan
from lmforge.store import ArtifactStore
from tests.helpers import REPO, basic_config, text_rows, write_config, write_jsonl


@pytest.fixture(autouse=True)
def _no_stop_request():
    """The stop request is process-wide: never leave one behind for the next test."""
    interrupt.reset()
    yield
    interrupt.reset()


# ---------------------------------------------------------------------------------------------
# lmforge.parallel


def _slow(task: tuple[str, int, bytes]) -> int:
    """A pool task that says it started (its pid in `{folder}/{i}.pid`) and then takes a minute."""
    folder, i, _payload = task
    Path(folder, f"{i}.pid").write_text(str(os.getpid()))
    time.sleep(60)
    return i


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_stop_request_while_a_process_pool_maps_raises_interrupted_at_once_and_ends_its_workers(tmp_path):
    started: list[Path] = []
    asked = []

    def stop_when_both_workers_run():
        deadline = time.monotonic() + 60
        while len(started) < 2 and time.monotonic() < deadline:
            started[:] = sorted(tmp_path.glob("*.pid"))
            time.sleep(0.02)
        asked.append(time.monotonic())
        interrupt.request(signal.SIGTERM)

    # 300 kB per task: more than a pipe holds, so the executor's feeder thread is blocked writing the queued
    # task when the workers go; the pool must still shut down
    tasks = [(str(tmp_path), i, b"x" * 300_000) for i in range(6)]
    t0 = time.monotonic()
    with make_mapper(workers=2) as mapper:
        assert isinstance(mapper, ProcessPoolMapper)
        threading.Thread(target=stop_when_both_workers_run, daemon=True).start()
        with pytest.raises(interrupt.Interrupted, match=r"^slow tasks: stopped by SIGTERM before it finished; rerun"):
            mapper.map(_slow, tasks, what="slow tasks")
        raised = time.monotonic()
    closed = time.monotonic()
    pids = [int(p.read_text()) for p in started]
    assert [p.name for p in started] == ["0.pid", "1.pid"], started  # the two running tasks; the rest never started
    assert sorted(p.name for p in tmp_path.glob("*.pid")) == ["0.pid", "1.pid"]
    assert raised - asked[0] < 3.0, raised - asked[0]  # polled every 0.2 s; workers get 2 s to exit on SIGTERM
    assert closed - raised < 3.0, closed - raised  # the pool closes without waiting for the tasks (a minute each)
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in pids), [(p, psutil.Process(p).cmdline()) for p in pids if not _gone(p)]
    assert closed - t0 < 30


def _ask_to_stop_at_two(i: int) -> int:
    if i == 2:
        interrupt.request(signal.SIGINT)
    return i * 10


def test_the_in_process_mapper_stops_between_tasks():
    seen = []
    with pytest.raises(interrupt.Interrupted, match=r"^parts: stopped by SIGINT before it finished"):
        Mapper().map(lambda i: seen.append(_ask_to_stop_at_two(i)), range(6), what="parts")
    assert seen == [0, 10, 20]  # the task that asked finished; the next one did not start


# ---------------------------------------------------------------------------------------------
# each data stage stops between its units of work

RECORDS = 3000


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, kinds_module):
    """A store with the ingest and shard artifacts of RECORDS text records: the inputs of every data stage."""
    tmp = tmp_path_factory.mktemp("datastop")
    write_jsonl(tmp / "data" / "text.jsonl", text_rows(RECORDS))
    raw = {"name": "t", "store": str(tmp / "artifacts"),
           "datasets": {"text": {"path": "data/text.jsonl", "kind": "text"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["text"]},
                      "shard": {"kind": "shard", "inputs": ["ingest"], "max_count": 100_000}}}
    plan = make_plan(parse_config(raw, kinds_module, root=tmp), kinds_module)
    for name in ("ingest", "shard"):
        execute_stage(RunContext(plan=plan, kinds=kinds_module), name)
    return plan


@pytest.mark.parametrize("kind, module, settings, ask_at, stopped_at, where", [
    # records per check: interrupt.EVERY_RECORDS (1000); filter checks per chunk of 500, a mapper per task
    ("ingest", "tasks.ingest", {}, 1500, 2000, "ingest text "),
    ("filter", "tasks.filter", {}, 1500, 1500, "filter"),
    ("dedup", "lmforge.parallel", {"workers": 1, "partition_records": 100}, 5, 5, "dedup map"),
    ("shard", "tasks.shard", {"max_count": 100_000}, 1500, 2000, "shard write"),
    ("tokenizer", "tasks.tokenizer", {"vocab_size": 300}, 1500, 2000, "tokenizer reading"),  # through tokenizers' Rust
], ids=["ingest", "filter", "dedup", "shard", "tokenizer"])
def test_a_data_stage_stops_between_its_units_of_work(upstream, kinds, monkeypatch, tmp_path, kind, module, settings,
                                                      ask_at, stopped_at, where):
    """The stop is asked from the stage's own progress counter after `ask_at` units: the stage raises `Interrupted`
    at its next check, having done exactly `stopped_at` units."""
    counted = []

    class AskToStop(Progress):
        def update(self, k: int = 1) -> None:
            super().update(k)
            counted.append(self.n)
            if self.n >= ask_at:
                interrupt.request(signal.SIGTERM)

    monkeypatch.setattr(f"{module}.Progress", AskToStop)
    source = "text" if kind == "ingest" else "shard" if kind == "tokenizer" else "ingest"
    inputs = [upstream.datasets["text"]] if kind == "ingest" else \
        [upstream.store.require(source, upstream.stages[source].artifact_id)]
    cfg = kinds[kind].config(kind=kind, inputs=[source], **settings)
    with pytest.raises(interrupt.Interrupted, match=rf"^{re.escape(where)}.*: stopped by SIGTERM before it finished"):
        kinds[kind].run(cfg, inputs, tmp_path)
    assert counted[-1] == stopped_at, counted[-5:]


# ---------------------------------------------------------------------------------------------
# Ctrl-C (SIGINT) to `lmforge run` while dedup runs

DOCS, DUPLICATE_EVERY = 30_000, 50


def _docs() -> list[dict[str, str]]:
    """Random 200-word documents (no two near each other) and, at the end, an exact copy of every 50th."""
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(5000)]
    docs = [{"text": " ".join(rng.choices(vocab, k=200))} for _ in range(DOCS)]
    return docs + docs[::DUPLICATE_EVERY]


def _cli(cfg: Path, log: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(cfg), *extra], cwd=cfg.parent, env=env,
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _pool_workers(family: list[psutil.Process]) -> list[psutil.Process]:
    """The process pool's workers: children of the CLI's multiprocessing fork server."""
    out = []
    for p in family:
        try:
            if "forkserver" in " ".join(p.cmdline()):
                out += [c for c in p.children() if c in family]
        except psutil.NoSuchProcess:
            pass
    return out


def test_ctrl_c_to_lmforge_run_stops_dedup_between_tasks_exits_3_leaves_nothing_and_the_rerun_goes_on(tmp_path):
    cfg = basic_config(tmp_path, max_count=10_000)  # one shard per split
    write_jsonl(tmp_path / "data" / "text.jsonl", _docs())
    cfg["stages"]["dedup"] = {"kind": "dedup", "inputs": ["ingest"], "workers": 2, "partition_records": 200,
                              "retries": 1}
    cfg["stages"]["shard"]["inputs"] = ["dedup"]
    path = write_config(tmp_path, cfg)
    log = tmp_path / "log.txt"
    store = ArtifactStore(str(tmp_path / "artifacts"))
    staging = f"{store.root}/_staging"

    proc = _cli(path, log)
    deadline = time.monotonic() + 240
    mapped: list[str] = []
    while time.monotonic() < deadline and proc.poll() is None:
        store.fs.invalidate_cache()
        mapped = store.fs.glob(f"{staging}/dedup-*/out.dedup-work-*/p*.npy")  # a map task is done: the pool works
        if mapped and (len(store.fs.glob(f"{store.root}/ingest/*/manifest.json")),  # ingest, ingest_pairs, shard_pairs
                       len(store.fs.glob(f"{store.root}/shard/*/manifest.json"))) == (2, 1):
            break
        time.sleep(0.05)
    assert mapped, log.read_text()[-3000:]
    family = psutil.Process(proc.pid).children(recursive=True)
    workers = _pool_workers(family)
    assert len(workers) == 2, [(p.pid, p.cmdline()) for p in family]
    staged = [Path(p).name for p in store.fs.ls(staging)]
    dedup_id = next(n for n in staged if n.startswith("dedup-")).split("-")[1]

    os.kill(proc.pid, signal.SIGINT)  # the CLI itself: Ctrl-C (SIGTERM is tests/test_signals.py's)
    sent = time.monotonic()
    rc = proc.wait(timeout=120)
    exited = time.monotonic() - sent
    out = log.read_text()
    assert rc == 3, out[-3000:]
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert alive == [], [(p.pid, p.cmdline()) for p in alive]  # no pool worker, fork server or Prefect server
    assert "SIGINT: stopping." in out
    assert "dedup map: stopped by SIGINT before it finished; rerun the same command to go on" in out, out[-3000:]
    assert "stopped 2 worker process(es) of the process pool" in out
    assert ("Finished in state Failed('Task run encountered an exception Interrupted: dedup map: stopped by SIGINT"
            in out)  # the stage's Prefect task run
    assert "stopped by SIGINT; stages not finished: dedup, shard." in out
    assert out.count("stage dedup: running") == 1  # an interrupted stage is not retried (retries: 1)
    assert not re.search(r"dedup map \(process pool, 2 workers\): \d+ tasks done", out)  # stopped mid-map
    assert exited < 60, exited  # the stage stops within a poll; the rest is Prefect and MLflow shutting down
    store.fs.invalidate_cache()
    assert store.get("dedup", dedup_id) is None and not store.fs.glob(f"{store.root}/dedup/*/manifest.json")
    assert [n for n in map(lambda p: Path(p).name, store.fs.ls(staging)) if n.startswith("dedup-")] == []
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    dedup_runs = [r for r in runs if r.data.tags.get("lmforge.stage") == "dedup"]
    assert [r.info.status for r in dedup_runs] == ["FAILED"]
    assert dedup_runs[0].data.tags["lmforge.error"].startswith("Interrupted: dedup map: stopped by SIGINT")
    assert all(r.info.status != "RUNNING" for r in runs)

    rerun = _cli(path, log, "--json", str(tmp_path / "summary.json"))
    assert rerun.wait(timeout=300) == 0, log.read_text()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {n: s["status"] for n, s in summary["stages"].items()} == {
        "ingest": "cached", "ingest_pairs": "cached", "shard_pairs": "cached", "dedup": "ran", "shard": "ran"}
    assert summary["stages"]["dedup"]["artifact_id"] == dedup_id  # the artifact the stopped run was making
    result = store.require("dedup", dedup_id).result
    duplicates = len(range(0, DOCS, DUPLICATE_EVERY))
    assert (result["input_records"], result["records"]) == (DOCS + duplicates, DOCS)
    assert result["dropped"] == {"exact_duplicate": duplicates, "near_duplicate": 0}
    assert [n for n in map(lambda p: Path(p).name, store.fs.ls(staging)) if n.startswith("dedup-")] == []
