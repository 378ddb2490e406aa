"""Alignment stages: reward (TRL RewardTrainer) and dpo (TRL DPOTrainer) on top of a tiny SFT model.

The same tiny Llama and on-the-fly tokenizer as tests/test_trainer.py, and the pipeline and preference set of
tests/helpers.py (align_pipeline, preference_rows). The preference set is learnable: the chosen answer is the SFT
format with the right sum ("3 plus 4 equals 7."), the rejected one a differently worded wrong sum ("I think it is
9."). On top of the 120 good pairs it holds 6 pairs with chosen == rejected (skipped by both stages) and 5 pairs
whose prompt alone is longer than max_length_tokens (dropped by DPOTrainer, and by RewardTrainer as too long): the
counts are exact. The data stages and one full SFT stage run once per module into a shared store.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmforge.config import parse_config
from tests.helpers import (IDENTICAL, LONG, TINY_LLAMA, align_pipeline, align_store, artifact, assert_pair_counts,
                           assert_tuned_model_reloads_and_generates, chat_rows, dpo, metric_steps, plan_of,
                           preference_rows, reward, run_align, signal_after_first_checkpoint)


@pytest.fixture(scope="module")
def root(tmp_path_factory, kinds_module):
    return align_store(tmp_path_factory.mktemp("align"), kinds_module, chat_rows(200), preference_rows())


def _assert_pair_metrics(client, run_id: str, r: dict, steps: int) -> None:
    """A reward or dpo stage's MLflow run: loss, reward accuracy and margin every step, held-out ones at the end."""
    assert [s for s, _ in metric_steps(client, run_id, "train/loss")] == list(range(1, steps + 1))
    assert len(metric_steps(client, run_id, "train/reward_accuracy")) == steps
    assert len(metric_steps(client, run_id, "train/margin")) == steps
    assert metric_steps(client, run_id, "eval/reward_accuracy") == [(steps, pytest.approx(r["eval_reward_accuracy"]))]
    assert metric_steps(client, run_id, "eval/margin") == [(steps, pytest.approx(r["eval_margin"]))]


# ----------------------------------------------------------------------------------------------
# reward


def test_reward_model_on_the_sft_model_learns_the_preference(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    from lmforge.tracking import Tracker
    from trainer.preference import load_reward_model

    tracker = Tracker(f"sqlite:///{root / 'mlflow-reward.db'}", "align")
    plan, out = run_align(root, kinds_module, {"rm": reward(method="full", max_steps=15)}, ["rm"], tracker=tracker)
    art, sft_art = artifact(plan, "rm"), artifact(plan, "sft")
    r = art.result
    assert art.manifest["output"] == {"type": "model", "data_kind": "reward"}
    assert {"config.json", "model.safetensors", "tokenizer.json", "lmforge_model.json"} <= set(art.files)
    assert "training_args.bin" not in art.files
    info = json.loads(Path(art.path, "lmforge_model.json").read_text())
    assert (info["kind"], info["format"], info["num_labels"]) == ("reward_model", "full", 1)
    assert info["base"] == {"kind": "artifact_ref", "ref": {"store": plan.store.url, "kind": "sft", "id": sft_art.id}}
    assert (r["method"], r["steps"], r["base_model"]) == ("full", 15, f"sft artifact {sft_art.id}")
    assert_pair_counts(r, "dropped_too_long")
    assert math.isfinite(r["train_loss_first"]) and r["train_loss_last"] < r["train_loss_first"] - 0.3, r
    assert r["eval_reward_accuracy"] >= 0.9 and r["eval_margin"] > 0, r
    # every backbone weight moved away from the SFT model; the score head is new
    trained, sft_w = load_file(f"{art.path}/model.safetensors"), load_file(f"{sft_art.path}/model.safetensors")
    backbone = [k for k in trained if k != "score.weight"]
    assert set(trained) - set(sft_w) == {"score.weight"} and trained["score.weight"].shape[0] == 1
    assert backbone and [k for k in backbone if torch.equal(trained[k], sft_w[k])] == []
    # reloads from the artifact folder alone; ranks a held-out style pair the right way
    model, tok = load_reward_model(Path(art.path))
    texts = [tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 5?"},
                                      {"role": "assistant", "content": c}], tokenize=False)
             for c in ("2 plus 5 equals 7.", "I think it is 9.")]
    with torch.no_grad():
        scores = model(**tok(texts, return_tensors="pt", padding=True)).logits[:, 0]
    assert torch.isfinite(scores).all() and scores[0] > scores[1], scores
    # metrics on the stage's MLflow run: per step, and held-out at the end
    run_id = out["rm"]["mlflow_run_id"]
    client = tracker.client
    _assert_pair_metrics(client, run_id, r, 15)
    assert client.get_run(run_id).data.metrics["skipped_identical_pairs"] == IDENTICAL


