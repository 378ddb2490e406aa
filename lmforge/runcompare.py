"""`lmforge compare RUN_A RUN_B`: two pipeline runs (parent runs) side by side.

- Where B's results come from: "B replayed A's cached artifacts" when every stage of B was cached with A's artifact
  ids (then B's metrics are A's, and only counts and timings differ), else how many of A's artifacts B reused and
  which stages made new ones.
- The settings that differ: every stage's settings, read from the stage runs (runview.run_settings).
- Every parent metric, headline first (`0_headline/*`), with a verdict on every row: `↑ better` / `↓ worse` /
  `= same` by the direction the run declared in its `summary.json` (runview), `info` for counts, timings and any
  metric whose direction nothing declares, `only in A` / `only in B`. A difference within two stderrs of the
  difference says so.
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

from lmforge.runview import HEADLINE_PREFIX, HIGHER, LOWER, declared_direction, run_settings, stage_runs

VERDICTS = ("↑ better", "↓ worse", "= same", "info", "only in A", "only in B")


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


def compare_url(tracking_uri: str, runs: list[Any]) -> str:
    ids = json.dumps([r.info.run_id for r in runs], separators=(",", ":"))
    exps = json.dumps(sorted({r.info.experiment_id for r in runs}), separators=(",", ":"))
    path = f"#/compare-runs?runs={quote(ids)}&experiments={quote(exps)}"
    if tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/{path}"
    return (f"http://127.0.0.1:5000/{path}  (start the UI first: mlflow ui --backend-store-uri {tracking_uri} "
            "--host 127.0.0.1 --port 5000)")


def run_summary(client, run) -> dict[str, Any]:
    """The run's `summary.json` ({} for a run without one)."""
    try:
        with tempfile.TemporaryDirectory(prefix="lmforge-compare-") as tmp:
            path = client.download_artifacts(run.info.run_id, "summary.json", tmp)
            return json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001  a run that ended before writing it, or an older lmforge's
        return {}


def run_directions(summary: dict[str, Any]) -> dict[str, str]:
    """metric -> higher | lower | none, as the run declared them (an older summary.json: `higher_is_better`)."""
    if "directions" in summary:
        return dict(summary["directions"])
    return {k: HIGHER if v else LOWER for k, v in summary.get("higher_is_better", {}).items()}


def provenance_lines(client, a, b) -> list[str]:
    """Where B's results come from, against A's artifacts."""
    ka, kb = stage_runs(client, a), stage_runs(client, b)

    def aid(r) -> str:
        return r.data.tags.get("lmforge.artifact_id", "")

    same = [s for s in kb if s in ka and aid(kb[s]) and aid(kb[s]) == aid(ka[s])]
    new = [s for s in kb if s not in same]
    every_cached = {x: run.data.tags.get("lmforge.cached") == "true" for x, run in (("A", a), ("B", b))}
    if ka and kb and not new and set(ka) == set(kb):
        for x, y in (("B", "A"), ("A", "B")):
            if every_cached[x]:
                return [f"{x} replayed {y}'s cached artifacts: every one of its {len(kb)} stages was cached, with "
                        f"{y}'s artifact ids, so its results are {y}'s; only counts and timings differ (info)."]
        return [f"A and B used the same {len(kb)} artifacts (same artifact ids): their results are the same."]
    if not kb:
        return ["B has no stage runs to compare artifacts with."]
    if every_cached["B"]:
        return [f"B replayed cached artifacts (every stage cached); {len(new)} of them are not A's: {', '.join(new)}."]
    return [f"B reused {len(same)} of A's {len(ka)} artifacts and has other ones for {len(new)} stage(s): "
            f"{', '.join(new)}."]


def verdict(ma: dict[str, float], mb: dict[str, float], key: str, direction: str | None) -> str:
    """One of VERDICTS, with `(within 2 stderr)` where both have a stderr and the difference is within two of
    the difference's."""
    if key not in mb:
        return "only in A"
    if key not in ma:
        return "only in B"
    if direction not in (HIGHER, LOWER):
        return "info"
    if ma[key] == mb[key]:
        return "= same"
    out = "↑ better" if (mb[key] > ma[key]) == (direction == HIGHER) else "↓ worse"
    sa, sb = ma.get(f"{key}_stderr"), mb.get(f"{key}_stderr")
    if sa is not None and sb is not None and abs(mb[key] - ma[key]) <= 2 * math.sqrt(sa * sa + sb * sb):
        out += " (within 2 stderr)"
    return out


def _fmt(metrics: dict[str, float], key: str) -> str:
    if key not in metrics:
        return "-"
    se = metrics.get(f"{key}_stderr")
    return f"{metrics[key]:.4g} ± {se:.2g}" if se is not None else f"{metrics[key]:.4g}"


def _stderrs(run) -> dict[str, float]:
    """The run's metrics, with each headline metric's stderr beside it (from its summary key)."""
    m = dict(run.data.metrics)
    for k in list(m):
        if k.startswith(HEADLINE_PREFIX):
            rest = k.removeprefix(HEADLINE_PREFIX)
            se = m.get(f"{rest if rest.startswith('stages_') else 'summary/' + rest}_stderr")
            if se is not None:
                m[f"{k}_stderr"] = se
    return m


def compare_lines(client, a, b) -> list[str]:
    """Provenance, config diff and every parent metric of two parent runs, B against A."""
    lines = [f"A: {a.info.run_name}  ({a.info.run_id}, {a.info.status})",
             f"B: {b.info.run_name}  ({b.info.run_id}, {b.info.status})", ""]
    lines += provenance_lines(client, a, b) + [""]
    pa, pb = run_settings(client, a), run_settings(client, b)
    diff = sorted(k for k in set(pa) | set(pb) if pa.get(k) != pb.get(k))
    lines.append(f"config: {len(diff)} setting(s) differ" + (":" if diff else ""))
    width = max((len(k) for k in diff), default=0)
    for k in diff:
        lines.append(f"  {k:<{width}}  {pa.get(k, '(unset)')}  ->  {pb.get(k, '(unset)')}")
    ma, mb = _stderrs(a), _stderrs(b)
    dirs = {**run_directions(run_summary(client, a)), **run_directions(run_summary(client, b))}
    keys = {k for k in set(ma) | set(mb) if not k.endswith("_stderr")}
    headline = sorted(k for k in keys if k.startswith(HEADLINE_PREFIX))
    both = [k.removeprefix(HEADLINE_PREFIX) for k in headline if k in ma and k in mb]
    shown = {f"summary/{k}" for k in both} | set(both)  # a headline row of both runs stands for its summary row
    rest = sorted(k for k in keys - set(headline) - shown)
    width = max((len(k) for k in keys), default=0)
    for title, rows in ((f"headline metrics ({HEADLINE_PREFIX}*), B against A:", headline),
                        ("metrics, B against A (info: counts and timings, not better or worse):", rest)):
        if not rows:
            continue
        lines += ["", title]
        for k in rows:
            v = verdict(ma, mb, k, declared_direction(k, dirs))
            lines.append(f"  {k:<{width}}  {_fmt(ma, k):>18}  {_fmt(mb, k):>18}  {v}")
    return lines
