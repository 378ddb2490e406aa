"""What a pipeline run looks like in MLflow: its parent run's name, headline metrics, plots and the champion alias,
and `lmforge compare`.

The parent run is the row a user compares. Its name says what the run is (`<pipeline> <config hash> <settings changed
since the previous run>`); its metrics are the same few keys on every run, cached or not: `summary/*` (the eval
table per model, gate counts, tokens trained per training stage, wall time) and the stage counts. Per-stage details
stay on the stage's child run. A `prefect flow-run retry` of a flow run continues that flow run's parent.
"""
from __future__ import annotations

import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

from lmforge.plan import Plan
from lmforge.stage import numeric_leaves
from lmforge.tracking import Tracker, flatten, registered_model_name

log = logging.getLogger(__name__)

NAME_MAX_CHARS = 90  # MLflow's run list shows about this much
VALUE_MAX_CHARS = 24
#: Direction of a metric by its name, where the eval result does not say: True when higher is better.
LOWER_IS_BETTER = re.compile(r"(perplexity|loss|bits_per_byte|_seconds$|gates_failed$|expectations_failed$|_stderr$)")
HIGHER_IS_BETTER = re.compile(r"(acc|accuracy|exact_match|f1|bleu|rouge|reward_margin|gates_passed$)")


# ----------------------------------------------------------------------------------------------
# the parent run: name, retry, params


def changed_settings(previous: dict[str, str] | None, current: dict[str, str]) -> list[str]:
    """`key=value` for each setting that differs from the previous run's params (`-key` for one it no longer has)."""
    if previous is None:
        return []
    out = []
    for k in sorted(set(previous) | set(current)):
        if k not in current:
            out.append(f"-{k}")
        elif previous.get(k) != current[k]:
            v = current[k]
            out.append(f"{k}={v if len(v) <= VALUE_MAX_CHARS else v[:VALUE_MAX_CHARS - 1] + '…'}")
    return out


def run_name(pipeline: str, config_hash: str, changes: list[str]) -> str:
    """`demo 3f9c2a1b sft.learning_rate=0.001, dpo.beta=0.2 +3 more`, at most NAME_MAX_CHARS."""
    name = f"{pipeline} {config_hash[:8]}"
    for i, c in enumerate(changes):
        more = f" +{len(changes) - i} more"
        sep = " " if i == 0 else ", "
        rest_fits = i == len(changes) - 1 or len(name) + len(sep) + len(c) + len(f" +{len(changes) - i - 1} more") \
            <= NAME_MAX_CHARS
        if len(name) + len(sep) + len(c) > NAME_MAX_CHARS or not rest_fits:
            return name + more
        name += sep + c
    return name


def _parents(tracker: Tracker, pipeline: str, extra: str = "") -> list[Any]:
    runs = tracker.find_runs(f"tags.`lmforge.pipeline` = '{pipeline}'{extra}", 20)
    return [r for r in runs if "mlflow.parentRunId" not in r.data.tags]


def start_parent(tracker: Tracker, plan: Plan, flow_run_id: str, tags: dict[str, Any]) -> str:
    """The pipeline run's parent MLflow run, with every stage's settings as params. A Prefect retry of a flow run
    (same flow run id) reopens that flow run's parent (tag lmforge.attempt counts); a new flow run of a config whose
    previous run failed is tagged lmforge.retry_of = that run."""
    cfg = plan.cfg
    params = {n: sp.settings for n, sp in plan.stages.items()}
    same = _parents(tracker, cfg.name, f" and tags.`prefect.flow_run_id` = '{flow_run_id}'") if flow_run_id else []
    if same:
        run = same[0]
        attempt = int(run.data.tags.get("lmforge.attempt", "1")) + 1
        tracker.reopen_run(run.info.run_id, {**tags, "lmforge.attempt": attempt})
        tracker.log_params(run.info.run_id, params, new_only=True)
        log.info("MLflow: continuing run %s (%s), attempt %d of flow run %s", run.info.run_id, run.info.run_name,
                 attempt, flow_run_id)
        return run.info.run_id
    previous = next(iter(_parents(tracker, cfg.name)), None)
    flat = {k[:250]: v for k, v in flatten(params).items()}
    name = run_name(cfg.name, cfg.config_hash(), changed_settings(previous.data.params if previous else None, flat))
    extra = {"lmforge.attempt": "1"}
    if previous is not None and previous.info.status in ("FAILED", "KILLED") and \
            previous.data.tags.get("lmforge.config_hash") == cfg.config_hash():
        extra["lmforge.retry_of"] = previous.info.run_id
    run_id = tracker.start_run(name, {**tags, **extra})
    tracker.log_params(run_id, params)
    return run_id


