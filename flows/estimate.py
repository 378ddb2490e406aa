"""`lmforge estimate CONFIG`: for every training stage, peak GPU memory by component, fit, time and cost per GPU.

The report comes from trainer/pipeline_estimate.py (models: trainer/shapes.py; memory: trainer/estimate.py; fit,
time and cost: trainer/gpus.py); this module holds the command, its arguments and its table.
"""
from __future__ import annotations

import argparse
import json
from typing import Any

from flows.run_cmd import add_config_args, kinds
from lmforge.config import load_config
from trainer.estimate import COMPONENTS, GIB


def cmd_estimate(args: argparse.Namespace) -> int:
    from trainer.gpus import load_catalog
    from trainer.pipeline_estimate import estimate

    cfg = load_config(args.config, kinds(), args.override)
    report = estimate(cfg, load_catalog(args.catalog), gpu_names=args.gpu, mfu=args.mfu, margin=args.margin,
                      attn=args.attn_implementation)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def _gib(b: int) -> str:
    return f"{b / GIB:.2f}"


def format_table(report: dict[str, Any]) -> str:
    lines = [f"pipeline {report['pipeline']}: peak GPU memory per stage (GiB per GPU), attention "
             f"{report['attn_implementation']}, time from FLOPs at MFU {report['mfu']} unless measured, cost with a "
             f"{report['margin']:.0%} margin (example prices: edit configs/gpus.yaml)"]
    for name, s in report["stages"].items():
        p, m = s["plan"], s["memory"]
        lines.append("")
        lines.append(f"{name} ({s['kind']}, {s['method']}): {s['model']['model_type']} {s['model']['params']:,} params "
                     f"from {s['model']['source']}; micro {p['micro_batch']} x accum {p['grad_accumulation_steps']} x "
                     f"world {p['world_size']}, {p['seq_tokens']} tokens, {p['precision']}, "
                     f"{p['sharding'] if p['sharding'] != 'none' else 'no sharding'}, checkpointing "
                     f"{'on' if p['gradient_checkpointing'] else 'off'}")
        comps = m["components"]
        lines.append("  " + "  ".join(f"{k} {comps[k]['gib']:.3f}" for k in COMPONENTS)
                     + f"  = total {m['total_gib']:.3f}")
        # what would fit, only where some GPU does not fit: a column that is empty in every row says nothing
        misfit = any(not r["fits"] for r in s["gpus"].values())
        lines.append(f"  {'GPU':<11} {'fits':<4} {'headroom':>16} {'step s':>9} {'hours':>9} {'cost $':>10}"
                     + ("  to fit on this GPU" if misfit else ""))
        for g, r in s["gpus"].items():
            head = f"{r['headroom_gib']:.1f} GiB {r['headroom_pct']:.0f}%"
            hours = f"{r['hours']:.4g}" if r["hours"] is not None else "-"
            usd = f"{r['cost']['total_usd']:.2f}" if r["cost"] else "-"
            lines.append((f"  {g:<11} {'yes' if r['fits'] else 'NO':<4} {head:>16} {r['step_seconds']:>9.4g} "
                          f"{hours:>9} {usd:>10}" + (f"  {_to_fit(r.get('suggestion'))}" if misfit else "")).rstrip())
        notes = sorted({r["note"] for r in s["gpus"].values() if r.get("note")})
        lines += [f"  hours and cost -: {n}" for n in notes]
    return "\n".join(lines)


def _to_fit(sug: dict[str, Any] | None) -> str:
    """The change that makes a stage fit a GPU it does not fit (trainer.gpus.suggest); "" where it fits."""
    if sug is None:
        return ""
    if sug.get("batch_size_per_device"):
        return (f"batch_size_per_device {sug['batch_size_per_device']} x grad_accumulation_steps "
                f"{sug['grad_accumulation_steps']} ({sug['total_gib']:.1f} GiB)")
    return f"no fit at micro-batch 1: {sug['advice']}"


def add_parser(sub) -> None:
    e = sub.add_parser("estimate", help="before renting a GPU: peak memory per training stage by component, fit "
                                        "on each GPU of the catalog, step time, hours and cost")
    add_config_args(e)
    e.add_argument("--json", action="store_true", help="print the estimate as JSON")
    e.add_argument("--gpu", action="append", metavar="NAME", help="only this GPU of the catalog (repeatable)")
    e.add_argument("--catalog", action="append", default=[], metavar="FILE",
                   help="a YAML file of your own GPU entries and rates, added to configs/gpus.yaml (repeatable)")
    e.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilization of the time model (default 0.35)")
    e.add_argument("--margin", type=float, default=0.2, help="added to the GPU cost, as a fraction (default 0.2)")
    e.add_argument("--attn-implementation", choices=("sdpa", "flash_attention_2", "eager"), default="sdpa",
                   help="attention kernel the activations assume (default sdpa, transformers' default)")
    e.set_defaults(fn=cmd_estimate)
