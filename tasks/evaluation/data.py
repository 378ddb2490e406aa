"""Held-out data for the eval stage: texts, conversations and preference pairs, read from shards or records.

Each reader reads the first N rows of its split, says in a note what it skipped or could not find, and
fails before any model loads when nothing is left to score.
"""
from __future__ import annotations

from itertools import islice
from typing import Any

from lmforge.errors import DataError
from lmforge.records import iter_records
from lmforge.shards import iter_samples
from lmforge.store import Artifact
from tasks.evaluation.config import ChatLossSet, PerplexitySet, PreferenceEval


def _records(art: Artifact, split: str) -> Any:
    """The records of a shards or records artifact; each shard or part is checked against the manifest first."""
    port = art.manifest.get("output", {}).get("type")
    return iter_samples(art, split) if port == "shards" else iter_records(art)


def read_texts(art: Artifact, s: PerplexitySet, where: str, notes: list[str]) -> list[str]:
    texts = [r["text"] for r in islice(_records(art, s.split), s.max_docs)]
    if s.max_docs and len(texts) < s.max_docs:
        notes.append(f"{s.name}: max_docs {s.max_docs} is more than the {len(texts)} documents of {art.kind}/{art.id}; "
                     f"scored all {len(texts)}")
    empty = sum(1 for t in texts if not t)
    texts = [t for t in texts if t]
    if empty:
        notes.append(f"{s.name}: skipped {empty} empty document(s)")
    if not texts:
        raise DataError(where, f"{art.uri} has no {s.split} text to score",
                        "Shard with validation_fraction > 0, or set split: train")
    return texts


def read_conversations(art: Artifact, s: ChatLossSet, where: str, notes: list[str]) -> list[list[dict[str, Any]]]:
    convs = [r["messages"] for r in islice(_records(art, s.split), s.max_conversations)]
    if s.max_conversations and len(convs) < s.max_conversations:
        notes.append(f"{s.name}: max_conversations {s.max_conversations} is more than the {len(convs)} "
                     f"conversations of {art.kind}/{art.id}; scored all {len(convs)}")
    convs = [m for m in convs if any(t.get("role") == "assistant" for t in m)]
    if not convs:
        raise DataError(where, f"{art.uri} has no {s.split} conversation with an assistant turn to score",
                        "Shard with validation_fraction > 0, or set split: train")
    return convs


def read_pairs(art: Artifact, p: PreferenceEval, where: str, notes: list[str]) -> list[dict[str, str]]:
    """The first max_pairs pairs of the split, without those with chosen == rejected (nothing to prefer: a
    tie would count as a loss for every model), which are counted in a note."""
    read = [{k: r[k] for k in ("prompt", "prompt_messages", "chosen", "rejected") if k in r}
            for r in islice(_records(art, p.split), p.max_pairs)]
    pairs = [r for r in read if r["chosen"] != r["rejected"]]
    if len(pairs) < len(read):
        notes.append(f"{p.name}: {len(read) - len(pairs)} of {len(read)} pairs have chosen == rejected and are "
                     "skipped")
    if p.max_pairs and len(read) < p.max_pairs:
        notes.append(f"{p.name}: max_pairs {p.max_pairs} is more than the {len(read)} pairs of {art.kind}/{art.id}; "
                     f"read all {len(read)}")
    if not pairs:
        raise DataError(where, f"{art.uri} has no {p.split} preference pairs",
                        "Shard with validation_fraction > 0, or set split: train")
    return pairs
