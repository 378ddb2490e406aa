"""Scoring for the eval stage: each measurement of one loaded model, gathered into `Collected` (scores,
directions, task details, generations, notes) for the Result and the reports.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.records import prompt_turns
from lmforge.stage import Input
from tasks.evaluation.config import ChatLossSet, EvalConfig, PerplexitySet, PreferenceEval
from tasks.evaluation.engine import chat_loss, format_prompt, perplexity
from tasks.evaluation.lmeval_tasks import flatten_results, run_tasks, write_results_json
from tasks.evaluation.models import reward_model_folder
from tasks.evaluation.preference_accuracy import (PairLogprobs, continuation_logprobs, continuation_tokens,
                                                  implicit_reward_accuracy, loglik_accuracy, reward_model_accuracy,
                                                  reward_model_scores)

if TYPE_CHECKING:  # pragma: no cover
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

log = logging.getLogger(__name__)

MAIN_METRIC = {"perplexity": "bits_per_byte", "preference": "accuracy", "chat_loss": "assistant_nll"}


@dataclass
class Collected:
    """What the stage gathers, model by model, for the Result and the reports."""

    scores: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # model -> task -> metric -> value
    higher_is_better: dict[str, dict[str, bool]] = field(default_factory=dict)  # from lm-eval's results
    main_metric: dict[str, str] = field(default_factory=dict)  # task -> the metric its chart panel shows
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    generations: dict[str, list[str]] = field(default_factory=dict)
    pair_logprobs: dict[str, PairLogprobs] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def score_perplexity(c: Collected, model: str, lm: "HFLM", s: PerplexitySet, texts: list[str]) -> None:
    p = perplexity(lm, texts, what=f"{model}: {s.name}")
    c.scores[model][s.name] = {"token_perplexity": p.token_perplexity, "bits_per_byte": p.bits_per_byte}
    info = c.tasks.setdefault(s.name, {"task": s.name, "kind": "perplexity", "input": s.input, "split": s.split,
                                       "documents": p.docs, "bytes": p.bytes, "tokens": {}})
    info["tokens"][model] = p.tokens
    c.main_metric.setdefault(s.name, MAIN_METRIC["perplexity"])
    log.info("model %s: %s token perplexity %.4f, %.4f bits/byte (%d docs, %d tokens, %.0f tokens/s)", model, s.name,
             p.token_perplexity, p.bits_per_byte, p.docs, p.tokens, p.tokens_per_second)


def score_chat_loss(c: Collected, model: str, lm: "HFLM", s: ChatLossSet, convs: list[list[dict[str, Any]]],
                    batch_size: int) -> None:
    r = chat_loss(lm, convs, model=model, batch_size=batch_size, what=f"{model}: {s.name}")
    c.scores[model][s.name] = r.metrics()
    info = c.tasks.setdefault(s.name, {"task": s.name, "kind": "chat_loss", "input": s.input, "split": s.split,
                                       "conversations": len(convs), "assistant_tokens": {}, "skipped": {}})
    info["assistant_tokens"][model] = r.tokens
    info["skipped"][model] = r.skipped
    if r.skipped:
        c.note(f"{s.name}: {model}: {r.skipped} conversation(s) have no assistant token within the model's "
               f"max_length {lm.max_length} and are not scored")
    c.main_metric.setdefault(s.name, MAIN_METRIC["chat_loss"])
    log.info("model %s: %s %.4f nats per assistant token (perplexity %.3f) over %d tokens of %d conversations, "
             "%.1fs", model, s.name, r.nll, math.exp(r.nll), r.tokens, r.conversations, r.seconds)


def score_tasks(c: Collected, model: str, lm: "HFLM", cfg: EvalConfig, tm: "TaskManager", results_json: Path,
                describe: dict[str, str]) -> None:
    results = run_tasks(lm, tm, cfg.tasks, num_fewshot=cfg.num_fewshot, limit=cfg.limit, seed=cfg.seed,
                        batch_size=cfg.batch_size, bootstrap_iters=cfg.bootstrap_iters,
                        apply_chat_template=cfg.apply_chat_template)
    pinned = {k: getattr(cfg, k) for k in ("num_fewshot", "batch_size", "limit", "seed", "bootstrap_iters",
                                           "apply_chat_template", "dtype", "max_length")}
    write_results_json(results, results_json, {"model": describe, **pinned})
    flat = flatten_results(results)
    c.scores[model].update(flat.metrics)
    for task, d in flat.higher_is_better.items():
        c.higher_is_better.setdefault(task, {}).update(d)
    for task, metric in flat.main_metric.items():
        c.main_metric.setdefault(task, metric)
    for task, n in flat.samples.items():
        c.tasks.setdefault(task, {"task": task, "kind": "lm-eval", "version": flat.versions.get(task),
                                  "num_fewshot": flat.n_shot.get(task), "documents": n["original"],
                                  "evaluated": n["effective"], "higher_is_better": flat.higher_is_better.get(task, {})})
        if cfg.limit and cfg.limit > n["original"]:
            c.note(f"{task}: limit {cfg.limit} is more than its {n['original']} documents; lm-eval evaluated "
                   f"all {n['effective']}")


def score_pairs(c: Collected, model: str, lm: "HFLM", cfg: EvalConfig, pairs: list[dict[str, str]]) -> None:
    sep = "" if cfg.apply_chat_template else cfg.preference.prompt_separator
    contexts = [format_prompt(lm, prompt_turns(r) if cfg.apply_chat_template else r["prompt"],
                              cfg.apply_chat_template, model) + sep for r in pairs]
    what = f"{model}: {cfg.preference.name}"
    chosen_pairs = [(ctx, r["chosen"]) for ctx, r in zip(contexts, pairs)]
    rejected_pairs = [(ctx, r["rejected"]) for ctx, r in zip(contexts, pairs)]
    chosen = continuation_logprobs(lm, chosen_pairs, f"{what} chosen")
    rejected = continuation_logprobs(lm, rejected_pairs, f"{what} rejected")
    c.pair_logprobs[model] = PairLogprobs(chosen, rejected, continuation_tokens(lm, chosen_pairs),
                                          continuation_tokens(lm, rejected_pairs))


def score_preference(c: Collected, pref: PreferenceEval, scored: list[str], n_pairs: int) -> None:
    """Every model by itself: loglik_accuracy (unless `loglik: false`); policies: implicit DPO reward against the
    reference (their log-probs were gathered model by model)."""
    if pref.loglik:
        for model, lp in c.pair_logprobs.items():
            c.scores[model].setdefault(pref.name, {}).update(loglik_accuracy(lp))
    if pref.reference is not None:
        ref = c.pair_logprobs[pref.reference]
        for model in scored:
            c.scores[model].setdefault(pref.name, {}).update(
                implicit_reward_accuracy(c.pair_logprobs[model], ref, pref.beta))
    # accuracy: the policies' implicit reward, or (no policies, no loglik) the reward models' own
    c.main_metric[pref.name] = MAIN_METRIC["preference"] if scored or not pref.loglik else "loglik_accuracy"
    c.tasks[pref.name] = {"task": pref.name, "kind": "preference", "input": pref.input, "split": pref.split,
                          "reference": pref.reference, "beta": pref.beta, "pairs": n_pairs,
                          "implicit_dpo": scored, "reward_models": list(pref.reward_models),
                          "loglik": sorted(c.pair_logprobs) if pref.loglik else []}


def score_reward_models(c: Collected, cfg: EvalConfig, by_input: dict[str, Input], pairs: list[dict[str, str]],
                        where: str) -> None:
    """Each reward artifact scores chosen and rejected itself; its row is named after its stage."""
    pref = cfg.preference
    for stage in pref.reward_models:
        folder = reward_model_folder(by_input[stage], f"{where}preference.reward_models")
        scores = reward_model_scores(folder, pairs, batch_size=cfg.batch_size, device=cfg.device,
                                     what=f"{stage}: {pref.name}")
        c.scores[stage] = {pref.name: reward_model_accuracy(scores)}
        log.info("reward model %s: %s accuracy %.4f, mean margin %.4f", stage, pref.name,
                 c.scores[stage][pref.name]["accuracy"], c.scores[stage][pref.name]["reward_margin"])
