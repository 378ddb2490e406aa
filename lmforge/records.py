"""Record schemas per data kind, and the records artifact layout shared by data stages.

Kinds and their normalized record (every record also carries a stable `id`):
- text:       {"text": str}
- chat:       {"messages": [{"role": system|user|assistant|tool, "content": str}, ...]}
              also read from ShareGPT `conversations`, Alpaca instruction/input/output(/system/history) rows
              and TRL prompt/completion rows (strings or message lists); see CHAT_LAYOUTS
- preference: {"prompt": str, "chosen": str, "rejected": str}, plus "prompt_messages": [messages] when the
              prompt is more than one user turn (multi-turn, system); see PREFERENCE_LAYOUTS and preference_record

A records artifact stores them as `records/part-NNNNN.jsonl`, UTF-8, one JSON object per line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from lmforge.errors import DataError
from lmforge.store import Artifact

ROLES = ("system", "user", "assistant", "tool")
#: ShareGPT speaker -> role. LLaMA-Factory's function_call is the assistant calling a tool (content: the call's
#: JSON), observation the tool's answer.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}
PART_DIR = "records"

CHAT_LAYOUTS = ("'messages' [{role, content}]; ShareGPT 'conversations' [{from, value}] (+ 'system'); Alpaca "
                "'instruction'/'input'/'output' (+ 'system', 'history' [[user, assistant], ...]); TRL 'prompt'/"
                "'completion' (strings or message lists)")
PREFERENCE_LAYOUTS = ("'prompt'/'chosen'/'rejected' strings; TRL conversational 'prompt' [messages] with 'chosen'/"
                      "'rejected' [one assistant message]; implicit prompt: 'chosen'/'rejected' full conversations "
                      "equal up to their last (assistant) message; LLaMA-Factory 'conversations' [{from, value}] "
                      "with 'chosen'/'rejected' {from, value} (+ 'system')")


class SchemaError(ValueError):
    """A row that does not fit its kind's schema; the message says which field and why."""


def _col(row: dict[str, Any], field: str, columns: dict[str, str]) -> str:
    return columns.get(field, field)


def _fields(row: dict[str, Any]) -> str:
    return ", ".join(sorted(map(str, row))) or "none"


def _string(row: dict[str, Any], field: str, columns: dict[str, str]) -> str:
    col = _col(row, field, columns)
    if col not in row:
        raise SchemaError(f"missing field {col!r} (have: {_fields(row)})")
    v = row[col]
    if not isinstance(v, str):
        raise SchemaError(f"field {col!r} must be a string, got {type(v).__name__}")
    return v


def _message(m: Any, where: str) -> dict[str, str]:
    """One {role, content} from an OpenAI-style {role, content} or a ShareGPT {from, value} object."""
    if not isinstance(m, dict):
        raise SchemaError(f"{where} must be an object with role and content (or from and value)")
    if "from" in m and "value" in m:  # ShareGPT
        role, content = SHAREGPT_ROLES.get(m["from"], m["from"]), m["value"]
    else:
        role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise SchemaError(f"{where}.role must be one of {', '.join(ROLES)} (ShareGPT: {', '.join(SHAREGPT_ROLES)}), "
                          f"got {role!r}")
    if not isinstance(content, str):
        raise SchemaError(f"{where}.content must be a string, got {type(content).__name__}")
    return {"role": role, "content": content}


def _messages(raw: Any, col: str) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise SchemaError(f"field {col!r} must be a non-empty list of messages")
    return [_message(m, f"{col}[{i}]") for i, m in enumerate(raw)]


def _system(row: dict[str, Any]) -> list[dict[str, str]]:
    """A top-level 'system' string (Alpaca, ShareGPT, LLaMA-Factory) as a leading system message."""
    v = row.get("system")
    if v is None or v == "":
        return []
    if not isinstance(v, str):
        raise SchemaError(f"field 'system' must be a string, got {type(v).__name__}")
    return [{"role": "system", "content": v}]


def _alpaca(row: dict[str, Any], columns: dict[str, str]) -> list[dict[str, str]]:
    instruction = _string(row, "instruction", columns)
    extra = row.get(_col(row, "input", columns)) or ""
    if not isinstance(extra, str):
        raise SchemaError(f"field {_col(row, 'input', columns)!r} must be a string")
    msgs = _system(row)
    history = row.get("history") or []
    if not isinstance(history, list):
        raise SchemaError(f"field 'history' must be a list of [user, assistant] pairs, got {type(history).__name__}")
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
            raise SchemaError(f"history[{i}] must be a [user, assistant] pair of strings")
        msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return msgs + [{"role": "user", "content": user},
                   {"role": "assistant", "content": _string(row, "output", columns)}]


