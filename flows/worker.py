"""`lmforge worker --pool NAME [--run-once] [--limit N]`: Prefect's process worker, with an exit status.

Prefect 3.9.1's `prefect worker start --run-once` exits 0 whatever happened to the flow runs it took, so a cron
job, a scheduler or a Kubernetes Job that runs it cannot tell a crashed or failed run from a good one. This runs
the same worker (`prefect.workers.process.ProcessWorker`, as `prefect worker start` builds it) in this process,
records the flow runs it submits (the list its poll returns), and once it stops reads each one's final state from
the Prefect API: one line per flow run, and with --run-once an exit status from the worst of them.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any
from uuid import UUID

from lmforge.errors import ConfigError

log = logging.getLogger(__name__)

EXIT_CRASHED = 4
#: the exit status of `lmforge worker --run-once` for a flow run's final state type; the worst one wins
EXIT_BY_STATE = {"COMPLETED": 0, "CANCELLED": 3, "FAILED": 1, "CRASHED": EXIT_CRASHED}


def check_pool(client, pool: str) -> None:
    """The pool must exist and be a process pool: a misspelt name would otherwise make a new, empty pool and an
    exit status of 0 for the runs that never ran."""
    from prefect.exceptions import ObjectNotFound

    try:
        wp = client.read_work_pool(pool)
    except ObjectNotFound:
        raise ConfigError([f"--pool {pool}: no work pool {pool!r} in the Prefect API at hand. Give the pool the "
                           "deployments run on (`prefect work-pool ls`; `lmforge deploy --pool NAME` creates it), "
                           "and point PREFECT_API_URL at its server"]) from None
    if wp.type != "process":
        raise ConfigError([f"--pool {pool}: work pool {pool!r} is of type {wp.type!r}; lmforge worker runs a "
                           "'process' worker. Start that pool's own worker (`prefect worker start --pool "
                           f"{pool}`), or give a process pool"])


def crash_cause(client, flow_run) -> str | None:
    """Why a crashed flow run could not start or died, when it can be told: a pull step folder that does not exist
    on this machine (Prefect 3.9.1 prints that `FileNotFoundError` on the worker's console only, not to the API),
    else the last line of the last traceback the flow run logged at ERROR (an import error while loading the flow)."""
    import os

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel
    from prefect.client.schemas.sorting import LogSort
    from prefect.exceptions import ObjectNotFound

    if flow_run.deployment_id:
        try:
            dep = client.read_deployment(flow_run.deployment_id)
        except ObjectNotFound:
            dep = None
        for step in (dep.pull_steps or []) if dep else []:
            for fqn, kwargs in step.items():
                folder = (kwargs or {}).get("directory")
                if fqn.endswith("set_working_directory") and isinstance(folder, str) and "{{" not in folder \
                        and not os.path.isdir(folder):
                    return (f"the pull step's folder {folder} does not exist on this machine (set_working_directory of "
                            f"deployment {dep.name!r}): the checkout moved or was deleted. Run `lmforge deploy` again "
                            "from the checkout, or put the checkout back at that path")
    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id]),
                                                 level=LogFilterLevel(ge_=logging.ERROR)),
                            sort=LogSort.TIMESTAMP_ASC)
    for rec in reversed(logs):
        if "Traceback (most recent call last)" in rec.message:
            return rec.message.strip().splitlines()[-1].strip()
    return None


def flow_run_ends(flow_run_ids: list[UUID]) -> list[dict[str, Any]]:
    """[{"id", "name", "state", "state_type", "message", "cause"}] for each flow run, read from the Prefect API."""
    from prefect.client.orchestration import get_client

    out = []
    with get_client(sync_client=True) as client:
        for fr_id in flow_run_ids:
            fr = client.read_flow_run(fr_id)
            st = fr.state
            state_type = st.type.value if st else "NONE"
            out.append({"id": str(fr.id), "name": fr.name, "state": st.name if st else "no state",
                        "state_type": state_type, "message": (st.message or "").strip() if st else "",
                        "cause": crash_cause(client, fr) if state_type == "CRASHED" else None})
    return out


def exit_status(ends: list[dict[str, Any]]) -> int:
    """The worst end wins: Crashed 4, Failed 1, Cancelled 3, Completed 0. A flow run the worker left in a
    non-final state (Running, Pending, ...) counts as crashed: nothing will finish it."""
    codes = {EXIT_BY_STATE.get(e["state_type"], EXIT_CRASHED) for e in ends}
    return next((c for c in (EXIT_CRASHED, 1, 3) if c in codes), 0)


def format_end(e: dict[str, Any]) -> str:
    line = f"flow run {e['id']} {e['name']}: {e['state']}"
    if e["state_type"] not in EXIT_BY_STATE:
        line += " (not a final state: the worker stopped before the flow run ended)"
    if e["message"]:
        line += f": {e['message']}"
    if e["cause"]:
        line += f"\n  cause: {e['cause']}"
    return line


async def _work(pool: str, run_once: bool, limit: int | None, name: str | None, submitted: list[UUID],
                stopped_by: list[str]) -> None:
    """Run Prefect's process worker on `pool` as `prefect worker start` does, appending each flow run it submits
    to `submitted`. SIGTERM or SIGINT cancels it (its flow runs' processes get SIGTERM from the worker's teardown);
    a second one kills this process, as `prefect worker start` does."""
    import os
    import signal

    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS, PREFECT_WORKER_PREFETCH_SECONDS
    from prefect.workers.process import ProcessWorker

    worker = ProcessWorker(name=name, work_pool_name=pool, limit=limit,
                           prefetch_seconds=PREFECT_WORKER_PREFETCH_SECONDS.value(),
                           heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()),
                           create_pool_if_not_found=False)
    poll = worker.get_and_submit_flow_runs

    async def poll_and_record():  # the worker's own poll: it returns the flow runs it just submitted
        runs = await poll()
        submitted.extend(r.id for r in runs if r.id not in submitted)
        return runs

    worker.get_and_submit_flow_runs = poll_and_record  # start() reads it when it builds its polling loop

    main = asyncio.current_task()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:  # runs in the main thread, between the event loop's callbacks
        if stopped_by:
            log.warning("%s again: killing lmforge worker (pid %d) now", sig.name, os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)
        stopped_by.append(sig.name)
        log.info("%s: stopping worker %r (send it again to kill it now)", sig.name, worker.name)
        main.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await worker.start(run_once=run_once, printer=log.info)
    except asyncio.CancelledError:
        if not stopped_by:
            raise
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def cmd_worker(args) -> int:
    from prefect.client.orchestration import get_client

    if args.limit is not None and args.limit < 1:
        raise ConfigError([f"--limit {args.limit}: give the most flow runs to run at once, 1 or more"])
    with get_client(sync_client=True) as client:
        check_pool(client, args.pool)
    submitted: list[UUID] = []
    stopped_by: list[str] = []
    asyncio.run(_work(args.pool, args.run_once, args.limit, args.name, submitted, stopped_by))
    if stopped_by:
        print(f"lmforge worker: stopped by {stopped_by[0]} (pool {args.pool!r})")
    interrupted = bool(stopped_by) and args.run_once
    if not submitted:
        if args.run_once and not interrupted:
            print(f"lmforge worker: no flow run was waiting in work pool {args.pool!r}; nothing ran")
        return 3 if interrupted else 0
    ends = flow_run_ends(submitted)
    for e in ends:
        print(format_end(e))
    if not args.run_once:  # a long-running worker stopped on purpose: its runs are in the lines above and the UI
        return 0
    code = 3 if interrupted else exit_status(ends)
    counts: dict[str, int] = {}
    for e in ends:
        counts[e["state"]] = counts.get(e["state"], 0) + 1
    print(f"lmforge worker: {len(ends)} flow run(s) in pool {args.pool!r}: "
          + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"; exit {code}")
    return code


def add_parser(sub) -> None:
    w = sub.add_parser("worker", help="Prefect's process worker for a pool; with --run-once its exit status says how "
                                      "the flow runs it took ended (0 Completed, 1 Failed, 3 Cancelled, 4 Crashed)")
    w.add_argument("--pool", required=True, help="the process work pool to take flow runs from (e.g. lmforge)")
    w.add_argument("--run-once", action="store_true",
                   help="take the flow runs that are due now, run them, print how each ended and exit with the "
                        "worst: 4 one crashed (it could not start or died), 1 one failed (a stage failed), "
                        "3 one was cancelled, 0 all completed or none was waiting")
    w.add_argument("--limit", type=int, help="the most flow runs to run at once (default: no limit)")
    w.add_argument("--name", help="the worker's name in the Prefect UI (default: Prefect's ProcessWorker <uuid>)")
    w.set_defaults(fn=cmd_worker)
