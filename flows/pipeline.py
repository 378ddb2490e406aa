"""The Prefect flow: config -> plan -> one Prefect task per stage, run as a DAG.

Prefect schedules, retries and shows progress; the artifact store decides what is done. Every task
checks the store first, so a new flow run, `prefect flow-run retry`, a deployment's schedule and the
CLI all skip finished stages the same way. Prefect's own result cache is switched off.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

# stage logs show in the terminal and in the Prefect UI under their task run; stages also run
# outside flows (tests, scripts), where there is no flow run to send logs to: that is fine
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "lmforge,tasks,trainer,flows")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
# Prefect's ephemeral API server gets 20 s to start by default; on a loaded 2-core machine it often needs more
# (that timeout failed 5 of ~20 runs at load 5-9). Its loop counts only its own sleeps, so this is a lower bound.
EPHEMERAL_STARTUP_SECONDS = os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

import yaml  # noqa: E402
from prefect import flow, runtime, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.task_runners import ThreadPoolTaskRunner  # noqa: E402

from lmforge import gc, interrupt, preflight, provenance, runview  # noqa: E402
from lmforge.config import load_config  # noqa: E402
from lmforge.errors import ArtifactError, ConfigError, DataError, LmforgeError, StageFailed  # noqa: E402
from lmforge.executor import RunContext, execute_stage  # noqa: E402
from lmforge.log import setup_logging  # noqa: E402
from lmforge.plan import make_plan  # noqa: E402
from lmforge.tracking import Tracker  # noqa: E402
from tasks import REGISTRY  # noqa: E402

log = logging.getLogger(__name__)
MAX_PARALLEL_STAGES = int(os.environ.get("LMFORGE_MAX_PARALLEL_STAGES", "4"))


def _retry_condition(task, task_run, state) -> bool:
    """Retry transient failures; bad input or config fails at once (retrying cannot fix it), and nothing is
    retried once the run was asked to stop."""
    if interrupt.requested():
        return False
    exc = state.result(raise_on_failure=False)
    return not (isinstance(exc, LmforgeError) and not exc.retryable)


@contextlib.contextmanager
def _stop_on_signals():
    """SIGTERM or SIGINT to this process (preemption notice, eviction, Ctrl-C, a Prefect cancellation) while the
    stages run: every training process checkpoints at the end of its step and stops, stages that have not started
    do not start, nothing is retried; the flow then ends with `Interrupted`. A second signal ends the training
    process trees at once. Python runs handlers in the main thread only: outside it (a flow run in a worker
    thread) this does nothing and the caller's handling stays."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # noqa: ARG001
        # trainer.launch starts every training process, so if it is not imported none runs; importing it here would
        # hold the stop request back for the ~7 s that torch and transformers take to import
        launch = sys.modules.get("trainer.launch")
        if interrupt.requested():
            log.warning("%s again: ending the training processes now", signal.Signals(signum).name)
            if hasattr(launch, "kill_all"):
                launch.kill_all()
            return
        interrupt.request(signum)  # first: data stages stop within a poll, and no training process starts now
        pids = launch.stop_all() if hasattr(launch, "stop_all") else []
        log.warning("%s: stopping. Training process(es) %s checkpoint at the end of their step and stop; no new "
                    "stage starts. Rerun the same command to resume.", signal.Signals(signum).name,
                    ", ".join(map(str, pids)) or "(none running)")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def _collect(futures: dict[str, Any], cfg) -> tuple[dict[str, Any], dict[str, str], set[str]]:
    """Wait for every stage; (per-stage summaries, failures by stage name with their cause, the stages that failed
    on bad input)."""
    stages: dict[str, Any] = {}
    failures: dict[str, str] = {}
    bad_input: set[str] = set()  # failed on bad config or data (exit 2), not on a crash (exit 1)
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
            upstream = [i for i in cfg.stages[name].inputs if i in failures]
            failures[name] = f"not run: upstream {', '.join(upstream)} failed" if upstream else \
                f"{state.name}: {state.message}"
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
    `accept_code_change` keeps its earlier artifact across a code change (see `lmforge run --accept-code-change`)."""
    setup_logging()
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
                wait_for = [futures[i] for i in sc.inputs if i in futures]
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
        runview.finish_parent(tracker, parent, plan, stages, counts, time.monotonic() - started,
                              promote=not failures and not interrupt.requested())
        tracker.end_run(parent, "KILLED" if interrupt.requested() else "FAILED" if failures else "FINISHED")
        if interrupt.requested():
            stopped = ", ".join(n for n, s in stages.items() if s["status"] == "failed") or "none"
            raise interrupt.Interrupted(f"pipeline {cfg.name}: stopped by {interrupt.signal_name()}; stages not finished: "
                                        f"{stopped}. Finished stages and uploaded checkpoints are kept: rerun the same "
                                        "command to resume.")
        if failures:
            raise StageFailed(failures, flow_run['id'] or None, bad_input=bad_input)
    except BaseException:  # never leave the parent RUNNING, whatever ended the run
        tracker.end_run(parent, "KILLED" if interrupt.requested() else "FAILED")
        raise
    log.info("pipeline %s: %d stage(s) ran, %d cached", cfg.name, summary["ran"], summary["cached"])
    return summary
