"""The real Prefect engine (ephemeral API in a temp PREFECT_HOME) and MLflow read back via MlflowClient."""
from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main
from flows.pipeline import pipeline
from lmforge.config import load_config
from lmforge.errors import StageFailed
from lmforge.plan import make_plan
from tests.helpers import basic_config, prefect_home, write_config

STAGES = ["ingest", "shard", "ingest_pairs", "shard_pairs"]


@pytest.fixture
def cfg_path(tmp_path):
    return write_config(tmp_path, basic_config(tmp_path))


def statuses(summary):
    return {n: s["status"] for n, s in summary["stages"].items()}


def children(client, parent_id):
    runs = client.search_runs([client.get_run(parent_id).info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.info.run_name: r for r in runs}


def test_run_rerun_change_force(cfg_path, tmp_path, kinds):
    first = pipeline(config_path=str(cfg_path))
    assert statuses(first) == dict.fromkeys(STAGES, "ran") and first["ran"] == 4
    manifests = {p: p.read_text() for p in (tmp_path / "artifacts").glob("*/*/manifest.json")}
    assert len(manifests) == 4

    again = pipeline(config_path=str(cfg_path))
    assert (again["ran"], again["cached"]) == (0, 4)  # zero stage executions
    assert {p: p.read_text() for p in (tmp_path / "artifacts").glob("*/*/manifest.json")} == manifests
    assert {n: s["artifact_id"] for n, s in again["stages"].items()} == \
        {n: s["artifact_id"] for n, s in first["stages"].items()}

    # one changed setting reruns that stage and its dependants only; plan says why
    cfg = load_config(cfg_path, kinds, ["stages.ingest_pairs.part_records=5"])
    reasons = {n: s.reason for n, s in make_plan(cfg, kinds).stages.items()}
    assert reasons == {"ingest": "cached: manifest exists", "shard": "cached: manifest exists",
                       "ingest_pairs": "config changed: part_records 100000 -> 5",
                       "shard_pairs": "input changed: ingest_pairs (will run)"}
    changed = pipeline(config_path=str(cfg_path), overrides=["stages.ingest_pairs.part_records=5"])
    assert statuses(changed) == {"ingest": "cached", "shard": "cached", "ingest_pairs": "ran", "shard_pairs": "ran"}
    assert changed["stages"]["shard_pairs"]["artifact_id"] != first["stages"]["shard_pairs"]["artifact_id"]

    # --force reruns a stage and what depends on it, keeping the replaced manifest in _history
    forced = pipeline(config_path=str(cfg_path), force=["ingest"])
    assert statuses(forced) == {"ingest": "ran", "shard": "ran", "ingest_pairs": "cached", "shard_pairs": "cached"}
    assert forced["stages"]["ingest"]["artifact_id"] == first["stages"]["ingest"]["artifact_id"]
    ingest_dir = tmp_path / "artifacts/ingest" / first["stages"]["ingest"]["artifact_id"]
    assert len(list((ingest_dir / "_history").iterdir())) == 1


def test_mlflow_parent_child_and_cached_linkage(cfg_path, tmp_path):
    first = pipeline(config_path=str(cfg_path))
    second = pipeline(config_path=str(cfg_path))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("t")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.`lmforge.pipeline` = 't'")
    assert {p.info.run_id for p in parents} == {first["mlflow_run_id"], second["mlflow_run_id"]}
    p1 = client.get_run(first["mlflow_run_id"])
    assert p1.data.tags["prefect.flow_run_id"] == first["flow_run_id"]
    assert len(p1.data.tags["lmforge.config_hash"]) == 16 and p1.data.tags["lmforge.git_commit"]
    assert "shard.max_count" not in p1.data.params  # the parent has a few key settings; all are on the stage's run
    # the parent holds the same few keys on every run; per-stage details stay on the children
    assert set(p1.data.metrics) == {"stages_ran", "stages_cached", "stages_failed", "summary/wall_seconds"}
    assert (p1.data.metrics["stages_ran"], p1.data.metrics["stages_cached"]) == (4, 0)
    assert p1.info.run_name == f"t {p1.data.tags['lmforge.config_hash'][:8]} · 4 ran"
    assert p1.info.status == "FINISHED"

    c1, c2 = children(client, first["mlflow_run_id"]), children(client, second["mlflow_run_id"])
    assert set(c1) == set(c2) == set(STAGES)
    shard1 = c1["shard"]
    assert shard1.data.tags["cached"] == "false"
    assert shard1.data.params["max_count"] == "20" and shard1.data.params["validation_fraction"] == "0.1"
    assert shard1.data.metrics["train_samples"] == 45 and shard1.data.metrics["validation_samples"] == 5
    assert shard1.data.tags["lmforge.artifact_id"] == first["stages"]["shard"]["artifact_id"]
    assert shard1.data.tags["lmforge.artifact_uri"].endswith(f"shard/{first['stages']['shard']['artifact_id']}")
    for name in STAGES:  # every cached child links to the run that made its artifact
        c = c2[name]
        assert c.data.tags["cached"] == "true"
        assert c.data.tags["lmforge.source_run_id"] == c1[name].info.run_id
        assert c.data.params == c1[name].data.params
    assert c2["shard"].data.metrics["train_samples"] == 45
    manifest = json.loads((tmp_path / "artifacts/shard" / first["stages"]["shard"]["artifact_id"] /
                           "manifest.json").read_text())
    assert manifest["produced_by"]["mlflow_run_id"] == shard1.info.run_id
    assert manifest["produced_by"]["flow_run_id"] == first["flow_run_id"]


def test_failed_stage_is_named_other_branch_finishes_and_rerun_redoes_only_the_rest(cfg_path, tmp_path):
    pairs = tmp_path / "data/pairs.jsonl"
    good = pairs.read_text()
    pairs.write_text(good + "{not json\n")
    with pytest.raises(StageFailed) as e:
        pipeline(config_path=str(cfg_path))
    assert set(e.value.failures) == {"ingest_pairs", "shard_pairs"}
    assert e.value.failures["ingest_pairs"].startswith(f"DataError: {pairs}:21: invalid JSON")
    assert e.value.failures["shard_pairs"] == "not run: upstream ingest_pairs failed"
    assert "stage 'ingest_pairs': DataError" in str(e.value)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("t")
    failed = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FAILED'")
    assert sorted(r.info.run_name for r in failed if not r.info.run_name.startswith("t ")) == ["ingest_pairs"]
    assert sum(1 for r in failed if r.info.run_name.startswith("t ")) == 1  # the parent run

    pairs.write_text(good)
    summary = pipeline(config_path=str(cfg_path))
    assert statuses(summary) == {"ingest": "cached", "shard": "cached", "ingest_pairs": "ran", "shard_pairs": "ran"}


def test_bad_input_is_not_retried_but_counts_attempts(tmp_path):
    raw = basic_config(tmp_path)
    raw["stages"]["ingest"]["retries"] = 2
    raw["stages"]["ingest"]["retry_delay_seconds"] = 0
    (tmp_path / "data/text.jsonl").write_text('{"text": 1}\n')
    path = write_config(tmp_path, raw)
    with pytest.raises(StageFailed):
        pipeline(config_path=str(path))
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("t")
    attempts = client.search_runs([exp.experiment_id], filter_string="attributes.run_name = 'ingest'")
    assert [r.info.status for r in attempts] == ["FAILED"]
    assert "must be a string, got int" in attempts[0].data.tags["lmforge.error"]


def test_cli_run_plan_and_artifacts(cfg_path, tmp_path, capsys):
    assert main(["run", str(cfg_path), "--json", str(tmp_path / "summary.json")]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ran"] == 4
    capsys.readouterr()
    assert main(["plan", str(cfg_path), "--force", "shard"]) == 0
    out = capsys.readouterr().out
    assert "cached ingest " in out and "forced (--force shard)" in out
    assert main(["artifacts", "ls", "shard", "-c", str(cfg_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\nshard ") == 2 and "t/shard" in out
    shard_id = summary["stages"]["shard"]["artifact_id"]
    assert main(["artifacts", "show", shard_id[:8], "--store", str(tmp_path / "artifacts")]) == 0
    out = capsys.readouterr().out
    sha = json.loads((tmp_path / "artifacts/ingest" / summary["stages"]["ingest"]["artifact_id"] /
                      "manifest.json").read_text())["inputs"][0]["files"][0]["sha256"]
    assert f"artifact shard/{shard_id}" in out and "lineage:" in out
    assert f"ingest/{summary['stages']['ingest']['artifact_id']}" in out and sha[:16] in out
    assert str(tmp_path / "data/text.jsonl") in out
    # bad data found inside a stage exits 2 (bad input, as in the README), naming the stage and the cause
    (tmp_path / "data/pairs.jsonl").write_text('{"prompt": "p"}\n')
    assert main(["run", str(cfg_path), "--force", "ingest_pairs"]) == 2
    err = capsys.readouterr().err
    assert "stage 'ingest_pairs': DataError" in err and "missing field 'chosen'" in err
    assert main(["artifacts", "show", "zzzz", "--store", str(tmp_path / "artifacts")]) == 2


def test_prefect_flow_run_retry_redoes_only_the_failed_stages(tmp_path):
    """`prefect flow-run retry` re-enters the same flow run; the store decides what is left to do."""
    import os
    import re
    import subprocess
    import sys

    from tests.helpers import REPO

    cfg = write_config(tmp_path, basic_config(tmp_path))
    pairs = tmp_path / "data/pairs.jsonl"
    good = pairs.read_text()
    pairs.write_text('{"prompt": 1}\n')
    env = {**os.environ, "PREFECT_HOME": prefect_home(tmp_path / "prefect-home")}  # own API db, own server
    first = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(cfg)], cwd=REPO, env=env,
                           capture_output=True, text=True)
    assert first.returncode == 2  # bad data inside a stage: bad input
    m = re.search(r"prefect flow-run retry ([0-9a-f-]{36}) --entrypoint flows/pipeline.py:pipeline", first.stderr)
    assert m, first.stderr
    pairs.write_text(good)
    retry = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", m.group(1), "--entrypoint",
                            "flows/pipeline.py:pipeline"], cwd=REPO, env=env, capture_output=True, text=True)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    logs = retry.stdout + retry.stderr
    assert sorted(re.findall(r"stage (\w+): running", logs)) == ["ingest_pairs", "shard_pairs"]
    assert sorted(re.findall(r"stage (\w+): cached", logs)) == ["ingest", "shard"]
    # MLflow: the retry continued the flow run's parent, and each stage has one child run
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("t").experiment_id
    parents = client.search_runs([exp], "tags.`lmforge.pipeline` = 't'")
    assert [(p.data.tags["prefect.flow_run_id"], p.data.tags["lmforge.attempt"], p.info.status) for p in parents] == \
        [(m.group(1), "2", "FINISHED")]
    kids = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
    assert sorted((k.info.run_name, k.data.tags["lmforge.attempt"], k.data.tags["cached"], k.info.status)
                  for k in kids) == [("ingest", "1", "false", "FINISHED"), ("ingest_pairs", "2", "false", "FINISHED"),
                                     ("shard", "1", "false", "FINISHED"), ("shard_pairs", "1", "false", "FINISHED")]
    assert "lmforge.error" not in next(k for k in kids if k.info.run_name == "ingest_pairs").data.tags
