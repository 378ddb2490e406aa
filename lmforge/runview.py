"""What a pipeline run looks like in MLflow: its parent run's name, params, headline metrics, the directions of its
metrics, and the champion alias. Plots are in lmforge/runplots.py, `lmforge compare` in lmforge/runcompare.py.

The parent run is the row a user compares. Its name says what the run is and what it did: `<pipeline> <config hash>
<settings changed since the previous run> · <15 cached | 15 ran | reran sft+4>`. Its params are the few settings a
user tunes (KEY_SETTINGS of each training stage) and the settings changed since the previous run; every stage's full
settings stay on its child run, and the whole config is the parent's `config.yaml`. Its metrics are the same keys on
every run, cached or not: the headline (`0_headline/*`, first in MLflow's sorted columns), `summary/*` (the eval table
per model, gate counts, tokens trained per training stage, wall time) and the stage counts. `summary.json` holds them
with their directions: higher or lower is better, or `none` for counts and timings, which are information. A
`prefect flow-run retry` of a flow run continues that flow run's parent.

Directions are declared where each metric is defined: the parent's own metrics here (PARENT_DIRECTIONS), the eval
metrics by the eval stage, which writes every metric's direction into its result (`tasks[].higher_is_better`,
lmforge's own from tasks/evaluation/gates.py, lm-eval's from its results). Nothing is guessed from a name.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from lmforge.plan import Plan
from lmforge.stage import numeric_leaves
from lmforge.tracking import Tracker, flatten, registered_model_name

log = logging.getLogger(__name__)

NAME_MAX_CHARS = 90  # MLflow's run list shows about this much
VALUE_MAX_CHARS = 24
#: the settings of each training stage the parent run carries as params (where the stage has them)
KEY_SETTINGS = ("method", "learning_rate", "max_steps", "epochs", "beta", "seed")
#: headline metrics go on the parent as `0_headline/<summary key without summary/>`: first in MLflow's sorted lists
HEADLINE_PREFIX = "0_headline/"
HIGHER, LOWER, INFO = "higher", "lower", "none"
#: the parent's own metrics (the flow counts the stages, summary_metrics makes the rest); prefix keys end with "/"
PARENT_DIRECTIONS = {"stages_ran": INFO, "stages_cached": INFO, "stages_failed": LOWER,
                     "summary/wall_seconds": INFO, "summary/gates_passed": HIGHER, "summary/gates_failed": LOWER,
                     "summary/expectations_failed": LOWER, "summary/tokens_trained/": INFO}


def declared_direction(key: str, dirs: dict[str, str]) -> str | None:
    """higher | lower | none for metric `key` from `dirs` (a run's declarations) and PARENT_DIRECTIONS; a headline
    key has its summary key's direction; a stderr is information. None: nothing declares it."""
    if key.startswith(HEADLINE_PREFIX):
        rest = key.removeprefix(HEADLINE_PREFIX)
        key = rest if rest.startswith("stages_") else f"summary/{rest}"
    if key in dirs:
        return dirs[key]
    if key.endswith("_stderr"):
        return INFO
    for k, d in PARENT_DIRECTIONS.items():
        if key == k or (k.endswith("/") and key.startswith(k)):
            return d
    return None


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


def outcome(statuses: dict[str, str]) -> str:
    """What a run did, from its stages' statuses in topological order (ran, or run in a plan; cached; failed, which
    counts as ran: the run's status in MLflow says it failed): `15 cached`, `15 ran`, or `reran sft+4` (the first
    stage that ran and how many others did)."""
    if not statuses:
        return ""
    rerun = [n for n, s in statuses.items() if s != "cached"]
    if not rerun:
        return f"{len(statuses)} cached"
    if len(rerun) == len(statuses):
        return f"{len(statuses)} ran"
    return f"reran {rerun[0]}" + (f"+{len(rerun) - 1}" if len(rerun) > 1 else "")


def run_name(pipeline: str, config_hash: str, changes: list[str], did: str = "") -> str:
    """`demo 3f9c2a1b sft.learning_rate=0.001, dpo.beta=0.2 +3 more · reran sft+4`, at most NAME_MAX_CHARS: the
    changes are cut first."""
    suffix = f" · {did}" if did else ""
    budget = NAME_MAX_CHARS - len(suffix)
    name = f"{pipeline} {config_hash[:8]}"
    for i, c in enumerate(changes):
        more = f" +{len(changes) - i} more"
        sep = " " if i == 0 else ", "
        rest_fits = i == len(changes) - 1 or len(name) + len(sep) + len(c) + len(f" +{len(changes) - i - 1} more") \
            <= budget
        if len(name) + len(sep) + len(c) > budget or not rest_fits:
            return name + more + suffix
        name += sep + c
    return name + suffix


def _parents(tracker: Tracker, pipeline: str, extra: str = "") -> list[Any]:
    runs = tracker.find_runs(f"tags.`lmforge.pipeline` = '{pipeline}'{extra}", 20)
    return [r for r in runs if "mlflow.parentRunId" not in r.data.tags]


def stage_runs(client, run) -> dict[str, Any]:
    """The stage (child) runs of a parent run, by stage name, in the order they started."""
    kids = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}'",
                              max_results=1000)
    kids = sorted(kids, key=lambda k: (k.info.start_time or 0, k.info.run_name or ""))
    return {k.data.tags.get("lmforge.stage") or k.info.run_name: k for k in kids}


