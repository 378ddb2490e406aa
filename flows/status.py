"""`lmforge status [FLOW_RUN_ID]` and `lmforge rerun FLOW_RUN_ID`: a pipeline's flow run as its stages.

Each stage's state, message and duration come from the Prefect API's task runs; its artifact id from planning the
flow run's own parameters (config and overrides) again, and whether it was built by this flow run or cached from
the store's manifest (`produced_by.flow_run_id`). A rerun runs those parameters again in this process, like
`lmforge run`: the store skips every finished stage, so only the failed stages and their dependants run.

Without PREFECT_API_URL, Prefect answers from its temporary server, which it starts as a subprocess on its own
sqlite database under PREFECT_HOME (not the project folder): tens of seconds on a busy machine. When that database
does not exist or holds no flow run of lmforge-pipeline, `status` says so at once (exit 1) instead of starting it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from flows.deploy import FLOW_NAME
from flows.flowrun import resolve_config_path
from flows.run_cmd import cmd_run
from lmforge.errors import LmforgeError

log = logging.getLogger(__name__)

EXIT_NO_FLOW_RUN = 1  # `lmforge status`: no flow run to show (none at all, or not the id given)


class NoFlowRun(LmforgeError):
    """No flow run of lmforge-pipeline to show: not a config problem, nothing to retry."""

    retryable = False


def _not_found(flow_run_id: str) -> NoFlowRun:
    return NoFlowRun(f"flow run {flow_run_id!r}: not found in the Prefect API. Give the id of a flow run of "
                     f"{FLOW_NAME} (`prefect flow-run ls --flow-name {FLOW_NAME}`), and point PREFECT_API_URL at the "
                     "server that ran it")


def _none_yet(where: str) -> NoFlowRun:
    return NoFlowRun(f"no flow runs found: {where} has no flow run of {FLOW_NAME}. Run `lmforge run CONFIG` or "
                     "trigger a deployment, or point PREFECT_API_URL at the server that ran one")


def local_flow_runs() -> int | None:
    """Without PREFECT_API_URL: how many started flow runs of lmforge-pipeline the temporary server's sqlite database
    holds (0 when it does not exist), read directly so that nothing starts. None when that cannot be told (a server
    is configured, another database, a schema this does not know): then ask the API."""
    import sqlite3

    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return None
    url = settings.server.database.connection_url
    url = url.get_secret_value() if url is not None else ""
    if not url.startswith("sqlite+aiosqlite:///") or ":memory:" in url:
        return None
    path = Path(url.removeprefix("sqlite+aiosqlite:///"))
    if not path.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=5)) as db:
            return db.execute("SELECT count(*) FROM flow_run r JOIN flow f ON f.id = r.flow_id WHERE f.name = ? "
                              "AND r.state_type != 'SCHEDULED'", (FLOW_NAME,)).fetchone()[0]
    except sqlite3.Error:
        return None


def _local_database() -> str:
    from prefect.settings import get_current_settings

    return f"Prefect's local database ({get_current_settings().home}; PREFECT_API_URL is not set)"


def read_flow_run(client, flow_run_id: str | None):
    """The flow run `flow_run_id`, or the latest started flow run of lmforge-pipeline (scheduled ones left out)."""
    from uuid import UUID

    from prefect.client.schemas.filters import (FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterState,
                                                FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.exceptions import ObjectNotFound

    if flow_run_id:
        try:
            fr = client.read_flow_run(UUID(flow_run_id))
        except (ValueError, ObjectNotFound):
            raise _not_found(flow_run_id) from None
        flow = client.read_flow(fr.flow_id)
        if flow.name != FLOW_NAME:
            raise NoFlowRun(f"flow run {flow_run_id}: a run of flow {flow.name!r}, not of {FLOW_NAME}")
        return fr
    runs = client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW_NAME])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
            type=FlowRunFilterStateType(not_any_=[StateType.SCHEDULED]))),
        sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1)
    if not runs:
        from prefect.settings import PREFECT_API_URL

        raise _none_yet(f"the Prefect API at {PREFECT_API_URL.value()}" if PREFECT_API_URL.value()
                        else _local_database())
    return runs[0]


def _check_local(flow_run_id: str | None) -> None:
    """Fail at once, before Prefect starts its temporary server, when its database has no flow run to show."""
    if local_flow_runs() == 0:
        raise _not_found(flow_run_id) if flow_run_id else _none_yet(_local_database())


def _seconds(tr) -> float | None:
    if tr.start_time is None:
        return None
    if tr.end_time is not None:
        return round((tr.end_time - tr.start_time).total_seconds(), 3)
    return round(tr.total_run_time.total_seconds(), 3) if tr.total_run_time else None


def _plan(params: dict[str, Any]):
    from lmforge.config import load_config
    from lmforge.plan import make_plan
    from tasks import REGISTRY

    cfg = load_config(resolve_config_path(params["config_path"]), REGISTRY, params.get("overrides") or [])
    return make_plan(cfg, REGISTRY, params.get("force") or [],
                     accept_code_change=params.get("accept_code_change") or [])


def flow_run_status(flow_run_id: str | None = None) -> dict[str, Any]:
    """{"flow_run_id", "flow_run_name", "deployment", "state", "message", "parameters", "stages": [{"stage",
    "state", "state_type", "artifact_id", "in_store", "cached", "seconds", "error"}], "plan_error"} in the order the
    config runs them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    _check_local(flow_run_id)
    with get_client(sync_client=True) as client:
        fr = read_flow_run(client, flow_run_id)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
        deployment = client.read_deployment(fr.deployment_id).name if fr.deployment_id else None
    latest: dict[str, Any] = {}
    for tr in sorted(task_runs, key=lambda t: t.created or t.expected_start_time):  # newest attempt wins
        latest[tr.name] = tr
    plan, plan_error = None, None
    try:
        plan = _plan(fr.parameters)
    except LmforgeError as e:  # the config moved or no longer plans: still show the states
        plan_error = str(e)
    order = list(plan.stages) if plan else sorted(latest)
    stages = []
    for name in order:
        tr = latest.get(name)
        sp = plan.stages.get(name) if plan else None
        art = plan.store.get(sp.kind, sp.artifact_id) if sp else None
        built_by = (art.manifest.get("produced_by") or {}).get("flow_run_id") if art else None
        state = tr.state if tr is not None else None
        failed = state is not None and (state.is_failed() or state.is_crashed() or state.is_cancelled())
        stages.append({
            "stage": name,
            "state": state.name if state else "no task run",
            "state_type": state.type.value if state else None,
            "artifact_id": f"{sp.kind}/{sp.artifact_id}" if sp else None,
            "in_store": art is not None,
            "cached": None if art is None or not (state and state.is_completed()) else built_by != str(fr.id),
            "seconds": _seconds(tr) if tr is not None else None,
            "error": (state.message or state.name) if failed else None,
        })
    return {"flow_run_id": str(fr.id), "flow_run_name": fr.name, "deployment": deployment,
            "state": fr.state.name if fr.state else None, "message": fr.state.message if fr.state else None,
            "parameters": fr.parameters, "stages": stages, "plan_error": plan_error}


