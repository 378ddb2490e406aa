"""`lmforge compare RUN_A RUN_B`: two pipeline runs side by side (lmforge.runview reads them from MLflow)."""
from __future__ import annotations

import argparse
import os
import sys

from flows.run_cmd import kinds
from lmforge.config import load_config


def cmd_compare(args: argparse.Namespace) -> int:
    """Config diff and headline metric diff of two pipeline runs, and the MLflow compare-view URL."""
    from mlflow.tracking import MlflowClient

    from lmforge import runview

    uri = load_config(args.config, kinds()).tracking_uri if args.config else \
        args.tracking or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"
    client = MlflowClient(tracking_uri=uri)
    try:
        runs = [runview.resolve_run(client, ref) for ref in (args.run_a, args.run_b)]
    except LookupError as e:
        print(f"lmforge compare: {e}", file=sys.stderr)
        return 2
    print("\n".join(runview.compare_lines(client, *runs)))
    print(f"\nMLflow compare view: {runview.compare_url(uri, runs)}")
    return 0


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="two pipeline runs side by side: the settings that differ, the headline "
                                       "metrics (summary/*) with better/worse, and the MLflow compare-view URL")
    c.add_argument("run_a", help="MLflow run id or Prefect flow run id of a pipeline run")
    c.add_argument("run_b", help="the run to compare against RUN_A")
    cg = c.add_mutually_exclusive_group()
    cg.add_argument("--tracking", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    cg.add_argument("-c", "--config", help="use the tracking URI of this pipeline config")
    c.set_defaults(fn=cmd_compare)
