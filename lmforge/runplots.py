"""The pipeline run's plots: `plots/loss_curves.png` (every training stage's loss, with its held-out validation loss
where the stage computes one) and each eval stage's bar chart as `plots/<eval stage>.png`.

The curves are read from the run that made each stage's artifact, so a cached run shows the curves of the run that
trained the model. A stage's training loss is `train/loss` (the Trainer-based stages) or, for ppo, whose own loop
has no single loss, `train/policy_loss`, drawn on a panel of its own: its scale is not a language-model loss. The
validation loss is `eval/loss` (trainer/metrics.py), dashed, in its stage's colour.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from lmforge.plan import Plan
from lmforge.tracking import Tracker

#: a stage's training loss: the first of these its run logged
TRAIN_LOSS = ("train/loss", "train/policy_loss")
VALIDATION_LOSS = "eval/loss"


def _history(client, run_id: str, key: str) -> tuple[list[int], list[float]] | None:
    try:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
    except Exception:  # noqa: BLE001  the run is in another tracking store, or gone
        return None
    return ([m.step for m in history], [m.value for m in history]) if history else None


def loss_series(client, sources: dict[str, str]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """stage -> {metric key: (steps, values)}: its training loss (TRAIN_LOSS) and validation loss, where logged,
    read from the run `sources[stage]`."""
    out: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for stage, run_id in sources.items():
        series = {}
        for key in TRAIN_LOSS:
            h = _history(client, run_id, key)
            if h:
                series[key] = h
                break
        h = _history(client, run_id, VALIDATION_LOSS)
        if h:
            series[VALIDATION_LOSS] = h
        if series:
            out[stage] = series
    return out


def _own(s: dict[str, Any]) -> str:
    """The panel of a stage's series: its training loss's key (a stage with a validation loss only: the first)."""
    return next((k for k in TRAIN_LOSS if k in s), TRAIN_LOSS[0])


def loss_figure(series: dict[str, dict[str, tuple[list[int], list[float]]]], path: Path, title: str) -> list[str]:
    """Draw `series` (loss_series) into `path`: one panel for the language-model losses, one for ppo's policy loss
    when a stage has it. Returns `<stage>: <key>` of every curve drawn; [] (and no file) when there is none."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not series:
        return []
    panels = [k for k in TRAIN_LOSS if any(_own(s) == k for s in series.values())]
    fig = Figure(figsize=(6.4 * len(panels), 3.8))
    FigureCanvasAgg(fig)
    drawn = []
    for p, key in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), p + 1)
        for i, (stage, s) in enumerate(series.items()):
            if _own(s) != key:
                continue
            if key in s:
                ax.plot(*s[key], marker=".", color=f"C{i}", label=f"{stage} {key.split('/', 1)[1]}")
                drawn.append(f"{stage}: {key}")
            if VALIDATION_LOSS in s:
                ax.plot(*s[VALIDATION_LOSS], marker="o", linestyle="--", color=f"C{i}", label=f"{stage} validation")
                drawn.append(f"{stage}: {VALIDATION_LOSS}")
        ax.set_xlabel("step")
        ax.set_ylabel(key if key != TRAIN_LOSS[0] else "loss (train solid, validation dashed)")
        ax.set_title(f"{title}: {'training and validation loss' if key == TRAIN_LOSS[0] else 'ppo ' + key}",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return drawn


def loss_curves_png(tracker: Tracker, plan: Plan, path: Path) -> list[str]:
    """Every training stage's losses, from the run that made its artifact, on one figure (loss_figure)."""
    sources = {}
    for name, sp in plan.stages.items():
        if sp.port is None or sp.port.type != "model" or sp.kind == "export":  # an export trains nothing
            continue
        art = plan.store.get(sp.kind, sp.artifact_id)
        source = art.manifest.get("produced_by", {}).get("mlflow_run_id") if art is not None else None
        if source:
            sources[name] = source
    return loss_figure(loss_series(tracker.client, sources), path, plan.cfg.name)


def log_plots(tracker: Tracker, parent: str, plan: Plan) -> dict[str, Any]:
    """`plots/loss_curves.png` and each eval stage's bar chart as `plots/<eval stage>.png` on the parent run.
    Returns {artifact path: the curves it draws (loss curves) or the stage it comes from}."""
    logged: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lmforge-plots-") as tmp:
        png = Path(tmp) / "loss_curves.png"
        drawn = loss_curves_png(tracker, plan, png)
        if drawn:
            tracker.log_file(parent, str(png), "plots")
            logged["plots/loss_curves.png"] = drawn
        for name, sp in plan.stages.items():
            art = plan.store.get(sp.kind, sp.artifact_id) if sp.kind == "eval" else None
            if art is None or "metrics.png" not in art.files:
                continue
            png = Path(tmp) / f"{name}.png"
            with art.open("metrics.png") as f:
                png.write_bytes(f.read())
            tracker.log_file(parent, str(png), "plots")
            logged[f"plots/{name}.png"] = name
    return logged