def format_status(st: dict[str, Any]) -> str:
    lines = [f"flow run {st['flow_run_name']} ({st['flow_run_id']})"
             f"{' of deployment ' + st['deployment'] if st['deployment'] else ''}: {st['state']}",
             f"  config {st['parameters'].get('config_path')}"
             + "".join(f" -o {o}" for o in st['parameters'].get('overrides') or [])]
    if st["plan_error"]:
        lines.append(f"  (artifact ids unknown: the config does not plan now: {st['plan_error']})")
    lines.append(f"  {'STAGE':<16} {'STATE':<12} {'ARTIFACT':<30} {'CACHED':<7} {'SECONDS':>8}  ERROR")
    for s in st["stages"]:
        cached = "-" if s["cached"] is None else "yes" if s["cached"] else "no"
        art = (s["artifact_id"] or "?") + ("" if s["in_store"] else " (absent)")
        secs = "-" if s["seconds"] is None else f"{s['seconds']:.1f}"
        lines.append(f"  {s['stage']:<16} {s['state']:<12} {art:<30} {cached:<7} {secs:>8}  {s['error'] or ''}")
    return "\n".join(lines)


def cmd_status(args) -> int:
    """Exit 0 with the status shown, EXIT_NO_FLOW_RUN (1) when there is no flow run to show."""
    try:
        st = flow_run_status(args.flow_run_id)
    except NoFlowRun as e:
        print(f"lmforge status: {e}", file=sys.stderr)
        return EXIT_NO_FLOW_RUN
    print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    return 0


def cmd_rerun(args) -> int:
    """Run the flow run's parameters again (tagged `rerun-of:<id>`); exit codes as `lmforge run`."""
    import argparse

    from prefect import tags
    from prefect.client.orchestration import get_client

    _check_local(args.flow_run_id)
    with get_client(sync_client=True) as client:
        fr = read_flow_run(client, args.flow_run_id)
    p = fr.parameters
    # not --force again: what that run forced and finished is in the store now, and a rerun redoes only what is not
    run_args = argparse.Namespace(config=resolve_config_path(p["config_path"]), override=list(p.get("overrides") or []),
                                  force=[], accept_code_change=list(p.get("accept_code_change") or []), json=args.json)
    print(f"rerunning flow run {fr.name} ({fr.id}): {run_args.config}" + "".join(f" -o {o}" for o in run_args.override)
          + (f" (its --force {', '.join(p['force'])} is not repeated)" if p.get("force") else ""))
    with tags(f"rerun-of:{fr.id}"):
        return cmd_run(run_args)


def add_parsers(sub) -> None:
    """`lmforge status` and `lmforge rerun`."""
    s = sub.add_parser("status", help="each stage of a flow run: state, artifact, cached or not, duration, error",
                       description="Each stage of a flow run of lmforge-pipeline, from the Prefect API. Exit 0, or 1 "
                       "when there is no flow run to show.")
    s.add_argument("flow_run_id", nargs="?", help="flow run id (default: the latest run of lmforge-pipeline)")
    s.add_argument("--json", action="store_true", help="print it as JSON")
    s.set_defaults(fn=cmd_status)
    r = sub.add_parser("rerun", help="run a flow run's config and overrides again: only what did not finish runs")
    r.add_argument("flow_run_id", help="flow run id (Prefect UI, `lmforge status`, or `prefect flow-run ls`)")
    r.add_argument("--json", metavar="FILE", help="also write the run summary to FILE")
    r.set_defaults(fn=cmd_rerun)