# ----------------------------------------------------------------------------------------------
# headline metrics


def _artifact(plan: Plan, name: str):
    sp = plan.stages[name]
    return plan.store.get(sp.kind, sp.artifact_id)


def _directions(result: dict[str, Any]) -> dict[str, bool]:
    """task/metric -> higher is better, from the eval result's `tasks` list (lm-eval's own), else by name."""
    out = {}
    for t in result.get("tasks", []):
        for metric, higher in (t.get("higher_is_better") or {}).items():
            out[f"{t['task']}/{metric}"] = bool(higher)
    return out


def direction(key: str, known: dict[str, bool] | None = None) -> bool | None:
    """True when higher is better for metric `key`, False when lower is, None when unknown."""
    if known and key in known:
        return known[key]
    last = key.rsplit("/", 1)[-1]
    if LOWER_IS_BETTER.search(last):
        return False
    if HIGHER_IS_BETTER.search(last):
        return True
    return None


def summary_metrics(plan: Plan, stages: dict[str, dict[str, Any]], wall_seconds: float) -> tuple[
        dict[str, float], dict[str, bool]]:
    """(`summary/*` metrics, their directions). Read from the artifacts in the store, so a cached run has exactly the
    keys (and values) of the run that made them: `summary/<model>/<task>/<metric>` (with `_stderr`) of the eval table
    (`summary/<eval stage>/...` when there are several eval stages), `summary/gates_passed`, `summary/gates_failed`,
    `summary/expectations_failed`, `summary/tokens_trained/<stage>` of each training stage whose result counts tokens, `summary/wall_seconds`."""
    metrics: dict[str, float] = {"summary/wall_seconds": round(wall_seconds, 3)}
    dirs: dict[str, bool] = {}
    evals = [n for n, sp in plan.stages.items() if sp.kind == "eval"]
    if evals:
        metrics.update({"summary/gates_passed": 0.0, "summary/gates_failed": 0.0, "summary/expectations_failed": 0.0})
    for name in evals:
        art = _artifact(plan, name)
        if art is None:
            continue
        prefix = "summary/" if len(evals) == 1 else f"summary/{name}/"
        result = art.result
        metrics.update({prefix + k: v for k, v in numeric_leaves(result.get("eval", {})).items()})
        known = _directions(result)
        for k in numeric_leaves(result.get("eval", {})):
            model_task_metric = k.split("/", 1)[-1]  # task/metric
            d = direction(model_task_metric, known)
            if d is not None and not k.endswith("_stderr"):
                dirs[prefix + k] = d
        gates = result.get("gates", [])
        metrics["summary/gates_passed"] += sum(1 for g in gates if g.get("passed"))
        metrics["summary/gates_failed"] += sum(1 for g in gates if not g.get("passed"))
        metrics["summary/expectations_failed"] += float(result.get("expectations_failed", 0))
    for name, sp in plan.stages.items():
        if sp.port is not None and sp.port.type == "model" and stages.get(name, {}).get("status") != "failed":
            art = _artifact(plan, name)
            tokens = (art.result or {}).get("tokens") if art is not None else None
            if isinstance(tokens, (int, float)) and not isinstance(tokens, bool):
                metrics[f"summary/tokens_trained/{name}"] = float(tokens)
    dirs.update({"summary/gates_passed": True, "summary/gates_failed": False, "summary/expectations_failed": False,
                 "summary/wall_seconds": False})
    return metrics, dirs


# ----------------------------------------------------------------------------------------------
# plots


