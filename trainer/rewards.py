"""Reward functions for the grpo stage (GRPO and RLOO), and how a config names them.

A reward function has TRL's signature: `fn(prompts, completions, **kwargs) -> list[float | None]`, one
reward per completion. `prompts` and `completions` are plain strings, or chat messages when the tokenizer
has a chat template (a prompt is a list of turns, a completion `[{"role": "assistant", "content": ...}]`).
The keyword arguments are the dataset's other columns, one value per completion (the grpo stage gives
`answer`: a record's `answer` field, else its demonstrated answer: a preference pair's `chosen`, a chat
record's last assistant turn), plus `completion_ids`, `trainer_state`, `log_extra` and `log_metric` from
TRL. `None` means "not scored" (TRL leaves it out of the mean and of the advantage). Take `**kwargs`.

A config names a function by import path, `module:function` (`trainer.rewards:sum_correct`,
`mypkg.rewards:my_fn`); the module must be importable by the training process too (an installed package,
this repository, or a folder on PYTHONPATH). This module is plain Python (no torch): configs are
checked against it when they are parsed.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib
import inspect
import re
from typing import Any, Callable

_NUMBER = re.compile(r"-?\d+")
_SUM_PROMPT = re.compile(r"what\s+is\s+(-?\d+)\s+plus\s+(-?\d+)\s*\?", re.IGNORECASE)
_SENTENCE_END = ".!?"

#: the functions lmforge ships, for error messages
SHIPPED = ("sum_correct", "answer_match", "answer_form", "one_sentence")


class RewardFunctionError(ValueError):
    """A reward function name that cannot be resolved; the message says what to do."""


# ----------------------------------------------------------------------------------------------
# the shipped reward functions


def text_of(x: Any) -> str:
    """The text of a prompt or completion: a string as is, chat turns -> the last turn's content."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and isinstance(x[-1], dict):
        content = x[-1].get("content", "")
        return content if isinstance(content, str) else ""
    return ""


def last_number(text: str) -> int | None:
    found = _NUMBER.findall(text)
    return int(found[-1]) if found else None


def sum_correct(prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's last number is A + B for a "What is A plus B?" prompt, else 0.0.

    The right sum comes from the prompt itself, so no reference is needed; prompts of another form get
    None (not scored)."""
    out: list[float | None] = []
    for prompt, completion in zip(prompts, completions, strict=True):
        m = _SUM_PROMPT.search(text_of(prompt))
        if m is None:
            out.append(None)
            continue
        out.append(1.0 if last_number(text_of(completion)) == int(m.group(1)) + int(m.group(2)) else 0.0)
    return out


def answer_match(prompts: list, completions: list, answer: list | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 when the completion gives the reference answer (the `answer` column), else 0.0.

    A reference with a number matches on the last number ("3 plus 4 equals 7." -> 7); one without, on the
    whole text, case and spacing ignored. No reference: None (not scored)."""
    def same(got: str, ref: str) -> bool:
        want = last_number(ref)
        if want is not None:
            return last_number(got) == want
        return " ".join(got.lower().split()) == " ".join(ref.lower().split())

    return _against_reference(completions, answer, same)


def _against_reference(completions: list, answer: list | None, same: Callable[[str, str], bool]) -> list[float | None]:
    """1.0 where `same(completion text, reference)`, else 0.0; None where the `answer` column has no reference."""
    refs = answer if answer is not None else [None] * len(completions)
    return [None if not isinstance(ref, str) or not ref.strip() else 1.0 if same(text_of(c), ref) else 0.0
            for c, ref in zip(completions, refs, strict=True)]


def _form(text: str) -> str:
    return " ".join(_NUMBER.sub("N", text.lower()).split())


def answer_form(prompts: list, completions: list, answer: list | None = None, **kwargs: Any) -> list[float | None]:
    """Format: 1.0 when the completion has the reference answer's form (the `answer` column) with its numbers left
    out, else 0.0: case and spacing ignored, every number read as N. "27 plus 5 equals 22." has the form of "27
    plus 5 equals 32."; "32" has the form of "32" but not of the sentence. The format half of the accuracy + format
    pair TRL's GRPO examples use: beside `sum_correct`, which reads only the last number, it keeps the answer in
    the shape the prompt asks for (a bare number after "Answer:", the sentence otherwise). No reference: None."""
    return _against_reference(completions, answer, lambda got, ref: _form(got) == _form(ref))


def one_sentence(prompts: list, completions: list, max_words: int = 20, **kwargs: Any) -> list[float]:
    """Format and length: 1.0 for one non-empty line that ends with one sentence mark (. ! ? but not "..."
    or "?!") in at most `max_words` words, else 0.0. Keeps answers short and finished (no rambling up to
    max_completion_tokens)."""
    out = []
    for completion in completions:
        text = text_of(completion).strip()
        ok = (len(text) >= 2 and "\n" not in text and text[-1] in _SENTENCE_END and text[-2] not in _SENTENCE_END
              and len(text.split()) <= max_words)
        out.append(1.0 if ok else 0.0)
    return out


# ----------------------------------------------------------------------------------------------
# names in configs


def load_reward_function(name: str) -> Callable[..., Any]:
    """`module:function` (the function may be a dotted attribute path) -> the callable.

    Raises RewardFunctionError saying what is wrong and what to write instead."""
    hint = f"write module:function, e.g. trainer.rewards:sum_correct (lmforge ships: {', '.join(SHIPPED)})"
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise RewardFunctionError(f"{name!r} is not an import path; {hint}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  ImportError, or the module itself failing at import
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RewardFunctionError(f"cannot import module {module_name!r} ({type(e).__name__}: {first}); install "
                                  f"the package or put its folder on PYTHONPATH, or {hint}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            have = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")
                          and v.__module__ == module.__name__)
            close = difflib.get_close_matches(attr, have, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RewardFunctionError(f"module {module_name!r} has no {attr!r}{hint}; its functions: "
                                      f"{', '.join(have) or 'none'}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardFunctionError(f"{name!r} is a {type(obj).__name__}, not a function; name a function "
                                  "fn(prompts, completions, **kwargs) -> list[float]")
    return obj


def source_sha256(fn: Callable[..., Any]) -> str | None:
    """sha256 of the function's source (None when Python cannot show it): a changed reward function
    changes the artifact id even under the same name."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(src.encode()).hexdigest()
