"""Shard artifacts -> what TRL trainers read.

Shards are webdataset tars with one JSON record per sample (see `lmforge.records` for the schemas). The
parent resolves the shard URLs from the artifact's manifest (`lmforge.shards.shard_urls`); here they
are read with webdataset, on local disk or object storage alike.

For now the records become an in-memory `datasets.Dataset` (map-style): the Trainer's sampler then
shards it across DDP ranks, shuffles it with the seed and, on resume, skips the batches already
seen, so the data position comes back with the checkpoint. That fits the demo and small SFT sets.
The scale path is streaming: `datasets.IterableDataset.from_generator` over the shard URLs split with
`webdataset.split_by_node` / `split_by_worker` (or `datasets.distributed.split_dataset_by_node`), with
the position restored by counting consumed samples per shard.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Iterator

from lmforge.errors import DataError
from lmforge.shards import register_webdataset_schemes

log = logging.getLogger(__name__)


def iter_records(urls: list[str]) -> Iterator[dict[str, Any]]:
    """The JSON records of the given shards, in order: all of them, on every rank.

    No node or worker splitting here (webdataset's default refuses to run under torchrun): each rank
    reads the whole split into a map-style dataset and the Trainer's DistributedSampler splits it.
    """
    import webdataset as wds

    if not urls:
        return
    register_webdataset_schemes()  # s3:// and other object-store URLs through fsspec
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False, nodesplitter=None, workersplitter=None):
        yield json.loads(sample["json"])


def chat_dataset(urls: list[str], where: str, max_records: int | None = None):
    """A `datasets.Dataset` with one `messages` column (TRL's conversational format)."""
    import datasets

    rows = []
    for rec in iter_records(urls):
        if "messages" not in rec:
            raise DataError(where, f"record {rec.get('id', '?')} has no messages (fields: {', '.join(sorted(rec))})",
                            "feed this stage shards of chat records")
        rows.append({"messages": rec["messages"]})
        if max_records is not None and len(rows) >= max_records:
            break
    if not rows and urls:
        raise DataError(where, "the shards hold no records", "check the upstream stages' drop counts")
    log.info("%s: %d conversations from %d shard(s)", where, len(rows), len(urls))
    return datasets.Dataset.from_list(rows) if rows else None
