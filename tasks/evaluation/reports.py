"""The eval stage's reports: `comparison.md` / `comparison.html` (task/metric x model, with stderr, then gates,
expectations and notes), `metrics.json`, `control_generations.md` / `.jsonl` and `metrics.png` (the main
metric of each task, one bar per model).
"""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.evaluation.config import EvalConfig
from tasks.evaluation.gates import direction

if TYPE_CHECKING:  # pragma: no cover
    from tasks.evaluation.scoring import Collected


def _columns(scores: dict[str, dict[str, dict[str, float]]]) -> list[tuple[str, str]]:
    """(task, metric) pairs in first-seen order, stderrs left out (they go beside their metric)."""
    cols: list[tuple[str, str]] = []
    for per_task in scores.values():
        for task, metrics in per_task.items():
            for m in metrics:
                if not m.endswith("_stderr") and (task, m) not in cols:
                    cols.append((task, m))
    return cols


def _cell(metrics: dict[str, float] | None, metric: str) -> str:
    if not metrics or metric not in metrics:
        return "-"
    se = metrics.get(f"{metric}_stderr")
    return f"{metrics[metric]:.4f} ± {se:.4f}" if se is not None else f"{metrics[metric]:.4f}"


def _arrow(higher: bool | None) -> str:
    return {True: "↑", False: "↓", None: ""}[higher]


def comparison_rows(scores: dict[str, dict[str, dict[str, float]]], dirs: dict[str, dict[str, bool]],
                    gates: list[dict[str, Any]] = ()) -> list[list[str]]:
    """The table: one row per task/metric, one column per model; "value ± stderr". The gated task/metrics come first
    (the pipeline's default headline), in the order of the gates; the rest keep their first-seen order."""
    models = list(scores)
    rows = [["task", "metric", "better", *models]]
    gated = list(dict.fromkeys(tuple(g["metric"].split("/")[1:]) for g in gates))
    columns = _columns(scores)
    for task, metric in [c for c in gated if c in columns] + [c for c in columns if c not in gated]:
        rows.append([task, metric, _arrow(direction(task, metric, dirs)),
                     *(_cell(scores[m].get(task), metric) for m in models)])
    return rows


def _md_table(rows: list[list[str]]) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(esc(c) for c in rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c).replace(chr(10), '<br>')}</td>" for c in r) + "</tr>"
                   for r in rows[1:])
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{body}</tbody>\n</table>"


def _settings_line(cfg: EvalConfig) -> str:
    return (f"num_fewshot {cfg.num_fewshot}, batch_size {cfg.batch_size}, seed {cfg.seed}, limit {cfg.limit}, "
            f"bootstrap_iters {cfg.bootstrap_iters}, apply_chat_template {cfg.apply_chat_template}, dtype {cfg.dtype}")


def gate_rows(gates: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["gate", "metric", "against", "value", "reference", "bar", "margin", "verdict"]]
    for g in gates:
        bar = "-" if "limit" not in g else (f"better by > {g['limit']:.4g}" if g["kind"] == "must_beat"
                                            else f"worse by <= {g['limit']:.4g}")
        rows.append([g["kind"].replace("_", " "), g["metric"], g["against"], _num(g.get("value")),
                     _num(g.get("reference")), bar, _num(g.get("margin"), signed=True),
                     "PASS" if g["passed"] else "FAIL"])
    return rows