def run_settings(client, run) -> dict[str, str]:
    """`stage.key` -> value: every stage's settings, from the stage runs (the parent carries only a few; an older
    parent carried them all, and those count too)."""
    out = dict(run.data.params)
    for stage, kid in stage_runs(client, run).items():
        out.update({f"{stage}.{k}"[:250]: v for k, v in kid.data.params.items()})
    return out


def key_params(plan: Plan, flat: dict[str, str]) -> dict[str, str]:
    """KEY_SETTINGS of every training stage (whose output is a model), from the flattened settings."""
    keys = {f"{n}.{k}" for n, sp in plan.stages.items() if sp.port is not None and sp.port.type == "model"
            and sp.kind != "export" for k in KEY_SETTINGS}
    return {k: v for k, v in flat.items() if k in keys}


def start_parent(tracker: Tracker, plan: Plan, flow_run_id: str, tags: dict[str, Any]) -> str:
    """The pipeline run's parent MLflow run, with the key settings and those changed since the previous run as
    params. A Prefect retry of a flow run (same flow run id) reopens that flow run's parent (tag lmforge.attempt
    counts); a new flow run of a config whose previous run failed is tagged lmforge.retry_of = that run."""
    cfg = plan.cfg
    flat = {k[:250]: v for k, v in flatten({n: sp.settings for n, sp in plan.stages.items()}).items()}
    same = _parents(tracker, cfg.name, f" and tags.`prefect.flow_run_id` = '{flow_run_id}'") if flow_run_id else []
    if same:
        run = same[0]
        attempt = int(run.data.tags.get("lmforge.attempt", "1")) + 1
        tracker.reopen_run(run.info.run_id, {**tags, "lmforge.attempt": attempt})
        tracker.log_params(run.info.run_id, key_params(plan, flat), new_only=True)
        log.info("MLflow: continuing run %s (%s), attempt %d of flow run %s", run.info.run_id, run.info.run_name,
                 attempt, flow_run_id)
        return run.info.run_id
    previous = next(iter(_parents(tracker, cfg.name)), None)
    changes: list[str] = []
    changed: dict[str, str] = {}
    if previous is not None:
        before = run_settings(tracker.client, previous)
        both = {k.split(".", 1)[0] for k in before} & {k.split(".", 1)[0] for k in flat}  # stages of both runs
        before = {k: v for k, v in before.items() if k.split(".", 1)[0] in both}
        now = {k: v for k, v in flat.items() if k.split(".", 1)[0] in both}
        changes = changed_settings(before, now)
        changed = {k: v for k, v in now.items() if before.get(k) != v}
    planned = {n: "cached" if sp.action == "cached" else "run" for n, sp in plan.stages.items()}
    name = run_name(cfg.name, cfg.config_hash(), changes, outcome(planned))
    extra = {"lmforge.attempt": "1"}
    if previous is not None and previous.info.status in ("FAILED", "KILLED") and \
            previous.data.tags.get("lmforge.config_hash") == cfg.config_hash():
        extra["lmforge.retry_of"] = previous.info.run_id
    run_id = tracker.start_run(name, {**tags, **extra})
    tracker.log_params(run_id, {**key_params(plan, flat), **changed})
    return run_id


