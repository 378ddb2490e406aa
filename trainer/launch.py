"""Run a training job in a child process and bring back its result or its error.

    local     python -m trainer.entry <spec.json>
    torchrun  python -m torch.distributed.run --standalone --nproc_per_node N -m trainer.entry <spec.json>

The child is a fresh interpreter: GPU memory is freed when it exits, a crash stays contained, and the
same command scales to more GPUs. Before it starts, the newest complete checkpoint is downloaded
from the stage's checkpoint URI, so the child resumes from it. The child's output streams into this
process's log line by line (logger `trainer.child`). It writes `result.json` (rank 0) or
`error-<rank>.json`; a setting error comes back as `SettingError` naming the field, anything else as
`TrainingError` with the exit status, the child's error and the tail of its log.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Iterator

from trainer import checkpoint
from trainer.errors import Preempted, SettingError, TrainingError
from trainer.job import JobSpec

log = logging.getLogger(__name__)
child_log = logging.getLogger("trainer.child")

REPO = Path(__file__).resolve().parent.parent
TAIL_LINES = 40
LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
          "CRITICAL": logging.CRITICAL}


@contextlib.contextmanager
def work_dir(stage: str, artifact_id: str) -> Iterator[Path]:
    """Local scratch for one attempt (spec, result, local checkpoints, downloads); removed afterwards."""
    base = Path(os.environ.get("LMFORGE_WORK_DIR") or tempfile.gettempdir()) / "lmforge-train"
    path = base / f"{stage}-{artifact_id}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def command(launcher: str, nproc_per_node: int, spec_path: Path) -> list[str]:
    if launcher == "local":
        if nproc_per_node != 1:
            raise SettingError("nproc_per_node", f"launcher local runs one process, got nproc_per_node "
                               f"{nproc_per_node}; set launcher: torchrun for more")
        return [sys.executable, "-m", "trainer.entry", str(spec_path)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
                "-m", "trainer.entry", str(spec_path)]
    raise SettingError("launcher", f"unknown launcher {launcher!r}; expected local or torchrun")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    return env


def run(spec: JobSpec, *, launcher: str = "local", nproc_per_node: int = 1) -> dict[str, Any]:
    """Run the job to completion; returns the child's result dict."""
    work = Path(spec.work_dir)
    restored = checkpoint.restore_latest(spec.checkpoint_uri, work / "resume")
    if restored is not None:
        spec = spec.model_copy(update={"resume_from": str(restored[0]), "resume_step": restored[1]})
    spec_path = work / "spec.json"
    spec.write(spec_path)
    cmd = command(launcher, nproc_per_node, spec_path)
    log.info("stage %s: training in a child process: %s", spec.stage, " ".join(cmd))
    proc = subprocess.Popen(cmd, cwd=work, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, errors="replace")
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with _forward_sigterm(proc):
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            tail.append(line)
            child_log.log(_level(line), "%s", line)
        rc = proc.wait()
    return _outcome(spec, rc, work, list(tail))


def _level(line: str) -> int:
    head = line.split(" ", 1)[0].rstrip(":")
    if head.startswith("[rank") and " " in line:  # torchrun's "[rank1]: ..." prefix
        head = line.split(" ", 2)[1].rstrip(":")
    return LEVELS.get(head, logging.INFO)


@contextlib.contextmanager
def _forward_sigterm(proc: subprocess.Popen) -> Iterator[None]:
    """A SIGTERM to this process (a cancelled stage) goes to the child, which checkpoints and stops."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame):  # noqa: ARG001
        log.warning("SIGTERM: asking the training process %d to checkpoint and stop", proc.pid)
        proc.send_signal(signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _outcome(spec: JobSpec, rc: int, work: Path, tail: list[str]) -> dict[str, Any]:
    result_path = work / "result.json"
    if rc == 0 and result_path.is_file():
        return json.loads(result_path.read_text())
    errors = sorted(work.glob("error-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    err = json.loads(errors[0].read_text()) if errors else None
    if err and err.get("type") == "SettingError":
        raise SettingError(err["field"], err["problem"])
    if err and err.get("type") == "Preempted":
        raise Preempted(err["message"])
    how = f"exit status {rc}"
    if rc < 0:
        name = signal.Signals(-rc).name
        how = f"killed by {name}" + (" (often the out-of-memory killer: check `dmesg`, lower batch_size_per_device "
                                     "or max_length_tokens, or use method lora/qlora)" if -rc == signal.SIGKILL else "")
    elif rc == 0:
        how = "exit status 0 but no result.json"
    cause = f"{err['type']}: {err['message']}" if err else "no error report (see the log lines below)"
    lines = "\n".join(f"    {x}" for x in tail[-15:])
    raise TrainingError(f"stage {spec.stage}: the training process failed ({how}): {cause}\n"
                        f"  last log lines of the training process:\n{lines}\n"
                        f"  Completed checkpoints in {spec.checkpoint_uri} are kept; rerun the stage to resume.")