def test_reward_lora_from_a_config_model_and_tokenizer(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    from trainer.preference import load_reward_model

    stage = reward(inputs=["shard_pairs", "tokenizer"], base_model={"config": TINY_LLAMA}, method="lora",
                   max_steps=8, learning_rate=1e-2, evaluate=False,
                   lora={"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
    plan, _ = run_align(root, kinds_module, {"rm_lora": stage}, ["rm_lora"])
    art = artifact(plan, "rm_lora")
    r = art.result
    assert (r["method"], r["steps"], r["validation_pairs"], r["eval_reward_accuracy"]) == ("lora", 8, 0, None)
    # rank 4 on q (64->64) and v (64->32) in 2 layers, plus the whole score head (64 -> 1)
    assert r["trainable_parameters"] == 2 * 4 * ((64 + 64) + (64 + 32)) + 64
    assert r["train_loss_last"] < r["train_loss_first"], r
    # saved merged: a plain sequence-classification model, no adapter files
    assert "adapter_model.safetensors" not in art.files and "model.safetensors" in art.files
    weights = load_file(f"{art.path}/model.safetensors")
    assert not any("lora" in k for k in weights) and weights["score.weight"].shape == (1, 64)
    model, tok = load_reward_model(Path(art.path))
    with torch.no_grad():
        assert torch.isfinite(model(**tok(["What is 1 plus 1?"], return_tensors="pt")).logits).all()


# ----------------------------------------------------------------------------------------------
# dpo


def test_dpo_lora_on_the_sft_model_counts_drops_and_generates(root, kinds_module):
    from safetensors.torch import load_file

    from lmforge.tracking import Tracker

    tracker = Tracker(f"sqlite:///{root / 'mlflow-dpo.db'}", "align")
    stage = dpo(method="lora", max_steps=12, lora={"rank": 8, "alpha": 16, "dropout": 0.0,
                                                   "target_modules": "all-linear"})
    plan, out = run_align(root, kinds_module, {"dpo": stage}, ["dpo"], tracker=tracker)
    art, sft_art = artifact(plan, "dpo"), artifact(plan, "sft")
    r = art.result
    assert art.manifest["output"] == {"type": "model", "data_kind": None}
    assert (r["method"], r["format"], r["reference"], r["steps"]) == ("lora", "adapter", "adapter disabled", 12)
    assert_pair_counts(r, "dropped_prompt_too_long")
    # at step 1 the policy is the reference: the sigmoid DPO loss is exactly log 2
    assert r["train_loss_first"] == pytest.approx(math.log(2), abs=1e-4)
    assert r["train_loss_last"] < r["train_loss_first"] - 0.1, r
    assert r["eval_reward_accuracy"] is not None and r["eval_reward_accuracy"] >= 0.9 and r["eval_margin"] > 0, r
    info = json.loads(Path(art.path, "lmforge_model.json").read_text())
    assert info["trained_with"] == "dpo"
    assert info["base"] == {"kind": "artifact_ref", "ref": {"store": plan.store.url, "kind": "sft", "id": sft_art.id}}
    adapter = load_file(f"{art.path}/adapter_model.safetensors")
    assert adapter and all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero
    assert_tuned_model_reloads_and_generates(art, sft_art)
    # metrics on the stage's MLflow run
    run_id = out["dpo"]["mlflow_run_id"]
    client = tracker.client
    _assert_pair_metrics(client, run_id, r, 12)
    assert client.get_run(run_id).data.metrics["dropped_prompt_too_long"] == LONG


def test_eval_scores_reward_and_dpo_models_on_held_out_pairs(root, kinds_module):
    """The eval stage's preference accuracy: the reward model by its own scores (formatted as RewardTrainer
    formats pairs, so it equals the reward stage's exact held-out accuracy), the DPO policy by implicit reward
    against the SFT model. Same stage configs as the tests above: cached when they ran first."""
    lora = {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}
    ev = {"kind": "eval", "inputs": ["sft", "dpo", "rm", "shard_pairs"], "retries": 0, "batch_size": 8,
          "models": [{"name": "sft", "input": "sft"}, {"name": "dpo", "input": "dpo"}],
          "preference": {"input": "shard_pairs", "reference": "sft", "reward_models": ["rm"]}}
    plan, _ = run_align(root, kinds_module, {"rm": reward(method="full", max_steps=15),
                                              "dpo": dpo(method="lora", max_steps=12, lora=lora), "eval": ev},
                         ["rm", "dpo", "eval"])
    rm, dpo_r, r = artifact(plan, "rm").result, artifact(plan, "dpo").result, artifact(plan, "eval").result
    scores = r["eval"]
    assert set(scores) == {"sft", "dpo", "rm"}
    assert "accuracy" not in scores["sft"]["preference"]  # the reference: by itself only (loglik_accuracy)
    assert scores["dpo"]["preference"]["loglik_accuracy"] >= scores["sft"]["preference"]["loglik_accuracy"]
    # 20 validation records: 19 usable pairs and one with chosen == rejected, skipped and noted
    assert "preference: 1 of 20 pairs have chosen == rejected and are skipped" in r["notes"]
    task = next(t for t in r["tasks"] if t["task"] == "preference")
    assert (task["pairs"], task["implicit_dpo"], task["reward_models"]) == (19, ["dpo"], ["rm"])
    assert scores["rm"]["preference"]["accuracy"] == pytest.approx(rm["eval_reward_accuracy"], abs=1e-9)
    assert scores["rm"]["preference"]["reward_margin"] == pytest.approx(rm["eval_margin"], rel=1e-4)
    assert scores["dpo"]["preference"]["accuracy"] >= 0.9 and scores["dpo"]["preference"]["reward_margin"] > 0
    assert dpo_r["eval_reward_accuracy"] >= 0.9


def test_eval_rejects_a_reward_model_as_a_generating_model(root, kinds_module):
    from lmforge.errors import ConfigError

    ev = {"kind": "eval", "inputs": ["rm"], "models": [{"name": "rm", "input": "rm"}]}
    with pytest.raises(ConfigError) as e:
        plan_of(align_pipeline(root, {"rm": reward(), "eval": ev}), kinds_module, root)
    assert "models[0].input 'rm' is a reward model, which scores text and does not generate; list it in " \
           "preference.reward_models instead" in str(e.value)
    ev = {"kind": "eval", "inputs": ["sft", "shard_pairs"], "models": [{"name": "policy", "input": "sft"}],
          "preference": {"input": "shard_pairs", "reward_models": ["sft"]}}
    with pytest.raises(ConfigError) as e:
        plan_of(align_pipeline(root, {"eval": ev}), kinds_module, root)
    assert "preference.reward_models[0] 'sft' is model; it needs a reward model (the output of a reward stage)" \
        in str(e.value)
    ev["models"] = [{"name": "sft", "input": "sft"}]  # a reward model's row is named after its stage
    with pytest.raises(ConfigError) as e:
        parse_config(align_pipeline(root, {"eval": ev}), kinds_module, root=root)
    assert "stages.eval.preference: value error, reward_models sft: a reward model's row is named after its stage, " \
           "and a model entry already has that name; rename the entry" in str(e.value)


def test_dpo_full_trains_against_a_frozen_reference(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    plan, _ = run_align(root, kinds_module, {"dpo_full": dpo(method="full", max_steps=6, learning_rate=1e-3,
                                                                   evaluate=False, checkpoint_every_steps=3)},
                         ["dpo_full"])
    art, sft_art = artifact(plan, "dpo_full"), artifact(plan, "sft")
    r = art.result
    assert (r["format"], r["reference"], r["steps"], r["checkpoints_uploaded"]) == ("full", "frozen copy", 6, [3])
    assert r["train_loss_first"] == pytest.approx(math.log(2), abs=1e-4)
    assert r["train_loss_last"] < r["train_loss_first"], r
    trained, sft_w = load_file(f"{art.path}/model.safetensors"), load_file(f"{sft_art.path}/model.safetensors")
    assert set(trained) == set(sft_w)
    assert [k for k in trained if torch.equal(trained[k], sft_w[k])] == []


@pytest.mark.slow
def test_dpo_qlora_on_a_4bit_base(root, kinds_module):
    stage = dpo(method="qlora", max_steps=4, learning_rate=1e-2, evaluate=False,
                lora={"rank": 4, "target_modules": "all-linear"})
    plan, _ = run_align(root, kinds_module, {"dpo_qlora": stage}, ["dpo_qlora"])
    r = artifact(plan, "dpo_qlora").result
    assert (r["format"], r["reference"], r["steps"]) == ("adapter", "frozen copy of the initial adapter", 4)
    assert r["train_loss_first"] == pytest.approx(math.log(2), abs=1e-3)
    assert r["train_loss_last"] < r["train_loss_first"], r


def test_align_config_errors(root, kinds_module):
    from lmforge.errors import ConfigError

    bad = {
        "dpo_no_model": dpo(inputs=["shard_pairs"]),
        "dpo_base": dpo(base_model={"config": TINY_LLAMA}),
        "dpo_chat": dpo(inputs=["shard", "sft"]),
        "dpo_on_rm": dpo(inputs=["shard_pairs", "rm"]),
        "rm": reward(),
        "rm_no_model": reward(inputs=["shard_pairs"]),
    }
    with pytest.raises(ConfigError) as e:
        parse_config(align_pipeline(root, bad), kinds_module, root=root)
    assert sorted(e.value.problems) == sorted([
        "stages.dpo_no_model.inputs: dpo needs a model to start from: add an sft stage to inputs",
        "stages.dpo_base.inputs: dpo starts from the model it is given in inputs (an sft stage); remove base_model",
        "stages.dpo_chat.inputs: dpo reads exactly one preference shards input (or a tokenize stage's dpo_tokens "
        "shards) (got chat shards)",
        "stages.dpo_on_rm.inputs: input 1 is a reward model; dpo starts from a policy model (e.g. an sft stage)",
        "stages.rm_no_model.inputs: reward needs a base model: set base_model (config, path, package+file or hub) or "
        "add a model stage to inputs",
    ])


# ----------------------------------------------------------------------------------------------
# checkpoints: SIGKILL the training process, rerun, resume


@pytest.mark.parametrize("kind", ["reward", "dpo", pytest.param("dpo_streamed", marks=pytest.mark.slow)])
# dpo_streamed is slow-marked: tests/test_tokenize.py resumes a streamed training run in the default suite
def test_sigkill_then_rerun_resumes_from_the_last_checkpoint(root, kinds_module, kind):
    """dpo_streamed: dpo on a tokenize stage's rows, streamed from the store, killed and resumed the same way (that
    the resumed stream skips exactly what the checkpoint consumed is tests/test_tokenize.py's bit-for-bit sft
    test: the same TokenRowStream)."""
    from trainer.errors import TrainingError

    make = reward if kind == "reward" else dpo
    stage = make(method="lora", max_steps=40, checkpoint_every_steps=2, keep_checkpoints=2, evaluate=False,
                 lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]})
    stages = {"resume": stage}
    if kind == "dpo_streamed":
        stages = {"tok": {"kind": "tokenize", "inputs": ["shard_pairs", "sft"], "retries": 0},
                  "resume": {**stage, "inputs": ["tok", "sft"]}}
        run_align(root, kinds_module, stages, ["tok"])
    killed_at, errors = signal_after_first_checkpoint(plan_of(align_pipeline(root, stages), kinds_module, root),
                                                      kinds_module, "resume")
    assert killed_at % 2 == 0 and 2 <= killed_at < 40
    assert len(errors) == 1 and isinstance(errors[0], TrainingError), errors
    plan, out = run_align(root, kinds_module, stages, ["resume"])
    assert out["resume"]["status"] == "ran"
    r = artifact(plan, "resume").result
    assert (r["resumed_from_step"], r["steps"]) == (killed_at, 40)
    assert r["checkpoints_uploaded"] == list(range(killed_at + 2, 40, 2))
    assert r["train_loss_last"] < r["train_loss_first"]  # the loss history spans both attempts
    if kind == "dpo_streamed":
        assert r["token_shards"] == f"tokenize/{artifact(plan, 'tok').id}"
