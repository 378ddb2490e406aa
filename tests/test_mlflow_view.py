"""What a user sees in MLflow after `lmforge run`: parent names (fresh, cached, partial rerun), the same metric keys
on fresh and cached runs, the headline (`0_headline/*`) and `summary/*` metrics with their directions, plots, the
registry's @candidate / @champion, and `lmforge compare` (a verdict on every row, a replay announced).

One tiny pipeline (chat data -> tokenizer -> a few sft steps -> eval of the sft model on a six-row task and on the
held-out chat turns) run through the real Prefect flow, read back with MlflowClient from a temp sqlite store.
"""
from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main
from flows.pipeline import pipeline
from lmforge.errors import StageFailed
from lmforge.runcompare import VERDICTS
from lmforge.runview import changed_settings, outcome, run_name
from tests.helpers import chat_rows, sft, train_pipeline, write_config, write_jsonl, write_task_dir

PASSING = [{"metric": "sft/t_mc/acc", "against": "sft", "max_regression": 0.0}]
IMPOSSIBLE = "stages.eval.gates=[{metric: sft/t_mc/acc_norm, against: sft, max_regression: 0}]"  # sft has no acc_norm


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four runs of one config: fresh (gates pass), all cached, one with a changed sft learning rate and an
    impossible gate (sft reruns, eval fails), and the first config again with a `headline:` of its own (all cached).
    The flow summaries, the failed run's id, the folder and a client."""
    root = tmp_path_factory.mktemp("view")
    write_jsonl(root / "data" / "chat.jsonl", chat_rows(120))
    tasks = write_task_dir(root / "tasks")
    raw = train_pipeline(root, {
        "sft": sft(method="full", max_steps=4, evaluate=True, seed=1),
        "eval": {"kind": "eval", "inputs": ["sft", "shard"], "retries": 0, "models": [{"name": "sft", "input": "sft"}],
                 "tasks": ["t_mc"], "task_dirs": [str(tasks)], "gates": PASSING,
                 "chat_loss": [{"input": "shard", "max_conversations": 6}]},
        # registered as soon as sft is done (no eval input): a failed eval's model is still a candidate
        "export": {"kind": "export", "inputs": ["sft"], "retries": 0, "publish_to": "published/v-sft"},
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
    # the first config again, with a headline of its own: every stage cached (the headline is not in any id)
    named = pipeline(config_path=str(cfg), overrides=["headline=[tokens_trained/sft, sft/chat_loss/assistant_nll]"])
    return {"fresh": fresh, "cached": cached, "changed_id": failed[0].info.run_id, "named": named, "root": root,
            "cfg": cfg, "client": client}


def summary_json(client, run_id: str) -> dict:
    import mlflow.artifacts

    return json.loads(mlflow.artifacts.load_text(f"{client.get_run(run_id).info.artifact_uri}/summary.json"))


def test_fresh_and_cached_parents_have_the_same_few_metric_keys(runs):
    client = runs["client"]
    fresh, cached = (client.get_run(runs[k]["mlflow_run_id"]) for k in ("fresh", "cached"))
    changed = client.get_run(runs["changed_id"])
    assert (runs["fresh"]["ran"], runs["cached"]["cached"]) == (6, 6)
    keys = set(fresh.data.metrics)
    assert set(cached.data.metrics) == keys
    # the changed run's headline is its gate's metric, sft/t_mc/acc_norm, which sft does not have (its gate failed)
    assert set(changed.data.metrics) == keys - {"0_headline/sft/t_mc/acc"}
    assert not [k for k in keys if k.startswith(("eval/", "sft/"))]  # no per-stage details, no eval/eval/
    chat = {k for k in keys if k.startswith("summary/sft/chat_loss/")}
    assert {"summary/sft/chat_loss/assistant_nll", "summary/sft/chat_loss/assistant_perplexity"} <= chat
    assert keys - chat == {"stages_ran", "stages_cached", "stages_failed", "summary/wall_seconds",
                           "summary/gates_passed", "summary/gates_failed", "summary/expectations_failed",
                           "summary/sft/t_mc/acc", "summary/sft/t_mc/acc_stderr", "summary/tokens_trained/sft",
                           "0_headline/sft/t_mc/acc"}  # the headline: by default the gated metric
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
    # plots on every parent: loss curves of the training stages (sft's validation loss too) and the eval bar chart
    for run in (fresh, cached):
        assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "plots")) == [
            "plots/eval.png", "plots/loss_curves.png"]
        assert summary_json(client, run.info.run_id)["plots"]["plots/loss_curves.png"] == [
            "sft: train/loss", "sft: eval/loss"]
    # one child per stage
    kids = client.search_runs([fresh.info.experiment_id], f"tags.mlflow.parentRunId = '{fresh.info.run_id}'")
    assert sorted(r.info.run_name for r in kids) == ["eval", "export", "ingest", "sft", "shard", "tokenizer"]


