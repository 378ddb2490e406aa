"""Stage kinds: one module per stage, each exposing `run(cfg, inputs, out)` and a `STAGE` definition.

`REGISTRY` maps a config's `kind:` to its definition. filter and dedup sit between ingest and
shard: all three read and write the same `records` artifacts.
"""
from __future__ import annotations

from lmforge.stage import StageDef
from tasks import dedup, dpo, filter, ingest, reward, sft, shard, tokenizer
from tasks import eval as eval_stage  # the name "eval" would shadow the builtin

REGISTRY: dict[str, StageDef] = {s.kind: s for s in (ingest.STAGE, filter.STAGE, dedup.STAGE, shard.STAGE,
                                                      tokenizer.STAGE, sft.STAGE, reward.STAGE, dpo.STAGE,
                                                      eval_stage.STAGE)}
