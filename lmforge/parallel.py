"""Run one function over many items: in this process, on a local process pool, or on a Dask cluster.

    with make_mapper(workers=4, dask_address=None) as mapper:
        results = mapper.map(fn, items, what="partitions")   # in the order of items

`fn` must be a module-level function and the items and results plain picklable data, so the same
call works in every backend. Results come back in item order whatever order the tasks finish in,
so callers stay deterministic. Progress is logged as tasks finish.

Backends, picked by `make_mapper`:
- inside a Dask worker (e.g. a stage running as a task of Prefect's DaskTaskRunner): the worker's
  own client, through `distributed.worker_client()`, which also takes this task's thread out of the
  worker's pool while it waits, so the fan-out cannot deadlock a cluster with few threads;
- `dask_address` set: `distributed.Client(dask_address)`;
- `workers` > 1: a `ProcessPoolExecutor` with the "forkserver" start method (forking a process
  that runs threads, as Prefect and MLflow do, can deadlock). Like "spawn", it imports the main
  module in the workers, so a script that runs a stage needs the `if __name__ == "__main__":` guard;
- otherwise, or inside a daemonic process (which may not start children): in this process.

A stop request (`lmforge.interrupt`: SIGTERM or SIGINT to `lmforge run`) is noticed between tasks in
this process and within `POLL_SECONDS` while waiting for workers: `map` raises `Interrupted`, cancels
the tasks not started yet, and ends the local worker processes at once (they are stopped, not waited
for: their output is thrown away with the stage's staging folder). Pool workers ignore SIGINT, so a
Ctrl-C to the terminal's process group reaches them only through this. Tasks already running on a
Dask cluster are cancelled, which Dask does between tasks, not inside one.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Sequence

from lmforge import interrupt
from lmforge.log import Progress

log = logging.getLogger(__name__)
POLL_SECONDS = 0.2  # how often a wait for workers looks for a stop request
STOP_GRACE_SECONDS = 2.0  # how long a worker gets to exit on SIGTERM before it is killed


class Mapper:
    """Base: `map(fn, items)` -> results in item order. `parallelism` is how many tasks run at once."""

    kind = "in-process"
    parallelism = 1

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], what: str = "tasks") -> list[Any]:
        items = list(items)
        progress = Progress(log, f"{what} ({self.kind})", total=len(items), unit="tasks")
        out = []
        for item in items:
            interrupt.check(what)
            out.append(fn(item))
            progress.update()
        progress.done()
        return out

    def close(self) -> None:
        pass

    def __enter__(self) -> "Mapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}, parallelism={self.parallelism})"


def _ignore_sigint() -> None:
    """Pool worker initializer: Ctrl-C goes to the whole process group; the main process decides what stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class ProcessPoolMapper(Mapper):
    kind = "process pool"

    def __init__(self, workers: int, preload: Sequence[str] = ()):
        self.parallelism = workers
        ctx = multiprocessing.get_context("forkserver")
        # modules imported once by the fork server, so workers start with them loaded (if this
        # process has not started its fork server yet; the setting is global to the process)
        ctx.set_forkserver_preload(["__main__", *preload])
        self._pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_ignore_sigint)
        self._stopped = False

    def map(self, fn, items, what="tasks"):
        items = list(items)
        progress = Progress(log, f"{what} ({self.kind}, {self.parallelism} workers)", total=len(items), unit="tasks")
        interrupt.check(what)
        futures = [self._pool.submit(fn, item) for item in items]
        pending = set(futures)
        try:
            while pending:
                done, pending = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
                for f in done:
                    f.result()  # raise the first failure at once
                progress.update(len(done))
                interrupt.check(what)
        except BrokenProcessPool as e:
            # a signal sent to the whole process group also ended the workers: the stop request is the cause
            if interrupt.requested() or interrupt.wait(1.0):
                self.stop()
                raise interrupt.error(what) from None
            raise RuntimeError(
                f"a {what} worker process died: out of memory, or it was killed, or the main script lacks the "
                "`if __name__ == '__main__':` guard that process pools need. Set workers: 1 to run in-process "
                "and see the cause") from e
        except interrupt.Interrupted:
            self.stop()
            raise
        except BaseException:
            for f in pending:
                f.cancel()
            raise
        progress.done()
        return [f.result() for f in futures]

    def stop(self) -> None:
        """Cancel what has not started and end the worker processes now, without waiting for their tasks."""
        if self._stopped:
            return
        self._stopped = True
        procs = list((self._pool._processes or {}).values())  # the executor offers no public handle on them
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(STOP_GRACE_SECONDS)
            if p.is_alive():
                p.kill()
                p.join()
        log.info("stopped %d worker process(es) of the process pool", len(procs))

    def close(self):
        self._pool.shutdown(wait=True, cancel_futures=True)


class DaskMapper(Mapper):
    kind = "dask"

    def __init__(self, client, stack: contextlib.ExitStack):
        self.client, self._stack = client, stack
        self.parallelism = max(1, sum(client.nthreads().values()))

    def map(self, fn, items, what="tasks"):
        items = list(items)
        progress = Progress(log, f"{what} (dask {self.client.scheduler.address}, {self.parallelism} threads)",
                            total=len(items), unit="tasks")
        futures = self.client.map(fn, items, pure=False)
        results = []
        try:
            for f in futures:  # in item order; raises the task's own exception
                while True:
                    interrupt.check(what)
                    try:
                        results.append(f.result(timeout=POLL_SECONDS))
                        break
                    except TimeoutError:
                        if f.status == "error":  # the task's own TimeoutError; else not done yet (or just done)
                            raise
                progress.update()
        finally:
            self.client.cancel([f for f in futures if not f.done()])
            for f in futures:
                f.release()
        progress.done()
        return results

    def close(self):
        self._stack.close()


def in_dask_worker() -> bool:
    if "distributed" not in sys.modules:  # a Dask worker has imported it; importing it here is slow
        return False
    from distributed import get_worker
    try:
        get_worker()
    except ValueError:
        return False
    return True


def make_mapper(workers: int | None = None, dask_address: str | None = None, preload: Sequence[str] = ()) -> Mapper:
    """The mapper for this process: see the module doc for which backend is picked when.

    `preload`: modules a local process pool imports before forking its workers (e.g. the module of
    the mapped functions), so each worker does not import them again."""
    if in_dask_worker():
        from distributed import get_worker, worker_client

        stack = contextlib.ExitStack()
        if dask_address and dask_address != get_worker().scheduler.address:
            from distributed import Client

            client = stack.enter_context(Client(dask_address, set_as_default=False))
        else:
            client = stack.enter_context(worker_client())
        return DaskMapper(client, stack)
    if dask_address:
        from distributed import Client

        stack = contextlib.ExitStack()
        try:
            client = stack.enter_context(Client(dask_address, set_as_default=False, timeout="30s"))
        except OSError as e:
            raise OSError(f"cannot reach the Dask scheduler at dask_address {dask_address!r}: {e}. Start the "
                          "cluster (dask scheduler / dask worker), or leave dask_address unset to run locally") from None
        return DaskMapper(client, stack)
    n = workers if workers is not None else (os.cpu_count() or 1)
    if n > 1 and multiprocessing.current_process().daemon:
        log.warning("running in a daemonic process, which cannot start a process pool: using 1 worker, not %d", n)
        n = 1
    return ProcessPoolMapper(n, preload) if n > 1 else Mapper()
