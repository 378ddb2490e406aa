"""ppo stage: TRL's PPOTrainer (trl.experimental.ppo, TRL 1.12) on a tiny SFT policy against a tiny reward model.

The same tiny Llama and on-the-fly tokenizer as tests/test_trainer.py, and the pipeline of tests/test_align.py
(tests/helpers.py), with data built so that PPO has something to learn in a few updates: the SFT conversations
answer in two styles, "Sure! 3 plus 4 equals 7." (2 in 5) and "No. I think it is 9." (3 in 5), so the SFT policy
samples both and answers greedily in the second; the reward model learns from pairs that prefer the first. 5 more
preference prompts are far longer than max_length_tokens - max_new_tokens: skipped and counted. The data stages, the
SFT stage and the reward stage run once per module into a shared store.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from lmforge.config import parse_config
from lmforge.executor import RunContext, execute_stage
from tests.helpers import (ALIGN_FAST, TINY_LLAMA, align_pipeline, align_store, artifact,
                           assert_tuned_model_reloads_and_generates, metric_steps, plan_of, run_align,
                           signal_after_first_checkpoint)

GOOD, LONG = 120, 5


def ppo_chat_rows(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        a, b = i % 10, (i * 7 + 3) % 10
        answer = f"Sure! {a} plus {b} equals {a + b}." if i % 5 < 2 else f"No. I think it is {a + b + 1 + i % 3}."
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": answer}]})
    return rows


def ppo_preference_rows() -> list[dict[str, str]]:
    rows = []
    for i in range(GOOD):
        a, b = i % 10, (i // 10) % 10
        rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f"Sure! {a} plus {b} equals {a + b}.",
                     "rejected": f"No. I think it is {a + b + 1 + i % 3}."})
    for i in range(LONG):  # the prompt alone is far beyond max_length_tokens
        rows.append({"prompt": " ".join([f"What is {i} plus {i}?"] * 30), "chosen": f"Sure! {i} plus {i} equals "
                     f"{2 * i}.", "rejected": f"No. I think it is {2 * i + 1}."})
    return rows


#: the policy learns both answer styles; the reward model the preference between them
BASE_STAGES = {
    "sft": {"kind": "sft", "inputs": ["shard", "tokenizer"], "base_model": {"config": TINY_LLAMA}, "method": "full",
            "max_steps": 40, "evaluate": False, "learning_rate": 3e-3, "warmup_steps": 2, "control_prompts": [],
            **ALIGN_FAST},
    "rm": {"kind": "reward", "inputs": ["shard_pairs", "sft"], "method": "full", "max_steps": 12,
           "learning_rate": 1e-3, "evaluate": False, "control_prompts": [], **ALIGN_FAST},
}
QUICK = {**ALIGN_FAST, "max_new_tokens": 12, "ppo_epochs": 2, "control_prompts": []}


def ppo(**over) -> dict[str, Any]:
    return {"kind": "ppo", "inputs": ["shard_pairs", "sft", "rm"], **QUICK, **over}


def run(root: Path, kinds, stages: dict[str, dict[str, Any]], names: list[str], tracker=None):
    return run_align(root, kinds, {**BASE_STAGES, **stages}, names, tracker=tracker)


@pytest.fixture(scope="module")
def root(tmp_path_factory, kinds_module):
    return align_store(tmp_path_factory.mktemp("ppo"), kinds_module, ppo_chat_rows(200), ppo_preference_rows(),
                       BASE_STAGES, ("rm",))


def _weights(art) -> dict[str, Any]:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if "adapter_model.safetensors" in art.files else "model.safetensors"
    return load_file(f"{art.path}/{name}")


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _rerun_unpublished(plan, kinds, stage: str):
    """Delete the stage's published manifest and run the stage again: what it publishes now (a resume from its
    uploaded checkpoints)."""
    Path(artifact(plan, stage).path, "manifest.json").unlink()
    execute_stage(RunContext(plan=plan, kinds=kinds), stage)
    return artifact(plan, stage)


# ----------------------------------------------------------------------------------------------
# lora: trains, raises the held-out reward, reloads; a rerun resumes from its checkpoint to the same weights


def test_ppo_lora_raises_the_heldout_reward_reloads_and_resumes_exactly(root, kinds_module):
    import torch

    from lmforge.tracking import Tracker
    from trainer.preference import load_reward_model

    tracker = Tracker(f"sqlite:///{root / 'mlflow-ppo.db'}", "ppo")
    stage = ppo(method="lora", max_steps=8, learning_rate=1e-2, checkpoint_every_steps=4, keep_checkpoints=1,
                lora={"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"})
    plan, out = run(root, kinds_module, {"ppo": stage}, ["ppo"], tracker=tracker)
    art, sft_art, rm_art = artifact(plan, "ppo"), artifact(plan, "sft"), artifact(plan, "rm")
    r = art.result
    assert art.manifest["output"] == {"type": "model", "data_kind": None}
    assert (r["method"], r["format"], r["reference"]) == ("lora", "adapter", "adapter disabled")
    assert (r["base_model"], r["reward_model"]) == (f"sft artifact {sft_art.id}", f"reward artifact {rm_art.id}")
    # every preference record gives a prompt; the long ones are skipped, in both splits
    assert r["train_records"] + r["validation_records"] == GOOD + LONG
    assert r["dropped_prompt_too_long"] == LONG
    assert (r["train_records"], r["train_prompts"], r["validation_prompts"]) == (106, 102, 17)
    # 8 updates of 8 rollouts; every PPO figure finite; the value model (a copy of the reward model) trained too
    assert (r["steps"], r["rollouts_per_step"], r["episodes"], r["checkpoints_uploaded"]) == (8, 8, 64, [4])
    for k in ("train_reward_first", "train_reward_last", "train_kl_last", "train_policy_loss_last",
              "train_value_loss_last", "train_entropy_last"):
        assert math.isfinite(r[k]), (k, r)
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    assert r["trainable_parameters"] == 2 * sum(8 * (i + o) for i, o in shapes.values())
    assert r["value_parameters"] == sum(v.numel() for v in _weights(rm_art).values())
    # the measurable improvement: greedy answers to the held-out prompts score higher after PPO than the reference's
    assert r["eval_reward_trained"] > r["eval_reward_start"] + 0.5, r
    # ... and those figures are the real reward model's scores of the saved generations
    heldout = json.loads(Path(art.path, "heldout_generations.json").read_text())
    assert len(heldout) == r["validation_prompts"]
    rm, _ = load_reward_model(Path(rm_art.path))
    for side, key in (("policy", "eval_reward_trained"), ("reference", "eval_reward_start")):
        with torch.no_grad():
            scores = [float(rm(input_ids=torch.tensor([h[side]["token_ids"]])).logits[0, 0]) for h in heldout]
        assert scores == pytest.approx([h[side]["reward"] for h in heldout], abs=1e-4)
        assert sum(scores) / len(scores) == pytest.approx(r[key], abs=1e-4)
    # the adapter trained (B starts at zero) and sits on the SFT model in the store
    info = json.loads(Path(art.path, "lmforge_model.json").read_text())
    assert (info["trained_with"], info["format"]) == ("ppo", "adapter")
    assert info["base"] == {"kind": "artifact_ref", "ref": {"store": plan.store.url, "kind": "sft", "id": sft_art.id}}
    assert info["reward_model"] == {"store": plan.store.url, "kind": "reward", "id": rm_art.id}
    adapter = _weights(art)
    assert adapter and all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    # reloads (adapter merged onto the SFT model), differs from the SFT model and generates
    tok = assert_tuned_model_reloads_and_generates(art, sft_art)
    assert tok.padding_side == "right"  # PPO pads prompts on the left while training; the artifact keeps the default
    # metrics on the stage's MLflow run: every update, and the held-out figures at the end
    run_id, client = out["ppo"]["mlflow_run_id"], tracker.client
    for key in ("train/reward", "train/kl", "train/policy_loss", "train/value_loss", "train/entropy",
                "train/learning_rate"):
        assert [s for s, _ in metric_steps(client, run_id, key)] == list(range(1, 9)), key
    assert metric_steps(client, run_id, "train/reward")[-1][1] == pytest.approx(r["train_reward_last"])
    assert metric_steps(client, run_id, "eval/reward") == [(8, pytest.approx(r["eval_reward_trained"]))]
    assert metric_steps(client, run_id, "eval/reward_start") == [(8, pytest.approx(r["eval_reward_start"]))]
    assert client.get_run(run_id).data.metrics["dropped_prompt_too_long"] == LONG

    # the checkpoint holds what a resume needs; unpublish the artifact and rerun: it resumes from update 4 and ends
    # with the very same weights and figures (prompt order, sampling and PPO's shuffles continue where they were)
    ckpt = Path(art.path, "_checkpoints", "checkpoint-4")
    assert {"adapter_model.safetensors", "value_model/model.safetensors", "optimizer.pt", "scheduler.pt",
            "rng_state.pth", "trainer_state.json", "DONE"} <= {p.relative_to(ckpt).as_posix()
                                                              for p in ckpt.rglob("*") if p.is_file()}
    first = _weights(art)
    again = _rerun_unpublished(plan, kinds_module, "ppo")
    r2 = again.result
    assert (r2["resumed_from_step"], r2["steps"], r2["episodes"], r2["checkpoints_uploaded"]) == (4, 8, 64, [])
    assert _same(_weights(again), first)
    for k in ("train_reward_first", "train_reward_last", "train_kl_last", "eval_reward_start", "eval_reward_trained"):
        assert r2[k] == r[k], k


def test_ppo_value_model_lora_trains_an_adapter_and_the_score_head_and_resumes_exactly(root, kinds_module):
    """`value_model: lora`: the value model trains an adapter and its score head, not every weight; a rerun after
    the published artifact is gone resumes from the checkpoint (whose value model holds the adapter) to the same
    weights. At its default (full) the setting stays out of the artifact id."""
    lora = {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}
    stage = ppo(method="lora", max_steps=4, learning_rate=1e-2, checkpoint_every_steps=2, keep_checkpoints=1,
                evaluate=False, value_model="lora", lora=lora)
    plan, _ = run(root, kinds_module, {"ppo_vlora": stage}, ["ppo_vlora"])
    art, rm_art = artifact(plan, "ppo_vlora"), artifact(plan, "rm")
    r = art.result
    score = [k for k in _weights(rm_art) if k.startswith("score.")]
    assert score == ["score.weight"]
    # the same adapter shapes as the policy's (trainable_parameters), plus the 64 x 1 score head
    assert r["value_parameters"] == r["trainable_parameters"] + 64, r
    ckpt = Path(art.path, "_checkpoints", "checkpoint-2", "value_model", "model.safetensors")
    from safetensors.torch import load_file
    value = load_file(str(ckpt))
    assert any("lora_B" in k for k in value) and all(v.abs().sum() > 0 for k, v in value.items() if "lora_B" in k)
    first = _weights(art)
    again = _rerun_unpublished(plan, kinds_module, "ppo_vlora")
    assert (again.result["resumed_from_step"], again.result["steps"]) == (2, 4)
    assert _same(_weights(again), first)
    # the id: lora differs from full, and full is the id the stage had before the setting existed
    from tasks.ppo import PpoStageConfig
    base = PpoStageConfig.model_validate({**stage, "value_model": "full"})
    assert "value_model" not in base.settings()
    assert PpoStageConfig.model_validate(stage).settings()["value_model"] == "lora"


# ----------------------------------------------------------------------------------------------
# full: chat shards as prompts, a frozen reference


def test_ppo_full_on_chat_prompts_against_a_frozen_reference(root, kinds_module):
    import torch

    stage = ppo(inputs=["shard", "sft", "rm"], method="full", max_steps=3, learning_rate=1e-3, evaluate=False,
                gradient_checkpointing=True)
    plan, _ = run(root, kinds_module, {"ppo_full": stage}, ["ppo_full"])
    art, sft_art = artifact(plan, "ppo_full"), artifact(plan, "sft")
    r = art.result
    assert (r["format"], r["reference"], r["steps"], r["episodes"]) == ("full", "frozen copy", 3, 24)
    # a chat record's prompt is its turns before the last assistant turn: 180 + 20 records, none too long
    assert (r["train_records"], r["train_prompts"], r["dropped_prompt_too_long"]) == (180, 180, 0)
    assert (r["validation_prompts"], r["eval_reward_start"], r["eval_reward_trained"]) == (0, None, None)
    assert r["trainable_parameters"] == sum(v.numel() for v in _weights(sft_art).values())
    trained, sft_w = _weights(art), _weights(sft_art)
    assert set(trained) == set(sft_w)
    assert [k for k in trained if torch.equal(trained[k], sft_w[k])] == []


# ----------------------------------------------------------------------------------------------
# errors


def test_ppo_config_errors(root, kinds_module):
    """Bad inputs and bad settings fail when the config is parsed (settings first, then the stage graph)."""
    from lmforge.errors import ConfigError

    def problems(stages: dict[str, dict[str, Any]]) -> list[str]:
        with pytest.raises(ConfigError) as e:
            parse_config(align_pipeline(root, {**BASE_STAGES, **stages}), kinds_module, root=root)
        return sorted(e.value.problems)

    assert problems({
        "no_room": ppo(max_new_tokens=64),
        "minis": ppo(mini_batches=3),
        "whiten": ppo(whiten_rewards=True, mini_batches=2),
        "zero": ppo(deepspeed="zero2", launcher="torchrun", nproc_per_node=2),
        "q_ddp": ppo(method="qlora", launcher="torchrun", nproc_per_node=2),
    }) == sorted([
        "stages.q_ddp.launcher: ppo with method qlora trains in one process only (launcher local) for now; use "
        "launcher local, or method lora or full with torchrun, got 'torchrun'",
        "stages.zero.deepspeed: the ppo stage trains in one process or with DDP (launcher torchrun); deepspeed is not "
        "supported with TRL's PPOTrainer here yet: remove it, got 'zero2'",
        "stages.no_room.max_new_tokens: 64 leaves no room for the prompt in max_length_tokens 64; lower it or raise "
        "max_length_tokens, got 64",
        "stages.minis.mini_batches: batch_size_per_device * grad_accumulation_steps = 8 rollouts per process do not "
        "split into 3 equal mini-batches; use a divisor of 8, got 3",
        "stages.whiten.whiten_rewards: whitening needs at least 8 rollouts per mini-batch and process, got 4 "
        "(batch_size_per_device * grad_accumulation_steps / mini_batches); raise them or set whiten_rewards: false, "
        "got True",
    ])
    assert problems({
        "rm2": BASE_STAGES["rm"],
        "no_rm": ppo(inputs=["shard_pairs", "sft"]),
        "no_policy": ppo(inputs=["shard_pairs", "rm"]),
        "two_rms": ppo(inputs=["shard_pairs", "sft", "rm", "rm2"]),
        "records": ppo(inputs=["ingest_pairs", "sft", "rm"]),
        "with_tokenizer": ppo(inputs=["shard_pairs", "sft", "rm", "tokenizer"]),
        "base": ppo(base_model={"config": TINY_LLAMA}),
    }) == sorted([
        "stages.no_rm.inputs: ppo needs a reward model to score the rollouts: add a reward stage to inputs",
        "stages.no_policy.inputs: ppo needs a policy model to start from: add an sft stage to inputs (a reward model "
        "only scores the rollouts)",
        "stages.two_rms.inputs: ppo takes one policy model and one reward model, got 1 and 2",
        "stages.records.inputs: ppo reads exactly one preference or chat shards input, for its prompts (got none)",
        "stages.with_tokenizer.inputs: input 3 is a tokenizer; ppo uses the policy model's own tokenizer (the reward "
        "model must share it): remove it",
        "stages.base.inputs: ppo starts from the policy model it is given in inputs (an sft stage); remove "
        "base_model",
    ])


def test_the_reward_model_reads_a_rollout_as_it_read_its_training_pairs(root, kinds_module):
    """A rollout ends at the eos; the reward stage's texts end with the chat template's whole end of turn."""
    import copy

    import torch
    from trl.data_utils import _tokenize

    from trainer.rollouts import append_turn_end, turn_end_suffix
    from trainer.preference import load_reward_model
    from trainer.prompts import prompt_ids

    plan, _ = run(root, kinds_module, {}, ["rm"])
    _, tok = load_reward_model(Path(artifact(plan, "rm").path))
    suffix = turn_end_suffix(tok)
    assert tok.convert_ids_to_tokens(suffix) == ["\u010a"]  # ChatML: "\n" after "<|im_end|>" (byte-level BPE)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    for row in ppo_preference_rows()[:3]:
        prompt = [{"role": "user", "content": row["prompt"]}]
        trained_on = _tokenize(tok, prompt + [{"role": "assistant", "content": row["chosen"]}])["input_ids"]
        query = prompt_ids(tok, prompt)
        rollout = query + tok(row["chosen"], add_special_tokens=False)["input_ids"] + [eos, pad, pad]
        read = append_turn_end(torch.tensor([rollout]), pad, len(query), suffix, eos)[0].tolist()
        assert read[:read.index(pad)] == trained_on
    # a response cut off before its eos is read as it is; a plain-text reward model needs no suffix
    cut = torch.tensor([query + [5, 6, 7]])
    assert append_turn_end(cut, pad, len(query), suffix, eos)[0].tolist() == query + [5, 6, 7, pad]
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    assert turn_end_suffix(plain) == []


def test_ppo_pads_with_a_free_token_when_the_tokenizer_pads_with_its_eos(root, kinds_module):
    """SmolLM2's tokenizer pads with its eos, <|im_end|>, which also ends every prompt turn. TRL's PPO masks by
    `ids != pad`, so with that pad the reward would be read a token before the eos with the prompt's ends of turn
    hidden. PPO pads with a free special token instead, and then reads exactly the score of the whole turn."""
    import copy

    import torch
    from trl.data_utils import _tokenize
    from trl.experimental.utils import get_reward

    from trainer.errors import SettingError
    from trainer.preference import load_reward_model
    from trainer.prompts import prompt_ids
    from trainer.rollouts import append_turn_end, rollout_pad_token, turn_end_suffix

    plan, _ = run(root, kinds_module, {}, ["rm"])
    rm, tok = load_reward_model(Path(artifact(plan, "rm").path))
    tok = copy.deepcopy(tok)
    tok.pad_token = tok.eos_token
    eos, suffix = tok.eos_token_id, turn_end_suffix(tok)
    rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in ppo_preference_rows()[:3]]
    for r in rows:
        r["input_ids"] = prompt_ids(tok, r["prompt"])
        assert eos in r["input_ids"]  # the system or user turn ends with it
    pad_token = rollout_pad_token(tok, rows, suffix)
    pad = tok.convert_tokens_to_ids(pad_token)
    assert pad != eos and all(pad not in r["input_ids"] for r in rows)

    def read(row, pad_id):
        query = row["input_ids"]
        rollout = query + tok(row["chosen"], add_special_tokens=False)["input_ids"] + [eos, pad_id, pad_id]
        ids = append_turn_end(torch.tensor([rollout]), pad_id, len(query), suffix, eos)
        with torch.no_grad():
            return float(get_reward(rm, ids, pad_id, len(query))[1][0])

    for r in rows:
        trained_on = _tokenize(tok, r["prompt"] + [{"role": "assistant", "content": r["chosen"]}])["input_ids"]
        with torch.no_grad():
            whole_turn = float(rm(input_ids=torch.tensor([trained_on])).logits[0, 0])
        assert read(r, pad) == pytest.approx(whole_turn, abs=1e-5)
        assert read(r, eos) != pytest.approx(whole_turn, abs=1e-3)  # what the eos as pad made PPO read
    # a tokenizer whose every special token is taken has nothing to pad with: a clear refusal
    taken = [{"input_ids": list(tok.all_special_ids) + list(tok.added_tokens_decoder)}]
    with pytest.raises(SettingError) as e:
        rollout_pad_token(tok, taken, suffix)
    assert e.value.field == "inputs" and "add a pad token" in e.value.problem


def test_ppo_refuses_a_reward_model_with_another_tokenizer(root, kinds_module, tmp_path):
    """Checked in the training process: the policy's token ids go to the reward model as they are."""
    from transformers import AutoTokenizer

    from tasks import tokenizer as tokenizer_stage
    from trainer.errors import SettingError
    from trainer.rollouts import check_reward_model
    from trainer.preference import load_reward_model
    from trainer.settings import PpoSettings

    plan, _ = run(root, kinds_module, {}, ["rm"])
    rm, rm_tok = load_reward_model(Path(artifact(plan, "rm").path))
    other = plan.cfg.stages["tokenizer"].model_copy(update={"vocab_size": 280})
    tokenizer_stage.run(other, [artifact(plan, "shard")], tmp_path)
    with pytest.raises(SettingError) as e:
        check_reward_model(rm, rm_tok, AutoTokenizer.from_pretrained(tmp_path), PpoSettings(), "reward artifact x")
    assert (e.value.field, e.value.problem) == ("inputs", "the reward model (reward artifact x) has another tokenizer "
                                                "than the policy (300 vs 280 tokens): PPO scores the policy's token "
                                                "ids directly, so train the reward stage on the same tokenizer (e.g. "
                                                "on the sft stage's model)")
    with pytest.raises(SettingError) as e:
        check_reward_model(rm, rm_tok, rm_tok, PpoSettings(max_length_tokens=256), "reward artifact x")
    assert (e.value.field, e.value.problem) == ("max_length_tokens", "256 is beyond the reward model's "
                                                "max_position_embeddings 128 (reward artifact x); set "
                                                "max_length_tokens to 128 or less")


