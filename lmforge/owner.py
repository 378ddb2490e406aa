"""Who owns a scratch folder, and whether that process still lives.

Every staging folder and every training scratch folder carries `owner.json`: the host, pid and process start time
of the run that made it, and the artifact it builds. `lmforge.gc` reads it to tell a leftover of a killed run from a
folder in use; `lmforge.lease` and `lmforge.tracking` ask the same question of a lease holder and of a run.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path

import psutil

OWNER = "owner.json"


def work_base(name: str) -> Path:
    """A host-local scratch area: `$LMFORGE_WORK_DIR/<name>` or `<temp dir>/<name>`."""
    return Path(os.environ.get("LMFORGE_WORK_DIR") or tempfile.gettempdir()) / name


def process_started(pid: int) -> float | None:
    """The start time of process `pid` on this host, or None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def process_gone(pid: int, started: float | None) -> bool:
    """Process `pid` (started at `started`, when known) no longer exists on this host: no such pid, or the pid
    now belongs to a process started at another time."""
    now = process_started(pid)
    return now is None or (started is not None and abs(now - started) > 1)


def claim(folder: Path, kind: str, aid: str) -> None:
    """Write `owner.json` into a fresh scratch folder: who made it, for which artifact."""
    record = {"host": platform.node(), "pid": os.getpid(), "pid_started": process_started(os.getpid()), "kind": kind,
              "artifact_id": aid, "created": time.time()}
    tmp = folder / f".{OWNER}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / OWNER)