def rename_for_outcome(tracker: Tracker, run_id: str, stages: dict[str, dict[str, Any]], plan: Plan) -> str:
    """The name's ` · ...` part as the run turned out (the plan's guess was set at the start)."""
    statuses = {n: stages.get(n, {}).get("status", "failed") for n in plan.stages}
    with tracker.lock:
        old = tracker.client.get_run(run_id).info.run_name or ""
        base = old.split(" · ", 1)[0]
        suffix = f" · {outcome(statuses)}" if statuses else ""
        if len(base) + len(suffix) > NAME_MAX_CHARS:  # a longer outcome than planned: cut the changes
            base = base[:NAME_MAX_CHARS - len(suffix) - 1] + "…"
        new = base + suffix
        if new != old:
            tracker.client.update_run(run_id, name=new)
    return new


# ----------------------------------------------------------------------------------------------
# headline metrics


def _artifact(plan: Plan, name: str):
    sp = plan.stages[name]
    return plan.store.get(sp.kind, sp.artifact_id)


def eval_directions(result: dict[str, Any]) -> dict[str, str]:
    """task/metric -> higher | lower, as the eval stage declared them in its result's `tasks` list."""
    out = {}
    for t in result.get("tasks", []):
        for metric, higher in (t.get("higher_is_better") or {}).items():
            out[f"{t['task']}/{metric}"] = HIGHER if higher else LOWER
    return out


def summary_metrics(plan: Plan, stages: dict[str, dict[str, Any]], wall_seconds: float) -> tuple[
        dict[str, float], dict[str, str]]:
    """(`summary/*` metrics, the direction of each). Read from the artifacts in the store, so a cached run has
    exactly the keys (and values) of the run that made them: `summary/<model>/<task>/<metric>` (with `_stderr`) of the
    eval table (`summary/<eval stage>/...` when there are several eval stages), `summary/gates_passed`,
    `summary/gates_failed`, `summary/expectations_failed`, `summary/tokens_trained/<stage>` of each training stage whose
    result counts tokens, `summary/wall_seconds`."""
    metrics: dict[str, float] = {"summary/wall_seconds": round(wall_seconds, 3)}
    dirs: dict[str, str] = {}
    evals = [n for n, sp in plan.stages.items() if sp.kind == "eval"]
    if evals:
        metrics.update({"summary/gates_passed": 0.0, "summary/gates_failed": 0.0, "summary/expectations_failed": 0.0})
    for name in evals:
        art = _artifact(plan, name)
        if art is None:
            continue
        prefix = "summary/" if len(evals) == 1 else f"summary/{name}/"
        result = art.result
        table = numeric_leaves(result.get("eval", {}))
        metrics.update({prefix + k: v for k, v in table.items()})
        known = eval_directions(result)
        for k in table:
            task_metric = k.split("/", 1)[-1]
            d = INFO if k.endswith("_stderr") else known.get(task_metric)
            if d is not None:
                dirs[prefix + k] = d
        gates = result.get("gates", [])
        metrics["summary/gates_passed"] += sum(1 for g in gates if g.get("passed"))
        metrics["summary/gates_failed"] += sum(1 for g in gates if not g.get("passed"))
        metrics["summary/expectations_failed"] += float(result.get("expectations_failed", 0))
    for name, sp in plan.stages.items():
        if sp.port is not None and sp.port.type == "model" and sp.kind != "export" and \
                stages.get(name, {}).get("status") != "failed":
            art = _artifact(plan, name)
            tokens = (art.result or {}).get("tokens") if art is not None else None
            if isinstance(tokens, (int, float)) and not isinstance(tokens, bool):
                metrics[f"summary/tokens_trained/{name}"] = float(tokens)
    for k in metrics:
        d = declared_direction(k, dirs)
        if d is not None:
            dirs[k] = d
    return metrics, dirs


def headline_keys(plan: Plan) -> list[str]:
    """The parent metrics the config's `headline:` names (`<model>/<task>/<metric>`, `<eval stage>/<model>/...`,
    any `summary/` key with or without its prefix, a stage count); by default the gated metrics of the eval stages."""
    evals = [n for n, sp in plan.stages.items() if sp.kind == "eval"]
    named = list(getattr(plan.cfg, "headline", None) or [])
    if not named:
        named = [g["metric"] if len(evals) == 1 else f"{n}/{g['metric']}" for n in evals
                 for g in plan.stages[n].settings.get("gates") or [] if isinstance(g, dict) and "metric" in g]
    keys: list[str] = []
    for h in named:
        k = h if h.startswith(("summary/", "stages_")) else f"summary/{h}"
        if k not in keys:
            keys.append(k)
    return keys