def test_headline_and_directions_on_the_parent(runs):
    client = runs["client"]
    fresh, named = (client.get_run(runs[k]["mlflow_run_id"]) for k in ("fresh", "named"))
    m = fresh.data.metrics
    assert m["0_headline/sft/t_mc/acc"] == m["summary/sft/t_mc/acc"]
    # a config's own headline: those keys, and not the default
    n = named.data.metrics
    assert sorted(k for k in n if k.startswith("0_headline/")) == ["0_headline/sft/chat_loss/assistant_nll",
                                                                     "0_headline/tokens_trained/sft"]
    assert n["0_headline/tokens_trained/sft"] == m["summary/tokens_trained/sft"]
    assert n["0_headline/sft/chat_loss/assistant_nll"] == m["summary/sft/chat_loss/assistant_nll"]
    # every parent metric has a declared direction: the eval's from its result (lm-eval's and lmforge's own)
    summary = summary_json(client, fresh.info.run_id)
    dirs = summary["directions"]
    assert set(dirs) == set(m) and summary["headline"] == ["0_headline/sft/t_mc/acc"]
    assert (dirs["summary/sft/t_mc/acc"], dirs["summary/sft/chat_loss/assistant_nll"],
            dirs["summary/sft/chat_loss/assistant_perplexity"], dirs["0_headline/sft/t_mc/acc"]) == (
        "higher", "lower", "lower", "higher")
    assert {dirs[k] for k in ("summary/wall_seconds", "summary/tokens_trained/sft", "stages_ran", "stages_cached",
                              "summary/sft/t_mc/acc_stderr")} == {"none"}
    assert (dirs["summary/gates_failed"], dirs["summary/gates_passed"], dirs["stages_failed"]) == (
        "lower", "higher", "lower")
    # the parent's params: the key settings of the training stages; every setting is on the stage's run
    assert set(fresh.data.params) == {"sft.method", "sft.learning_rate", "sft.max_steps", "sft.epochs", "sft.seed"}


