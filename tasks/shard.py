"""shard: records -> webdataset tar shards with a seeded train/validation split.

The split picks the `round(n * validation_fraction)` records with the smallest seeded hash of their
id (at least one when the fraction is > 0 and there are two or more records). It depends on the
seed and the record ids only, never on the order records arrive in or on how they are partitioned.
Tars are written with `mtime=0`, so the same records give byte-identical shards.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.log import Progress
from lmforge.port import Port
from lmforge.records import iter_records, require_records
from lmforge.shards import SPLITS, shard_name
from lmforge.stage import Result, StageDef, expect_inputs
from lmforge.store import Artifact, sha256_file

log = logging.getLogger(__name__)


class ShardConfig(StageConfig):
    kind: Literal["shard"] = Field(description="Writes records into webdataset tar shards.")
    max_count: int = Field(10_000, gt=0, description="Most samples per shard (webdataset maxcount).")
    max_bytes: int = Field(256 * 2**20, gt=0, description="A shard closes once its sample payload reaches this many bytes "
                           "(webdataset maxsize); tar headers add about 1 KiB per sample on top.")
    validation_fraction: float = Field(0.05, ge=0, lt=1, description="Share of records held out for validation.")
    seed: int = Field(0, description="Seed of the train/validation split.")


class ShardResult(Result):
    data_kind: str
    train_samples: int
    validation_samples: int
    num_shards: dict[str, int]
    bytes: int
    shards: list[dict]


def _split_key(seed: int, rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{rid}".encode(), digest_size=8).digest(), "big")


def run(cfg: ShardConfig, inputs: list[Artifact], out: Path) -> ShardResult:
    import webdataset as wds

    src = inputs[0]
    n = require_records(src)
    keys = np.fromiter((_split_key(cfg.seed, r["id"]) for r in interrupt.checked(iter_records(src), "shard split")),
                       dtype=np.uint64, count=n)
    k = round(n * cfg.validation_fraction)
    if cfg.validation_fraction > 0 and n >= 2:
        k = max(k, 1)
    threshold = np.partition(keys, k - 1)[k - 1] if k else None
    del keys

    writers = {s: wds.ShardWriter(str(out / f"{s}-%06d.tar"), maxcount=cfg.max_count, maxsize=cfg.max_bytes,
                                  verbose=0, mtime=0) for s in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    progress = Progress(log, f"shard {src.kind}/{src.id}", total=n)
    try:
        for rec in interrupt.checked(iter_records(src), "shard write"):
            split = "validation" if threshold is not None and _split_key(cfg.seed, rec["id"]) <= threshold else "train"
            writers[split].write({"__key__": f"{counts[split]:09d}", "json": rec})
            counts[split] += 1
            progress.update()
    finally:
        for w in writers.values():
            w.close()
    progress.done()
    shards = written_shards(out, counts)
    return ShardResult(data_kind=src.result["data_kind"], train_samples=counts["train"],
                       validation_samples=counts["validation"],
                       num_shards={s: sum(1 for x in shards if x["split"] == s) for s in SPLITS},
                       bytes=sum(x["bytes"] for x in shards), shards=shards)


def written_shards(out: Path, counts: dict[str, int]) -> list[dict]:
    """The shard tars a `webdataset.ShardWriter` per split left in `out` (`{split}-%06d.tar`), as the result lists
    them: name, split, bytes, sha256 and samples. An empty split's tar (ShardWriter leaves one) is removed."""
    shards = []
    for split in SPLITS:
        files = sorted(out.glob(f"{split}-*.tar"))
        if counts[split] == 0:  # ShardWriter leaves an empty tar when nothing was written
            for f in files:
                f.unlink()
            files = []
        for i, f in enumerate(files):
            if f.name != shard_name(split, i):
                raise RuntimeError(f"unexpected shard name {f.name}")
        shards += [{"name": f.name, "split": split, "bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in files]
    # per-shard sample counts: ShardWriter rolls over at max_count or max_bytes, so count by reading back
    _count_samples(out, shards)
    return shards


def _count_samples(out: Path, shards: list[dict]) -> None:
    import tarfile

    for s in shards:
        with tarfile.open(out / s["name"]) as tf:
            s["samples"] = sum(1 for m in tf if m.isfile())


def output_port(cfg: ShardConfig, inputs: list[Port]) -> Port:
    return Port("shards", expect_inputs(inputs, "shard", count=1, types={"records"}))


STAGE = StageDef(kind="shard", version="1", config=ShardConfig, run=run, output_port=output_port,
                 description="records -> webdataset tar shards, train/validation", output_type="shards")
