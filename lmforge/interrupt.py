"""A process-wide stop request: SIGTERM or SIGINT to `lmforge run` (a preemption notice, a Kubernetes eviction,
Ctrl-C, a Prefect cancellation).

Python delivers signals to the main thread only, and stages run in Prefect's worker threads, so a handler inside
a stage never fires. `flows/pipeline.py` handles the signal in the main thread: it calls `request()`, and the
layers below react: training processes are asked to checkpoint and stop (`trainer.launch.stop_all`), a stage that
has not started yet does not start (`check`), a data stage stops between its units of work, and no stage is
retried. The run then exits with the documented code for an interrupted run; the rerun resumes.
"""
from __future__ import annotations

import signal
import threading
from typing import Iterable, Iterator, TypeVar

from lmforge.errors import LmforgeError

_requested = threading.Event()
_signal: list[int] = []
T = TypeVar("T")
#: How many records a data stage handles between two checks: a check costs well under a microsecond, a record
#: (parse, hash, write) tens of microseconds or more, so a stop comes within milliseconds at no measurable cost.
EVERY_RECORDS = 1000


class Interrupted(LmforgeError):
    """The run was asked to stop (SIGTERM/SIGINT): finished and checkpointed work is kept; rerun to resume."""

    retryable = False


def request(signum: int = signal.SIGTERM) -> None:
    if not _requested.is_set():
        _signal.append(signum)
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def signal_name() -> str:
    return signal.Signals(_signal[0]).name if _signal else "a stop request"


def error(where: str) -> Interrupted:
    return Interrupted(f"{where}: stopped by {signal_name()} before it finished; rerun the same command to go on")


def check(where: str) -> None:
    """Raise `Interrupted` if a stop was requested: call before starting work and between units of work."""
    if _requested.is_set():
        raise error(where)


def checked(items: Iterable[T], where: str, every: int = EVERY_RECORDS) -> Iterator[T]:
    """`items`, with `check(where)` before the first item and then before every `every`-th: a data stage's record
    loop that stops between records when asked."""
    for i, item in enumerate(items):
        if i % every == 0:
            check(where)
        yield item


def wait(timeout: float) -> bool:
    """Wait up to `timeout` seconds for a stop request; True if there is one."""
    return _requested.wait(timeout)


def reset() -> None:
    """Forget an earlier request (a new run in the same process, e.g. tests)."""
    _requested.clear()
    _signal.clear()
