"""Prompts of the RL recipes (ppo, grpo): preference or chat records -> the prompts the policy answers.

A preference record gives its `prompt`, a chat record its turns before the last assistant turn; with a chat
template the prompt is chat turns (a preference record's `prompt_messages` keep theirs), otherwise plain text.
Each prompt carries an `answer` for the reward functions: the record's `answer` field, else its demonstrated
answer (`chosen`, or the last assistant turn). Prompts too long to leave room for a completion are skipped and
counted, as the trainers would cut them.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from lmforge.errors import DataError
from lmforge.records import prompt_turns
from lmforge.shards import ShardRef
from trainer import data
from trainer.job import JobSpec

log = logging.getLogger(__name__)


@dataclass
class Prompts:
    """The prompts of one split, tokenized as the policy sees them, and how many records were skipped."""

    rows: list[dict[str, Any]]  # {"prompt": str | list[turn], "answer": str | None, "input_ids": list[int]}
    records: int  # records read from the shards
    too_long: int  # prompt + completion beyond max_length_tokens: skipped


def record_prompt(rec: dict[str, Any], conversational: bool, where: str) -> dict[str, Any]:
    """{"prompt", "answer"} of a preference or chat record."""
    answer = rec.get("answer") if isinstance(rec.get("answer"), str) else None
    if isinstance(rec.get("prompt"), str):
        text = rec["prompt"]
        if answer is None and isinstance(rec.get("chosen"), str):
            answer = rec["chosen"]
        return {"prompt": prompt_turns(rec) if conversational else text, "answer": answer}
    messages = rec.get("messages")
    if isinstance(messages, list) and messages:
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        turns = messages[:last] if last is not None else messages
        if answer is None and last is not None:
            answer = messages[last].get("content")
        if turns:
            turns = [{"role": m["role"], "content": m["content"]} for m in turns]
            return {"prompt": turns if conversational else "\n".join(m["content"] for m in turns), "answer": answer}
    raise DataError(where, f"record {rec.get('id', '?')} has no prompt: neither a string prompt nor chat turns "
                    f"before an assistant turn (fields: {', '.join(sorted(rec))})",
                    "feed this stage preference or chat shards")


def prompt_ids(tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """The prompt's token ids as the trainers feed them: the chat template with the generation prompt, or the
    plain text."""
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def load_prompts(shards: list[ShardRef], where: str, tokenizer, max_length_tokens: int, completion: tuple[str, int],
                 max_records: int | None = None) -> Prompts:
    """The prompts of `shards` that leave room for a completion of `completion` = (setting, tokens) within
    `max_length_tokens`; the others skipped and counted."""
    conversational = bool(tokenizer.chat_template)
    name, completion_tokens = completion
    room = max_length_tokens - completion_tokens
    rows, records, too_long = [], 0, 0
    for rec in data.iter_records(shards):
        if max_records is not None and records >= max_records:
            break
        records += 1
        row = record_prompt(rec, conversational, where)
        ids = prompt_ids(tokenizer, row["prompt"])
        if len(ids) > room:
            too_long += 1
            continue
        rows.append({**row, "input_ids": ids})
    if shards and not records:
        raise DataError(where, "the shards hold no records", "check the upstream stages' drop counts")
    if too_long:
        log.warning("%s: %d of %d prompts are longer than max_length_tokens %d - %s %d and are skipped", where,
                    too_long, records, max_length_tokens, name, completion_tokens)
    log.info("%s: %d prompts from %d shard(s)", where, len(rows), len(shards))
    return Prompts(rows, records, too_long)


def load_splits(spec: JobSpec, tokenizer, s, completion: tuple[str, int], where: str) -> tuple[Prompts, Prompts]:
    """(train prompts, validation prompts) of a job: the train split (at most `max_train_records` records) must
    leave a prompt to train on (else a DataError at `where`); the validation split is read when `s.evaluate`."""
    train = load_prompts(spec.train_shards, f"stage {spec.stage} train split", tokenizer, s.max_length_tokens,
                         completion, s.max_train_records)
    if not train.rows:
        raise DataError(where, f"no prompt is left to train on: {train.records} read, {train.too_long} longer than "
                        f"max_length_tokens - {completion[0]}", f"raise max_length_tokens or lower {completion[0]}")
    evaluation = (load_prompts(spec.validation_shards, f"stage {spec.stage} validation split", tokenizer,
                               s.max_length_tokens, completion)
                  if s.evaluate and spec.validation_shards else Prompts([], 0, 0))
    return train, evaluation


def distinct(rows: list[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    """The rows with distinct prompts, in order, at most `limit` of them."""
    seen, out = set(), []
    for r in rows:
        key = json.dumps(r["prompt"], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out[:limit] if limit is not None else out