def loss_curves_png(tracker: Tracker, plan: Plan, path: Path, key: str = "train/loss") -> bool:
    """Every training stage's `train/loss` history (from the run that made its artifact) on one figure. False when
    no stage has one."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = {}
    for name, sp in plan.stages.items():
        if sp.port is None or sp.port.type != "model":
            continue
        art = _artifact(plan, name)
        source = art.manifest.get("produced_by", {}).get("mlflow_run_id") if art is not None else None
        if not source:
            continue
        try:
            history = sorted(tracker.client.get_metric_history(source, key), key=lambda m: m.step)
        except Exception:  # noqa: BLE001  the run is in another tracking store, or gone
            continue
        if history:
            curves[name] = ([m.step for m in history], [m.value for m in history])
    if not curves:
        return False
    fig = Figure(figsize=(6.4, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for name, (steps, values) in curves.items():
        ax.plot(steps, values, marker=".", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(f"{plan.cfg.name}: {key} of every training stage")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def log_plots(tracker: Tracker, parent: str, plan: Plan) -> list[str]:
    """`plots/loss_curves.png` and each eval stage's bar chart as `plots/<eval stage>.png` on the parent run."""
    logged = []
    with tempfile.TemporaryDirectory(prefix="lmforge-plots-") as tmp:
        png = Path(tmp) / "loss_curves.png"
        if loss_curves_png(tracker, plan, png):
            tracker.log_file(parent, str(png), "plots")
            logged.append("plots/loss_curves.png")
        for name, sp in plan.stages.items():
            art = _artifact(plan, name) if sp.kind == "eval" else None
            if art is None or "metrics.png" not in art.files:
                continue
            png = Path(tmp) / f"{name}.png"
            with art.open("metrics.png") as f:
                png.write_bytes(f.read())
            tracker.log_file(parent, str(png), "plots")
            logged.append(f"plots/{name}.png")
    return logged


# ----------------------------------------------------------------------------------------------
# the end of a run


