"""Alignment stages: reward (TRL RewardTrainer) and dpo (TRL DPOTrainer) on top of a tiny SFT model.

The same tiny Llama and on-the-fly tokenizer as tests/test_trainer.py. The preference set is learnable:
the chosen answer is the SFT format with the right sum ("3 plus 4 equals 7."), the rejected one a
differently worded wrong sum ("I think it is 9."). On top of the 120 good pairs it holds 6 pairs with
chosen == rejected (skipped by both stages) and 5 pairs whose prompt alone is longer than
max_length_tokens (dropped by DPOTrainer, and by RewardTrainer as too long): the counts are exact.
The data stages and one full SFT stage run once per module into a shared store.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from lmforge.config import parse_config
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from tests.conftest import write_jsonl
from tests.test_trainer import SFT_FAST, TINY_LLAMA, artifact, chat_rows

GOOD, IDENTICAL, LONG = 120, 6, 5
MAX_LENGTH = 64


def preference_rows() -> list[dict[str, str]]:
    rows = []
    for i in range(GOOD):
        a, b = i % 10, (i // 10) % 10
        wrong = a + b + 1 + i % 3
        rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f"{a} plus {b} equals {a + b}.",
                     "rejected": f"I think it is {wrong}."})
    for i in range(IDENTICAL):  # nothing to prefer
        rows.append({"prompt": f"What is {i} plus {i}?", "chosen": f"{i} plus {i} equals {2 * i}.",
                     "rejected": f"{i} plus {i} equals {2 * i}."})
    for i in range(LONG):  # the prompt alone is far beyond max_length_tokens
        rows.append({"prompt": " ".join([f"What is {i} plus {i}?"] * 30), "chosen": f"{i} plus {i} equals {2 * i}.",
                     "rejected": f"I think it is {2 * i + 1}."})
    return rows


def pipeline(root: Path, stages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "align",
        "store": str(root / "artifacts"),
        "tracking": f"sqlite:///{root / 'mlflow.db'}",
        "datasets": {"chat": {"path": "data/chat.jsonl", "kind": "chat"},
                     "pairs": {"path": "data/pairs.jsonl", "kind": "preference"}},
        "stages": {
            "ingest": {"kind": "ingest", "inputs": ["chat"], "retries": 0},
            "shard": {"kind": "shard", "inputs": ["ingest"], "validation_fraction": 0.1, "retries": 0},
            "tokenizer": {"kind": "tokenizer", "inputs": ["shard"], "vocab_size": 300, "min_frequency": 1,
                          "retries": 0},
            "ingest_pairs": {"kind": "ingest", "inputs": ["pairs"], "retries": 0},
            "shard_pairs": {"kind": "shard", "inputs": ["ingest_pairs"], "validation_fraction": 0.15, "retries": 0},
            "sft": {"kind": "sft", "inputs": ["shard", "tokenizer"], "base_model": {"config": TINY_LLAMA},
                    "method": "full", "max_steps": 12, "evaluate": False, **SFT_FAST},
            **stages,
        },
    }


def run_stages(root: Path, kinds, stages: dict[str, dict[str, Any]], names: list[str], tracker=None):
    plan = make_plan(parse_config(pipeline(root, stages), kinds, root=root), kinds)
    ctx = RunContext(plan=plan, kinds=kinds, tracker=tracker)
    if tracker is not None:
        ctx.parent_run_id = tracker.start_run("pipeline", {})
    out = {n: execute_stage(ctx, n) for n in names}
    return plan, out


@pytest.fixture(scope="module")
def root(tmp_path_factory, kinds_module):
    root = tmp_path_factory.mktemp("align")
    write_jsonl(root / "data" / "chat.jsonl", chat_rows(200))
    write_jsonl(root / "data" / "pairs.jsonl", preference_rows())
    run_stages(root, kinds_module, {}, ["ingest", "shard", "tokenizer", "ingest_pairs", "shard_pairs", "sft"])
    return root


FAST = {"max_length_tokens": MAX_LENGTH, "batch_size_per_device": 8, "warmup_steps": 1, "logging_steps": 1,
        "retries": 0}


def reward(**over) -> dict[str, Any]:
    return {"kind": "reward", "inputs": ["shard_pairs", "sft"], "learning_rate": 1e-3, **FAST, **over}


def dpo(**over) -> dict[str, Any]:
    return {"kind": "dpo", "inputs": ["shard_pairs", "sft"], "learning_rate": 5e-3, "beta": 0.1, **FAST, **over}


def _counts(r: dict[str, Any], dropped_key: str) -> None:
    """Exact skip and drop counts: every record is either used, identical, or too long."""
    assert r["train_records"] + r["validation_records"] == GOOD + IDENTICAL + LONG
    assert r["skipped_identical_pairs"] == IDENTICAL
    assert r[dropped_key] == LONG
    assert r["train_pairs"] + r["validation_pairs"] == GOOD
    # the shard stage's split is a seeded hash of the record ids: 111 train and 20 validation records, of which
    # 101 and 19 pairs are used (the 6 identical and 5 too long pairs fall 5 + 5 in train, 1 + 0 in validation)
    assert (r["train_records"], r["validation_records"], r["train_pairs"], r["validation_pairs"]) == (111, 20, 101, 19)


def _metric_steps(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


# ----------------------------------------------------------------------------------------------
# reward


def test_reward_model_on_the_sft_model_learns_the_preference(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    from lmforge.tracking import Tracker
    from trainer.reward import load_reward_model

    tracker = Tracker(f"sqlite:///{root / 'mlflow-reward.db'}", "align")
    plan, out = run_stages(root, kinds_module, {"rm": reward(method="full", max_steps=15)}, ["rm"], tracker=tracker)
    art, sft_art = artifact(plan, "rm"), artifact(plan, "sft")
    r = art.result
    assert art.manifest["output"] == {"type": "model", "data_kind": "reward"}
    assert {"config.json", "model.safetensors", "tokenizer.json", "lmforge_model.json"} <= set(art.files)
    assert "training_args.bin" not in art.files
    info = json.loads(Path(art.path, "lmforge_model.json").read_text())
    assert (info["kind"], info["format"], info["num_labels"]) == ("reward_model", "full", 1)
    assert info["base"] == {"kind": "artifact_ref", "ref": {"store": plan.store.url, "kind": "sft", "id": sft_art.id}}
    assert (r["method"], r["steps"], r["base_model"]) == ("full", 15, f"sft artifact {sft_art.id}")
    _counts(r, "dropped_too_long")
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
    assert [s for s, _ in _metric_steps(client, run_id, "train/loss")] == list(range(1, 16))
    assert len(_metric_steps(client, run_id, "train/reward_accuracy")) == 15
    assert len(_metric_steps(client, run_id, "train/margin")) == 15
    assert _metric_steps(client, run_id, "eval/reward_accuracy") == [(15, pytest.approx(r["eval_reward_accuracy"]))]
    assert _metric_steps(client, run_id, "eval/margin") == [(15, pytest.approx(r["eval_margin"]))]
    assert client.get_run(run_id).data.metrics["skipped_identical_pairs"] == IDENTICAL


def test_reward_lora_from_a_config_model_and_tokenizer(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    from trainer.reward import load_reward_model

    stage = reward(inputs=["shard_pairs", "tokenizer"], base_model={"config": TINY_LLAMA}, method="lora",
                   max_steps=8, learning_rate=1e-2, evaluate=False,
                   lora={"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]})
    plan, _ = run_stages(root, kinds_module, {"rm_lora": stage}, ["rm_lora"])
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
    import torch
    from safetensors.torch import load_file

    from lmforge.tracking import Tracker
    from trainer import models

    tracker = Tracker(f"sqlite:///{root / 'mlflow-dpo.db'}", "align")
    stage = dpo(method="lora", max_steps=12, lora={"rank": 8, "alpha": 16, "dropout": 0.0,
                                                   "target_modules": "all-linear"})
    plan, out = run_stages(root, kinds_module, {"dpo": stage}, ["dpo"], tracker=tracker)
    art, sft_art = artifact(plan, "dpo"), artifact(plan, "sft")
    r = art.result
    assert art.manifest["output"] == {"type": "model", "data_kind": None}
    assert (r["method"], r["format"], r["reference"], r["steps"]) == ("lora", "adapter", "adapter disabled", 12)
    _counts(r, "dropped_prompt_too_long")
    # at step 1 the policy is the reference: the sigmoid DPO loss is exactly log 2
    assert r["train_loss_first"] == pytest.approx(math.log(2), abs=1e-4)
    assert r["train_loss_last"] < r["train_loss_first"] - 0.1, r
    assert r["eval_reward_accuracy"] is not None and r["eval_reward_accuracy"] >= 0.9 and r["eval_margin"] > 0, r
    info = json.loads(Path(art.path, "lmforge_model.json").read_text())
    assert info["trained_with"] == "dpo"
    assert info["base"] == {"kind": "artifact_ref", "ref": {"store": plan.store.url, "kind": "sft", "id": sft_art.id}}
    adapter = load_file(f"{art.path}/adapter_model.safetensors")
    assert adapter and all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero
    # reloads (adapter merged onto the SFT model from the store), differs from the SFT model and generates
    model, tok = models.load_trained(Path(art.path))
    sft_model, _ = models.load_trained(Path(sft_art.path))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 5?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        assert not torch.allclose(model(**prompt).logits, sft_model(**prompt).logits)
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > prompt["input_ids"].shape[1]
    # metrics on the stage's MLflow run
    run_id = out["dpo"]["mlflow_run_id"]
    client = tracker.client
    assert [s for s, _ in _metric_steps(client, run_id, "train/loss")] == list(range(1, 13))
    assert len(_metric_steps(client, run_id, "train/reward_accuracy")) == 12
    assert len(_metric_steps(client, run_id, "train/margin")) == 12
    assert _metric_steps(client, run_id, "eval/reward_accuracy") == [(12, pytest.approx(r["eval_reward_accuracy"]))]
    assert _metric_steps(client, run_id, "eval/margin") == [(12, pytest.approx(r["eval_margin"]))]
    assert client.get_run(run_id).data.metrics["dropped_prompt_too_long"] == LONG


def test_eval_scores_reward_and_dpo_models_on_held_out_pairs(root, kinds_module):
    """The eval stage's preference accuracy: the reward model by its own scores (formatted as RewardTrainer
    formats pairs, so it equals the reward stage's exact held-out accuracy), the DPO policy by implicit reward
    against the SFT model. Same stage configs as the tests above: cached when they ran first."""
    lora = {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}
    ev = {"kind": "eval", "inputs": ["sft", "dpo", "rm", "shard_pairs"], "retries": 0, "batch_size": 8,
          "models": [{"name": "sft", "input": "sft"}, {"name": "dpo", "input": "dpo"}],
          "preference": {"input": "shard_pairs", "reference": "sft", "reward_models": ["rm"]}}
    plan, _ = run_stages(root, kinds_module, {"rm": reward(method="full", max_steps=15),
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
        make_plan(parse_config(pipeline(root, {"rm": reward(), "eval": ev}), kinds_module, root=root), kinds_module)
    assert "models[0].input 'rm' is a reward model, which scores text and does not generate; list it in " \
           "preference.reward_models instead" in str(e.value)
    ev = {"kind": "eval", "inputs": ["sft", "shard_pairs"], "models": [{"name": "policy", "input": "sft"}],
          "preference": {"input": "shard_pairs", "reward_models": ["sft"]}}
    with pytest.raises(ConfigError) as e:
        make_plan(parse_config(pipeline(root, {"eval": ev}), kinds_module, root=root), kinds_module)
    assert "preference.reward_models[0] 'sft' is model; it needs a reward model (the output of a reward stage)" \
        in str(e.value)
    ev["models"] = [{"name": "sft", "input": "sft"}]  # a reward model's row is named after its stage
    with pytest.raises(ConfigError) as e:
        parse_config(pipeline(root, {"eval": ev}), kinds_module, root=root)
    assert "stages.eval.preference: value error, reward_models sft: a reward model's row is named after its stage, " \
           "and a model entry already has that name; rename the entry" in str(e.value)


def test_dpo_full_trains_against_a_frozen_reference(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    plan, _ = run_stages(root, kinds_module, {"dpo_full": dpo(method="full", max_steps=6, learning_rate=1e-3,
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
    plan, _ = run_stages(root, kinds_module, {"dpo_qlora": stage}, ["dpo_qlora"])
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
        parse_config(pipeline(root, bad), kinds_module, root=root)
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


def _kill_after_first_checkpoint(root, kinds, stages: dict[str, Any], name: str) -> tuple[int, list[BaseException]]:
    import signal
    import threading
    import time

    from tests.test_trainer import _training_child
    from trainer import checkpoint

    plan = make_plan(parse_config(pipeline(root, stages), kinds, root=root), kinds)
    uri = plan.store.checkpoint_uri(plan.stages[name].kind, plan.stages[name].artifact_id)
    errors: list[BaseException] = []

    def attempt():
        try:
            execute_stage(RunContext(plan=plan, kinds=kinds), name)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=attempt)
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and checkpoint.latest_complete(uri) is None and t.is_alive():
        time.sleep(0.005)
    child = _training_child()
    assert child is not None and checkpoint.latest_complete(uri) is not None, "no checkpoint before the run ended"
    child.send_signal(signal.SIGKILL)
    t.join(60)
    return checkpoint.latest_complete(uri)[0], errors


@pytest.mark.parametrize("kind", ["reward", "dpo", "dpo_streamed"])
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
        run_stages(root, kinds_module, stages, ["tok"])
    killed_at, errors = _kill_after_first_checkpoint(root, kinds_module, stages, "resume")
    assert killed_at % 2 == 0 and 2 <= killed_at < 40
    assert len(errors) == 1 and isinstance(errors[0], TrainingError), errors
    plan, out = run_stages(root, kinds_module, stages, ["resume"])
    assert out["resume"]["status"] == "ran"
    r = artifact(plan, "resume").result
    assert (r["resumed_from_step"], r["steps"]) == (killed_at, 40)
    assert r["checkpoints_uploaded"] == list(range(killed_at + 2, 40, 2))
    assert r["train_loss_last"] < r["train_loss_first"]  # the loss history spans both attempts
    if kind == "dpo_streamed":
        assert r["token_shards"] == f"tokenize/{artifact(plan, 'tok').id}"