def expectation_rows(expectations: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = [["metric", "expected band", "value", "verdict"]]
    for metric, e in expectations.items():
        lo = "-inf" if e["min"] is None else format(e["min"], "g")
        band = f"{lo} .. {'inf' if e['max'] is None else format(e['max'], 'g')}"
        rows.append([metric, band, _num(e["value"]), "as expected" if e["met"] else "UNEXPECTED"])
    return rows


def _num(v: float | None, signed: bool = False) -> str:
    return "-" if v is None else (f"{v:+.4f}" if signed else f"{v:.4f}")


def write_reports(out: Path, cfg: EvalConfig, c: "Collected", gates: list[dict[str, Any]],
                  expectations: dict[str, dict[str, Any]]) -> None:
    scores, dirs, notes, generations = c.scores, c.higher_is_better, c.notes, c.generations
    rows = comparison_rows(scores, dirs, gates)
    sections = []  # (title, intro, table rows, lines)
    if gates:
        sections.append(("Gates", "Margin: how far each result is on the passing side of its bar (negative: failed).",
                         gate_rows(gates), [g["message"] for g in gates if not g["passed"]]))
    if expectations:
        sections.append(("Expectations", "The band each metric is declared to land in (`expect:`).",
                         expectation_rows(expectations), [e["message"] for e in expectations.values() if not e["met"]]))
    md = ["# Evaluation", "", f"Settings: {_settings_line(cfg)}", "", _md_table(rows), ""]
    for title, intro, table, failed in sections:
        md += [f"## {title}", "", intro, "", _md_table(table), "", *(f"- {m}" for m in failed), ""]
    if notes:
        md += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    (out / "comparison.md").write_text("\n".join(md), encoding="utf-8")
    page = ["<!doctype html><html><head><meta charset='utf-8'><title>Evaluation</title>",
            "<style>table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}"
            "</style></head><body>", "<h1>Evaluation</h1>", f"<p>Settings: {html.escape(_settings_line(cfg))}</p>",
            _html_table(rows)]
    for title, intro, table, failed in sections:
        page += [f"<h2>{title}</h2>", f"<p>{html.escape(intro)}</p>", _html_table(table)]
        page += ["<ul>", *(f"<li>{html.escape(m)}</li>" for m in failed), "</ul>"] if failed else []
    if notes:
        page += ["<h2>Notes</h2><ul>", *(f"<li>{html.escape(n)}</li>" for n in notes), "</ul>"]
    if generations:
        page += ["<h2>Control generations</h2>", _html_table(_generation_rows(cfg.control_prompts, generations))]
    page.append("</body></html>")
    (out / "comparison.html").write_text("\n".join(page), encoding="utf-8")
    (out / "metrics.json").write_text(json.dumps({"eval": scores, "higher_is_better": dirs,
                                                  "main_metric": c.main_metric, "gates": gates,
                                                  "expectations": expectations, "notes": notes},
                                                 indent=2), encoding="utf-8")
    if generations:
        gen_rows = _generation_rows(cfg.control_prompts, generations)
        (out / "control_generations.md").write_text(
            f"# Control generations\n\nGreedy, max_new_tokens {cfg.max_new_tokens}.\n\n{_md_table(gen_rows)}\n",
            encoding="utf-8")
        with open(out / "control_generations.jsonl", "w", encoding="utf-8") as f:
            for i, prompt in enumerate(cfg.control_prompts):
                for model, outs in generations.items():
                    row = {"prompt": prompt, "model": model, "output": outs[i]}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    _bar_chart(out / "metrics.png", scores, c.main_metric, dirs)


def _generation_rows(prompts: list[str], generations: dict[str, list[str]]) -> list[list[str]]:
    rows = [["prompt", *generations]]
    return rows + [[p, *(outs[i] for outs in generations.values())] for i, p in enumerate(prompts)]


def _bar_chart(path: Path, scores: dict[str, dict[str, dict[str, float]]], main: dict[str, str],
               dirs: dict[str, dict[str, bool]]) -> None:
    """One panel per task (its main metric), one bar per model, stderr as error bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [(t, m) for t, m in main.items()]
    models = list(scores)
    fig = Figure(figsize=(max(3.2 * len(panels), 4), 3.4))
    FigureCanvasAgg(fig)
    for i, (task, metric) in enumerate(panels):
        ax = fig.add_subplot(1, max(len(panels), 1), i + 1)
        vals = [scores[m].get(task, {}).get(metric, float("nan")) for m in models]
        errs = [scores[m].get(task, {}).get(f"{metric}_stderr", 0.0) for m in models]
        ax.bar(range(len(models)), vals, yerr=errs, capsize=3, color=[f"C{j}" for j in range(len(models))])
        ax.set_xticks(range(len(models)), models, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{task}\n{metric} {_arrow(direction(task, metric, dirs))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
