"""`lmforge validate`, `lmforge plan`, `lmforge run`: the commands that read a pipeline config, and their arguments.

Exit codes of `lmforge run`: 0 success, 1 a stage failed, 2 bad config, bad data (found while planning or inside a
stage, a damaged artifact too) or bad usage, 3 interrupted (SIGTERM/SIGINT, or the flow run cancelled through
Prefect: training checkpointed; rerun the same command to resume).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from lmforge import preflight
from lmforge.config import load_config
from lmforge.errors import StageFailed
from lmforge.interrupt import Interrupted

EXIT_INTERRUPTED = 3


def kinds():
    """The stage registry ({kind: StageDef}), imported when a command needs it."""
    from tasks import REGISTRY

    return REGISTRY


def add_config_args(p: argparse.ArgumentParser, force: bool = False) -> None:
    """CONFIG and -o KEY=VALUE; with `force`, --force and --accept-code-change too."""
    p.add_argument("config", help="pipeline YAML file")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. -o stages.shard.max_count=500 (repeatable)")
    if force:
        p.add_argument("--force", action="append", default=[], metavar="STAGE",
                       help="rerun this stage and everything downstream of it even if cached (repeatable)")
        p.add_argument("--accept-code-change", action="append", default=[], metavar="STAGE",
                       help="keep this stage's earlier artifact although the code (or a library) that makes it "
                            "changed, so neither it nor its dependants rerun; only when its config and inputs are "
                            "unchanged. Recorded in the store, the manifest and MLflow (repeatable)")


def cmd_validate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, kinds(), args.override)
    print(f"OK: {args.config}: pipeline {cfg.name!r}, {len(cfg.datasets)} dataset(s), {len(cfg.stages)} stage(s)")
    for n in cfg.topo_order():
        s = cfg.stages[n]
        print(f"  {n} ({s.kind}) <- {', '.join(s.inputs) or '-'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from lmforge.plan import make_plan

    cfg = load_config(args.config, kinds(), args.override)
    print(make_plan(cfg, kinds(), args.force, accept_code_change=args.accept_code_change).format())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from lmforge.plan import make_plan

    # fail fast on config and input problems and on unreachable services, before the Prefect engine starts
    cfg = load_config(args.config, kinds(), args.override)
    preflight.check_all(cfg.store_url, cfg.tracking_uri)
    make_plan(cfg, kinds(), args.force, accept_code_change=args.accept_code_change)
    from prefect.exceptions import CancelledRun

    from flows.pipeline import pipeline

    try:
        summary = pipeline(config_path=os.path.abspath(args.config), overrides=args.override, force=args.force,
                           accept_code_change=args.accept_code_change)
    except StageFailed as e:
        print(f"lmforge run: {e}", file=sys.stderr)
        return 2 if e.only_bad_input else 1
    except Interrupted as e:
        print(f"lmforge run: {e}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except CancelledRun as e:  # cancelled through Prefect, and its final state came from elsewhere than this run
        print(f"lmforge run: the flow run was cancelled through Prefect ({e}). Finished stages and uploaded "
              "checkpoints are kept: rerun the same command to resume.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except RuntimeError as e:
        if "ephemeral Prefect API server" not in str(e):
            raise
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as startup

        print(f"lmforge run: Prefect's temporary API server did not start (Prefect: {str(e)[:600]}). A busy machine "
              f"starts it slowly: raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (now "
              f"{startup.value():g} s), or start a persistent server (`prefect server start --host "
              "127.0.0.1`) and set PREFECT_API_URL=http://127.0.0.1:4200/api.", file=sys.stderr)
        return 1
    print(f"pipeline {summary['pipeline']}: {summary['ran']} stage(s) ran, {summary['cached']} cached "
          f"(MLflow run {summary['mlflow_run_id']}, Prefect flow run {summary['flow_run_id']})")
    for s in summary["stages"].values():
        print(f"  {s['status']:<7} {s['stage']:<20} {s['uri']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


def add_validate_parsers(sub) -> None:
    """`lmforge validate` and `lmforge plan`."""
    v = sub.add_parser("validate", help="check a config and report every problem at once")
    add_config_args(v)
    v.set_defaults(fn=cmd_validate)
    pl = sub.add_parser("plan", help="show each stage's artifact id and whether it will run or is cached, and why")
    add_config_args(pl, force=True)
    pl.set_defaults(fn=cmd_plan)


def add_run_parser(sub) -> None:
    r = sub.add_parser("run", help="run the pipeline as a Prefect flow; finished stages are skipped")
    add_config_args(r, force=True)
    r.add_argument("--json", metavar="FILE", help="also write the run summary to FILE")
    r.set_defaults(fn=cmd_run)
