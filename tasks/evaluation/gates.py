"""Gates and expected bands for the eval stage.

A gate compares one metric of one model with another model's (must beat, or must not regress, with the
stderrs of both added to the bar); an expectation checks that one metric lands in its declared band.
"""
from __future__ import annotations

import math
from typing import Any

from tasks.evaluation.config import Expectation, Gate

#: direction (True: higher is better) of every metric lmforge's own measurements make (scoring.py: perplexity,
#: chat_loss, preference, reward models); lm-eval's come with its results. The one declaration the gates, the
#: reports and, through the result's `tasks[].higher_is_better`, the pipeline run's summary and `lmforge compare`
#: read.
HIGHER_IS_BETTER = {"token_perplexity": False, "bits_per_byte": False, "accuracy": True, "reward_margin": True,
                    "assistant_nll": False, "assistant_perplexity": False, "loglik_accuracy": True,
                    "loglik_margin": True}


def direction(task: str, metric: str, lm_eval_dirs: dict[str, dict[str, bool]]) -> bool | None:
    """True when higher is better; None when unknown."""
    if metric in lm_eval_dirs.get(task, {}):
        return lm_eval_dirs[task][metric]
    return HIGHER_IS_BETTER.get(metric)


def metric_directions(scores: dict[str, dict[str, dict[str, float]]],
                      lm_eval_dirs: dict[str, dict[str, bool]]) -> dict[str, dict[str, bool]]:
    """task -> metric -> higher is better, for every measured metric whose direction is known (stderrs left out):
    lm-eval's where it gave one, else HIGHER_IS_BETTER."""
    out: dict[str, dict[str, bool]] = {t: dict(d) for t, d in lm_eval_dirs.items()}
    for per_task in scores.values():
        for task, metrics in per_task.items():
            for m in metrics:
                d = None if m.endswith("_stderr") else direction(task, m, lm_eval_dirs)
                if d is not None:
                    out.setdefault(task, {})[m] = d
    return out


def check_gates(gates: list[Gate], scores: dict[str, dict[str, dict[str, float]]],
                lm_eval_dirs: dict[str, dict[str, bool]]) -> list[dict[str, Any]]:
    """Each gate's outcome, with its margin: how far the result is on the passing side of the bar (negative: failed).
    - must beat (min_improvement): improvement > min_improvement + stderr_k * se;
    - must not regress (max_regression): regression <= max_regression + stderr_k * se;
    where se = sqrt(se_model^2 + se_against^2) (a missing stderr counts as 0) and improvement = -regression is the
    change for the better."""
    out = []
    for g in gates:
        model, task, metric = g.metric.split("/")
        beat = g.min_improvement is not None
        row: dict[str, Any] = {"metric": g.metric, "against": g.against, "kind": "must_beat" if beat else
                               "must_not_regress", "min_improvement": g.min_improvement,
                               "max_regression": g.max_regression, "stderr_k": g.stderr_k}
        missing = [m for m in (model, g.against) if metric not in scores.get(m, {}).get(task, {})]
        higher = g.higher_is_better if g.higher_is_better is not None else direction(task, metric, lm_eval_dirs)
        if missing:
            have = sorted(f"{t}/{k}" for t, ms in scores.get(missing[0], {}).items() for k in ms
                          if not k.endswith("_stderr"))
            row.update(passed=False, message=f"gate {g.metric}: {missing[0]} has no metric {task}/{metric} "
                       f"(it has: {', '.join(have) or 'none'})")
            out.append(row)
            continue
        if higher is None:
            row.update(passed=False, message=f"gate {g.metric}: lmforge does not know whether higher or lower "
                       "is better for this metric; set higher_is_better on the gate")
            out.append(row)
            continue
        value, ref = scores[model][task][metric], scores[g.against][task][metric]
        se = math.sqrt(sum(scores[m][task].get(f"{metric}_stderr", 0.0) ** 2 for m in (model, g.against)))
        improvement = (value - ref) if higher else (ref - value)
        if beat:
            bar = g.min_improvement + g.stderr_k * se
            margin, passed = improvement - bar, improvement > bar
            rule = (f"must beat {g.against} by more than {bar:.4g} (min_improvement {g.min_improvement:g} + "
                    f"{g.stderr_k:g} x stderr {se:.4g})")
        else:
            bar = g.max_regression + g.stderr_k * se
            margin, passed = bar + improvement, -improvement <= bar
            rule = (f"may fall behind {g.against} by at most {bar:.4g} (max_regression {g.max_regression:g} + "
                    f"{g.stderr_k:g} x stderr {se:.4g})")
        verdict = "passed" if passed else "FAILED"
        row.update(value=value, reference=ref, stderr=se, higher_is_better=higher, improvement=improvement,
                   regression=-improvement, limit=bar, margin=margin, passed=passed,
                   message=f"gate {g.metric} {verdict}: {value:.4g} against {g.against}'s {ref:.4g} "
                   f"({'higher' if higher else 'lower'} is better), a change of {improvement:+.4g} for the better; "
                   f"it {rule}: margin {margin:+.4g}")
        out.append(row)
    return out


def check_expectations(expect: list[Expectation], scores: dict[str, dict[str, dict[str, float]]]
                       ) -> dict[str, dict[str, Any]]:
    """metric path -> {value, min, max, met, message} for every declared band. A metric that was not measured
    is a failed expectation too (value None)."""
    out: dict[str, dict[str, Any]] = {}
    for e in expect:
        model, task, metric = e.metric.split("/")
        value = scores.get(model, {}).get(task, {}).get(metric)
        row: dict[str, Any] = {"value": value, "min": e.min, "max": e.max}
        if value is None:
            have = sorted(f"{t}/{k}" for t, ms in scores.get(model, {}).items() for k in ms
                          if not k.endswith("_stderr"))
            row.update(met=False, message=f"expect {e.metric} {e.band()}: {model} has no metric {task}/{metric} "
                       f"(it has: {', '.join(have) or 'none'})")
        else:
            met = (e.min is None or value >= e.min) and (e.max is None or value <= e.max)
            where = "" if met else (" below" if e.min is not None and value < e.min else " above")
            row.update(met=met, message=f"expect {e.metric} {e.band()}: {value:.4g}, "
                       f"{'as expected' if met else 'UNEXPECTED,' + where + ' the band'}")
        out[e.metric] = row
    return out
