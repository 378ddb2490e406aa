"""The Prefect flow: config -> plan -> one Prefect task per stage, run as a DAG.

Prefect schedules, retries and shows progress; the artifact store decides what is done. Every task
checks the store first, so a new flow run, `prefect flow-run retry`, a deployment's schedule and the
CLI all skip finished stages the same way. Prefect's own result cache is switched off.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import sys
import threading
import time
from typing import Any
from uuid import UUID

# stage logs show in the terminal and in the Prefect UI under their task run; stages also run
# outside flows (tests, scripts), where there is no flow run to send logs to: that is fine
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "lmforge,tasks,trainer,flows")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
# (the ephemeral server's start-up window is set in flows/__init__.py, before Prefect's import)

import yaml  # noqa: E402
from prefect import flow, runtime, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.states import Cancelled  # noqa: E402
from prefect.task_runners import ThreadPoolTaskRunner  # noqa: E402

from flows import flowrun  # noqa: E402
from lmforge import gc, interrupt, preflight, provenance, publish, runview  # noqa: E402
from lmforge.config import load_config  # noqa: E402
from lmforge.errors import ArtifactError, ConfigError, DataError, LmforgeError, StageFailed  # noqa: E402
from lmforge.executor import RunContext, execute_stage  # noqa: E402
from lmforge.log import setup_logging  # noqa: E402
from lmforge.plan import make_plan  # noqa: E402
from lmforge.tracking import Tracker  # noqa: E402
from tasks import REGISTRY  # noqa: E402

log = logging.getLogger("flows.pipeline")  # by name: a deployment loads this file as a module of another name
MAX_PARALLEL_STAGES = int(os.environ.get("LMFORGE_MAX_PARALLEL_STAGES", "4"))
#: how often a run against a Prefect server reads its flow run's state to see a cancellation (`prefect flow-run cancel`)
CANCEL_POLL_SECONDS = float(os.environ.get("LMFORGE_CANCEL_POLL_SECONDS", "2"))


def _retry_condition(task, task_run, state) -> bool:
    """Retry transient failures; bad input or config fails at once (retrying cannot fix it), and nothing is
    retried once the run was asked to stop."""
    if interrupt.requested():
        return False
    exc = state.result(raise_on_failure=False)
    return not (isinstance(exc, LmforgeError) and not exc.retryable)


def _stop(cause: int | str) -> None:
    """Stop the run: every training process checkpoints at the end of its step and stops, stages that have not
    started do not start, nothing is retried; the flow then ends with `Interrupted`. `cause` is a signal number (from
    the main thread's handler) or `interrupt.PREFECT_CANCELLATION` (from the cancellation watcher's thread). A second
    signal ends the training process trees at once; a signal after a Prefect cancellation does not, since that is
    how a Prefect worker cancels (it sends SIGTERM to the flow's process after the state turned Cancelling)."""
    # trainer.launch starts every training process, so if it is not imported none runs; importing it here would
    # hold the stop request back while torch and transformers import
    launch = sys.modules.get("trainer.launch")
    what = interrupt.describe(cause)
    if isinstance(cause, int) and interrupt.signalled():
        log.warning("%s again: ending the training processes now", what)
        if hasattr(launch, "kill_all"):
            launch.kill_all()
        return
    already = interrupt.requested()
    interrupt.request(cause)  # first: data stages stop within a poll, and no training process starts now
    pids = ", ".join(map(str, launch.stop_all() if hasattr(launch, "stop_all") else [])) or "(none running)"
    if already:
        log.warning("%s: already stopping after %s; training process(es) %s asked again", what, interrupt.cause(), pids)
        return
    log.warning("%s: stopping. Training process(es) %s checkpoint at the end of their step and stop; no new stage "
                "starts. Rerun the same command to resume.", what, pids)


@contextlib.contextmanager
def _stop_on_signals():
    """SIGTERM or SIGINT to this process (preemption notice, eviction, Ctrl-C, a Prefect worker cancelling the run)
    while the stages run: `_stop`. Python runs handlers in the main thread only: outside it (a flow run in a worker
    thread) this does nothing and the caller's handling stays. Prefect runs a flow run in the main thread of the
    process it starts for it (`python -m prefect.engine` from a process worker, a spawned process from `serve()`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # noqa: ARG001
        _stop(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def _stop_on_cancellation(flow_run_id: str):
    """A cancellation of this flow run through Prefect (`prefect flow-run cancel`, the UI's Cancel) while the stages
    run: `_stop`, as for SIGTERM.

    Prefect tells only the processes that its worker or `serve()` runner started: they watch for the Cancelling
    state and send SIGTERM to the flow's process. A flow run started by a plain call, as `lmforge run` does, is never
    told: its stages run on, and the server then refuses its final state and leaves it Cancelling. So a thread reads
    the flow run's state every CANCEL_POLL_SECONDS. Only against a Prefect server (PREFECT_API_URL set): nothing
    can cancel a run on the temporary API that Prefect starts for this process alone."""
    from prefect.settings import PREFECT_API_URL

    if not flow_run_id or not PREFECT_API_URL.value():
        yield
        return
    done = threading.Event()

    def watch():
        from prefect.client.orchestration import get_client

        with contextlib.ExitStack() as stack:
            try:  # a client of its own (the flow's belongs to the flow's thread); the timeout bounds a hung request
                client = stack.enter_context(get_client(sync_client=True, httpx_settings={"timeout": 10.0}))
            except Exception as e:
                log.warning("cannot watch flow run %s for a cancellation through Prefect (%s): cancelling it will "
                            "not stop this run; SIGTERM still does", flow_run_id, e)
                return
            while True:
                try:
                    state = client.read_flow_run(UUID(flow_run_id)).state
                except Exception as e:  # the server is away for a moment: the run goes on, and so does the watch
                    log.debug("reading the state of flow run %s failed: %s", flow_run_id, e)
                    state = None
                if state is not None and (state.is_cancelling() or state.is_cancelled()):
                    _stop(interrupt.PREFECT_CANCELLATION)
                    return
                if done.wait(CANCEL_POLL_SECONDS):
                    return

    # the thread sees the flow's Prefect settings (API URL, key, profile): they live in context variables
    watcher = threading.Thread(target=contextvars.copy_context().run, args=(watch,), daemon=True,
                               name=f"lmforge-cancel-watch-{flow_run_id[:8]}")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=15)


def _collect(futures: dict[str, Any], cfg) -> tuple[dict[str, Any], dict[str, str], set[str]]:
    """Wait for every stage; (per-stage summaries, failures by stage name with their cause, the stages that failed
    on bad input)."""
    stages: dict[str, Any] = {}
    failures: dict[str, str] = {}
    bad_input: set[str] = set()  # failed on bad config or data (exit 2), not on a crash (exit 1)
    roots: dict[str, list[str]] = {}  # a stage that did not run: the failed stages upstream of it
    for name, fut in futures.items():
        fut.wait()
        state = fut.state
        if state.is_completed():
            stages[name] = fut.result()
            continue
        exc = state.result(raise_on_failure=False) if state.is_failed() else None
        if isinstance(exc, BaseException):
            failures[name] = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, (ConfigError, DataError, ArtifactError)):
                bad_input.add(name)
        else:
            inputs = cfg.stages[name].upstream()
            roots[name] = flowrun.failed_roots(name, inputs, set(failures) - set(roots), roots)
            upstream = [i for i in inputs if i in failures]
            failures[name] = f"not run: upstream {', '.join(upstream)} failed" if upstream else \
                f"{state.name}: {state.message}"
            if roots[name] and not state.is_final():  # Prefect leaves it Pending/NotReady: end it, named
                flowrun.mark_not_run(fut, name, roots[name])
        stages[name] = {"stage": name, "status": "failed", "error": failures[name]}
    return stages, failures, bad_input


@task(cache_policy=NO_CACHE, persist_result=False)
def stage_task(ctx: RunContext, name: str) -> dict[str, Any]:
    return execute_stage(ctx, name)


@flow(name="lmforge-pipeline", task_runner=ThreadPoolTaskRunner(max_workers=MAX_PARALLEL_STAGES),
      validate_parameters=True)
def pipeline(config_path: str, overrides: list[str] | None = None, force: list[str] | None = None,
             accept_code_change: list[str] | None = None) -> dict[str, Any]:
    """Run the pipeline declared in `config_path`; stages with a finished artifact are skipped. A stage named in
    `accept_code_change` keeps its earlier artifact across a code change (see `lmforge run --accept-code-change`).
    A run stopped by a signal raises `Interrupted`; one cancelled through Prefect ends Cancelled, and the call raises
    the same `Interrupted`."""
    setup_logging()
    flowrun.send_logs_to_api()  # a worker's flow-run process configured Prefect's logging before importing us
    config_path = flowrun.resolve_config_path(config_path)  # a deployment stores it relative to the project root
    cfg = load_config(config_path, REGISTRY, overrides or [])
    preflight.check_all(cfg.store_url, cfg.tracking_uri)  # a deployment run too: services first, each bounded
    plan = make_plan(cfg, REGISTRY, force or [], accept_code_change=accept_code_change or [])
    log.info("plan:\n%s", plan.format())
    swept = gc.sweep_leftovers(plan.store)  # staging and scratch folders of killed runs
    if swept.removals:
        log.info("removed %d leftover folder(s) of runs that are gone (%.1f MB): %s", len(swept.removals),
                 swept.bytes / 2**20, "; ".join(f"{r.path} ({r.why})" for r in swept.removals))
    flow_run = {"id": str(runtime.flow_run.id or ""), "name": str(runtime.flow_run.name or "")}
    tracker = Tracker(cfg.tracking_uri, cfg.name)
    for run_id in tracker.end_runs_of_dead_processes():
        log.warning("MLflow run %s was left RUNNING by a process that died (kill -9?); marked KILLED", run_id)
    started = time.monotonic()
    parent = runview.start_parent(tracker, plan, flow_run["id"], {
        "lmforge.pipeline": cfg.name,
        "prefect.flow_run_id": flow_run["id"],
        "prefect.flow_run_name": flow_run["name"],
        "lmforge.config_hash": cfg.config_hash(),
        "lmforge.config_path": str(config_path),
        "lmforge.store": plan.store.url,
        "mlflow.source.git.commit": provenance.git_commit(),
        "lmforge.git_commit": provenance.git_commit(),
        **{f"lmforge.env.{k}": v for k, v in provenance.environment().items()},
        "lmforge.forced": ",".join(force or []),
        "lmforge.accept_code_change": ",".join(accept_code_change or []),
        "lmforge.deployment": str(runtime.deployment.name or ""),
    })
    try:
        tracker.log_text(parent, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), "config.yaml")
        ctx = RunContext(plan=plan, kinds=REGISTRY, tracker=tracker, parent_run_id=parent, flow_run=flow_run)

        interrupt.reset()  # a new run in this process
        with contextlib.ExitStack() as stack:
            stack.enter_context(_stop_on_signals())
            stack.enter_context(_stop_on_cancellation(flow_run["id"]))
            if cfg.dask_address:  # every stage becomes a task on the Dask cluster
                from prefect_dask import DaskTaskRunner

                runner = stack.enter_context(DaskTaskRunner(address=cfg.dask_address))
                log.info("running stages on the Dask cluster at %s", cfg.dask_address)
            else:
                runner = None
            futures = {}
            for name in plan.stages:
                sc = cfg.stages[name]
                t = stage_task.with_options(name=name, task_run_name=name, retries=sc.retries,
                                            retry_delay_seconds=sc.retry_delay_seconds,
                                            timeout_seconds=sc.timeout_seconds, retry_condition_fn=_retry_condition)
                wait_for = [futures[i] for i in sc.upstream() if i in futures]
                futures[name] = runner.submit(t, {"ctx": ctx, "name": name}, wait_for=wait_for) if runner else \
                    t.submit(ctx, name, wait_for=wait_for)
            stages, failures, bad_input = _collect(futures, cfg)

        summary = {
            "pipeline": cfg.name,
            "flow_run_id": flow_run["id"],
            "mlflow_run_id": parent,
            "ran": sum(1 for s in stages.values() if s["status"] == "ran"),
            "cached": sum(1 for s in stages.values() if s["status"] == "cached"),
            "failed": len(failures),
            "stages": stages,
        }
        counts = {"stages_ran": summary["ran"], "stages_cached": summary["cached"], "stages_failed": summary["failed"]}
        promote = not failures and not interrupt.requested()
        runview.finish_parent(tracker, parent, plan, stages, counts, time.monotonic() - started, promote=promote)
        if promote:  # the export stages' folders to their publish_to, once the gates passed (lmforge/publish.py)
            summary["published"] = publish.publish_exports(plan, stages)
            if summary["published"]:
                tracker.set_tags(parent, {"lmforge.published": ", ".join(f"{k}: {v}" for k, v in
                                                                          summary["published"].items())})
        tracker.end_run(parent, "KILLED" if interrupt.requested() else "FAILED" if failures else "FINISHED")
        if interrupt.requested():
            stopped = ", ".join(n for n, s in stages.items() if s["status"] == "failed") or "none"
            stop = interrupt.Interrupted(f"pipeline {cfg.name}: stopped by {interrupt.cause()}; stages not finished: "
                                         f"{stopped}. Finished stages and uploaded checkpoints are kept: rerun the "
                                         "same command to resume.")
            if interrupt.cancelled_through_prefect():
                # once a run is Cancelling the server refuses every final state but Cancelled (it would stay
                # Cancelling); a State returned by a flow becomes its final state, and `pipeline(...)` raises its data
                return Cancelled(message=str(stop), data=stop)
            raise stop
        if failures:
            raise StageFailed(failures, flow_run['id'] or None, bad_input=bad_input)
    except BaseException:  # never leave the parent RUNNING, whatever ended the run
        tracker.end_run(parent, "KILLED" if interrupt.requested() else "FAILED")
        raise
    log.info("pipeline %s: %d stage(s) ran, %d cached", cfg.name, summary["ran"], summary["cached"])
    return summary