def promote_champions(tracker: Tracker, plan: Plan, stages: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Move `@champion` of every trained stage of this run to this run's version, when the run has an eval stage and
    every eval stage finished (ran or cached) with all its gates passed. The version is the one this run evaluated,
    so a cached run moves it only to a version that passed in this run. Returns {registered model: version}."""
    evals = [n for n, sp in plan.stages.items() if sp.kind == "eval"]
    if not evals:
        return {}
    for name in evals:
        art = _artifact(plan, name)
        if stages.get(name, {}).get("status") not in ("ran", "cached") or art is None or \
                art.manifest.get("failure") or art.result.get("gates_failed", 1):
            return {}
    moved = {}
    for name, sp in plan.stages.items():
        if sp.port is None or sp.port.type != "model" or stages.get(name, {}).get("status") not in ("ran", "cached"):
            continue
        model = registered_model_name(plan.cfg.name, name)
        version = tracker.model_version(model, sp.artifact_id)
        if version is not None:
            tracker.set_alias(model, "champion", version)
            moved[model] = version
    return moved


def finish_parent(tracker: Tracker, parent: str, plan: Plan, stages: dict[str, dict[str, Any]],
                  counts: dict[str, float], wall_seconds: float, promote: bool) -> dict[str, float]:
    """The parent's metrics (`counts` plus `summary/*`), `summary.json` (metrics, directions, gates), plots, the tag
    `lmforge.cached` (every stage cached) and, when `promote`, the champion aliases. Returns the metrics."""
    metrics, dirs = summary_metrics(plan, stages, wall_seconds)
    metrics.update(counts)
    tracker.log_metrics(parent, metrics)
    gates = []
    for name, sp in plan.stages.items():
        art = _artifact(plan, name) if sp.kind == "eval" else None
        gates += [{"stage": name, **g} for g in (art.result.get("gates", []) if art is not None else [])]
    tracker.log_text(parent, json.dumps({"metrics": metrics, "higher_is_better": dirs, "gates": gates}, indent=2,
                                        sort_keys=True, default=str), "summary.json")
    tags = {"lmforge.cached": str(bool(stages) and all(s["status"] == "cached" for s in stages.values())).lower()}
    try:
        log_plots(tracker, parent, plan)
    except Exception as e:  # noqa: BLE001  a plot is a view; the run's result does not depend on it
        log.warning("MLflow: could not log the plots: %s", str(e).splitlines()[0])
    if promote:
        moved = promote_champions(tracker, plan, stages)
        if moved:
            tags["lmforge.champion"] = ", ".join(f"{m}/{v}" for m, v in moved.items())
            log.info("eval gates passed: @champion -> %s", tags["lmforge.champion"])
    tracker.set_tags(parent, tags)
    return metrics


# ----------------------------------------------------------------------------------------------
# lmforge compare


def resolve_run(client, ref: str):
    """An MLflow run id, or a Prefect flow run id (its pipeline's parent run)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(ref)
    except MlflowException:
        pass
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.`prefect.flow_run_id` = '{ref}'", max_results=100) \
        if experiments else []
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if not parents:
        raise LookupError(f"{ref!r} is neither an MLflow run id nor the Prefect flow run id of a pipeline run in "
                          f"{client.tracking_uri}; give one of the ids `lmforge run` prints (MLflow run ..., Prefect "
                          "flow run ...), and the config (-c) or --tracking of the store it ran against")
    return parents[0]


def _directions_of(client, run) -> dict[str, bool]:
    try:
        import mlflow.artifacts

        text = mlflow.artifacts.load_text(f"{run.info.artifact_uri}/summary.json")
        return json.loads(text).get("higher_is_better", {})
    except Exception:  # noqa: BLE001  an older run without summary.json: directions by name
        return {}


def _fmt(metrics: dict[str, float], key: str) -> str:
    if key not in metrics:
        return "-"
    se = metrics.get(f"{key}_stderr")
    return f"{metrics[key]:.4g} ± {se:.2g}" if se is not None else f"{metrics[key]:.4g}"


def compare_url(tracking_uri: str, runs: list[Any]) -> str:
    ids = json.dumps([r.info.run_id for r in runs], separators=(",", ":"))
    exps = json.dumps(sorted({r.info.experiment_id for r in runs}), separators=(",", ":"))
    path = f"#/compare-runs?runs={quote(ids)}&experiments={quote(exps)}"
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/{path}"
    return (f"http://127.0.0.1:5000/{path}  (start the UI first: mlflow ui --backend-store-uri {tracking_uri} "
            "--host 127.0.0.1 --port 5000)")


def compare_lines(client, a, b) -> list[str]:
    """The config diff (params) and the headline metric diff (summary/*) of two parent runs, B against A: ↑ B is
    better, ↓ B is worse, = the same; no arrow where the direction is unknown."""
    lines = [f"A: {a.info.run_name}  ({a.info.run_id}, {a.info.status})",
             f"B: {b.info.run_name}  ({b.info.run_id}, {b.info.status})", ""]
    pa, pb = a.data.params, b.data.params
    diff = sorted(k for k in set(pa) | set(pb) if pa.get(k) != pb.get(k))
    lines.append(f"config: {len(diff)} setting(s) differ" + (":" if diff else ""))
    width = max((len(k) for k in diff), default=0)
    for k in diff:
        lines.append(f"  {k:<{width}}  {pa.get(k, '(unset)')}  ->  {pb.get(k, '(unset)')}")
    ma = {k: v for k, v in a.data.metrics.items() if k.startswith("summary/")}
    mb = {k: v for k, v in b.data.metrics.items() if k.startswith("summary/")}
    dirs = {**_directions_of(client, a), **_directions_of(client, b)}
    keys = sorted(k for k in set(ma) | set(mb) if not k.endswith("_stderr"))
    lines += ["", "headline metrics (summary/*), B against A:"]
    width = max((len(k) for k in keys), default=0)
    for k in keys:
        higher = direction(k, dirs)
        if k not in ma or k not in mb or higher is None:
            verdict = ""
        elif mb[k] == ma[k]:
            verdict = "= same"
        else:
            verdict = "↑ better" if (mb[k] > ma[k]) == higher else "↓ worse"
        lines.append(f"  {k:<{width}}  {_fmt(ma, k):>18}  {_fmt(mb, k):>18}  {verdict}")
    return lines
