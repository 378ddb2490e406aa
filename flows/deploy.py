"""`lmforge deploy`: register a pipeline's Prefect deployments (a manual one and a nightly one) on a process pool.

The deployments load the flow from this checkout: their pull step is `set_working_directory` to the project root
as an absolute path, taken at deploy time, so a worker on the same machine (or one with the same checkout at the
same path) needs no environment variable. The config path is stored relative to the project root when the config
lies inside it (it then travels with the code), else absolute.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flows.flowrun import PROJECT_ROOT, resolve_config_path
from lmforge.errors import ConfigError

log = logging.getLogger(__name__)

ENTRYPOINT = "flows/pipeline.py:pipeline"
FLOW_NAME = "lmforge-pipeline"
DEFAULT_POOL = "lmforge"
NIGHTLY_CRON = "0 3 * * *"


def config_parameter(config_path: str | Path) -> str:
    """The `config_path` a deployment stores: relative to the project root when the file is inside it (so the
    deployment works wherever the checkout is), else absolute."""
    path = Path(config_path).expanduser().resolve()
    if not path.is_file():
        raise ConfigError([f"config file not found: {path}. Pass the path of a pipeline YAML file."])
    try:
        return str(path.relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


def ensure_process_pool(client, pool: str) -> bool:
    """Create the process work pool `pool` (with Prefect's default process job template) unless it exists; True
    when it was created. A pool of another type is refused: its workers would not run this checkout's code."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        existing = client.read_work_pool(pool)
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process",
                                               base_job_template=ProcessWorker.get_default_base_job_template()))
        return True
    if existing.type != "process":
        raise ConfigError([f"--pool {pool}: work pool {pool!r} is of type {existing.type!r}; lmforge deploy registers "
                           "deployments that run from this checkout and needs a 'process' pool. Pick another name, "
                           "or deploy to Docker/Kubernetes pools with prefect.yaml (see README, Deployments)"])
    return False


def deploy(config_path: str | Path, name: str | None = None, pool: str = DEFAULT_POOL,
           cron: str | None = NIGHTLY_CRON, timezone: str = "UTC",
           overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """Register `<name>` (runs on demand) and, with a cron, `<name>-nightly` (schedule active) for the pipeline in
    `config_path`; the pool is created when missing. Returns [{"name", "id", "schedule"}] per deployment."""
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import RunnerDeployment
    from prefect.runner.storage import LocalStorage
    from prefect.schedules import Cron

    from flows.pipeline import pipeline
    from lmforge.config import load_config
    from tasks import REGISTRY

    config_path = resolve_config_path(config_path)
    cfg = load_config(config_path, REGISTRY, overrides or [])  # a broken config fails here, not on the worker
    name = name or cfg.name
    params = {"config_path": config_parameter(config_path), "overrides": list(overrides or []), "force": []}
    with get_client(sync_client=True) as client:
        if ensure_process_pool(client, pool):
            log.info("created process work pool %r", pool)
    out = []
    for dep_name, schedule in ((name, None), (f"{name}-nightly", cron)):
        if dep_name.endswith("-nightly") and not cron:
            continue
        dep = RunnerDeployment.from_flow(
            pipeline, name=dep_name, parameters=params, work_pool_name=pool,
            schedules=[Cron(schedule, timezone=timezone)] if schedule else None,
            description=f"lmforge pipeline {cfg.name!r} ({params['config_path']})"
                        + (f", every day at cron {schedule!r} {timezone}" if schedule else ", on demand"),
            tags=["lmforge", cfg.name])
        dep.storage = LocalStorage(str(PROJECT_ROOT))  # pull step: set_working_directory to this checkout
        dep.entrypoint = ENTRYPOINT
        dep_id = dep.apply(work_pool_name=pool)
        out.append({"name": f"{FLOW_NAME}/{dep_name}", "id": str(dep_id),
                    "schedule": f"cron {schedule!r} {timezone}" if schedule else "none (manual)"})
    return out


def cmd_deploy(args) -> int:
    deps = deploy(args.config, name=args.name, pool=args.pool, cron=None if args.no_schedule else args.cron,
                  timezone=args.timezone, overrides=args.override)
    print(f"registered {len(deps)} deployment(s) on process work pool {args.pool!r}, running from {PROJECT_ROOT}:")
    for d in deps:
        print(f"  {d['name']}  (id {d['id']}; schedule: {d['schedule']})")
    print(f"""
Start a worker (same machine, or one with this checkout at {PROJECT_ROOT}, and the same PREFECT_API_URL):
  lmforge worker --pool {args.pool}
(Prefect's process worker, as `prefect worker start --pool {args.pool}` runs it; with --run-once it exits with the
worst flow run's status, where `prefect worker start --run-once` exits 0 whatever happened: docs/operations.md)
Trigger a run now, and follow it:
  prefect deployment run {deps[0]['name']}
  lmforge status            # the latest run's stages; `lmforge rerun FLOW_RUN_ID` after fixing a failure""")
    return 0


def add_parser(sub) -> None:
    d = sub.add_parser("deploy", help="register the pipeline's Prefect deployments (manual and nightly) on a process "
                                      "work pool, creating the pool if missing; prints how to start a worker")
    d.add_argument("config", nargs="?", default="configs/demo.yaml", help="pipeline YAML file (default: the demo)")
    d.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value in every run of the deployments (repeatable)")
    d.add_argument("--name", help="deployment name (default: the pipeline's name); the scheduled one is NAME-nightly")
    d.add_argument("--pool", default=DEFAULT_POOL, help=f"process work pool (default: {DEFAULT_POOL})")
    d.add_argument("--cron", default=NIGHTLY_CRON, help=f"schedule of NAME-nightly (default: {NIGHTLY_CRON!r})")
    d.add_argument("--timezone", default="UTC", help="time zone of --cron (default: UTC)")
    d.add_argument("--no-schedule", action="store_true", help="register only the manual deployment")
    d.set_defaults(fn=cmd_deploy)