# ----------------------------------------------------------------------------------------------
# slow: qlora; SIGKILL mid-run, then a rerun resumes


@pytest.mark.slow
def test_ppo_qlora_on_a_4bit_base(root, kinds_module):
    stage = ppo(method="qlora", max_steps=3, learning_rate=1e-2, lora={"rank": 4, "target_modules": "all-linear"})
    plan, _ = run(root, kinds_module, {"ppo_qlora": stage}, ["ppo_qlora"])
    r = artifact(plan, "ppo_qlora").result
    assert (r["format"], r["reference"], r["steps"]) == ("adapter", "adapter disabled (4-bit base)", 3)
    assert r["eval_reward_trained"] > r["eval_reward_start"], r


# slow (35 s on 2 cores): DDP resume is tests/test_distributed.py's sigkill test, ppo's resume the SIGTERM test below
@pytest.mark.slow
def test_ppo_lora_on_two_ddp_processes_resumes_exactly(root, kinds_module):
    """torchrun, 2 CPU processes (gloo): each samples its slice of every update's prompts; TRL would reach the
    adapter-disabled reference through the DDP wrapper, so it gets a frozen copy. Unpublished, the stage resumes
    from update 2 with both ranks' RNG states and ends with the same adapter."""
    stage = ppo(method="lora", launcher="torchrun", nproc_per_node=2, batch_size_per_device=4, max_steps=4,
                checkpoint_every_steps=2, keep_checkpoints=1, learning_rate=1e-2,
                lora={"rank": 4, "alpha": 8, "dropout": 0.0})
    plan, _ = run(root, kinds_module, {"ddp": stage}, ["ddp"])
    art = artifact(plan, "ddp")
    r = art.result
    assert (r["reference"], r["steps"], r["rollouts_per_step"], r["episodes"]) == ("frozen copy (DDP)", 4, 8, 32)
    assert r["eval_reward_trained"] > r["eval_reward_start"], r
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(p.name for p in Path(art.path, "_checkpoints",
                                                                                "checkpoint-2").iterdir())
    first = _weights(art)
    again = _rerun_unpublished(plan, kinds_module, "ddp")
    assert (again.result["resumed_from_step"], again.result["steps"]) == (2, 4)
    assert _same(_weights(again), first)
    assert again.result["train_reward_last"] == r["train_reward_last"]


