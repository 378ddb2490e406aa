"""Stage kinds: one module per stage, each exposing `run(cfg, inputs, out)` and a `STAGE` definition.

`REGISTRY` maps a config's `kind:` to its definition. Every module of this package that defines a
module-level `STAGE` (a `StageDef`) is a stage kind: adding a stage means adding its file, nothing else.
filter and dedup sit between ingest and shard: all three read and write the same `records` artifacts.
"""
from __future__ import annotations

import importlib
import pkgutil

from lmforge.stage import StageDef


def _discover() -> dict[str, StageDef]:
    found: dict[str, StageDef] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        stage = getattr(module, "STAGE", None)
        if not isinstance(stage, StageDef):
            continue  # helpers such as filter_rules, minhash
        if stage.kind in found:
            raise RuntimeError(f"stage kind {stage.kind!r} is defined twice: tasks.{info.name} and an earlier module")
        found[stage.kind] = stage
    return found


REGISTRY: dict[str, StageDef] = _discover()
