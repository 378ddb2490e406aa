"""A process-wide stop request: SIGTERM or SIGINT to `lmforge run` (a preemption notice, a Kubernetes eviction,
Ctrl-C), or a cancellation of its flow run through Prefect (`prefect flow-run cancel`, the UI's Cancel).

Python delivers signals to the main thread only, and stages run in Prefect's worker threads, so a handler inside
a stage never fires. `flows/pipeline.py` handles the signal in the main thread and watches the flow run's state
for a cancellation in a thread of its own; both call `request()`, and the layers below react: training processes
are asked to checkpoint and stop (`trainer.launch.stop_all`), a stage that has not started yet does not start
(`check`), a data stage stops between its units of work, and no stage is retried. The run then exits with the
documented code for an interrupted run; the rerun resumes.
"""
from __future__ import annotations

import signal
import threading
from typing import Iterable, Iterator, TypeVar

from lmforge.errors import LmforgeError

#: the cause of a stop request that came as a cancellation of the flow run through Prefect, not as a signal
PREFECT_CANCELLATION = "a cancellation through Prefect"

_requested = threading.Event()
# every request in order, a signal number or PREFECT_CANCELLATION. No lock: a signal handler that waited for one
# held by the main thread it interrupted would never return; appending to and reading a list are atomic in CPython
_causes: list[int | str] = []
T = TypeVar("T")
#: How many records a data stage handles between two checks: a check costs well under a microsecond, a record
#: (parse, hash, write) tens of microseconds or more, so a stop comes within milliseconds at no measurable cost.
EVERY_RECORDS = 1000


class Interrupted(LmforgeError):
    """The run was asked to stop (SIGTERM/SIGINT, a Prefect cancellation): finished and checkpointed work is kept;
    rerun to resume."""

    retryable = False


def request(cause: int | str = signal.SIGTERM) -> None:
    """Ask the run to stop; `cause` is the signal number or `PREFECT_CANCELLATION`."""
    _causes.append(cause)
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def signalled() -> bool:
    """Whether a signal (not only a Prefect cancellation) asked the run to stop."""
    return any(isinstance(c, int) for c in list(_causes))


def cancelled_through_prefect() -> bool:
    """Whether the flow run was cancelled through Prefect (first, or after a signal: a worker's SIGTERM may come
    before the cancellation watcher sees the Cancelling state)."""
    return PREFECT_CANCELLATION in list(_causes)


def describe(cause: int | str) -> str:
    return signal.Signals(cause).name if isinstance(cause, int) else cause


def cause() -> str:
    """What asked the run to stop: `a cancellation through Prefect` if it was one (a Prefect worker cancels by
    sending SIGTERM, which may come first), else the first signal, `SIGTERM` or `SIGINT`."""
    causes = list(_causes)
    if PREFECT_CANCELLATION in causes:
        return PREFECT_CANCELLATION
    return describe(causes[0]) if causes else "a stop request"


def error(where: str) -> Interrupted:
    return Interrupted(f"{where}: stopped by {cause()} before it finished; rerun the same command to go on")


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
    _causes.clear()
