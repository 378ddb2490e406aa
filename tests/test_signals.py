"""A stop request to `lmforge run` itself (SIGTERM: a preemption notice, an eviction; SIGINT: Ctrl-C) reaches the
training process in Prefect's worker thread: it checkpoints and stops, the run exits 3 leaving no process behind
(no trainer, no Prefect server), the MLflow parent run is KILLED, and the rerun resumes from the checkpoint.

The signal goes to the CLI process, as a scheduler or a user sends it, never to the training child.
`start_training_run` and `assert_stopped_then_resumed` are shared with tests/test_cancel.py, where the stop request
is a cancellation through Prefect.
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
import pytest
import yaml
from mlflow.tracking import MlflowClient

from lmforge.store import ArtifactStore
from tests.conftest import REPO, write_jsonl
from tests.test_trainer import chat_rows, pipeline, sft


def _cli(cfg, log, *extra):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(cfg), *extra], cwd=cfg.parent, env=env,
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def start_training_run(tmp_path: Path, max_steps: int = 400) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """`lmforge run` of a tiny sft stage (`max_steps` steps of ~30 a second here, a checkpoint every 5, retries 1) in
    `tmp_path`, returned once its first checkpoint is uploaded, with the processes it runs then (a training child
    among them). The stop request must come before the training ends."""
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(120))
    stages = {"sft": sft(method="full", max_steps=max_steps, checkpoint_every_steps=5, evaluate=False, retries=1)}
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(pipeline(tmp_path, stages), sort_keys=False))
    log = tmp_path / "log.txt"
    store = ArtifactStore(str(tmp_path / "artifacts"))

    proc = _cli(cfg, log)
    deadline = time.monotonic() + 240
    done: list[str] = []
    while time.monotonic() < deadline and not done and proc.poll() is None:
        store.fs.invalidate_cache()
        done = store.fs.glob(f"{store.root}/sft/*/_checkpoints/checkpoint-*/DONE")
        time.sleep(0.05)
    assert done, log.read_text()[-3000:]
    family = psutil.Process(proc.pid).children(recursive=True)
    assert any("trainer.entry" in " ".join(p.cmdline()) for p in family)  # a training child is running
    return proc, family


def assert_stopped_then_resumed(tmp_path: Path, proc: subprocess.Popen, family: list[psutil.Process],
                                cause: str, max_steps: int = 400) -> str:
    """After a stop request (`cause`: SIGTERM, SIGINT, a cancellation through Prefect) to the run that
    `start_training_run` started: it exits 3 leaving no process behind, nothing retried or published, the MLflow
    parent KILLED; then the same command resumes from the checkpoint and finishes. Returns the stopped run's log."""
    log = tmp_path / "log.txt"
    rc = proc.wait(timeout=180)
    out = log.read_text()
    assert rc == 3, out[-3000:]
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert alive == [], [(p.pid, p.cmdline()) for p in alive]  # no trainer, no Prefect server left behind
    assert f"{cause}: stopping. Training process(es)" in out
    assert f"stopped by {cause}" in out and "rerun the same command to resume" in out
    assert out.count("training in a child process") == 1  # not retried (retries: 1 would start a second one)
    store = ArtifactStore(str(tmp_path / "artifacts"))
    sft_dir = store.fs.glob(f"{store.root}/sft/*")[0]
    assert not store.fs.exists(f"{sft_dir}/manifest.json")  # not finished: nothing published
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    parent = [r for r in runs if "lmforge.pipeline" in r.data.tags]
    assert [r.info.status for r in parent] == ["KILLED"]
    assert all(r.info.status != "RUNNING" for r in runs)

    rerun = _cli(tmp_path / "pipeline.yaml", log, "--json", str(tmp_path / "summary.json"))
    assert rerun.wait(timeout=300) == 0, log.read_text()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"]["sft"]["status"] == "ran"
    result = store.require("sft", summary["stages"]["sft"]["artifact_id"]).result
    assert result["resumed_from_step"] > 0  # the step it stopped at: saved on SIGTERM at the end of that step
    assert result["steps"] == max_steps
    return out


# SIGINT takes the same path in lmforge.interrupt; the default run has it (Ctrl-C) in tests/test_datastop.py
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_lmforge_run_checkpoints_training_exits_3_leaves_nothing_and_the_rerun_resumes(tmp_path, sig):
    proc, family = start_training_run(tmp_path)
    os.kill(proc.pid, sig)  # the CLI itself
    assert_stopped_then_resumed(tmp_path, proc, family, signal.Signals(sig).name)


def test_a_stage_timeout_ends_the_training_process_tree_before_the_retry_starts_another(tmp_path):
    """A stage timeout (or any exception in the launcher's wait) ended the stage while its training process went on
    training, and the retry started a second one on the same checkpoints. Now the first is ended (checkpoint, then
    stop) before the retry starts, the retry resumes from its checkpoint, and nothing is left when the run fails."""
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(120))
    stages = {"sft": sft(method="full", max_steps=5000, checkpoint_every_steps=5, evaluate=False, retries=1,
                         retry_delay_seconds=0, timeout_seconds=20)}  # its first checkpoint comes ~10 s in
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(pipeline(tmp_path, stages), sort_keys=False))
    log = tmp_path / "log.txt"
    proc = _cli(cfg, log)
    most, seen = 0, set()
    family: dict[int, psutil.Process] = {}
    while proc.poll() is None:  # how many training processes run at once, sampled through the whole run
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            break
        family.update({p.pid: p for p in kids})
        with contextlib.suppress(psutil.Error):
            trainers = [p for p in kids if "trainer.entry" in " ".join(p.cmdline())]
            most = max(most, len(trainers))
            seen |= {p.pid for p in trainers}
        time.sleep(0.1)
    out = log.read_text()
    assert proc.wait() == 1, out[-3000:]
    assert out.count("training in a child process") == 2  # the first attempt and its retry
    assert out.count("ending its training process tree") == 2
    assert len(seen) == 2 and most == 1  # never two trainers at once
    assert "resuming at step" in out  # the retry went on from the first attempt's checkpoint
    _, alive = psutil.wait_procs(list(family.values()), timeout=10)
    assert alive == [], [(p.pid, p.cmdline()) for p in alive]
