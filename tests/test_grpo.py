"""grpo stage: GRPO and RLOO (TRL GRPOTrainer / RLOOTrainer) on top of a tiny SFT model.

The same tiny Llama, tokenizer and preference pairs as tests/test_align.py (tests/helpers.py), with a chat set in
two styles: "What is A plus B?" -> "A plus B equals C." and "What is A plus B?\\nAnswer:" -> "C". After a short SFT
the model answers the second style with a bare number, which `trainer.rewards:one_sentence` scores 0: a reward
that a few GRPO steps can raise on held-out prompts (greedy completions before and after), while the
model is far too small to learn the sums themselves. The data stages and the SFT run once per module.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from lmforge.config import parse_config
from lmforge.plan import make_plan
from tests.helpers import (GOOD, IDENTICAL, LONG, SFT_FAST, TINY_LLAMA, align_pipeline, align_store, artifact,
                           metric_steps, plan_of, preference_rows, run_align, signal_after_first_checkpoint)

MAX_LENGTH = 64
SFT = {"kind": "sft", "inputs": ["shard", "tokenizer"], "base_model": {"config": TINY_LLAMA}, "method": "full",
       "max_steps": 100, "evaluate": False, **SFT_FAST, "batch_size_per_device": 16, "control_prompts": []}
FAST = {"max_length_tokens": MAX_LENGTH, "max_completion_tokens": 12, "batch_size_per_device": 16,
        "num_generations": 8, "warmup_steps": 0, "logging_steps": 1, "control_prompts": [], "retries": 0}
FORMAT_REWARDS = ["trainer.rewards:sum_correct", "trainer.rewards:one_sentence"]


def chat_rows(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        a, b = i % 10, (i // 10) % 10
        if i % 2:
            turns = [f"What is {a} plus {b}?\nAnswer:", f"{a + b}"]
        else:
            turns = [f"What is {a} plus {b}?", f"{a} plus {b} equals {a + b}."]
        rows.append({"messages": [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": turns[1]}]})
    return rows


def pipeline(root: Path, stages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return align_pipeline(root, {"sft": SFT, **stages})


def run_stages(root: Path, kinds, stages: dict[str, dict[str, Any]], names: list[str], tracker=None):
    return run_align(root, kinds, {"sft": SFT, **stages}, names, tracker=tracker)


def grpo(**over) -> dict[str, Any]:
    return {"kind": "grpo", "inputs": ["shard", "sft"], "reward_functions": FORMAT_REWARDS, "learning_rate": 5e-3,
            "temperature": 1.5, **FAST, **over}


@pytest.fixture(scope="module")
def root(tmp_path_factory, kinds_module):
    return align_store(tmp_path_factory.mktemp("grpo"), kinds_module, chat_rows(200), preference_rows(), {"sft": SFT})


def _prompt(tok, text: str):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)


# ----------------------------------------------------------------------------------------------
# the reward functions


def test_shipped_reward_functions_score_plain_and_chat_completions():
    from trainer.rewards import answer_form, answer_match, one_sentence, sum_correct

    chat = [[{"role": "user", "content": "What is 3 plus 4?"}]] * 3
    said = [[{"role": "assistant", "content": c}] for c in ("3 plus 4 equals 7.", "3 plus 4 equals 8.", "7")]
    assert sum_correct(chat, said) == [1.0, 0.0, 1.0]
    assert sum_correct(["What is 12 plus 30?", "Name a colour."], ["It is 42", "red"]) == [1.0, None]
    assert answer_match(chat, said, answer=["3 plus 4 equals 7."] * 3) == [1.0, 0.0, 1.0]
    assert answer_match(["q", "q", "q"], ["Paris.", "paris", "Rome"], answer=["paris", "Paris", None]) == [0.0, 1.0, None]
    assert one_sentence(chat, said) == [1.0, 1.0, 0.0]
    # the form: numbers left out, so a wrong sum in the right shape passes and a right sum in the wrong one fails
    assert answer_form(chat, said, answer=["3 plus 4 equals 7."] * 3) == [1.0, 1.0, 0.0]
    assert answer_form(chat, said, answer=["7"] * 3) == [0.0, 0.0, 1.0]
    assert answer_form(["q", "q"], ["  32 ", "32firehose"], answer=["12", None]) == [1.0, None]
    assert one_sentence(None, ["7.", "7...", "a\nb.", "", " ".join(["w"] * 21) + "."]) == [1.0, 0.0, 0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------------------------
# grpo with reward functions


def test_grpo_lora_with_reward_functions_raises_the_heldout_reward(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    from lmforge.tracking import Tracker
    from trainer import models

    tracker = Tracker(f"sqlite:///{root / 'mlflow-grpo.db'}", "grpo")
    stage = grpo(method="lora", max_steps=30, lora={"rank": 8, "alpha": 16, "dropout": 0.0})
    plan, out = run_stages(root, kinds_module, {"g": stage}, ["g"], tracker=tracker)
    art, sft_art = artifact(plan, "g"), artifact(plan, "sft")
    r = art.result
    assert art.manifest["output"] == {"type": "model", "data_kind": None}
    assert (r["algorithm"], r["method"], r["format"], r["steps"]) == ("grpo", "lora", "adapter", 30)
    assert r["rewards"] == {"sum_correct": "trainer.rewards:sum_correct", "one_sentence": "trainer.rewards:one_sentence"}
    # chat shards: every record gives a prompt (its user turn); 19 distinct validation prompts are scored
    assert (r["train_records"], r["validation_records"], r["train_prompts"]) == (180, 20, 180)
    assert r["dropped_prompt_too_long"] == 0 and r["validation_prompts"] == 19
    assert r["completions_per_step"] == 16
    assert math.isfinite(r["train_loss_first"]) and math.isfinite(r["train_loss_last"])
    # the measurable improvement: greedy completions of held-out prompts, before and after
    assert r["eval_reward_by_source_start"]["one_sentence"] < 0.8, r
    # 19 prompts: >= 0.95 demanded all 19 and failed once in the full suite at 17/19 (sampled training, 2 threads)
    assert r["eval_reward_by_source_trained"]["one_sentence"] >= 0.85, r
    assert r["eval_reward_trained"] > r["eval_reward_start"] + 0.2, r
    assert r["train_reward_last"] > r["train_reward_first"], r
    assert r["train_kl_last"] > 0
    info = json.loads(Path(art.path, "lmforge_model.json").read_text())
    assert info["trained_with"] == "grpo"
    assert info["base"] == {"kind": "artifact_ref", "ref": {"store": plan.store.url, "kind": "sft", "id": sft_art.id}}
    gens = json.loads(Path(art.path, "heldout_generations.json").read_text())
    assert len(gens["start"]) == len(gens["trained"]) == 19
    adapter = load_file(f"{art.path}/adapter_model.safetensors")
    assert adapter and all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero
    # reloads (adapter merged onto the SFT model from the store), differs from the SFT model, generates
    model, tok = models.load_trained(Path(art.path))
    sft_model, _ = models.load_trained(Path(sft_art.path))
    prompt = _prompt(tok, "What is 2 plus 5?\nAnswer:")
    with torch.no_grad():
        assert not torch.allclose(model(**prompt).logits, sft_model(**prompt).logits)
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > prompt["input_ids"].shape[1]
    # metrics on the stage's MLflow run, per step under stable names, and the held-out reward at the end
    run_id, client = out["g"]["mlflow_run_id"], tracker.client
    for key in ("train/loss", "train/reward", "train/reward_std", "train/kl", "train/completion_length",
                "train/reward/sum_correct", "train/reward/one_sentence"):
        assert [s for s, _ in metric_steps(client, run_id, key)] == list(range(1, 31)), key
    assert metric_steps(client, run_id, "train/kl")[0][1] == pytest.approx(0.0, abs=1e-6)  # step 1: policy = ref
    assert metric_steps(client, run_id, "eval/reward") == [(30, pytest.approx(r["eval_reward_trained"]))]
    assert metric_steps(client, run_id, "eval/reward_start") == [(30, pytest.approx(r["eval_reward_start"]))]
    assert metric_steps(client, run_id, "eval/reward/one_sentence") == [
        (30, pytest.approx(r["eval_reward_by_source_trained"]["one_sentence"]))]


# ----------------------------------------------------------------------------------------------
# rloo with a reward model (and a function)


def test_rloo_full_with_a_reward_model_and_a_function(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    from lmforge.tracking import Tracker
    from trainer import models

    rm = {"kind": "reward", "inputs": ["shard_pairs", "sft"], "method": "full", "max_steps": 10,
          "learning_rate": 1e-3, "evaluate": False, "max_length_tokens": MAX_LENGTH, "batch_size_per_device": 16,
          "logging_steps": 5, "control_prompts": [], "retries": 0}
    stage = grpo(inputs=["shard_pairs", "sft", "rm"], algorithm="rloo", method="full", max_steps=6,
                 learning_rate=1e-4, temperature=1.0, reward_functions=[
                     {"function": "trainer.rewards:answer_match", "weight": 2.0}], reward_model_weight=0.5)
    tracker = Tracker(f"sqlite:///{root / 'mlflow-rloo.db'}", "grpo")
    plan, out = run_stages(root, kinds_module, {"rm": rm, "g_rloo": stage}, ["rm", "g_rloo"], tracker=tracker)
    art, sft_art, rm_art = artifact(plan, "g_rloo"), artifact(plan, "sft"), artifact(plan, "rm")
    r = art.result
    assert (r["algorithm"], r["method"], r["format"], r["steps"]) == ("rloo", "full", "full", 6)
    assert r["rewards"] == {"answer_match": "trainer.rewards:answer_match", "reward_model": f"reward artifact {rm_art.id}"}
    assert r["reward_weights"] == {"answer_match": 2.0, "reward_model": 0.5}
    # preference shards: every record gives its prompt; prompts too long for a completion are skipped
    assert r["train_records"] + r["validation_records"] == GOOD + IDENTICAL + LONG
    assert r["dropped_prompt_too_long"] == LONG
    assert r["train_prompts"] == r["train_records"] - 5  # the split puts all 5 long prompts in train
    assert all(math.isfinite(r[k]) for k in ("train_loss_first", "train_loss_last", "train_reward_first",
                                             "train_reward_last", "eval_reward_start", "eval_reward_trained"))
    assert set(r["eval_reward_by_source_trained"]) == {"answer_match", "reward_model"}
    # every weight moved away from the SFT model (full); the frozen reference was the SFT model: KL 0 at step 1
    trained, sft_w = load_file(f"{art.path}/model.safetensors"), load_file(f"{sft_art.path}/model.safetensors")
    assert set(trained) == set(sft_w)
    assert [k for k in trained if torch.equal(trained[k], sft_w[k])] == []
    run_id, client = out["g_rloo"]["mlflow_run_id"], tracker.client
    kl = metric_steps(client, run_id, "train/kl")
    assert len(kl) == 6 and kl[0][1] == pytest.approx(0.0, abs=1e-5) and kl[-1][1] != 0
    for key in ("train/reward", "train/reward_std", "train/completion_length", "train/reward/reward_model",
                "train/reward/answer_match"):
        assert len(metric_steps(client, run_id, key)) == 6, key
    info = json.loads(Path(art.path, "lmforge_model.json").read_text())
    assert (info["trained_with"], info["format"]) == ("rloo", "full")
    model, tok = models.load_trained(Path(art.path))
    prompt = _prompt(tok, "What is 2 plus 5?")
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > prompt["input_ids"].shape[1]


# ----------------------------------------------------------------------------------------------
# config errors and artifact ids (parse and plan only: seconds)


def test_bad_reward_functions_and_settings_fail_when_the_config_is_parsed(root, kinds_module):
    from lmforge.errors import ConfigError

    bad = {
        "g_typo": grpo(reward_functions=["trainer.rewards:sum_correct", "trainer.rewards:sum_corect"]),
        "g_module": grpo(reward_functions=[{"function": "trainer.no_such_module:f", "weight": 1.0}]),
        "g_path": grpo(reward_functions=["sum_correct"]),
        "g_value": grpo(reward_functions=["trainer.rewards:SHIPPED"]),
        "g_groups": grpo(batch_size_per_device=12),
        "g_algo": grpo(algorithm="rloo", loss_type="grpo"),
        "g_no_reward": grpo(reward_functions=[]),
        "g_two_policies": grpo(inputs=["shard", "sft", "tokenizer", "sft2"]),
        "sft2": SFT,
    }
    with pytest.raises(ConfigError) as e:
        parse_config(pipeline(root, bad), kinds_module, root=root)
    hint = "write module:function, e.g. trainer.rewards:sum_correct (lmforge ships: sum_correct, answer_match, answer_form, one_sentence)"
    assert sorted(e.value.problems) == sorted([
        "stages.g_typo.reward_functions[1]: module 'trainer.rewards' has no 'sum_corect' (did you mean "
        "'sum_correct'?); its functions: "
        "answer_form, answer_match, last_number, load_reward_function, one_sentence, source_sha256, sum_correct, text_of, got "
        "'trainer.rewards:sum_corect'",
        "stages.g_module.reward_functions[0]: cannot import module 'trainer.no_such_module' (ModuleNotFoundError: No "
        f"module named 'trainer.no_such_module'); install the package or put its folder on PYTHONPATH, or {hint}, got "
        "{'function': 'trainer.no_such_module:f', 'weight': 1.0}",
        f"stages.g_path.reward_functions[0]: 'sum_correct' is not an import path; {hint}, got 'sum_correct'",
        "stages.g_value.reward_functions[0]: 'trainer.rewards:SHIPPED' is a tuple, not a function; name a function "
        "fn(prompts, completions, **kwargs) -> list[float], got 'trainer.rewards:SHIPPED'",
        "stages.g_groups.num_generations: batch_size_per_device * grad_accumulation_steps * processes = 12 "
        "completions per step is not a multiple of num_generations 8: each prompt's group of completions must fit "
        "in one step; change batch_size_per_device or num_generations, got 8",
        "stages.g_algo.loss_type: applies to algorithm grpo only (algorithm is rloo); remove it, got 'grpo'",
        "stages.g_no_reward.inputs: grpo needs a reward: name reward_functions (e.g. trainer.rewards:sum_correct) "
        "and/or add a reward stage to inputs",
        "stages.g_two_policies.inputs: grpo takes at most one tokenizer, one policy model (e.g. an sft stage) and one "
        "reward model (a reward stage)",
    ])


def test_reward_functions_enter_the_artifact_id(root, kinds_module):
    def gid(**over) -> str:
        plan = make_plan(parse_config(pipeline(root, {"g": grpo(**over)}), kinds_module, root=root), kinds_module)
        return plan.stages["g"].artifact_id

    base = gid()
    assert gid(logging_steps=7, control_prompts=["hi"]) == base  # run-only settings
    assert gid(reward_functions=[{"function": f, "weight": 1.0} for f in FORMAT_REWARDS]) == base  # same, spelled out
    assert gid(reward_functions=FORMAT_REWARDS[:1]) != base
    assert gid(reward_functions=[FORMAT_REWARDS[0], {"function": FORMAT_REWARDS[1], "weight": 0.5}]) != base
    assert gid(algorithm="rloo") != base
    from tasks.grpo import GrpoStageConfig
    from trainer.rewards import one_sentence, source_sha256

    settings = GrpoStageConfig.model_validate(grpo()).settings()
    assert settings["reward_functions"][1] == {"function": "trainer.rewards:one_sentence", "weight": 1.0,
                                               "source_sha256": source_sha256(one_sentence)}
    assert len(settings["reward_functions"][1]["source_sha256"]) == 64


# ----------------------------------------------------------------------------------------------
# checkpoints: SIGKILL the training process, rerun, resume


def test_grpo_sigkill_then_rerun_resumes_from_the_last_checkpoint(root, kinds_module):
    from trainer.errors import TrainingError

    stage = grpo(method="lora", max_steps=24, checkpoint_every_steps=2, keep_checkpoints=2, evaluate=False,
                 lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]})
    killed_at, errors = signal_after_first_checkpoint(plan_of(pipeline(root, {"resume": stage}), kinds_module, root),
                                                      kinds_module, "resume")
    assert killed_at % 2 == 0 and 2 <= killed_at < 24
    assert len(errors) == 1 and isinstance(errors[0], TrainingError), errors
    plan, out = run_stages(root, kinds_module, {"resume": stage}, ["resume"])
    assert out["resume"]["status"] == "ran"
    r = artifact(plan, "resume").result
    assert (r["resumed_from_step"], r["steps"]) == (killed_at, 24)
    assert r["checkpoints_uploaded"] == list(range(killed_at + 2, 24, 2))
    assert math.isfinite(r["train_loss_last"]) and r["train_reward_first"] is not None  # history spans both attempts
    assert Path(artifact(plan, "resume").path, "adapter_model.safetensors").is_file()
