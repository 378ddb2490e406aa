"""`lmforge artifacts ls|show` and `lmforge gc`: the commands that read or clean a store."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from flows.run_cmd import kinds
from lmforge.config import load_config
from lmforge.errors import ConfigError
from lmforge.store import Artifact, ArtifactStore


def _store(args: argparse.Namespace) -> ArtifactStore:
    if args.config:
        return ArtifactStore(load_config(args.config, kinds()).store_url)
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
              f"{by.get('pipeline', '?') + '/' + by.get('stage', '?'):<28} {_short_summary(a.result, a.kind)}")
    return 0


#: What `artifacts ls` shows of each kind's result, in this order: counts for data stages, the loss and held-out
#: figures for training stages (eval: its gates and scores, `_eval_summary`). Another kind: its first numbers, less
#: the run's resources (memory, threads, timings).
SUMMARY_FIELDS = {
    "ingest": ("data_kind", "records", "rows_read", "bad_records"),
    "filter": ("records", "input_records", "dropped"),
    "dedup": ("records", "input_records", "clusters", "dropped"),
    "decontaminate": ("records", "input_records", "records_flagged", "dropped"),
    "mix": ("data_kind", "mode", "records", "train_samples", "validation_samples"),
    "shard": ("data_kind", "train_samples", "validation_samples", "num_shards"),
    "tokenizer": ("vocab_size", "chars_per_token", "records"),
    "tokenize": ("rows", "train_rows", "validation_rows", "longest_row", "dropped_no_label"),
    "pretrain": ("steps", "train_loss_first", "train_loss_last", "validation_loss_after",
                 "validation_perplexity_after"),
    "sft": ("method", "steps", "train_loss_first", "train_loss_last", "eval_loss"),
    "reward": ("method", "steps", "train_loss_last", "eval_loss", "eval_reward_accuracy"),
    "dpo": ("method", "steps", "train_loss_last", "eval_loss", "eval_reward_accuracy"),
    "ppo": ("method", "steps", "train_reward_last", "eval_reward_start", "eval_reward_trained"),
    "grpo": ("algorithm", "steps", "train_reward_last", "eval_reward_start", "eval_reward_trained"),
    "preflight": ("stage", "steps", "tokens_per_s", "peak_memory_mb", "estimate_error_pct"),
}
RESOURCE_FIELD = ("_mb", "_s", "_seconds", "cpu_threads", "_per_s", "deterministic")


def _value(v: Any) -> str | None:
    """A result value in a few characters: numbers to 4 significant digits, a {name: count} dict as its total."""
    if isinstance(v, dict) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values()):
        v = sum(v.values())
    if isinstance(v, bool) or v is None or isinstance(v, (dict, list)):
        return None
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _eval_summary(result: dict[str, Any], n: int) -> str:
    """Gates passed, then the gated metrics' values (against their reference), else the first scores."""
    gates = result.get("gates") or []
    failed = result.get("gates_failed", 0)
    parts = [f"gates {len(gates) - failed}/{len(gates)} passed" if gates else "no gates"]
    parts += [f"{g['metric']}={_value(g['value'])} ({g.get('against')} {_value(g.get('reference'))})"
              for g in gates if _value(g.get("value")) is not None]
    if not gates:
        for model, tasks in (result.get("eval") or {}).items():
            for task, metrics in tasks.items():
                parts += [f"{model}/{task}/{m}={_value(v)}" for m, v in metrics.items()
                          if not m.endswith("_stderr") and _value(v) is not None]
    return ", ".join(parts[:n])


def _short_summary(result: dict[str, Any], kind: str | None = None, n: int = 5) -> str:
    """The few result fields that tell what an artifact is (`SUMMARY_FIELDS`)."""
    if kind == "eval":
        return _eval_summary(result, n)
    keys = SUMMARY_FIELDS.get(kind or "") or [k for k in result if not k.endswith(RESOURCE_FIELD)]
    parts = [f"{k}={_value(result[k])}" for k in keys if k in result and _value(result[k]) is not None]
    return ", ".join(parts[:n])


def lineage(store: ArtifactStore, a: Artifact, depth: int = 0) -> list[str]:
    pad = "  " * depth
    lines = [f"{pad}{a.kind}/{a.id}  {a.uri}  ({_short_summary(a.result, a.kind)})"]
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


def _add_store_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--store", help="store URL (default: $LMFORGE_STORE or ./artifacts)")
    g.add_argument("-c", "--config", help="use the store of this pipeline config")


def add_artifacts_parser(sub) -> None:
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


def add_gc_parser(sub) -> None:
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
