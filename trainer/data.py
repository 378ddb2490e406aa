"""Shard artifacts -> what TRL trainers read.

Shards are webdataset tars with one JSON record per sample (see `lmforge.records` for the schemas). The
parent resolves the shards from the artifact's manifest (`lmforge.shards.shard_refs`): each `ShardRef`
carries the shard's URL, on local disk or object storage, with the size and sha256 the manifest lists, and
every shard is read whole and checked against them before any of its records is used.

For now the records become an in-memory `datasets.Dataset` (map-style): the Trainer's sampler then
shards it across DDP ranks, shuffles it with the seed and, on resume, skips the batches already
seen, so the data position comes back with the checkpoint. That fits the demo and small SFT sets.
The scale path is streaming: `datasets.IterableDataset.from_generator` over the shards split by node and
worker (or `datasets.distributed.split_dataset_by_node`), with the position restored by counting consumed
samples per shard (`trainer.stream` does this for pretraining).
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

from lmforge.errors import DataError
from lmforge.shards import ShardRef, iter_shards

log = logging.getLogger(__name__)


def iter_records(shards: list[ShardRef]) -> Iterator[dict[str, Any]]:
    """The JSON records of the given shards, in order: all of them, on every rank; each shard verified first.

    No node or worker splitting here: each rank reads the whole split into a map-style dataset and the
    Trainer's DistributedSampler splits it.
    """
    return iter_shards(shards)


def chat_dataset(shards: list[ShardRef], where: str, max_records: int | None = None):
    """A `datasets.Dataset` with one `messages` column (TRL's conversational format)."""
    import datasets

    rows = []
    for rec in iter_records(shards):
        if "messages" not in rec:
            raise DataError(where, f"record {rec.get('id', '?')} has no messages (fields: {', '.join(sorted(rec))})",
                            "feed this stage shards of chat records")
        rows.append({"messages": rec["messages"]})
        if max_records is not None and len(rows) >= max_records:
            break
    if not rows and shards:
        raise DataError(where, "the shards hold no records", "check the upstream stages' drop counts")
    log.info("%s: %d conversations from %d shard(s)", where, len(rows), len(shards))
    return datasets.Dataset.from_list(rows) if rows else None