def headline_metrics(plan: Plan, metrics: dict[str, float]) -> dict[str, float]:
    """`0_headline/<key>` for each headline key the run has (a missing one is logged, not an error)."""
    out = {}
    for k in headline_keys(plan):
        if k not in metrics:
            log.warning("headline metric %s is not among this run's metrics; it has: %s", k,
                        ", ".join(sorted(m for m in metrics if not m.endswith("_stderr"))))
            continue
        out[HEADLINE_PREFIX + k.removeprefix("summary/")] = metrics[k]
    return out


# ----------------------------------------------------------------------------------------------
# the end of a run


def gates_passed(plan: Plan, stages: dict[str, dict[str, Any]]) -> bool:
    """The run has an eval stage, and every eval stage finished (ran or cached) with all its gates passed."""
    evals = [n for n, sp in plan.stages.items() if sp.kind == "eval"]
    for name in evals:
        art = _artifact(plan, name)
        if stages.get(name, {}).get("status") not in ("ran", "cached") or art is None or \
                art.manifest.get("failure") or art.result.get("gates_failed", 1):
            return False
    return bool(evals)


def promote_champions(tracker: Tracker, plan: Plan, stages: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Move `@champion` of every exported model of this run to this run's version, when the run has an eval stage and
    every eval stage finished (ran or cached) with all its gates passed. The version is the one this run evaluated,
    so a cached run moves it only to a version that passed in this run. Returns {registered model: version}."""
    if not gates_passed(plan, stages):
        return {}
    moved = {}
    for name, sp in plan.stages.items():  # what the registry holds: the export stages' models (tasks/export.py)
        if sp.kind != "export" or stages.get(name, {}).get("status") not in ("ran", "cached"):
            continue
        model = registered_model_name(plan.cfg.name, plan.cfg.stages[name].model_name())
        version = tracker.model_version(model, sp.artifact_id)
        if version is not None:
            tracker.set_alias(model, "champion", version)
            moved[model] = version
    return moved


def finish_parent(tracker: Tracker, parent: str, plan: Plan, stages: dict[str, dict[str, Any]],
                  counts: dict[str, float], wall_seconds: float, promote: bool) -> dict[str, float]:
    """The parent's metrics (headline, `summary/*`, `counts`), `summary.json` (metrics, directions, headline, gates,
    plotted series), plots, the name's outcome, the tag `lmforge.cached` (every stage cached) and, when `promote`,
    the champion aliases. Returns the metrics."""
    from lmforge import runplots

    metrics, dirs = summary_metrics(plan, stages, wall_seconds)
    metrics.update(counts)
    headline = headline_metrics(plan, metrics)
    metrics.update(headline)
    dirs.update({k: d for k in metrics if (d := declared_direction(k, dirs)) is not None})
    tracker.log_metrics(parent, metrics)
    gates = []
    for name, sp in plan.stages.items():
        art = _artifact(plan, name) if sp.kind == "eval" else None
        gates += [{"stage": name, **g} for g in (art.result.get("gates", []) if art is not None else [])]
    tags = {"lmforge.cached": str(bool(stages) and all(s["status"] == "cached" for s in stages.values())).lower()}
    plotted: dict[str, Any] = {}
    try:
        plotted = runplots.log_plots(tracker, parent, plan)
    except Exception as e:  # noqa: BLE001  a plot is a view; the run's result does not depend on it
        log.warning("MLflow: could not log the plots: %s", str(e).splitlines()[0])
    tracker.log_text(parent, json.dumps({"metrics": metrics, "directions": dirs, "headline": sorted(headline),
                                         "gates": gates, "plots": plotted}, indent=2, sort_keys=True, default=str),
                     "summary.json")
    try:
        rename_for_outcome(tracker, parent, stages, plan)
    except Exception as e:  # noqa: BLE001  the name is a view too
        log.warning("MLflow: could not rename run %s: %s", parent, str(e).splitlines()[0])
    if promote:
        moved = promote_champions(tracker, plan, stages)
        if moved:
            tags["lmforge.champion"] = ", ".join(f"{m}/{v}" for m, v in moved.items())
            log.info("eval gates passed: @champion -> %s", tags["lmforge.champion"])
    tracker.set_tags(parent, tags)
    return metrics
