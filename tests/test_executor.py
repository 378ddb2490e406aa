"""Executor contract: a stage whose complete output fails a check is published, then fails, also when cached."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from mlflow.tracking import MlflowClient

from lmforge.config import StageConfig, parse_config
from lmforge.errors import FailedAfterPublish
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from lmforge.port import Port
from lmforge.records import iter_records
from lmforge.stage import Result, StageDef
from lmforge.tracking import Tracker
from tests.helpers import basic_config


class CountCheck(StageConfig):
    kind: Literal["count_check"]
    min_records: int


class CountResult(Result):
    records: int


def run_check(cfg: CountCheck, inputs, out: Path) -> CountResult:
    n = sum(1 for _ in iter_records(inputs[0]))
    (out / "count.txt").write_text(str(n))
    result = CountResult(records=n)
    if n < cfg.min_records:
        raise FailedAfterPublish(f"gate: records {n} < min_records {cfg.min_records}", result)
    return result


CHECK = StageDef(kind="count_check", version="1", config=CountCheck, run=run_check,
                 output_port=lambda cfg, ports: Port("report"))


def test_failed_check_publishes_then_fails_and_fails_again_when_cached(tmp_path, kinds):
    kinds = {**kinds, "count_check": CHECK}
    raw = basic_config(tmp_path)
    raw["stages"]["check"] = {"kind": "count_check", "inputs": ["ingest"], "min_records": 51}
    plan = make_plan(parse_config(raw, kinds, root=tmp_path), kinds)
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t")
    ctx = RunContext(plan=plan, kinds=kinds, tracker=tracker)
    execute_stage(ctx, "ingest")
    for attempt in ("ran", "cached"):
        with pytest.raises(FailedAfterPublish, match="gate: records 50 < min_records 51"):
            execute_stage(ctx, "check")
    art = plan.store.require("count_check", plan.stages["check"].artifact_id)
    assert art.result == {"records": 50} and art.manifest["failure"] == "gate: records 50 < min_records 51"
    with art.open("count.txt") as f:
        assert f.read() == b"50"
    client = MlflowClient(tracker.uri)
    runs = client.search_runs([tracker.experiment_id], filter_string="attributes.run_name = 'check'")
    assert sorted((r.data.tags["cached"], r.info.status, r.data.metrics["records"]) for r in runs) == \
        [("false", "FAILED", 50.0), ("true", "FAILED", 50.0)]
