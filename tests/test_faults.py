"""The pipeline-level fault suite: faults are injected where the user's world injects them, on `lmforge run` itself.

- kill -9 of the whole process group of `lmforge run` at several points spread over the demo (a data stage
  writing its output, pretrain and ppo after a checkpoint, eval scoring), each followed by a rerun that is killed at
  the next point, then a last rerun: it exits 0, `lmforge plan` says every stage is cached, every manifest
  verifies, the weights and eval metrics equal those of an uninterrupted run, nothing is left in staging or
  scratch, no process of any killed run survives, and no MLflow run is left RUNNING.
- a lease holder killed: of two concurrent runs, the one holding the sft lease is killed with its process group;
  the waiter takes the stage over at once (its holder's process is gone), resumes from the holder's checkpoint and
  finishes.

SIGTERM during sft (checkpoint, resume, no orphans) is tests/test_signals.py; two concurrent runs executing each
stage once is tests/test_lease.py; unreachable services are tests/test_preflight.py.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml
from mlflow.tracking import MlflowClient

from lmforge import gc
from lmforge.store import ArtifactStore
from tests import short_demo
from tests.helpers import REPO, chat_rows, sft, train_pipeline, write_jsonl

# where to kill, as seen in the store: (what, glob under the store root); each is reached in its own run
POINTS = [
    ("a data stage writing its output", "_staging/shard-*/out/*"),
    ("pretrain after a checkpoint", "pretrain/*/_checkpoints/checkpoint-*/DONE"),
    ("ppo after a checkpoint", "ppo/*/_checkpoints/checkpoint-*/DONE"),
    ("eval scoring", "_staging/eval-*"),
]


def _family(pid: int) -> list[psutil.Process]:
    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _wait_for(store: Path, pattern: str, proc: subprocess.Popen, timeout: float = 600) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if list(store.glob(pattern)):
            return True
        time.sleep(0.05)
    return False


def _killpg(proc: subprocess.Popen) -> list[psutil.Process]:
    family = _family(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the CLI, Prefect's server, trainers, workers
    proc.wait(timeout=30)
    gone, alive = psutil.wait_procs(family, timeout=15)
    assert alive == [], [(p.pid, p.cmdline()) for p in alive]
    return family


def test_kill_9_at_points_over_the_demo_then_rerun_equals_an_uninterrupted_run(short_demo_run, tmp_path):
    ref_dir, ref = short_demo_run
    work = Path(os.environ["LMFORGE_WORK_DIR"])
    d = tmp_path / "faulty"
    store = d / "artifacts"
    for what, pattern in POINTS:
        proc = short_demo.start(d)
        reached = _wait_for(store, pattern, proc)
        assert reached, f"the run ended before {what} ({pattern}):\n" + (d / "log.txt").read_text()[-3000:]
        _killpg(proc)
        with (d / "log.txt").open("a") as f:
            f.write(f"\n==== test: kill -9 of the process group during {what}\n")

    last = short_demo.start(d)
    assert last.wait(timeout=900) == 0, (d / "log.txt").read_text()[-4000:]
    log = (d / "log.txt").read_text()
    got = short_demo.summary(d)
    assert got["failed"] == 0
    assert "removed" in log and "leftover folder(s) of runs that are gone" in log
    assert {n: s["artifact_id"] for n, s in got["stages"].items()} == \
        {n: s["artifact_id"] for n, s in ref["stages"].items()}

    # the rerun resumed from the checkpoints the killed runs uploaded, and the result is the uninterrupted one's
    mine, theirs = short_demo.manifests(d, got), short_demo.manifests(ref_dir, ref)
    for name in short_demo.TRAINED + ("eval",):
        files = {f["path"]: f["sha256"] for f in mine[name]["files"]}
        ref_files = {f["path"]: f["sha256"] for f in theirs[name]["files"]}
        weights = [p for p in ref_files if p.endswith((".safetensors", ".bin", "tokenizer.json"))]
        assert {p: files.get(p) for p in weights} == {p: ref_files[p] for p in weights}, name
    assert mine["eval"]["result"]["eval"] == theirs["eval"]["result"]["eval"]
    for name in ("shard_text", "dedup_text", "shard_chat", "shard_pairs"):
        assert mine[name]["files"] == theirs[name]["files"], name

    plan = subprocess.run([sys.executable, "-m", "flows.cli", "plan", str(d / "demo.yaml")], cwd=d, text=True,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.count("(cached: manifest exists)") == len(ref["stages"]), plan.stdout
    s = ArtifactStore(str(store))
    for art in s.list():
        art.verify()
    assert list((store / "_staging").iterdir()) == []
    scratch = [f for area in ("lmforge-train", "lmforge-staging") for f in (work / area).glob("*")]
    assert [(f, gc.orphaned(f)) for f in scratch if gc.orphaned(f)] == []  # the killed runs' scratch is gone
    client = MlflowClient(f"sqlite:///{d / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("demo").experiment_id], max_results=2000)
    assert [r.info.run_id for r in runs if r.info.status == "RUNNING"] == []
    assert sum(r.data.tags.get("lmforge.ended_by", "").startswith("its process") for r in runs) >= len(POINTS)


def test_a_killed_lease_holder_is_taken_over_by_the_waiting_run(tmp_path):
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(120))
    stages = {"sft": sft(method="full", max_steps=300, checkpoint_every_steps=5, evaluate=False)}
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(train_pipeline(tmp_path, stages), sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def cli(name: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(cfg), "--json",
                                 str(tmp_path / f"{name}.json")], cwd=tmp_path, env=env,
                                stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    store = tmp_path / "artifacts"
    procs = {name: cli(name) for name in ("a", "b")}  # at once: one of them takes the sft lease, the other waits
    deadline = time.monotonic() + 600
    holder = waiter = None
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs.values()), \
            "\n".join((tmp_path / f"{n}.log").read_text()[-2000:] for n in procs)
        leases = list(store.glob("sft/*/_lease.json"))
        if leases and list(store.glob("sft/*/_checkpoints/checkpoint-*/DONE")):
            with contextlib.suppress(ValueError, FileNotFoundError):
                pid = json.loads(leases[0].read_text())["pid"]
                holder_name = next(n for n, p in procs.items() if p.pid == pid)  # the CLI process holds it
                waiter_name = "b" if holder_name == "a" else "a"
                if "is being built by run" in "".join(
                        line for line in (tmp_path / f"{waiter_name}.log").read_text().splitlines(True)
                        if "sft/" in line):
                    holder, waiter = procs[holder_name], procs[waiter_name]
                    break
        time.sleep(0.1)
    assert holder is not None, "\n".join((tmp_path / f"{n}.log").read_text()[-2000:] for n in procs)
    _killpg(holder)
    assert waiter.wait(timeout=600) == 0, (tmp_path / f"{waiter_name}.log").read_text()[-3000:]
    out = (tmp_path / f"{waiter_name}.log").read_text()
    assert f"pid {holder.pid}) is stale: its process is gone; taking over" in out
    summary = json.loads((tmp_path / f"{waiter_name}.json").read_text())
    assert summary["stages"]["sft"]["status"] == "ran"
    result = ArtifactStore(str(store)).require("sft", summary["stages"]["sft"]["artifact_id"]).result
    assert result["resumed_from_step"] >= 5 and result["steps"] == 300
    assert list((store / "_staging").iterdir()) == []  # the holder's staging folder went with the takeover
    assert not list(store.glob("sft/*/_lease.json"))
