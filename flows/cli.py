"""`lmforge` command line: validate, plan, estimate, run, artifacts ls/show, gc, compare, stack, deploy, status, rerun.

Exit codes: 0 success, 1 a stage failed, 2 bad config, bad data (found while planning or inside a stage, a damaged
artifact too) or bad usage, 3 interrupted (SIGTERM/SIGINT, or the flow run cancelled through Prefect:
training checkpointed; rerun the same command to resume).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

# No usage reports: Prefect's ephemeral server sends telemetry on every run unless told not to (seen as "Failed to
# send telemetry: Name or service not known" offline), and DO_NOT_TRACK turns off MLflow's and other libraries'.
# Before anything imports Prefect; setting either variable yourself decides instead.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from lmforge import preflight  # noqa: E402
from lmforge.config import load_config  # noqa: E402
from lmforge.errors import ConfigError, LmforgeError, StageFailed  # noqa: E402
from lmforge.interrupt import Interrupted  # noqa: E402
from lmforge.log import setup_logging  # noqa: E402
from lmforge.store import Artifact, ArtifactStore  # noqa: E402

log = logging.getLogger("flows.cli")
EXIT_INTERRUPTED = 3


def _kinds():
    from tasks import REGISTRY

    return REGISTRY


def _add_config_args(p: argparse.ArgumentParser, force: bool = False) -> None:
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
    cfg = load_config(args.config, _kinds(), args.override)
    print(f"OK: {args.config}: pipeline {cfg.name!r}, {len(cfg.datasets)} dataset(s), {len(cfg.stages)} stage(s)")
    for n in cfg.topo_order():
        s = cfg.stages[n]
        print(f"  {n} ({s.kind}) <- {', '.join(s.inputs) or '-'}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from lmforge.plan import make_plan

    cfg = load_config(args.config, _kinds(), args.override)
    print(make_plan(cfg, _kinds(), args.force, accept_code_change=args.accept_code_change).format())
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from flows.estimate import estimate, format_table
    from trainer.gpus import load_catalog

    cfg = load_config(args.config, _kinds(), args.override)
    report = estimate(cfg, load_catalog(args.catalog), gpu_names=args.gpu, mfu=args.mfu, margin=args.margin,
                      attn=args.attn_implementation)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from lmforge.plan import make_plan

    # fail fast on config and input problems and on unreachable services, before the Prefect engine starts
    cfg = load_config(args.config, _kinds(), args.override)
    preflight.check_all(cfg.store_url, cfg.tracking_uri)
    make_plan(cfg, _kinds(), args.force, accept_code_change=args.accept_code_change)
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


def _store(args: argparse.Namespace) -> ArtifactStore:
    if args.config:
        return ArtifactStore(load_config(args.config, _kinds()).store_url)
    return ArtifactStore(args.store or os.environ.get("LMFORGE_STORE") or os.path.abspath("artifacts"))


def cmd_artifacts_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    arts = store.list(args.kind)
    if not arts:
        print(f"no artifacts{' of kind ' + args.kind if args.kind else ''} in {store.url}")
        return 0
    print(f"{'KIND':<10} {'ID':<18} {'FINISHED':<21} {'PIPELINE/STAGE':<28} SUMMARY")
    for a in arts:
        m = a.manifest
        by = m.get("produced_by", {})
        print(f"{a.kind:<10} {a.id:<18} {m.get('timings', {}).get('finished_at', '?'):<21} "
              f"{by.get('pipeline', '?') + '/' + by.get('stage', '?'):<28} {_short_summary(a.result)}")
    return 0


def _short_summary(result: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in result.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)]
    return ", ".join(parts[:5])


def lineage(store: ArtifactStore, a: Artifact, depth: int = 0) -> list[str]:
    pad = "  " * depth
    lines = [f"{pad}{a.kind}/{a.id}  {a.uri}  ({_short_summary(a.result)})"]
    for i in a.manifest.get("inputs", []):
        if i["type"] == "dataset":
            lines.append(f"{pad}  dataset {i['name']} {i['artifact_id']} ({i['kind']})")
            for f in i["files"]:
                lines.append(f"{pad}    {f['uri']}  sha256 {f['sha256'][:16]}…  {f['bytes']} bytes")
        else:
            up = store.get(i["kind"], i["artifact_id"])
            lines += lineage(store, up, depth + 1) if up else [f"{pad}  {i['kind']}/{i['artifact_id']} (missing!)"]
    return lines


def cmd_artifacts_show(args: argparse.Namespace) -> int:
    store = _store(args)
    a = store.find(args.id)
    if args.json:
        print(json.dumps(a.manifest, indent=2))
        return 0
    m = a.manifest
    by = m.get("produced_by", {})
    print(f"artifact {a.kind}/{a.id}\n  uri:      {a.uri}\n  made by:  pipeline {by.get('pipeline')}, stage "
          f"{by.get('stage')}, MLflow run {by.get('mlflow_run_id')}, flow run {by.get('flow_run_id')}\n"
          f"  code:     fingerprint {m.get('code_version')}, git {m.get('git_commit')}"
          f"{_accepted_line(m)}\n"
          f"  finished: {m.get('timings', {}).get('finished_at')} ({m.get('timings', {}).get('seconds')}s)\n"
          f"  config:   {json.dumps(m.get('config'), sort_keys=True)}\n  files:")
    for f in m["files"]:
        print(f"    {f['path']:<40} {f['bytes']:>12} bytes  sha256 {f['sha256'][:16]}…")
    print("  lineage:")
    for line in lineage(store, a, 2):
        print(line)
    return 0


def _accepted_line(m: dict[str, Any]) -> str:
    """`; kept across code changes: <when>: <what>` for an artifact reused by --accept-code-change."""
    acc = m.get("code_change_accepted") or []
    return "; kept across code changes: " + "; ".join(f"{a.get('accepted_at')}: {a.get('changes')}" for a in acc) \
        if acc else ""


def cmd_gc(args: argparse.Namespace) -> int:
    from lmforge import gc

    store = _store(args)
    if args.keep_checkpoints < 0:
        raise ConfigError([f"--keep-checkpoints: {args.keep_checkpoints} is negative; give 0 (none) or more"])
    report = gc.collect(store, keep_checkpoints=args.keep_checkpoints, unreferenced=args.unreferenced,
                        caches=args.caches, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for r in report.removals:
        print(f"  {verb} {r.what:<12} {r.bytes / 2**20:>10.1f} MB  {r.path}  ({r.why})")
    print(f"{store.url}: {verb} {len(report.removals)} item(s), {'would free' if args.dry_run else 'freed'} "
          f"{report.bytes / 2**20:.1f} MB ({report.bytes} bytes)")
    return 0


def cmd_stack(args: argparse.Namespace) -> int:
    from flows import stack

    return stack.main(args)


def cmd_compare(args: argparse.Namespace) -> int:
    """Config diff and headline metric diff of two pipeline runs, and the MLflow compare-view URL."""
    from mlflow.tracking import MlflowClient

    from lmforge import runview

    uri = load_config(args.config, _kinds()).tracking_uri if args.config else \
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


def _add_store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--store", help="store URL (default: $LMFORGE_STORE or ./artifacts)")
    g.add_argument("-c", "--config", help="use the store of this pipeline config")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmforge", description="Declarative LLM pipeline: corpus -> evaluated model.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check a config and report every problem at once")
    _add_config_args(v)
    v.set_defaults(fn=cmd_validate)
    pl = sub.add_parser("plan", help="show each stage's artifact id and whether it will run or is cached, and why")
    _add_config_args(pl, force=True)
    pl.set_defaults(fn=cmd_plan)
    e = sub.add_parser("estimate", help="before renting a GPU: peak memory per training stage by component, fit "
                                        "on each GPU of the catalog, step time, hours and cost")
    _add_config_args(e)
    e.add_argument("--json", action="store_true", help="print the estimate as JSON")
    e.add_argument("--gpu", action="append", metavar="NAME", help="only this GPU of the catalog (repeatable)")
    e.add_argument("--catalog", action="append", default=[], metavar="FILE",
                   help="a YAML file of your own GPU entries and rates, added to configs/gpus.yaml (repeatable)")
    e.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilization of the time model (default 0.35)")
    e.add_argument("--margin", type=float, default=0.2, help="added to the GPU cost, as a fraction (default 0.2)")
    e.add_argument("--attn-implementation", choices=("sdpa", "flash_attention_2", "eager"), default="sdpa",
                   help="attention kernel the activations assume (default sdpa, transformers' default)")
    e.set_defaults(fn=cmd_estimate)
    r = sub.add_parser("run", help="run the pipeline as a Prefect flow; finished stages are skipped")
    _add_config_args(r, force=True)
    r.add_argument("--json", metavar="FILE", help="also write the run summary to FILE")
    r.set_defaults(fn=cmd_run)
    a = sub.add_parser("artifacts", help="list and inspect artifacts in a store")
    asub = a.add_subparsers(dest="artifacts_command", required=True)
    for name, fn, helptext in (("ls", cmd_artifacts_ls, "list finished artifacts"),
                               ("show", cmd_artifacts_show, "show one artifact's manifest and lineage")):
        x = asub.add_parser(name, help=helptext)
        if name == "ls":
            x.add_argument("kind", nargs="?", help="only this stage kind")
        else:
            x.add_argument("id", help="artifact id or a unique prefix of it")
            x.add_argument("--json", action="store_true", help="print the raw manifest")
        _add_store_args(x)
        x.set_defaults(fn=fn)
    g = sub.add_parser("gc", help="remove leftovers of killed runs, checkpoints of finished artifacts and, "
                                  "optionally, artifacts no pipeline refers to; reports the bytes freed")
    g.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    g.add_argument("--keep-checkpoints", type=int, default=0, metavar="N",
                   help="keep the newest N complete checkpoints of each finished artifact (default 0: none)")
    g.add_argument("--unreferenced", action="store_true",
                   help="also remove finished artifacts that no pipeline ref (_refs/) reaches, directly or as an "
                        "input of one that is")
    g.add_argument("--caches", action="store_true", help="also empty the local model cache (lmforge-models/)")
    g.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_store_args(g)
    g.set_defaults(fn=cmd_gc)
    st = sub.add_parser("stack", help="a production-like stack on 127.0.0.1: SeaweedFS S3, MLflow on Postgres, "
                                      "a Prefect server and a process worker")
    stsub = st.add_subparsers(dest="stack_command", required=True)
    for name, helptext in (("up", "start the stack (its data stays in --dir)"),
                           ("down", "stop every server of the stack by its pid"),
                           ("env", "print the environment that points lmforge at the stack: eval \"$(lmforge stack env)\""),
                           ("status", "show the stack's servers")):
        x = stsub.add_parser(name, help=helptext)
        x.add_argument("--dir", default=".lmforge/stack", help="the stack's folder (default .lmforge/stack)")
        if name == "up":
            x.add_argument("--s3-port", type=int, help="S3 port (default 8333)")
            x.add_argument("--mlflow-port", type=int, help="MLflow server port (default 5000)")
            x.add_argument("--prefect-port", type=int, help="Prefect server port (default 4200)")
            x.add_argument("--pool", default="lmforge", help="the process work pool the worker serves")
        if name == "down":
            x.add_argument("--purge", action="store_true", help="also delete the stack's data")
        x.set_defaults(fn=cmd_stack)
    from flows.status import add_parsers

    add_parsers(sub)  # deploy, status, rerun
    from flows.preflight_cmd import add_parser as add_preflight_parser

    add_preflight_parser(sub)
    c = sub.add_parser("compare", help="two pipeline runs side by side: the settings that differ, the headline "
                                       "metrics (summary/*) with better/worse, and the MLflow compare-view URL")
    c.add_argument("run_a", help="MLflow run id or Prefect flow run id of a pipeline run")
    c.add_argument("run_b", help="the run to compare against RUN_A")
    cg = c.add_mutually_exclusive_group()
    cg.add_argument("--tracking", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db)")
    cg.add_argument("-c", "--config", help="use the tracking URI of this pipeline config")
    c.set_defaults(fn=cmd_compare)
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