def _turns(row: dict[str, Any], field: str, columns: dict[str, str], role: str) -> list[dict[str, str]]:
    """A TRL field: a plain string (one `role` turn) or a message list."""
    col = _col(row, field, columns)
    v = row[col]
    if isinstance(v, str):
        return [{"role": role, "content": v}]
    return _messages(v, col)


def _chat(row: dict[str, Any], columns: dict[str, str]) -> list[dict[str, str]]:
    col = _col(row, "messages", columns)
    if col in row:
        return _messages(row[col], col)
    if "conversations" in row:  # ShareGPT
        return _system(row) + _messages(row["conversations"], "conversations")
    if _col(row, "instruction", columns) in row:  # Alpaca
        return _alpaca(row, columns)
    if _col(row, "prompt", columns) in row and _col(row, "completion", columns) in row:  # TRL prompt-completion
        return _turns(row, "prompt", columns, "user") + _turns(row, "completion", columns, "assistant")
    raise SchemaError(f"no chat layout fits (have: {_fields(row)}); expected one of: {CHAT_LAYOUTS}")


def _answer(v: Any, col: str) -> str:
    """A preference completion: a string, one assistant message, or a list holding one assistant message."""
    if isinstance(v, str):
        return v
    if not isinstance(v, (dict, list)):
        raise SchemaError(f"field {col!r} must be a string, got {type(v).__name__}")
    msgs = [_message(v, col)] if isinstance(v, dict) else _messages(v, col)
    if len(msgs) != 1 or msgs[0]["role"] != "assistant":
        raise SchemaError(f"field {col!r} must be one assistant message, got "
                          f"{', '.join(m['role'] for m in msgs)}")
    return msgs[0]["content"]


def _preference(row: dict[str, Any], columns: dict[str, str]) -> dict[str, Any]:
    p, c, r = (_col(row, f, columns) for f in ("prompt", "chosen", "rejected"))
    if c not in row or r not in row:
        raise SchemaError(f"missing field {c if c not in row else r!r} (have: {_fields(row)}); "
                          f"expected one of: {PREFERENCE_LAYOUTS}")
    if p in row:  # flat strings, or TRL conversational
        v = row[p]
        if not isinstance(v, (str, list)):
            raise SchemaError(f"field {p!r} must be a string or a list of messages, got {type(v).__name__}")
        prompt = [{"role": "user", "content": v}] if isinstance(v, str) else _messages(v, p)
        chosen, rejected = _answer(row[c], c), _answer(row[r], r)
    elif "conversations" in row:  # LLaMA-Factory ShareGPT pairs
        prompt = _system(row) + _messages(row["conversations"], "conversations")
        chosen, rejected = _answer(row[c], c), _answer(row[r], r)
    elif isinstance(row[c], list) and isinstance(row[r], list):  # implicit prompt
        cm, rm = _messages(row[c], c), _messages(row[r], r)
        if cm[:-1] != rm[:-1] or len(cm) < 2:
            at = next((i for i, (a, b) in enumerate(zip(cm, rm)) if a != b), min(len(cm), len(rm)))
            raise SchemaError(f"implicit-prompt row: {c!r} and {r!r} must be the same conversation up to their last "
                              f"message, and hold a prompt before it; they differ at message {at} "
                              f"({len(cm)} vs {len(rm)} messages)")
        prompt = cm[:-1]
        chosen, rejected = _answer(cm[-1:], f"{c}[-1]"), _answer(rm[-1:], f"{r}[-1]")
    else:
        raise SchemaError(f"missing field {p!r} (have: {_fields(row)}); expected one of: {PREFERENCE_LAYOUTS}")
    if not prompt or prompt[-1]["role"] == "assistant":
        raise SchemaError("the prompt must end with a user (or tool) turn, before the chosen and rejected answers")
    return preference_record(prompt, chosen, rejected)


def preference_record(prompt: list[dict[str, str]], chosen: str, rejected: str) -> dict[str, Any]:
    """{prompt, chosen, rejected} strings; a prompt that is more than one user turn also keeps its turns in
    `prompt_messages` (rendered with the model's chat template by the consumers), while `prompt` holds their
    contents joined by newlines for the text-level stages (filter, dedup, tokenizer) and template-less models."""
    rec: dict[str, Any] = {"prompt": "\n".join(m["content"] for m in prompt), "chosen": chosen, "rejected": rejected}
    if len(prompt) > 1 or prompt[0]["role"] != "user":
        rec = {"prompt": rec["prompt"], "prompt_messages": prompt, "chosen": chosen, "rejected": rejected}
    return rec


