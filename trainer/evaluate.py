"""The evaluation engine behind the `eval` stage: one model at a time, through lm-eval's `HFLM`.

- `load_lm`: a model folder (+ optional peft adapter) as an lm-eval `HFLM`, loaded once and reused
  for every measurement below.
- `perplexity`: token perplexity and bits per byte of held-out texts, scored by lm-eval's own
  `HFLM.loglikelihood_rolling` (the code path of lm-eval's perplexity tasks such as wikitext).
- `chat_loss`: held-out chat loss, the mean NLL per assistant token (and its perplexity) of chat
  conversations, rendered with the model's own chat template and masked like SFT trains (TRL's
  `assistant_only_loss`: `apply_chat_template(..., return_assistant_tokens_mask=True)`).
- `continuation_logprobs` / `implicit_reward_accuracy`: held-out preference accuracy of a policy
  against a reference model (DPO's implicit reward); `loglik_accuracy`: of any model by itself, chosen vs
  rejected log-likelihood per token.
- `reward_model_scores` / `reward_model_accuracy`: held-out preference accuracy of a reward model
  (a `reward` stage's artifact), by its scores of chosen and rejected.
- `generate`: greedy control generations.
- `prepare_task_dirs` / `task_manager` / `check_tasks` / `run_tasks`: lm-eval tasks from YAML folders,
  with data paths made absolute, checked before any model loads, run by `lm_eval.simple_evaluate`.

No artifacts and no MLflow here; `tasks/eval.py` does those.
"""
from __future__ import annotations

import difflib
import functools
import json
import logging
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import yaml

from lmforge.errors import ConfigError, DataError
from lmforge.log import Progress
from lmforge.records import prompt_turns

if TYPE_CHECKING:  # pragma: no cover
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

log = logging.getLogger(__name__)

TASK_FILE_SUFFIXES = (".yaml", ".yml", ".py")  # copied into the work dir; data files stay where they are
TEMPLATE_FIELDS = ("doc_to_text", "doc_to_target", "doc_to_choice")
LOCAL_DATA_SUFFIXES = (".jsonl", ".json")  # data files whose rows check_tasks reads
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
# preference accuracy


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
    acc, acc_se = mean_and_stderr([1.0 if m > 0 else 0.0 for m in margins])
    margin, margin_se = mean_and_stderr(margins)
    out = {"loglik_accuracy": acc, "loglik_margin": margin}
    if acc_se is not None:
        out.update({"loglik_accuracy_stderr": acc_se, "loglik_margin_stderr": margin_se})
    return out


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


def preference_metrics(margins: Sequence[float]) -> dict[str, float]:
    """accuracy (share of pairs with margin > 0: a tie is not a win), mean reward_margin, and their stderrs."""
    acc, acc_se = mean_and_stderr([1.0 if m > 0 else 0.0 for m in margins])
    margin, margin_se = mean_and_stderr(margins)
    out = {"accuracy": acc, "reward_margin": margin}
    if acc_se is not None:
        out.update({"accuracy_stderr": acc_se, "reward_margin_stderr": margin_se})
    return out


def reward_model_scores(folder: Path, pairs: Sequence[dict[str, str]], *, batch_size: int, device: str | None = None,
                        what: str = "reward model") -> PairLogprobs:
    """Reward-model scores of (prompt + chosen, prompt + rejected) for each pair, formatted the way TRL's
    RewardTrainer formats its training pairs: with the tokenizer's chat template (a user turn and an
    assistant turn) when it has one, else prompt + response + EOS as plain text. The reward is the score
    head's output at the last non-pad token (the model pads on the right with its pad_token_id)."""
    import torch

    from trainer.reward import load_reward_model

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


# ----------------------------------------------------------------------------------------------
# lm-eval task folders


class _FunctionRef(str):
    """A `!function module.fn` value of an lm-eval YAML, kept as written when the YAML is rewritten."""


class _TaskLoader(yaml.SafeLoader):
    pass


class _TaskDumper(yaml.SafeDumper):
    pass


_TaskLoader.add_constructor("!function", lambda loader, node: _FunctionRef(loader.construct_scalar(node)))
_TaskDumper.add_representer(_FunctionRef, lambda dumper, v: dumper.represent_scalar("!function", str(v)))


