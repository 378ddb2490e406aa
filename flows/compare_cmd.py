"""`lmforge compare RUN_A RUN_B`: two pipeline runs side by side (lmforge.runcompare reads them from MLflow)."""
from __future__ import annotations

import argparse
import os
import sys

from flows.run_cmd import kinds
from lmforge.config import load_config


def cmd_compare(args: argparse.Namespace) -> int:
    """Where B's results come from, the config diff and every parent metric with a verdict, and the MLflow
    compare-view URL. Stdout only: MLflow's artifact download progress bars (summary.json) are switched off."""
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    from mlflow.tracking import MlflowClient

    from lmforge import runcompare

    uri = load_config(args.config, kinds()).tracking_uri if args.config else \
        args.tracking or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath('mlflow.db')}"
    client = MlflowClient(tracking_uri=uri)
    try:
        runs = [runcompare.resolve_run(client, ref) for ref in (args.run_a, args.run_b)]
    except LookupError as e:
        print(f"lmforge compare: {e}", file=sys.stderr)
        return 2
    print("\n".join(runcompare.compare_lines(client, *runs)))
    print(f"\nMLflow compare view: {runcompare.compare_url(uri, runs)}")
    return 0


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="two pipeline runs side by side: whether B replayed A's cached artifacts, "
                                       "the settings that differ, every run metric (headline first) with a verdict "
                                       "(better, worse, same, info), and the MLflow compare-view URL")
    c.add_argument("run_a", help="MLflow run id or Prefect flow run id of a pipeline run")
    c.add_argument("run_b", help="the run to compare against RUN_A")
    cg = c.add_mutually_exclusive_group()
    cg.add_argument("--tracking", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    cg.add_argument("-c", "--config", help="use the tracking URI of this pipeline config")
    c.set_defaults(fn=cmd_compare)
