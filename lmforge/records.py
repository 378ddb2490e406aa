"""Record schemas per data kind, and the records artifact layout shared by data stages.

Kinds and their normalized record (every record also carries a stable `id`):
- text:       {"text": str}
- chat:       {"messages": [{"role": system|user|assistant|tool, "content": str}, ...]}
              also read from instruction/input/output rows and from ShareGPT `conversations`
- preference: {"prompt": str, "chosen": str, "rejected": str}

A records artifact stores them as `records/part-NNNNN.jsonl`, UTF-8, one JSON object per line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from lmforge.errors import DataError
from lmforge.store import Artifact

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                  "assistant": "assistant", "tool": "tool"}
PART_DIR = "records"


class SchemaError(ValueError):
    """A row that does not fit its kind's schema; the message says which field and why."""


def _col(row: dict[str, Any], field: str, columns: dict[str, str]) -> str:
    return columns.get(field, field)


def _string(row: dict[str, Any], field: str, columns: dict[str, str]) -> str:
    col = _col(row, field, columns)
    if col not in row:
        raise SchemaError(f"missing field {col!r} (have: {', '.join(sorted(map(str, row))) or 'none'})")
    v = row[col]
    if not isinstance(v, str):
        raise SchemaError(f"field {col!r} must be a string, got {type(v).__name__}")
    return v


def _messages(raw: Any, col: str) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise SchemaError(f"field {col!r} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise SchemaError(f"{col}[{i}] must be an object with role and content")
        if "from" in m and "value" in m:  # ShareGPT
            role, content = SHAREGPT_ROLES.get(m["from"], m["from"]), m["value"]
        else:
            role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise SchemaError(f"{col}[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise SchemaError(f"{col}[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def normalize(kind: str, row: Any, columns: dict[str, str] | None = None) -> dict[str, Any]:
    """Map one source row to the kind's record. Raises SchemaError saying what is wrong."""
    columns = columns or {}
    if not isinstance(row, dict):
        raise SchemaError(f"expected a JSON object, got {type(row).__name__}")
    if kind == "text":
        return {"text": _string(row, "text", columns)}
    if kind == "chat":
        for col in (_col(row, "messages", columns), "conversations"):
            if col in row:
                return {"messages": _messages(row[col], col)}
        if _col(row, "instruction", columns) in row:
            instruction = _string(row, "instruction", columns)
            extra = row.get(_col(row, "input", columns)) or ""
            if not isinstance(extra, str):
                raise SchemaError(f"field {_col(row, 'input', columns)!r} must be a string")
            user = f"{instruction}\n\n{extra}" if extra else instruction
            msgs = []
            if isinstance(row.get("system"), str) and row["system"]:
                msgs.append({"role": "system", "content": row["system"]})
            msgs += [{"role": "user", "content": user},
                     {"role": "assistant", "content": _string(row, "output", columns)}]
            return {"messages": msgs}
        raise SchemaError("a chat row needs 'messages' (or 'conversations'), or instruction/input/output "
                          f"fields (have: {', '.join(sorted(map(str, row))) or 'none'})")
    if kind == "preference":
        return {f: _string(row, f, columns) for f in ("prompt", "chosen", "rejected")}
    raise SchemaError(f"unknown data kind {kind!r}")


class RecordWriter:
    """Writes records into `out/records/part-NNNNN.jsonl`, `part_records` per part."""

    def __init__(self, out: Path, part_records: int = 100_000):
        self.dir = out / PART_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.part_records = part_records
        self.count = 0
        self.parts: list[str] = []
        self._f = None

    def write(self, record: dict[str, Any]) -> None:
        if self._f is None or self.count % self.part_records == 0:
            self._roll()
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.count += 1

    def _roll(self) -> None:
        if self._f:
            self._f.close()
        name = f"part-{len(self.parts):05d}.jsonl"
        self.parts.append(f"{PART_DIR}/{name}")
        self._f = open(self.dir / name, "w", encoding="utf-8")

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
