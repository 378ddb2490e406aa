"""The evaluation engine behind the `eval` stage: one model at a time, through lm-eval's `HFLM`.

- `load_lm`: a model folder (+ optional peft adapter) as an lm-eval `HFLM`, loaded once and reused
  for every measurement below.
- `perplexity`: token perplexity and bits per byte of held-out texts, scored by lm-eval's own
  `HFLM.loglikelihood_rolling` (the code path of lm-eval's perplexity tasks such as wikitext).
- `chat_loss`: held-out chat loss, the mean NLL per assistant token (and its perplexity) of chat
  conversations, rendered with the model's own chat template and masked like SFT trains (TRL's
  `assistant_only_loss`: `apply_chat_template(..., return_assistant_tokens_mask=True)`).
- `generate`: greedy control generations.

Preference accuracy is in `preference_accuracy.py`, lm-eval tasks in `lmeval_tasks.py`. No artifacts and
no MLflow here; the stage (`tasks/eval.py`) writes those.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from lmforge.errors import DataError
from lmforge.log import Progress

if TYPE_CHECKING:  # pragma: no cover
    from lm_eval.models.huggingface import HFLM

log = logging.getLogger(__name__)

CHUNK_DOCS = 512  # documents per call into lm-eval, between progress lines


# ----------------------------------------------------------------------------------------------
# models


@dataclass(frozen=True)
class ModelSource:
    """Where one model's files are: a full model folder, or a base folder plus a peft adapter folder."""

    name: str
    path: Path  # full model, or the base an adapter goes on
    tokenizer: Path
    adapter: Path | None = None
    origin: str = ""  # what the config named: a folder, or stage/kind/artifact_id

    def describe(self) -> dict[str, str]:
        out = {"name": self.name, "origin": self.origin, "path": str(self.path), "tokenizer": str(self.tokenizer)}
        if self.adapter:
            out["adapter"] = str(self.adapter)
        return out


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def _chat_hflm() -> type:
    from lm_eval.models.huggingface import HFLM

    class ChatHFLM(HFLM):
        """HFLM whose loglikelihood contexts keep their trailing whitespace when they are chat prompts.

        lm-eval moves a context's trailing whitespace into the continuation (right for "Answer: 7", where the
        space belongs to the answer's first word). A chat prompt ends with the template's generation prompt,
        ChatML's "<|im_start|>assistant\n", whose newline is the template's, not the answer's: moved, it is
        scored as the answer's first token, which a model trained with the loss on assistant tokens only never
        learned, and every loglikelihood target fails its greedy check."""

        chat_contexts = False

        def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            if not self.chat_contexts or context == context.rstrip():
                return super()._encode_pair(context, continuation)
            whole, ctx = self.tok_encode(context + continuation), self.tok_encode(context)
            return ctx, whole[len(ctx):]

    return ChatHFLM


def load_lm(src: ModelSource, *, batch_size: int, device: str | None = None, dtype: str = "auto",
            max_length: int | None = None, chat: bool = False) -> "HFLM":
    """The model as lm-eval's `hf` model (HFLM); an adapter goes through HFLM's own `peft=` loading.
    `chat`: the prompts go through the chat template (see ChatHFLM).

    Later this should take its model from trainer/models.py (hub ids, GGUF, quantized loading) and
    hand the loaded model to HFLM(pretrained=<model>); today it reads local folders only.
    """
    t0 = time.monotonic()
    lm = _chat_hflm()(pretrained=str(src.path), peft=str(src.adapter) if src.adapter else None,
                      tokenizer=str(src.tokenizer), batch_size=batch_size, device=device or default_device(),
                      dtype=dtype, max_length=max_length)
    lm.chat_contexts = chat
    log.info("model %s: loaded %s%s in %.1fs (max_length %d)", src.name, src.path,
             f" + adapter {src.adapter}" if src.adapter else "", time.monotonic() - t0, lm.max_length)
    return lm


