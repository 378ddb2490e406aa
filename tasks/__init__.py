"""Stage kinds: one module per stage, each exposing `run(cfg, inputs, out)` and a `STAGE` definition.

`REGISTRY` maps a config's `kind:` to its definition. The data slot between ingest and shard is
open: filter and dedup read and write the same `records` artifacts, so they drop in without changes
to either neighbour.
"""
from __future__ import annotations

from lmforge.stage import StageDef
from tasks import ingest, shard

REGISTRY: dict[str, StageDef] = {s.kind: s for s in (ingest.STAGE, shard.STAGE)}