def prompt_turns(rec: dict[str, Any]) -> list[dict[str, str]]:
    """A preference record's prompt as chat turns: `prompt_messages`, else `prompt` as one user turn."""
    msgs = rec.get("prompt_messages")
    if isinstance(msgs, list) and msgs:
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    return [{"role": "user", "content": rec["prompt"]}]


def normalize(kind: str, row: Any, columns: dict[str, str] | None = None) -> dict[str, Any]:
    """Map one source row to the kind's record. Raises SchemaError saying what is wrong."""
    columns = columns or {}
    if not isinstance(row, dict):
        raise SchemaError(f"expected a JSON object, got {type(row).__name__}")
    if kind == "text":
        return {"text": _string(row, "text", columns)}
    if kind == "chat":
        return {"messages": _chat(row, columns)}
    if kind == "preference":
        return _preference(row, columns)
    raise SchemaError(f"unknown data kind {kind!r}")


class PartWriter:
    """Lines into `out/<folder>/part-NNNNN.jsonl`, `part_records` per part: the layout of a records artifact
    (`folder` records) and of a stage's other line files (removed, pairs). Lines are written as given, so a stage
    that keeps a record copies its bytes unchanged instead of decoding and encoding it again."""

    def __init__(self, out: Path, part_records: int = 100_000, folder: str = PART_DIR):
        self.folder = folder
        self.dir = out / folder
        self.dir.mkdir(parents=True, exist_ok=True)
        self.part_records = part_records
        self.count = 0
        self.parts: list[str] = []
        self._f = None

    def write_line(self, line: bytes) -> None:
        """One line, its newline added when it has none."""
        if self._f is None or self.count % self.part_records == 0:
            self._roll()
        self._f.write(line if line.endswith(b"\n") else line + b"\n")
        self.count += 1

    def _roll(self) -> None:
        if self._f:
            self._f.close()
        name = f"part-{len(self.parts):05d}.jsonl"
        self.parts.append(f"{self.folder}/{name}")
        self._f = open(self.dir / name, "wb")

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RecordWriter(PartWriter):
    """Writes records into `out/records/part-NNNNN.jsonl`, `part_records` per part, as UTF-8 JSON."""

    def write(self, record: dict[str, Any]) -> None:
        self.write_line(json.dumps(record, ensure_ascii=False).encode("utf-8"))


def encode_record(record: dict[str, Any]) -> bytes:
    """A record as RecordWriter writes it, escaped where UTF-8 cannot hold it (a lone surrogate), so the record
    survives as it is."""
    try:
        return json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(record).encode("ascii")


def part_names(artifact: Artifact) -> list[str]:
    return sorted(p for p in artifact.files if p.startswith(f"{PART_DIR}/") and p.endswith(".jsonl"))


def iter_part(artifact: Artifact, part: str) -> Iterator[dict[str, Any]]:
    """The records of one part, checked against the manifest (size and sha256) before the first is used."""
    with artifact.open_verified(part) as f:
        for line in f:
            yield json.loads(line)


def iter_records(artifact: Artifact) -> Iterator[dict[str, Any]]:
    """Every record of a records artifact, in order; each part is verified against the manifest before use."""
    for part in part_names(artifact):
        yield from iter_part(artifact, part)


def require_records(artifact: Artifact) -> int:
    """The record count of a records artifact; a clear error naming what emptied it when it is 0.

    Stages that drop records report `dropped: {reason: count}` in their result; this walks the
    lineage upstream and names every such count, so an all-dropped corpus explains itself.
    """
    n = int(artifact.result.get("records", 0))
    if n > 0:
        return n
    reasons: list[str] = []
    node: Artifact | None = artifact
    while node is not None:
        dropped = {k: v for k, v in (node.result.get("dropped") or {}).items() if v}
        if dropped:
            by = node.manifest.get("produced_by", {}).get("stage", node.kind)
            reasons.append(f"{by} ({node.kind}/{node.id}) dropped " + ", ".join(f"{k}: {v}" for k, v in
                                                                                  sorted(dropped.items(), key=lambda x: -x[1])))
        ups = [i for i in node.manifest.get("inputs", []) if i.get("type") == "artifact"]
        node = node.store.get(ups[0]["kind"], ups[0]["artifact_id"]) if ups else None
    why = "; ".join(reasons) if reasons else "its input held no records"
    raise DataError(f"{artifact.kind} artifact {artifact.id}", f"has no records: {why}",
                    "loosen the thresholds or switch off the rules that dropped everything, then rerun")