def prepare_task_dirs(dirs: Sequence[Path], work: Path) -> list[Path]:
    """Copies each task folder's YAML and Python files to `work/<i>-<name>/`, with every relative path
    in `dataset_kwargs.data_files`, `dataset_kwargs.data_dir` and `dataset_path` made absolute against
    the folder of the YAML that wrote it (lm-eval itself resolves them against the working directory).
    Data files are not copied. Returns the copies, in order (later folders win on equal task names)."""
    out = []
    for i, src in enumerate(dirs):
        if not src.is_dir():
            raise DataError(str(src), "task folder does not exist",
                            "Give a folder of lm-eval task YAML files in task_dirs (absolute, or relative to "
                            "the working directory)")
        dst = work / f"{i}-{src.name}"
        for f in sorted(src.rglob("*")):
            rel = f.relative_to(src)
            if not f.is_file() or f.suffix not in TASK_FILE_SUFFIXES or any(
                    p.startswith(".") or p == "__pycache__" for p in rel.parts):
                continue
            target = dst / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if f.suffix == ".py":
                shutil.copyfile(f, target)
            else:
                _write_resolved_yaml(f, target)
        out.append(dst)
    return out


def _write_resolved_yaml(src: Path, dst: Path) -> None:
    text = src.read_text(encoding="utf-8")
    try:
        cfg = yaml.load(text, Loader=_TaskLoader)  # noqa: S506 - a SafeLoader plus the !function tag
    except yaml.YAMLError as e:
        raise DataError(str(src), f"not valid lm-eval task YAML: {e}", "Fix the file") from None
    changed = False
    if isinstance(cfg, dict):
        base = src.parent
        kwargs = cfg.get("dataset_kwargs")
        if isinstance(kwargs, dict):
            for key in ("data_files", "data_dir"):
                if key in kwargs:
                    resolved = _resolve_paths(kwargs[key], base, f"{src}: dataset_kwargs.{key}")
                    changed |= resolved != kwargs[key]
                    kwargs[key] = resolved
        dp = cfg.get("dataset_path")
        if isinstance(dp, str) and "://" not in dp and (dp.startswith(".") or (base / dp).exists()):
            cfg["dataset_path"] = _resolve_paths(dp, base, f"{src}: dataset_path")
            changed |= cfg["dataset_path"] != dp
    if changed:
        header = f"# resolved copy of {src}: relative data paths made absolute by lmforge\n"
        dst.write_text(header + yaml.dump(cfg, Dumper=_TaskDumper, sort_keys=False, allow_unicode=True),
                       encoding="utf-8")
    else:
        dst.write_text(text, encoding="utf-8")


