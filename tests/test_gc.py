"""Garbage: `lmforge gc` and the leftovers a rerun removes.

`lmforge gc` is run as the user runs it, on a store that real pipeline runs filled: it removes the checkpoints of
finished artifacts (keep policy), orphaned staging folders of dead processes (never a live run's), and with
`--unreferenced` artifacts no pipeline ref reaches; `--dry-run` removes nothing and reports the same bytes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.pipeline import pipeline
from lmforge import gc, owner
from lmforge.store import ArtifactStore
from tests.helpers import REPO, chat_rows, sft, train_pipeline, write_jsonl


def _lmforge(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _fake_staging(base: Path, name: str, pid: int, size: int) -> Path:
    folder = base / name
    (folder / "out").mkdir(parents=True)
    (folder / "out" / "part.bin").write_bytes(b"x" * size)
    (folder / owner.OWNER).write_text(json.dumps({"host": os.uname().nodename, "pid": pid, "pid_started": None,
                                                "kind": "sft", "artifact_id": "x", "created": 0}))
    return folder


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_gc_removes_checkpoints_leftovers_and_unreferenced_artifacts_and_reports_the_bytes(tmp_path):
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(60))
    stages = {"sft": sft(method="full", max_steps=12, checkpoint_every_steps=3, keep_checkpoints=3, evaluate=False)}
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(train_pipeline(tmp_path, stages), sort_keys=False))
    # the runs go through the pipeline flow in this process (the CLI's start-up is tested elsewhere); gc is the CLI
    sft_id = pipeline(config_path=str(cfg))["stages"]["sft"]["artifact_id"]
    store = ArtifactStore(str(tmp_path / "artifacts"))
    ckpts = tmp_path / "artifacts" / "sft" / sft_id / "_checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]

    staging = tmp_path / "artifacts" / "_staging"
    dead = _fake_staging(staging, "sft-x-dead0001", _dead_pid(), 1000)  # a kill -9 leftover
    live = _fake_staging(staging, "sft-x-live0001", os.getpid(), 500)  # a run that is still going: not touched

    dry = _lmforge("gc", "--dry-run", "--json", "-c", str(cfg), cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    found = {(r["what"], Path(r["path"]).name): r for r in report["removals"]}
    assert set(found) == {("leftover", "sft-x-dead0001"), ("checkpoints", "_checkpoints")}
    assert "process" in found[("leftover", "sft-x-dead0001")]["why"]
    assert found[("leftover", "sft-x-dead0001")]["bytes"] == 1000 + len((dead / owner.OWNER).read_bytes())
    ckpt_bytes = _du(ckpts)
    assert found[("checkpoints", "_checkpoints")]["bytes"] == ckpt_bytes > 0
    assert report["bytes"] == ckpt_bytes + found[("leftover", "sft-x-dead0001")]["bytes"]
    assert dead.exists() and ckpts.exists()  # a dry run removes nothing

    keep = _lmforge("gc", "--keep-checkpoints", "1", "-c", str(cfg), cwd=tmp_path)
    assert keep.returncode == 0, keep.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["checkpoint-9"]  # the newest complete one
    assert not dead.exists() and live.exists()
    assert "freed" in keep.stdout

    full = _lmforge("gc", "-c", str(cfg), cwd=tmp_path)
    assert full.returncode == 0, full.stderr
    assert not ckpts.exists() and live.exists()
    assert f"removed 1 item(s), freed" in full.stdout
    for art in store.list():
        art.verify()  # every finished artifact is whole
    plan = _lmforge("plan", str(cfg), cwd=tmp_path)
    assert plan.returncode == 0 and plan.stdout.count("(cached: manifest exists)") == 4, plan.stdout

    # a config change makes a new sft artifact: the old one is no longer referenced; its inputs still are
    new_id = pipeline(config_path=str(cfg), overrides=["stages.sft.learning_rate=0.002"])["stages"]["sft"]["artifact_id"]
    assert new_id != sft_id
    old = tmp_path / "artifacts" / "sft" / sft_id
    old_bytes = _du(old)
    gone = _lmforge("gc", "--unreferenced", "--keep-checkpoints", "3", "--json", "-c", str(cfg), cwd=tmp_path)
    assert gone.returncode == 0, gone.stderr
    removed = json.loads(gone.stdout)["removals"]
    assert [(r["what"], r["path"], r["bytes"]) for r in removed if r["what"] == "unreferenced"] == \
        [("unreferenced", str(old), old_bytes)]
    assert not old.exists()
    assert {a.kind for a in store.list()} == {"ingest", "shard", "tokenizer", "sft"}
    assert [a.id for a in store.list("sft")] == [new_id]


def test_gc_refuses_a_negative_keep(tmp_path):
    bad = _lmforge("gc", "--keep-checkpoints", "-1", "--store", str(tmp_path / "artifacts"), cwd=tmp_path)
    assert bad.returncode == 2 and "--keep-checkpoints: -1 is negative" in bad.stderr


@pytest.mark.s3
def test_gc_on_s3_keeps_the_newest_checkpoint_and_counts_bytes(s3, tmp_path):
    store = ArtifactStore("s3://lmforge-test/gc")
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "model.bin").write_bytes(b"m" * 100)
    store.publish("sft", "a1", staged, {"kind": "sft", "artifact_id": "a1", "inputs": []})
    root = store.checkpoint_path("sft", "a1")
    for step in (5, 10):
        store.fs.pipe_file(f"{root}/checkpoint-{step}/weights.bin", b"w" * 40)
        store.fs.pipe_file(f"{root}/checkpoint-{step}/DONE", b"{}")
    store.fs.pipe_file(f"{root}/checkpoint-15/weights.bin", b"w" * 40)  # half-uploaded: no DONE
    report = gc.collect(store, keep_checkpoints=1)
    assert sorted(Path(r.path).name for r in report.removals) == ["checkpoint-15", "checkpoint-5"]
    assert report.bytes == 40 + 42
    store.fs.invalidate_cache()
    assert sorted(f[len(root) + 1:] for f in store.fs.find(root)) == ["checkpoint-10/DONE", "checkpoint-10/weights.bin"]
    assert [s for s, _, _ in gc._checkpoints(store, root)] == [10]
    store.require("sft", "a1").verify()
