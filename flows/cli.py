"""`lmforge` command line: validate, plan, estimate, run, artifacts ls/show, gc, stack, deploy, status, rerun, worker,
preflight, compare, join, export, generate.

Each command lives with its parser in its own module (flows/run_cmd.py, estimate.py, store_cmd.py, stack.py,
deploy.py, status.py, worker.py, preflight_cmd.py, compare_cmd.py, join_cmd.py, export_cmd.py); `build_parser` puts
them together.
Exit codes: 0 success, 1 a stage failed, 2 bad config, bad data (found while planning or inside a stage, a damaged
artifact too) or bad usage, 3 interrupted (SIGTERM/SIGINT, or the flow run cancelled through Prefect:
training checkpointed; rerun the same command to resume).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

# No usage reports: Prefect's ephemeral server sends telemetry on every run unless told not to (seen as "Failed to
# send telemetry: Name or service not known" offline), and DO_NOT_TRACK turns off MLflow's and other libraries'.
# Before anything imports Prefect; setting either variable yourself decides instead.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from flows import (compare_cmd, deploy, estimate, export_cmd, join_cmd, preflight_cmd, run_cmd, stack,  # noqa: E402
                   status, store_cmd, worker)
from lmforge.errors import ConfigError, LmforgeError  # noqa: E402
from lmforge.log import setup_logging  # noqa: E402

log = logging.getLogger("flows.cli")


def build_parser() -> argparse.ArgumentParser:
    """The complete `lmforge` parser (docs/cli.md is written from it)."""
    p = argparse.ArgumentParser(prog="lmforge", description="Declarative LLM pipeline: corpus -> evaluated model.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    run_cmd.add_validate_parsers(sub)  # validate, plan
    estimate.add_parser(sub)
    run_cmd.add_run_parser(sub)
    store_cmd.add_artifacts_parser(sub)
    store_cmd.add_gc_parser(sub)
    stack.add_parser(sub)
    deploy.add_parser(sub)
    status.add_parsers(sub)  # status, rerun
    worker.add_parser(sub)
    preflight_cmd.add_parser(sub)
    compare_cmd.add_parser(sub)
    join_cmd.add_parser(sub)
    export_cmd.add_parsers(sub)  # export, generate
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"lmforge {args.command}: {e}", file=sys.stderr)
        return 2
    except LmforgeError as e:
        print(f"lmforge {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