def _resolve_paths(value: Any, base: Path, where: str) -> Any:
    if isinstance(value, dict):
        return {k: _resolve_paths(v, base, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_paths(v, base, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str) or "://" in value:
        return value
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base / path
    if any(c in value for c in "*?["):
        if not list(path.parent.glob(path.name)):
            raise DataError(where, f"{value!r} matches no file (looked for {path})",
                            "Fix the pattern; paths in a task YAML resolve against the YAML's folder")
        return str(path)
    if not path.exists():
        raise DataError(where, f"{value!r} does not exist (looked for {path.resolve()})",
                        "Fix the path; paths in a task YAML resolve against the YAML's folder")
    return str(path.resolve())


def task_manager(include: Sequence[Path], names: Sequence[str], where: str = "tasks") -> "TaskManager":
    """A TaskManager over `include` that knows every name in `names`. lm-eval's built-in index
    (thousands of YAML files, seconds to build) is only added when a name is not in `include`.
    Raises ConfigError naming each unknown task."""
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in include]
    tm = TaskManager(include_path=paths, include_defaults=False)
    if all(n in tm.all_tasks for n in names):
        return tm
    local = tm.all_tasks
    tm = TaskManager(include_path=paths, include_defaults=True)
    problems = []
    for i, n in enumerate(names):
        if n not in tm.all_tasks:
            close = difflib.get_close_matches(n, tm.all_tasks, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{where}[{i}]: lm-eval does not know task {n!r}{hint}. Tasks in the task folders: "
                            f"{', '.join(local) or 'none'}; others come from lm-eval (`lm-eval ls tasks`). Add the "
                            "folder with its YAML to task_dirs, or fix the name")
    if problems:
        raise ConfigError(problems)
    return tm


def check_tasks(tm: "TaskManager", names: Sequence[str], include: Sequence[Path], sources: Sequence[Path]) -> None:
    """Before any model loads: every task from the local folders uses only lm-eval's built-in
    (offline) metrics, and every row of its local JSON data has each column its templates use.
    `include` are the resolved copies of the folders `sources` (errors name the original YAML)."""
    from lm_eval.api import registry
    from lm_eval.tasks._yaml_loader import load_yaml

    if len(registry.metric_registry) == 0:
        import lm_eval.api.metrics  # noqa: F401  (fills the registry)
    roots = [(p.resolve(), src) for p, src in zip(include, sources, strict=True)]
    for name in names:
        entry = tm.task_index.get(name)
        path = getattr(entry, "yaml_path", None)
        origin = next((src / Path(path).resolve().relative_to(r) for r, src in roots
                       if path is not None and Path(path).resolve().is_relative_to(r)), None)
        if origin is None:
            continue  # a group, a Python task or one of lm-eval's own: lm-eval checks those
        cfg = load_yaml(Path(path), resolve_func=False, recursive=True)
        if not isinstance(cfg, dict) or "task" not in cfg:
            continue
        where = f"task {name} ({origin})"
        for m in cfg.get("metric_list") or []:
            metric = m.get("metric") if isinstance(m, dict) else None
            if isinstance(metric, str) and not metric.startswith("/") and metric not in registry.metric_registry:
                raise DataError(where, f"metric {metric!r} is not one of lm-eval's built-in metrics "
                                f"({', '.join(sorted(registry.metric_registry.keys()))})",
                                "lmforge evaluates offline, and other metrics would be fetched from the Hugging "
                                "Face hub; use a built-in metric or a !function")
        if cfg.get("process_docs"):
            continue  # columns may be made by process_docs; lm-eval reports what is missing
        needed = _template_columns(cfg)
        if needed:
            for f in _local_data_files(cfg):
                _check_rows(f, needed, where)


def _template_columns(cfg: dict[str, Any]) -> dict[str, list[str]]:
    """{column: [fields that use it]} for the Jinja templates (and bare column names) of a task."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment()
    out: dict[str, list[str]] = {}
    for field in TEMPLATE_FIELDS:
        value = cfg.get(field)
        if not isinstance(value, str) or isinstance(value, _FunctionRef) or value.startswith("/"):
            continue  # a literal list/dict, or a function (load_yaml gives its absolute path)
        if "{{" in value or "{%" in value:
            cols = meta.find_undeclared_variables(env.parse(value))
        elif field != "doc_to_text" and re.fullmatch(r"[A-Za-z_]\w*", value):
            cols = {value}  # a bare column name (lm-eval also accepts a literal target here; rare)
        else:
            continue
        for c in sorted(cols):
            out.setdefault(c, []).append(field)
    return out


def _local_data_files(cfg: dict[str, Any]) -> list[Path]:
    kwargs = cfg.get("dataset_kwargs") or {}
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    flat: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str):
            flat.append(v)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(files)
    return [Path(f) for f in flat if Path(f).is_absolute() and Path(f).suffix in LOCAL_DATA_SUFFIXES
            and Path(f).is_file()]


def _check_rows(path: Path, needed: dict[str, list[str]], where: str) -> None:
    with open(path, encoding="utf-8") as fh:
        if path.suffix == ".json":
            try:
                data = json.load(fh)
            except json.JSONDecodeError:
                return  # lm-eval's loader reports it
            rows = enumerate(data if isinstance(data, list) else [], start=1)
            unit = "item"
        else:
            rows = ((i, json.loads(line)) for i, line in enumerate(fh, start=1) if line.strip())
            unit = "line"
        for i, row in rows:
            if not isinstance(row, dict):
                continue
            for col, fields in needed.items():
                if row.get(col) is None:
                    have = ", ".join(sorted(k for k, v in row.items() if v is not None)) or "none"
                    raise DataError(f"{path}:{i}" if unit == "line" else f"{path} item {i}",
                                    f"{where} uses column {col!r} in {' and '.join(fields)}, which this row does "
                                    f"not have (columns: {have})",
                                    f"Add {col!r} to every row, or change the task's template")


# ----------------------------------------------------------------------------------------------
# running lm-eval


@dataclass
class TaskScores:
    """One model's lm-eval results, flattened: {task: {metric: value}} with `<metric>_stderr` beside
    each metric that has one. Metric names drop lm-eval's `,none` filter suffix; any other filter
    becomes `<metric>_<filter>`."""

    metrics: dict[str, dict[str, float]]
    higher_is_better: dict[str, dict[str, bool]]
    samples: dict[str, dict[str, int]]  # task -> {"original": docs, "effective": evaluated}
    versions: dict[str, Any]
    n_shot: dict[str, Any]
    main_metric: dict[str, str]  # task -> its first metric, for the chart


def run_tasks(lm: "HFLM", tm: "TaskManager", names: Sequence[str], *, num_fewshot: int | None, limit: int | None,
              seed: int, batch_size: int, bootstrap_iters: int, apply_chat_template: bool) -> dict[str, Any]:
    """lm_eval.simple_evaluate on an already-loaded HFLM, every seed pinned to `seed`."""
    import lm_eval

    # lm-eval's bootstrap stderr forks a process pool per metric; inside a pipeline's threads that
    # is slow and can hang, so it runs in-process (same numbers)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    return lm_eval.simple_evaluate(
        model=lm, tasks=list(names), task_manager=tm, num_fewshot=num_fewshot, limit=limit, batch_size=batch_size,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        bootstrap_iters=bootstrap_iters, log_samples=False, apply_chat_template=apply_chat_template)


def metric_name(key: str) -> tuple[str, str, bool]:
    """lm-eval's result key -> (lmforge name, lm-eval metric, is a stderr): "acc,none" -> ("acc", "acc",
    False); "exact_match_stderr,strict-match" -> ("exact_match_strict-match_stderr", "exact_match", True)."""
    metric, _, flt = key.partition(",")
    base = metric.removesuffix("_stderr")
    name = base if flt in ("", "none") else f"{base}_{flt}"
    is_stderr = metric != base
    return safe_name(name + ("_stderr" if is_stderr else "")), base, is_stderr


def safe_name(s: str) -> str:
    """Characters MLflow allows in a metric name path segment (no '/')."""
    return re.sub(r"[^A-Za-z0-9_.\- ]", "_", s)


def flatten_results(results: dict[str, Any]) -> TaskScores:
    metrics: dict[str, dict[str, float]] = {}
    higher: dict[str, dict[str, bool]] = {}
    main: dict[str, str] = {}
    hib = results.get("higher_is_better", {})
    for section in ("results", "groups"):
        for task, vals in (results.get(section) or {}).items():
            t = safe_name(task)
            for key, v in vals.items():
                if "," not in key or isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                    continue  # alias, name, sample_len, "N/A" stderrs
                name, base, is_stderr = metric_name(key)
                metrics.setdefault(t, {})[name] = float(v)
                if is_stderr:
                    continue
                main.setdefault(t, name)
                if base in hib.get(task, {}):
                    higher.setdefault(t, {})[name] = bool(hib[task][base])
    samples = {safe_name(t): {"original": int(s["original"]), "effective": int(s["effective"])}
               for t, s in (results.get("n-samples") or {}).items()}
    return TaskScores(metrics=metrics, higher_is_better=higher, samples=samples,
                      versions={safe_name(t): v for t, v in (results.get("versions") or {}).items()},
                      n_shot={safe_name(t): v for t, v in (results.get("n-shot") or {}).items()}, main_metric=main)


def write_results_json(results: dict[str, Any], path: Path, extra: dict[str, Any]) -> None:
    from lm_eval.utils import handle_non_serializable

    body = {**results, "lmforge": extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2, default=handle_non_serializable, ensure_ascii=False), encoding="utf-8")

