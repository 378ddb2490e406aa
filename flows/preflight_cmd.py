"""`lmforge preflight CONFIG STAGE [--steps N] [-o KEY=VALUE] [--json]`: try a training stage before renting for it.

Runs the config's preflight of STAGE (a `kind: preflight` stage with `stage: STAGE`; one named
`preflight_<STAGE>` is added when the config has none), after the stages it needs (data, tokenizer, an upstream
model: cached ones are reused, missing ones are built), in this process, with the same store, tracking and leases
as `lmforge run`. Prints what it measured (tasks/preflight.py) and exits 0 when it passed, 2 when the stage's
settings failed it (no checkpoint, no reload or generation, an estimate beyond max_estimate_error) or on bad config
or data, 1 when something crashed. The preflight artifact is cached like any other: a later `lmforge run` of a config that
declares the same preflight reuses it.
"""
from __future__ import annotations

import json
from typing import Any

from lmforge.config import apply_overrides, find_project_root, parse_config, read_yaml
from lmforge.errors import ConfigError


def preflight_config(path: str, stage: str, steps: int | None, overrides: list[str], kinds) -> tuple[Any, str]:
    """(the config with a preflight of `stage`, the preflight's name)."""
    from pathlib import Path

    raw = apply_overrides(read_yaml(Path(path)), overrides)
    stages = raw.get("stages") or {}
    if stage not in stages:
        raise ConfigError([f"STAGE {stage!r}: no such stage in {path}; training stages: " + ", ".join(
            n for n, b in stages.items() if isinstance(b, dict) and b.get("kind") in
            ("pretrain", "sft", "reward", "dpo", "grpo", "ppo"))])
    name = next((n for n, b in stages.items() if isinstance(b, dict) and b.get("kind") == "preflight"
                 and b.get("stage") == stage), None)
    if name is None:
        name = f"preflight_{stage}"
        stages[name] = {"kind": "preflight", "stage": stage}
    if steps is not None:
        stages[name]["steps"] = steps
    raw["stages"] = stages
    return parse_config(raw, kinds, root=find_project_root(Path(path)), source=path), name


def needed(cfg, name: str) -> list[str]:
    """`name` and every stage it waits for, in run order."""
    want: set[str] = set()
    todo = [name]
    while todo:
        n = todo.pop()
        if n in want or n not in cfg.stages:
            continue
        want.add(n)
        todo += cfg.stages[n].upstream()
    return [n for n in cfg.topo_order() if n in want]


def cmd_preflight(args) -> int:
    from lmforge import preflight as services
    from lmforge.executor import RunContext, execute_stage
    from lmforge.plan import make_plan
    from lmforge.tracking import Tracker
    from tasks import REGISTRY

    cfg, name = preflight_config(args.config, args.stage, args.steps, args.override, REGISTRY)
    services.check_all(cfg.store_url, cfg.tracking_uri)
    plan = make_plan(cfg, REGISTRY, [name] if args.force else [])
    tracker = Tracker(cfg.tracking_uri, cfg.name)
    parent = tracker.start_run(f"{cfg.name} preflight {args.stage}", {"lmforge.pipeline": cfg.name,
                                                                       "lmforge.preflight": args.stage})
    ctx = RunContext(plan=plan, kinds=REGISTRY, tracker=tracker, parent_run_id=parent)
    status = "FAILED"
    try:
        for n in needed(cfg, name):
            execute_stage(ctx, n)
        status = "FINISHED"
    finally:
        tracker.end_run(parent, status)
    sp = plan.stages[name]
    art = plan.store.require(sp.kind, sp.artifact_id)
    r = art.result
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(format_result(r, art.uri))
    return 0


def format_result(r: dict[str, Any], uri: str) -> str:
    above = f" ({r['peak_above_baseline_mb']:,.0f} MB above its non-model RSS when training began)" \
        if r.get("peak_above_baseline_mb") is not None else ""
    est = "no estimate" if r.get("estimate_compared_mb") is None else \
        f"{r['estimate_compared_mb']:,.0f} MB estimated, error {r['estimate_error_pct']:+.1f}%"
    lines = [f"preflight of {r['stage']} ({r['kind']}, {r['method']}): passed", f"  artifact      {uri}",
             f"  steps         {r['steps']}, {r['step_time_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s",
             f"  peak memory   {r['peak_memory_mb']:,.0f} MB {r['peak_memory_source']}{above}",
             f"  estimate      {est}",
             f"  checkpoint    {r['checkpoint_bytes'] / 2**20:,.1f} MB",
             f"  reload        {'ok' if r['reload_ok'] else 'FAILED'}, generation "
             f"{'ok' if r['generation_ok'] else 'FAILED'}"]
    lines += [f"    {p!r} -> {g!r}" for p, g in r["generations"].items()]
    lines += [f"  note: {n}" for n in r.get("notes", [])]
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("preflight", help="run a few steps of a training stage on its settings, checkpoint, reload "
                                         "and generate, and compare the measured peak memory with the estimate")
    p.add_argument("config", help="pipeline YAML file")
    p.add_argument("stage", help="the training stage to try")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the preflight stage's, else 3)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. -o stages.sft.batch_size_per_device=4")
    p.add_argument("--force", action="store_true", help="run the preflight again even if it is cached")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(fn=cmd_preflight)
