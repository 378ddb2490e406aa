"""What a user sees in MLflow after `lmforge run`: parent names, the same metric keys on fresh and cached runs,
headline `summary/*` metrics, plots, the registry's @candidate / @champion, and `lmforge compare`.

One tiny pipeline (chat data -> tokenizer -> a few sft steps -> eval of the sft model on a six-row task) run through
the real Prefect flow, read back with MlflowClient from a temp sqlite store.
"""
from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main
from flows.pipeline import pipeline
from lmforge.errors import StageFailed
from lmforge.runview import changed_settings, run_name
from tests.helpers import chat_rows, sft, train_pipeline, write_config, write_jsonl, write_task_dir

PASSING = [{"metric": "sft/t_mc/acc", "against": "sft", "max_regression": 0.0}]
IMPOSSIBLE = "stages.eval.gates=[{metric: sft/t_mc/acc_norm, against: sft, max_regression: 0}]"  # sft has no acc_norm


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three runs of one config: fresh (gates pass), all cached, and one with a changed sft learning rate and an
    impossible gate (sft reruns, eval fails). {name: (summary or None, mlflow parent run id)} and the folder."""
    root = tmp_path_factory.mktemp("view")
    write_jsonl(root / "data" / "chat.jsonl", chat_rows(120))
    tasks = write_task_dir(root / "tasks")
    raw = train_pipeline(root, {
        "sft": sft(method="full", max_steps=4, evaluate=False, seed=1),
        "eval": {"kind": "eval", "inputs": ["sft"], "retries": 0, "models": [{"name": "sft", "input": "sft"}],
                 "tasks": ["t_mc"], "task_dirs": [str(tasks)], "gates": PASSING},
    })
    raw["name"] = "v"
    cfg = write_config(root, raw)
    fresh = pipeline(config_path=str(cfg))
    cached = pipeline(config_path=str(cfg))
    with pytest.raises(StageFailed) as e:
        pipeline(config_path=str(cfg), overrides=["stages.sft.learning_rate=1e-3", IMPOSSIBLE])
    assert set(e.value.failures) == {"eval"} and "1 of 1 eval gate(s) failed" in e.value.failures["eval"]
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    failed = client.search_runs([client.get_experiment_by_name("v").experiment_id],
                                "attributes.status = 'FAILED' and tags.`lmforge.pipeline` = 'v'")
    assert len(failed) == 1
    return {"fresh": fresh, "cached": cached, "changed_id": failed[0].info.run_id, "root": root, "cfg": cfg,
            "client": client}


def test_fresh_and_cached_parents_have_the_same_few_metric_keys(runs):
    client = runs["client"]
    fresh, cached = (client.get_run(runs[k]["mlflow_run_id"]) for k in ("fresh", "cached"))
    changed = client.get_run(runs["changed_id"])
    assert (runs["fresh"]["ran"], runs["cached"]["cached"]) == (5, 5)
    keys = set(fresh.data.metrics)
    assert set(cached.data.metrics) == keys == set(changed.data.metrics)
    assert not [k for k in keys if k.startswith(("eval/", "sft/"))]  # no per-stage details, no eval/eval/
    assert keys == {"stages_ran", "stages_cached", "stages_failed", "summary/wall_seconds", "summary/gates_passed",
                    "summary/gates_failed", "summary/expectations_failed", "summary/sft/t_mc/acc",
                    "summary/sft/t_mc/acc_stderr",
                    "summary/tokens_trained/sft"}
    # the headline values are the eval artifact's result, on the cached parent too
    store = runs["root"] / "artifacts"
    eval_id = runs["fresh"]["stages"]["eval"]["artifact_id"]
    result = json.loads((store / "eval" / eval_id / "manifest.json").read_text())["result"]
    sft_id = runs["fresh"]["stages"]["sft"]["artifact_id"]
    sft_result = json.loads((store / "sft" / sft_id / "manifest.json").read_text())["result"]
    for run in (fresh, cached):
        m = run.data.metrics
        assert m["summary/sft/t_mc/acc"] == result["eval"]["sft"]["t_mc"]["acc"]
        assert m["summary/sft/t_mc/acc_stderr"] == result["eval"]["sft"]["t_mc"]["acc_stderr"]
        assert (m["summary/gates_passed"], m["summary/gates_failed"], m["summary/expectations_failed"]) == (1, 0, 0)
        assert m["summary/tokens_trained/sft"] == sft_result["tokens"] > 0
        assert m["summary/wall_seconds"] > 0
    assert (changed.data.metrics["summary/gates_passed"], changed.data.metrics["summary/gates_failed"]) == (0, 1)
    assert (fresh.data.tags["lmforge.cached"], cached.data.tags["lmforge.cached"]) == ("false", "true")
    # plots on every parent: loss curves of the training stages and the eval bar chart
    for run in (fresh, cached):
        assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "plots")) == [
            "plots/eval.png", "plots/loss_curves.png"]
    # one child per stage
    kids = client.search_runs([fresh.info.experiment_id], f"tags.mlflow.parentRunId = '{fresh.info.run_id}'")
    assert sorted(r.info.run_name for r in kids) == ["eval", "ingest", "sft", "shard", "tokenizer"]


def test_run_names_say_config_hash_and_changed_settings(runs):
    client = runs["client"]
    fresh, cached, changed = (client.get_run(i) for i in (runs["fresh"]["mlflow_run_id"],
                                                          runs["cached"]["mlflow_run_id"], runs["changed_id"]))
    h = fresh.data.tags["lmforge.config_hash"]
    assert fresh.info.run_name == cached.info.run_name == f"v {h[:8]}"
    h2 = changed.data.tags["lmforge.config_hash"]
    assert h2 != h and changed.info.run_name.startswith(f"v {h2[:8]} eval.gates=")
    assert "sft.learning_rate=0.001" in changed.info.run_name and len(changed.info.run_name) <= 90
    assert changed.data.tags["lmforge.attempt"] == "1" and "lmforge.retry_of" not in changed.data.tags


def test_run_name_is_truncated_with_a_count():
    old = {f"s.k{i}": "1" for i in range(20)}
    new = {**{f"s.k{i}": "2" for i in range(20)}, "s.new": "x" * 40}
    changes = changed_settings(old, new)
    assert changes[:2] == ["s.k0=2", "s.k1=2"] and changes[-1] == "s.new=" + "x" * 23 + "…"
    name = run_name("demo", "0123456789abcdef", changes)
    assert name.startswith("demo 01234567 s.k0=2, s.k1=2, ") and len(name) <= 90
    assert name.endswith(" more") and int(name.split(" +")[1].split()[0]) + name.count(", ") + 1 == 21
    assert run_name("demo", "0123456789abcdef", []) == "demo 01234567"
    assert changed_settings(None, new) == [] and changed_settings({"a": "1", "b": "2"}, {"a": "1"}) == ["-b"]


def test_registry_candidate_and_champion_only_after_gates_pass(runs):
    client = runs["client"]
    assert sorted(m.name for m in client.search_registered_models()) == ["v-sft"]
    model = client.get_registered_model("v-sft")
    assert model.description.startswith("policy model made by the sft stage 'sft' of pipeline 'v': method full, "
                                        "base a new llama model from a config, inputs shard, tokenizer.")
    versions = {v.tags["lmforge.artifact_id"]: v for v in client.search_model_versions("name='v-sft'")}
    first = versions[runs["fresh"]["stages"]["sft"]["artifact_id"]]
    assert len(versions) == 2
    second = next(v for a, v in versions.items() if a != runs["fresh"]["stages"]["sft"]["artifact_id"])
    assert set(first.tags) == {"lmforge.artifact_id", "lmforge.artifact_uri", "lmforge.pipeline", "lmforge.stage",
                               "lmforge.method", "lmforge.git_commit", "lmforge.source_run_id"}
    assert first.source == first.tags["lmforge.artifact_uri"] and first.tags["lmforge.method"] == "full"
    # the changed run made a new candidate, but its eval failed: @champion stays on the version that passed
    assert client.get_model_version_by_alias("v-sft", "candidate").version == second.version
    assert client.get_model_version_by_alias("v-sft", "champion").version == first.version
    fresh = client.get_run(runs["fresh"]["mlflow_run_id"])
    assert fresh.data.tags["lmforge.champion"] == f"v-sft/{first.version}"
    assert "lmforge.champion" not in client.get_run(runs["changed_id"]).data.tags


def test_compare_prints_config_diff_arrows_and_url(runs, capsys):
    uri = f"sqlite:///{runs['root'] / 'mlflow.db'}"
    # a Prefect flow run id for A, an MLflow run id for B
    assert main(["compare", runs["fresh"]["flow_run_id"], runs["changed_id"], "--tracking", uri]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"A: {runs['client'].get_run(runs['fresh']['mlflow_run_id']).info.run_name}  " \
                       f"({runs['fresh']['mlflow_run_id']}, FINISHED)"
    assert "config: 2 setting(s) differ:" in out
    lr = next(line for line in lines if line.strip().startswith("sft.learning_rate"))
    assert lr.split() == ["sft.learning_rate", "0.003", "->", "0.001"]
    gates = [line.split() for line in lines if line.strip().startswith("summary/gates_")]
    assert gates == [["summary/gates_failed", "0", "1", "↓", "worse"], ["summary/gates_passed", "1", "0", "↓", "worse"]]
    acc = next(line for line in lines if line.strip().startswith("summary/sft/t_mc/acc"))
    assert "±" in acc and acc.rstrip().endswith(("↑ better", "↓ worse", "= same"))
    assert "MLflow compare view: http://127.0.0.1:5000/#/compare-runs?runs=" in out
    assert f"mlflow ui --backend-store-uri {uri}" in out
    assert main(["compare", "nope", runs["changed_id"], "--tracking", uri]) == 2
    assert "'nope' is neither an MLflow run id nor the Prefect flow run id" in capsys.readouterr().err
