"""ppo: an SFT policy + a reward model + prompts -> an RL-tuned model or LoRA adapter, with TRL's PPOTrainer
(TRL 1.12, `trl.experimental.ppo`; TRL 1.13 removed PPO).

Inputs: one `shards` artifact of prompts: preference records (their `prompt`) or chat records (the turns
before the last assistant turn); one policy `model` artifact (an sft stage: the policy starts from it and it
is the reference, with its own tokenizer); one reward model (a `reward` stage's output, data kind `reward`:
it scores the rollouts, and the value model starts as a copy of it). Prompts too long to leave room for
`max_new_tokens` are skipped and counted (`dropped_prompt_too_long`). With lora the reference is the policy
with its adapter disabled; with full it is a frozen copy; with qlora the 4-bit base with the adapter disabled.

A step is one PPO update (`max_steps` counts them): each process samples batch_size_per_device *
grad_accumulation_steps responses, scores them, and optimizes the clipped policy and value losses on them
`ppo_epochs` times. Training runs in a child process with checkpoints in the store (policy, value model,
optimizer, scheduler, RNG and data position: a rerun resumes) and metrics on the stage's MLflow run
(`train/reward`, `train/kl`, `train/policy_loss`, `train/value_loss`, `train/entropy`, ...). At the end the
trained policy and the reference answer the distinct validation prompts greedily and the reward model
scores both: `eval_reward_start` -> `eval_reward_trained` (`eval/reward_start`, `eval/reward`).

Output: a `model` artifact like dpo's: a full model or an adapter on top of the input model artifact, the
tokenizer, `lmforge_model.json` (`trained_with: ppo`) and `heldout_generations.json`;
`trainer.models.load_trained` reloads it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from lmforge.port import Port
from lmforge.stage import StageDef, StageRuntime
from lmforge.store import Artifact
from tasks.training import (RLResult, TrainingConfig, check_prompt_shards, launch_training, split_models,
                            split_reward_model)
from trainer.settings import PpoSettings


class PpoStageConfig(TrainingConfig, PpoSettings):
    kind: Literal["ppo"] = Field(description="PPO of an SFT policy against a reward model (TRL PPOTrainer).")

    def settings(self) -> dict:
        """`value_model` came after the first ppo artifacts: at its default (full) it stays out of the id, so a
        store's ppo artifacts from before it keep their ids; lora changes the result and enters it."""
        out = super().settings()
        if out.get("value_model") == "full":
            del out["value_model"]
        return out


class PpoResult(RLResult):
    reward_model: str
    reference: str
    episodes: int  # rollouts sampled, all processes
    rollouts_per_step: int
    train_policy_loss_last: float | None
    train_value_loss_last: float | None
    train_entropy_last: float | None
    value_parameters: int  # of the value model, trained alongside


def run(cfg: PpoStageConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> PpoResult:
    policy_inputs, reward_model = split_reward_model(inputs)
    return PpoResult(**launch_training("ppo", cfg, policy_inputs, out, runtime, reward_model=reward_model))


def output_port(cfg: PpoStageConfig, inputs: list[Port]) -> Port:
    check_prompt_shards("ppo", inputs)
    for i, p in enumerate(inputs):
        if p.type == "tokenizer":
            raise ValueError(f"input {i} is a tokenizer; ppo uses the policy model's own tokenizer (the reward "
                             "model must share it): remove it")
        if p.type not in ("shards", "model"):
            raise ValueError(f"input {i} is {p.describe()}; ppo reads prompt shards, a policy model and a reward "
                             "model")
    policies, reward_models = split_models(inputs)
    if cfg.base_model is not None:
        raise ValueError("ppo starts from the policy model it is given in inputs (an sft stage); remove base_model")
    if not policies:
        raise ValueError("ppo needs a policy model to start from: add an sft stage to inputs (a reward model only "
                         "scores the rollouts)")
    if not reward_models:
        raise ValueError("ppo needs a reward model to score the rollouts: add a reward stage to inputs")
    if len(policies) > 1 or len(reward_models) > 1:
        raise ValueError(f"ppo takes one policy model and one reward model, got {len(policies)} and "
                         f"{len(reward_models)}")
    return Port("model")


STAGE = StageDef(kind="ppo", version="1", code=("trainer.entry", "trainer.ppo"),  # the child's code
                 config=PpoStageConfig, run=run, output_port=output_port,
                 wants_runtime=True, description="SFT policy + reward model + prompts -> PPO-tuned model or LoRA "
                 "adapter (TRL PPOTrainer, full/lora/qlora)", output_type="model")
