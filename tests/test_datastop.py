"""A stop request reaches the data stages: SIGTERM to `lmforge run` while dedup's process pool works stops the stage
between its tasks, ends the pool's workers, publishes nothing, and the run exits 3 leaving no process behind; the
rerun builds the same artifact and keeps the stages that had finished. Below that: each data stage, asked to stop
mid-loop, raises `Interrupted` at its next check; `lmforge.parallel`, asked while a pool maps, raises at once and ends
the workers mid-task.

The signal goes to the CLI process, as a scheduler or a user sends it, never to a child.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from lmforge import interrupt
from lmforge.parallel import Mapper, ProcessPoolMapper, make_mapper


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