def free_lm() -> None:
    """Give back the memory of a model the caller has just deleted."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def format_prompt(lm: "HFLM", text: str | list[dict[str, str]], chat: bool, model: str) -> str:
    """The prompt as the model sees it: as is, or through the tokenizer's chat template: a string as one user turn,
    a list of turns (a multi-turn preference prompt) as they are."""
    if not chat:
        return text if isinstance(text, str) else "\n".join(m["content"] for m in text)
    if not getattr(lm.tokenizer, "chat_template", None):
        raise DataError(f"model {model}", "apply_chat_template is on, but its tokenizer has no chat template",
                        "Turn apply_chat_template off, or evaluate a model whose tokenizer_config.json has one")
    turns = [{"role": "user", "content": text}] if isinstance(text, str) else text
    return lm.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------------------------------------
# perplexity


@dataclass(frozen=True)
class Perplexity:
    docs: int
    tokens: int  # tokens scored: every token of every document (the first one after the prefix token)
    bytes: int  # UTF-8 bytes of the documents
    logprob: float  # natural-log likelihood of all documents, summed
    seconds: float

    @property
    def token_perplexity(self) -> float:
        return math.exp(-self.logprob / self.tokens)

    @property
    def bits_per_byte(self) -> float:
        """Comparable across tokenizers: the same bytes, whatever the tokens."""
        return -self.logprob / (self.bytes * math.log(2))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def perplexity(lm: "HFLM", texts: Sequence[str], what: str = "perplexity") -> Perplexity:
    """Scores each text with lm-eval's `loglikelihood_rolling`: disjoint windows of the model's
    max_length, the first token conditioned on the prefix token (BOS, else EOS), like lm-eval's
    wikitext task; so bits_per_byte equals lm-eval's own `bits_per_byte` on the same texts."""
    from lm_eval.api.instance import Instance

    t0 = time.monotonic()
    progress = Progress(log, what, total=len(texts), unit="docs")
    logprob = 0.0
    for i in range(0, len(texts), CHUNK_DOCS):
        chunk = texts[i:i + CHUNK_DOCS]
        requests = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=0) for t in chunk]
        logprob += float(sum(lm.loglikelihood_rolling(requests, disable_tqdm=True)))
        progress.update(len(chunk))
    seconds = time.monotonic() - t0
    progress.done()
    tokens = sum(len(lm.tok_encode(t)) for t in texts)
    return Perplexity(docs=len(texts), tokens=tokens, bytes=sum(len(t.encode("utf-8")) for t in texts),
                      logprob=logprob, seconds=seconds)


# ----------------------------------------------------------------------------------------------
# held-out chat loss


@dataclass(frozen=True)
class ChatLoss:
    conversations: int  # scored: those with at least one assistant token within max_length
    skipped: int  # conversations with no assistant token within max_length (nothing to score)
    tokens: int  # assistant tokens scored
    nll: float  # mean natural-log NLL per assistant token, over all scored tokens
    nll_stderr: float | None  # ratio-estimator standard error (conversations are the sampling unit)
    seconds: float

    def metrics(self) -> dict[str, float]:
        out = {"assistant_nll": self.nll, "assistant_perplexity": math.exp(self.nll)}
        if self.nll_stderr is not None:  # perplexity's by the delta method: d exp(x) = exp(x) dx
            out.update({"assistant_nll_stderr": self.nll_stderr,
                        "assistant_perplexity_stderr": math.exp(self.nll) * self.nll_stderr})
        return out


def ratio_stderr(sums: Sequence[float], counts: Sequence[int]) -> float | None:
    """Standard error of sum(sums) / sum(counts) when the (sum, count) pairs are the samples: the ratio
    estimator's sqrt(sum (x_i - r n_i)^2 / (k (k-1))) / mean(n). Each conversation is one sample, so a long
    conversation does not count as many independent tokens."""
    k = len(sums)
    if k < 2:
        return None
    r = sum(sums) / sum(counts)
    mean_n = sum(counts) / k
    return math.sqrt(sum((x - r * n) ** 2 for x, n in zip(sums, counts)) / (k * (k - 1))) / mean_n


