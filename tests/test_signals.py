"""A stop request to `lmforge run` itself (SIGTERM: a preemption notice, an eviction; SIGINT: Ctrl-C) reaches the
training process in Prefect's worker thread: it checkpoints and stops, the run exits 3 leaving no process behind
(no trainer, no Prefect server), the MLflow parent run is KILLED, and the rerun resumes from the checkpoint.

The signal goes to the CLI process, as a scheduler or a user sends it, never to the training child.
`start_training_run` and `assert_stopped_then_resumed` (tests/helpers.py) are shared with tests/test_cancel.py, where
the stop request is a cancellation through Prefect.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil
import pytest
import yaml

from tests.helpers import (assert_stopped_then_resumed, chat_rows, sft, start_cli, start_training_run, train_pipeline,
                           write_jsonl)


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
                         retry_delay_seconds=0, timeout_seconds=20)}  # its first checkpoint comes well before that
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(train_pipeline(tmp_path, stages), sort_keys=False))
    log = tmp_path / "log.txt"
    proc = start_cli(cfg, log)
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