def test_run_names_tell_fresh_cached_and_partial_runs_apart(runs):
    client = runs["client"]
    fresh, cached, changed, named = (client.get_run(i) for i in (
        runs["fresh"]["mlflow_run_id"], runs["cached"]["mlflow_run_id"], runs["changed_id"],
        runs["named"]["mlflow_run_id"]))
    h = fresh.data.tags["lmforge.config_hash"]
    assert fresh.info.run_name == f"v {h[:8]} · 6 ran"
    assert cached.info.run_name == f"v {h[:8]} · 6 cached"
    h2 = changed.data.tags["lmforge.config_hash"]
    assert h2 != h and changed.info.run_name.startswith(f"v {h2[:8]} eval.gates=")
    assert changed.info.run_name.endswith(", sft.learning_rate=0.001 · reran sft+2")  # eval (failed) and export ran too
    assert len(changed.info.run_name) <= 90
    assert changed.data.tags["lmforge.attempt"] == "1" and "lmforge.retry_of" not in changed.data.tags
    # the settings changed since the previous run are params too (the compare view's "why")
    assert changed.data.params["sft.learning_rate"] == "0.001" and "eval.gates" in changed.data.params
    assert "eval.gates" not in fresh.data.params
    # back to the first config: the name says what changed back, and that all of it was cached
    assert named.info.run_name.startswith(f"v {h[:8]} eval.gates=") and named.info.run_name.endswith(
        "sft.learning_rate=0.003 · 6 cached")
    # the experiment opens on MLflow's model-training pages (runs, charts, compare), not on GenAI's traces
    assert client.get_experiment(fresh.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"


def test_outcome_words():
    assert outcome({"a": "run", "b": "run"}) == "2 ran"
    assert outcome({"a": "cached", "b": "cached"}) == "2 cached"
    assert outcome({"a": "cached", "b": "ran", "c": "failed", "d": "ran"}) == "reran b+2"
    assert outcome({"a": "cached", "b": "ran"}) == "reran b"
    assert run_name("demo", "0123456789abcdef", [], "15 cached") == "demo 01234567 · 15 cached"
    name = run_name("demo", "0123456789abcdef", [f"s.k{i}=2" for i in range(20)], "reran sft+4")
    assert len(name) <= 90 and name.endswith(" more · reran sft+4")


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
    assert model.description.startswith("Standalone model of the sft stage 'sft' of pipeline 'v' (method full, "
                                        "base a new llama model from a config), exported by stage 'export': merged "
                                        "float32 weights")
    versions = {v.tags["lmforge.artifact_id"]: v for v in client.search_model_versions("name='v-sft'")}
    first = versions[runs["fresh"]["stages"]["export"]["artifact_id"]]
    assert len(versions) == 2
    second = next(v for a, v in versions.items() if a != runs["fresh"]["stages"]["export"]["artifact_id"])
    assert set(first.tags) == {"lmforge.artifact_id", "lmforge.artifact_uri", "lmforge.pipeline", "lmforge.stage",
                               "lmforge.export_stage", "lmforge.source_artifact", "lmforge.dtype",
                               "lmforge.evaluation", "lmforge.method", "lmforge.git_commit", "lmforge.source_run_id",
                               "lmforge.contents", "lmforge.model_digest"}
    # the model files only, logged to the run that made them (tests/test_registry.py)
    assert first.source == f"runs:/{runs['fresh']['stages']['export']['mlflow_run_id']}/model"
    assert first.tags["lmforge.method"] == "full"
    # the changed run made a new candidate, but its eval failed: @champion stays on the version that passed
    assert client.get_model_version_by_alias("v-sft", "candidate").version == second.version
    assert client.get_model_version_by_alias("v-sft", "champion").version == first.version
    fresh = client.get_run(runs["fresh"]["mlflow_run_id"])
    assert fresh.data.tags["lmforge.champion"] == f"v-sft/{first.version}"
    assert "lmforge.champion" not in client.get_run(runs["changed_id"]).data.tags
    # publish_to got the champion's folder, once; the changed run's model (gates failed) was not published
    target = runs["root"] / "published" / "v-sft"
    assert runs["fresh"]["published"] == {"export": f"published {target}"}
    assert runs["cached"]["published"] == {"export": f"unchanged {target}"}
    assert fresh.data.tags["lmforge.published"] == f"export: published {target}"
    marker = json.loads((target / "lmforge_published.json").read_text())
    assert marker["artifact"] == f"export/{runs['fresh']['stages']['export']['artifact_id']}"
    assert "lmforge.published" not in client.get_run(runs["changed_id"]).data.tags


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
    # eval and export both follow sft, so either may start first: the stages are listed in the order they started
    reused = next(line for line in lines if line.startswith("B reused"))
    head, _, stages = reused.partition(": ")
    assert head == "B reused 3 of A's 6 artifacts and has other ones for 3 stage(s)"
    assert stages.endswith(".") and stages[:-1].split(", ")[0] == "sft"
    assert sorted(stages[:-1].split(", ")) == ["eval", "export", "sft"]
    gates = [line.split() for line in lines if line.strip().startswith("summary/gates_")]
    assert gates == [["summary/gates_failed", "0", "1", "↓", "worse"], ["summary/gates_passed", "1", "0", "↓", "worse"]]
    rows = metric_rows(lines)
    # B's headline is its failed gate's metric, which it does not have: A's headline row is A's alone, and the
    # metric itself has its own row
    assert rows["0_headline/sft/t_mc/acc"].endswith("only in A")
    acc = rows["summary/sft/t_mc/acc"]
    assert "±" in acc and acc.endswith(("↑ better", "↓ worse", "= same", "(within 2 stderr)"))
    nll = rows["summary/sft/chat_loss/assistant_nll"]
    assert nll.endswith(("↑ better", "↓ worse", "(within 2 stderr)"))  # sft changed: so did its chat loss
    assert "MLflow compare view: http://127.0.0.1:5000/#/compare-runs?runs=" in out
    assert f"mlflow ui --backend-store-uri {uri}" in out
    assert main(["compare", "nope", runs["changed_id"], "--tracking", uri]) == 2
    assert "'nope' is neither an MLflow run id nor the Prefect flow run id" in capsys.readouterr().err


def metric_rows(lines: list[str]) -> dict[str, str]:
    """The metric rows of `lmforge compare`'s output, by key; each must end with a verdict."""
    start = next(i for i, line in enumerate(lines) if line.startswith(("headline metrics", "metrics,")))
    rows = {}
    for line in lines[start:]:
        if not line.startswith("  "):
            if line.startswith("MLflow compare view"):
                break
            continue
        rows[line.split()[0]] = line.rstrip()
        assert line.rstrip().removesuffix(" (within 2 stderr)").endswith(VERDICTS), line
    return rows


def test_compare_of_a_cached_rerun_says_replay_and_marks_timings_as_info(runs, capfd):
    uri = f"sqlite:///{runs['root'] / 'mlflow.db'}"
    a, b = runs["fresh"]["mlflow_run_id"], runs["cached"]["mlflow_run_id"]
    capfd.readouterr()
    assert main(["compare", a, b, "--tracking", uri]) == 0
    out, err = capfd.readouterr()
    assert err == ""  # no download progress bars, no warnings
    lines = out.splitlines()
    assert lines[3].startswith("B replayed A's cached artifacts: every one of its 6 stages was cached, with A's "
                               "artifact ids")
    assert "config: 0 setting(s) differ" in out
    rows = metric_rows(lines)
    assert set(rows) == {k for k in runs["client"].get_run(a).data.metrics if not k.endswith("_stderr")} - {
        "summary/sft/t_mc/acc"}
    for key in ("summary/wall_seconds", "stages_ran", "stages_cached", "summary/tokens_trained/sft"):
        assert rows[key].endswith("  info"), rows[key]
    assert rows["0_headline/sft/t_mc/acc"].endswith("= same")
    assert rows["summary/sft/chat_loss/assistant_nll"].endswith("= same")
    assert rows["summary/gates_passed"].endswith("= same")
    # the other way round: A replayed B's
    assert main(["compare", b, a, "--tracking", uri]) == 0
    assert "A replayed B's cached artifacts" in capfd.readouterr().out