def assistant_template(tok: Any, conversations: Sequence[list[dict[str, Any]]], model: str) -> str:
    """The chat template that marks assistant tokens, as SFT trains with it: the tokenizer's own when it has
    {% generation %} markers, else the marked copy that renders these conversations byte-identical."""
    from trainer.chat_templates import training_template
    from trainer.errors import SettingError

    if not getattr(tok, "chat_template", None):
        raise DataError(f"model {model}", "chat_loss needs a chat template, and its tokenizer has none",
                        "evaluate chat_loss on models whose tokenizer_config.json has a chat template (a tokenizer "
                        "stage's output or a chat model), or drop chat_loss")
    try:
        return training_template(tok, list(conversations[:20])) or tok.chat_template
    except SettingError as e:
        raise DataError(f"model {model}", f"chat_loss cannot tell assistant tokens: {e}",
                        "use a tokenizer whose chat template has {% generation %} markers") from None


def chat_loss(lm: "HFLM", conversations: Sequence[list[dict[str, Any]]], *, model: str, batch_size: int,
              what: str = "chat loss") -> ChatLoss:
    """NLL per assistant token of each conversation, the way TRL's SFTTrainer computes its training loss with
    `assistant_only_loss=True`: the conversation rendered and tokenized by the chat template with the
    assistant mask, truncated to the first `lm.max_length` tokens, each masked token predicted from the ones
    before it. Rows are batched by length (right padding, ignored by the attention mask)."""
    import torch

    t0 = time.monotonic()
    tok = lm.tokenizer
    template = assistant_template(tok, conversations, model)
    encoded: list[tuple[list[int], list[int]]] = []
    for messages in conversations:
        enc = tok.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, chat_template=template)
        ids, mask = list(enc["input_ids"])[:lm.max_length], list(enc["assistant_masks"])[:lm.max_length]
        encoded.append((ids, mask))
    keep = [i for i, (_ids, mask) in enumerate(encoded) if any(mask[1:])]
    order = sorted(keep, key=lambda i: len(encoded[i][0]))  # similar lengths together: little padding
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    model_ = lm.model
    device = lm.device
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    progress = Progress(log, what, total=len(order), unit="conversations")
    with torch.no_grad():
        for b in range(0, len(order), batch_size):
            rows = order[b:b + batch_size]
            width = max(len(encoded[i][0]) for i in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            amask = torch.zeros((len(rows), width), dtype=torch.bool)
            for j, i in enumerate(rows):
                n = len(encoded[i][0])
                ids[j, :n] = torch.tensor(encoded[i][0])
                attn[j, :n] = 1
                amask[j, :n] = torch.tensor(encoded[i][1], dtype=torch.bool)
            logits = model_(input_ids=ids.to(device), attention_mask=attn.to(device)).logits[:, :-1].float()
            target = ids[:, 1:].to(device)
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            m = amask[:, 1:].to(device)
            for j, i in enumerate(rows):
                sums[i] = float(nll[j][m[j]].sum())
                counts[i] = int(m[j].sum())
            progress.update(len(rows))
    progress.done()
    xs, ns = [sums[i] for i in keep], [counts[i] for i in keep]
    tokens = sum(ns)
    return ChatLoss(conversations=len(keep), skipped=len(encoded) - len(keep), tokens=tokens,
                    nll=sum(xs) / tokens if tokens else float("nan"), nll_stderr=ratio_stderr(xs, ns),
                    seconds=time.monotonic() - t0)


# ----------------------------------------------------------------------------------------------
# control generations


def generate(lm: "HFLM", prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    """Greedy continuations, new text only (special tokens dropped)."""
    import torch

    outs = []
    for p in prompts:
        ids = lm.tok_encode(p)
        room = max(lm.max_length - len(ids), 0)
        if room == 0:
            outs.append("")
            continue
        x = torch.tensor([ids], device=lm.device)
        with torch.no_grad():
            y = lm.model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=min(max_new_tokens, room),
                                  pad_token_id=lm.tokenizer.pad_token_id)
        outs.append(lm.tokenizer.decode(y[0, len(ids):], skip_special_tokens=True))
    return outs