# SIGKILL after a ppo checkpoint is also in the default run at the pipeline level: tests/test_faults.py kills
# `lmforge run` there and the rerun's ppo weights equal an uninterrupted run's
@pytest.mark.parametrize("sig", [pytest.param("SIGKILL", marks=pytest.mark.slow), "SIGTERM"])
def test_ppo_stopped_then_rerun_resumes_from_the_last_checkpoint(root, kinds_module, sig):
    """SIGKILL: the newest uploaded checkpoint survives. SIGTERM: TRL's loop would go on (it ignores
    should_training_stop); the stage checkpoints the update it is in, uploads it and stops with Preempted."""
    import signal

    from trainer.errors import Preempted, TrainingError

    stage = ppo(method="lora", max_steps=16, checkpoint_every_steps=2, keep_checkpoints=2, evaluate=False,
                learning_rate=1e-2, lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]},
                seed={"SIGKILL": 1, "SIGTERM": 2}[sig])  # two artifacts
    plan = plan_of(align_pipeline(root, {**BASE_STAGES, "stop": stage}), kinds_module, root)
    stopped, errors = signal_after_first_checkpoint(plan, kinds_module, "stop", getattr(signal, sig))
    assert 2 <= stopped < 16
    assert len(errors) == 1 and isinstance(errors[0], TrainingError if sig == "SIGKILL" else Preempted), errors
    if sig == "SIGKILL":
        assert stopped % 2 == 0
    else:
        assert f"stopped by SIGTERM at step {stopped}; checkpoint {stopped} is in" in str(errors[0])
    plan, out = run(root, kinds_module, {"stop": stage}, ["stop"])
    assert out["stop"]["status"] == "ran"
    r = artifact(plan, "stop").result
    assert (r["resumed_from_step"], r["steps"], r["episodes"]) == (stopped, 16, 128)
    assert r["checkpoints_uploaded"] == [s for s in range(stopped + 1, 16) if s % 2 == 0]
    assert math.isfinite(r["train_reward_first"])  # the reward history spans both attempts
