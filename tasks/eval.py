"""eval: the same measurements on every model named in the config, side by side.

Models: a list of `{name, base: <folder>}` (a local Hugging Face model folder) and `{name, input: <stage>}`
(the `model` artifact of a training stage: an HF folder, or a peft adapter that goes on `base:`, a folder or
another entry's name). Every model gets, with the same settings:
- perplexity on held-out text (`perplexity:`; the validation split of text shards, or text records):
  token perplexity and bits per byte, scored by lm-eval's `loglikelihood_rolling`;
- lm-eval tasks (`tasks:`) through `lm_eval.simple_evaluate`: lmforge's own in `configs/eval_tasks/`, any
  folder in `task_dirs:`, or any lm-eval task name; num_fewshot, batch_size, seed and limit pinned here;
- held-out preference accuracy (`preference:`) against a reference model, by DPO's implicit reward;
- greedy generations on fixed control prompts (`control_prompts:`).

Metric paths are `<model>/<task>/<metric>`, e.g. `sft/local_ppl/bits_per_byte` or `base/lmforge_arith_mc/acc`;
`<metric>_stderr` sits beside a metric that has one. Direction: lm-eval's `higher_is_better` for its tasks;
for lmforge's own, token_perplexity and bits_per_byte are lower-is-better, accuracy and reward_margin
higher-is-better. The Result carries `eval: {model: {task: {metric: value}}}`, so MLflow gets
`eval/<model>/<task>/<metric>` on the stage's run; the flow puts them on the pipeline run as
`summary/<model>/<task>/<metric>` (lmforge/runview.py).

Gates (`gates:`) compare one metric of one model against another model. A failing gate fails the stage
with `FailedAfterPublish`, raised after every file and MLflow record is written, so the artifact can be
published and inspected (the executor publishes, then fails the stage).

Artifact: `results/<model>.json` (lm-eval's results) and `results/<model>.samples.jsonl` (each document, target,
answer as scored and its metrics), `metrics.json`, `comparison.md` / `comparison.html`
(task/metric x model, with stderr), `metrics.png` (main metric per task), `control_generations.md` /
`.jsonl`, and `tasks/` (the task YAMLs as lm-eval read them, data paths absolute).

The parts live in `tasks/evaluation/` (config, model resolution, data readers, the scoring engine, lm-eval
tasks, gates, reports, MLflow); this module is the stage: `run`, its Result and its output port.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lmforge.errors import FailedAfterPublish
from lmforge.port import Port
from lmforge.stage import Input, Result, StageDef, StageRuntime
from tasks.evaluation.config import EvalConfig
from tasks.evaluation.data import read_conversations, read_pairs, read_texts
from tasks.evaluation.engine import format_prompt, free_lm, generate, load_lm
from tasks.evaluation.gates import check_expectations, check_gates, metric_directions
from tasks.evaluation.lmeval_tasks import SHIPPED_TASKS, check_tasks, prepare_task_dirs, task_manager
from tasks.evaluation.models import resolve_models
from tasks.evaluation.reports import write_reports
from tasks.evaluation.scoring import (Collected, score_chat_loss, score_pairs, score_perplexity, score_preference,
                                      score_reward_models, score_tasks)
from tasks.evaluation.tracking import log_reports

log = logging.getLogger(__name__)

TEXT_PORTS = {"shards", "records"}


class EvalResult(Result):
    models: list[dict[str, str]]  # what each name resolved to
    eval: dict[str, dict[str, dict[str, float]]]  # model -> task -> metric (+ metric_stderr) -> value
    tasks: list[dict[str, Any]]  # per task: kind, version, documents, evaluated, higher_is_better, ...
    gates: list[dict[str, Any]]
    gates_failed: int
    expectations: dict[str, dict[str, Any]] = {}  # metric path -> value, min, max, met, message
    expectations_failed: int = 0
    notes: list[str]


def run(cfg: EvalConfig, inputs: list[Input], out: Path, runtime: StageRuntime | None = None) -> EvalResult:
    where = f"stages.{runtime.stage}." if runtime else ""
    by_input = dict(zip(cfg.inputs, inputs))
    c = Collected()
    # everything that can fail on bad input fails here, before any model loads
    models = resolve_models(cfg, by_input, where)
    texts = {s.name: read_texts(by_input[s.input], s, f"{where}perplexity[{i}]", c.notes)
             for i, s in enumerate(cfg.perplexity)}
    convs = {s.name: read_conversations(by_input[s.input], s, f"{where}chat_loss[{i}]", c.notes)
             for i, s in enumerate(cfg.chat_loss)}
    pref = cfg.preference
    pairs = read_pairs(by_input[pref.input], pref, f"{where}preference", c.notes) if pref else []
    scored_pairs = [] if pref is None or pref.reference is None else (
        pref.models or [m for m in models if m != pref.reference])
    tm = None
    if cfg.tasks:
        sources = [SHIPPED_TASKS, *(cfg.local_path(d) for d in cfg.task_dirs)]
        include = prepare_task_dirs(sources, out / "tasks")
        tm = task_manager(include, cfg.tasks, where=f"{where}tasks")
        check_tasks(tm, cfg.tasks, include, sources)

    for name, src in models.items():  # one model in memory at a time
        lm = load_lm(src, batch_size=cfg.batch_size, device=cfg.device, dtype=cfg.dtype, max_length=cfg.max_length,
                     chat=cfg.apply_chat_template)
        c.scores[name] = {}
        for s in cfg.perplexity:
            score_perplexity(c, name, lm, s, texts[s.name])
        for s in cfg.chat_loss:
            score_chat_loss(c, name, lm, s, convs[s.name], cfg.batch_size)
        if cfg.tasks:
            score_tasks(c, name, lm, cfg, tm, out / "results" / f"{name}.json", src.describe())
        if pref is not None and (pref.loglik or name == pref.reference or name in scored_pairs):
            score_pairs(c, name, lm, cfg, pairs)  # loglik_accuracy; the reference and policies: implicit reward
        if cfg.control_prompts:
            prompts = [format_prompt(lm, p, cfg.apply_chat_template, name) for p in cfg.control_prompts]
            c.generations[name] = generate(lm, prompts, cfg.max_new_tokens)
        del lm
        free_lm()
    if pref is not None:
        score_preference(c, pref, scored_pairs, len(pairs))
        score_reward_models(c, cfg, by_input, pairs, where)

    c.higher_is_better = metric_directions(c.scores, c.higher_is_better)  # every metric's, lmforge's own too
    for t in c.tasks.values():  # the result carries them: the pipeline run's summary and `compare` read them
        t["higher_is_better"] = c.higher_is_better.get(t["task"], {})
    gates = check_gates(cfg.gates, c.scores, c.higher_is_better)
    failed = [g["message"] for g in gates if not g["passed"]]
    for g in gates:
        (log.info if g["passed"] else log.error)("%s", g["message"])
    expectations = check_expectations(cfg.expect, c.scores)
    unexpected = [e["message"] for e in expectations.values() if not e["met"]]
    for e in expectations.values():
        (log.info if e["met"] else log.error)("%s", e["message"])
    write_reports(out, cfg, c, gates, expectations)
    result = EvalResult(models=[s.describe() for s in models.values()], eval=c.scores, tasks=list(c.tasks.values()),
                        gates=gates, gates_failed=len(failed), expectations=expectations,
                        expectations_failed=len(unexpected), notes=c.notes)
    log_reports(runtime, out)
    problems = [f"{len(failed)} of {len(gates)} eval gate(s) failed"] if failed else []
    if unexpected and cfg.expect_fails_stage:
        problems.append(f"{len(unexpected)} of {len(expectations)} result(s) outside their expected band")
        failed += unexpected
    if problems:  # after every file and MLflow record: the executor publishes the artifact, then fails the stage
        lines = "\n".join(f"  - {m}" for m in failed)
        raise FailedAfterPublish(f"{' and '.join(problems)}:\n{lines}", result)
    return result


def output_port(cfg: EvalConfig, inputs: list[Port]) -> Port:
    """Model entries read `model` artifacts; perplexity reads text shards/records; preference reads
    preference shards/records. Every input must be used by one of them."""
    ports = dict(zip(cfg.inputs, inputs))
    used: set[str] = set()

    def need(ref: str, what: str, ok: bool, expected: str) -> None:
        if ref not in ports:
            raise ValueError(f"{what} {ref!r} is not one of this stage's inputs ({', '.join(cfg.inputs) or 'none'}); "
                             "add it to inputs")
        if not ok:
            raise ValueError(f"{what} {ref!r} is {ports[ref].describe()}; it needs {expected}")
        used.add(ref)

    for i, m in enumerate(cfg.models):
        if m.input is not None:
            p = ports.get(m.input, Port("?"))
            if p.type == "model" and p.data_kind == "reward":
                raise ValueError(f"models[{i}].input {m.input!r} is a reward model, which scores text and does not "
                                 "generate; list it in preference.reward_models instead")
            need(m.input, f"models[{i}].input", p.type == "model", "a model (the output of a training stage)")
    for i, s in enumerate(cfg.perplexity):
        p = ports.get(s.input, Port("?"))
        need(s.input, f"perplexity[{i}].input", p.type in TEXT_PORTS and p.data_kind == "text",
             "text shards or text records (ingest a raw dataset first)")
    for i, s in enumerate(cfg.chat_loss):
        p = ports.get(s.input, Port("?"))
        need(s.input, f"chat_loss[{i}].input", p.type in TEXT_PORTS and p.data_kind == "chat",
             "chat shards or chat records (ingest a chat dataset first)")
    if cfg.preference is not None:
        p = ports.get(cfg.preference.input, Port("?"))
        need(cfg.preference.input, "preference.input", p.type in TEXT_PORTS and p.data_kind == "preference",
             "preference shards or preference records")
        for j, r in enumerate(cfg.preference.reward_models):
            p = ports.get(r, Port("?"))
            need(r, f"preference.reward_models[{j}]", p.type == "model" and p.data_kind == "reward",
                 "a reward model (the output of a reward stage)")
    unused = [n for n in cfg.inputs if n not in used]
    if unused:
        raise ValueError(f"input(s) {', '.join(unused)} not used; name each in models (input:), perplexity, "
                         "chat_loss or preference")
    return Port("eval")


STAGE = StageDef(kind="eval", version="1", config=EvalConfig, run=run, output_port=output_port, wants_runtime=True,
                 loads_models_here=True,
                 description="models -> eval report: perplexity, lm-eval tasks, preference accuracy, "
                             "control generations, gates", output_type="eval")
