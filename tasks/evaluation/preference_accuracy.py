"""Held-out preference accuracy, for the `preference:` section of the eval stage.

- `continuation_logprobs` / `implicit_reward_accuracy`: of a policy against a reference model (DPO's
  implicit reward); `loglik_accuracy`: of any model by itself, chosen vs rejected log-likelihood per token.
- `reward_model_scores` / `reward_model_accuracy`: of a reward model (a `reward` stage's artifact), by its
  scores of chosen and rejected.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from lmforge.log import Progress
from lmforge.records import prompt_turns
from tasks.evaluation.engine import CHUNK_DOCS, default_device, free_lm

if TYPE_CHECKING:  # pragma: no cover
    from lm_eval.models.huggingface import HFLM

log = logging.getLogger(__name__)


def continuation_logprobs(lm: "HFLM", pairs: Sequence[tuple[str, str]], what: str = "logprobs") -> list[float]:
    """log p(continuation | context) per pair, through lm-eval's `loglikelihood` (its tokenization of
    context/continuation pairs: trailing context whitespace moves onto the continuation)."""
    from lm_eval.api.instance import Instance

    progress = Progress(log, what, total=len(pairs), unit="pairs")
    out: list[float] = []
    for i in range(0, len(pairs), CHUNK_DOCS):
        chunk = pairs[i:i + CHUNK_DOCS]
        requests = [Instance(request_type="loglikelihood", doc={}, arguments=(c, x), idx=0) for c, x in chunk]
        out += [float(ll) for ll, _greedy in lm.loglikelihood(requests, disable_tqdm=True)]
        progress.update(len(chunk))
    progress.done()
    return out


@dataclass(frozen=True)
class PairLogprobs:
    chosen: list[float]
    rejected: list[float]
    chosen_tokens: list[int] | None = None  # continuation lengths in tokens, where known
    rejected_tokens: list[int] | None = None


def continuation_tokens(lm: "HFLM", pairs: Sequence[tuple[str, str]]) -> list[int]:
    """How many tokens each continuation is, tokenized as `loglikelihood` tokenizes the pair."""
    return [len(lm._encode_pair(c, x)[1]) for c, x in pairs]


def loglik_accuracy(p: PairLogprobs) -> dict[str, float]:
    """A model by itself, no reference: a pair counts as preferred when the chosen response's log-likelihood
    per token is higher than the rejected one's (length-normalised, so a short answer does not win by being
    short). `loglik_margin` is the mean per-token difference in nats."""
    margins = [c / max(nc, 1) - r / max(nr, 1) for c, r, nc, nr in
               zip(p.chosen, p.rejected, p.chosen_tokens, p.rejected_tokens, strict=True)]
    return preference_metrics(margins, accuracy="loglik_accuracy", margin="loglik_margin")


def mean_and_stderr(xs: Sequence[float]) -> tuple[float, float | None]:
    """Mean and its standard error, as lm-eval computes them for `mean` metrics (sample stddev / sqrt n)."""
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


def implicit_reward_accuracy(policy: PairLogprobs, reference: PairLogprobs, beta: float) -> dict[str, float]:
    """DPO's implicit reward r(x, y) = beta * (log pi(y|x) - log ref(y|x)). A pair counts as preferred
    when r(chosen) > r(rejected) strictly (a tie, e.g. policy == reference, is not a win)."""
    margins = [beta * ((pc - rc) - (pr - rr)) for pc, rc, pr, rr in
               zip(policy.chosen, reference.chosen, policy.rejected, reference.rejected, strict=True)]
    return preference_metrics(margins)


def preference_metrics(margins: Sequence[float], accuracy: str = "accuracy",
                       margin: str = "reward_margin") -> dict[str, float]:
    """`accuracy` (share of pairs with margin > 0: a tie is not a win), the mean `margin`, and their stderrs,
    under the names given."""
    acc, acc_se = mean_and_stderr([1.0 if m > 0 else 0.0 for m in margins])
    mean_margin, margin_se = mean_and_stderr(margins)
    out = {accuracy: acc, margin: mean_margin}
    if acc_se is not None:
        out.update({f"{accuracy}_stderr": acc_se, f"{margin}_stderr": margin_se})
    return out


def reward_model_scores(folder: Path, pairs: Sequence[dict[str, str]], *, batch_size: int, device: str | None = None,
                        what: str = "reward model") -> PairLogprobs:
    """Reward-model scores of (prompt + chosen, prompt + rejected) for each pair, formatted the way TRL's
    RewardTrainer formats its training pairs: with the tokenizer's chat template (a user turn and an
    assistant turn) when it has one, else prompt + response + EOS as plain text. The reward is the score
    head's output at the last non-pad token (the model pads on the right with its pad_token_id)."""
    import torch

    from trainer.preference import load_reward_model

    model, tok = load_reward_model(folder)
    device = device or default_device()
    model.to(device).eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    chat = bool(tok.chat_template)

    def ids(pair: dict[str, Any], response: str) -> list[int]:
        if chat:  # a multi-turn prompt keeps its turns (records' prompt_messages)
            out = tok.apply_chat_template(prompt_turns(pair) + [{"role": "assistant", "content": response}],
                                          tokenize=True, return_dict=True)
            return list(out["input_ids"])
        eos = tok.eos_token or ""
        return tok(pair["prompt"] + response + ("" if response.endswith(eos) else eos))["input_ids"]

    texts = [ids(r, r["chosen"]) for r in pairs] + [ids(r, r["rejected"]) for r in pairs]
    scores: list[float] = []
    progress = Progress(log, what, total=len(texts), unit="sequences")
    for i in range(0, len(texts), batch_size):
        batch = tok.pad({"input_ids": texts[i:i + batch_size]}, return_tensors="pt").to(device)
        with torch.no_grad():
            scores += model(**batch).logits[:, 0].float().tolist()
        progress.update(len(texts[i:i + batch_size]))
    progress.done()
    del model
    free_lm()
    return PairLogprobs(scores[:len(pairs)], scores[len(pairs):])


def reward_model_accuracy(scores: PairLogprobs) -> dict[str, float]:
    """Preferred when score(chosen) > score(rejected); the margin is in the reward model's units."""
    return preference_metrics([c - r for c, r in zip(scores.chosen, scores.rejected, strict=True)])
