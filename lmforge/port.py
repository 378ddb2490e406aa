"""What flows along an edge of the pipeline's DAG: the type of an artifact and, for data, its record kind.

Its own module because both the config's graph check (`lmforge.config`) and the stage contract (`lmforge.stage`)
speak of ports, and the stage contract builds on the config.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Port:
    """What flows along an edge of the DAG: an artifact type and, for data, its record kind."""

    type: str  # dataset | records | shards | ... (training types come with their stages)
    data_kind: str | None = None

    def describe(self) -> str:
        return f"{self.data_kind} {self.type}" if self.data_kind else self.type
