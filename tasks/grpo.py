"""grpo: a policy + prompts + rewards -> an RL-tuned model or LoRA adapter, with TRL's GRPOTrainer
(`algorithm: grpo`) or RLOOTrainer (`algorithm: rloo`).

Inputs: one `shards` artifact of preference records (their `prompt`) or chat records (the turns before the
last assistant turn); the policy: a `model` artifact (an sft stage) or `base_model`; optionally a
`tokenizer` artifact and a reward model (a `reward` stage's output). The reward is the weighted sum of the
reward functions named in `reward_functions` (import paths, e.g. `trainer.rewards:sum_correct`, checked
when the config is parsed) and of the reward model's score; at least one is required. A function enters
the artifact id by its import path and the sha256 of its source, so editing it retrains.

Training runs in a child process with checkpoints in the store (a rerun resumes) and metrics on the
stage's MLflow run: `train/loss`, `train/reward`, `train/reward_std`, `train/kl`, `train/completion_length`,
`train/reward/<name>` per reward (`reward_model` for the model), and at the end `eval/reward_start` and
`eval/reward`: the mean reward of greedy completions of the distinct validation prompts, from the
starting and from the trained policy.

Output: a `model` artifact like dpo's (`trained_with: grpo` or `rloo` in `lmforge_model.json`, plus
`heldout_generations.json`); `trainer.models.load_trained` reloads it.
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
from trainer.settings import GrpoSettings


class GrpoStageConfig(TrainingConfig, GrpoSettings):
    kind: Literal["grpo"] = Field(description="Online RL from rewards: GRPO or RLOO (TRL GRPOTrainer / "
                                  "RLOOTrainer).")

    def settings(self) -> dict:
        """As in every training stage, a base model enters the id by its content. Each reward function enters by
        its import path and the sha256 of its source (when Python can show it)."""
        from trainer.rewards import load_reward_function, source_sha256

        out = super().settings()
        for entry in out["reward_functions"]:
            entry["source_sha256"] = source_sha256(load_reward_function(entry["function"]))
        return out


class GrpoResult(RLResult):
    algorithm: str
    rewards: dict[str, str]  # metric name -> import path, or the reward model artifact
    reward_weights: dict[str, float]
    validation_prompts_seen_in_train: int
    completions_per_step: int
    train_loss_first: float | None
    train_loss_last: float | None
    train_completion_length_last: float | None
    eval_reward_by_source_start: dict[str, float | None]
    eval_reward_by_source_trained: dict[str, float | None]


def run(cfg: GrpoStageConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> GrpoResult:
    policy_inputs, reward_model = split_reward_model(inputs)
    return GrpoResult(**launch_training("grpo", cfg, policy_inputs, out, runtime, reward_model=reward_model))


def output_port(cfg: GrpoStageConfig, inputs: list[Port]) -> Port:
    check_prompt_shards("grpo", inputs)
    for i, p in enumerate(inputs):
        if p.type not in ("shards", "tokenizer", "model"):
            raise ValueError(f"input {i} is {p.describe()}; grpo reads shards, a tokenizer, a policy model and a "
                             "reward model")
    policies, reward_models = split_models(inputs)
    if sum(p.type == "tokenizer" for p in inputs) > 1 or len(policies) > 1 or len(reward_models) > 1:
        raise ValueError("grpo takes at most one tokenizer, one policy model (e.g. an sft stage) and one reward "
                         "model (a reward stage)")
    if cfg.base_model is None and not policies:
        raise ValueError("grpo needs a policy to start from: add an sft stage to inputs, or set base_model")
    if cfg.base_model is not None and policies:
        raise ValueError("both base_model and a policy model input are given; keep one of them")
    if cfg.base_model is not None and cfg.base_model.config is not None and not any(
            p.type == "tokenizer" for p in inputs):
        raise ValueError("a base_model built from config has no tokenizer; add a tokenizer stage to inputs")
    if not cfg.reward_functions and not reward_models:
        raise ValueError("grpo needs a reward: name reward_functions (e.g. trainer.rewards:sum_correct) and/or add "
                         "a reward stage to inputs")
    return Port("model")


STAGE = StageDef(kind="grpo", version="1", code=("trainer.entry", "trainer.grpo"),  # the child's code
                 config=GrpoStageConfig, run=run, output_port=output_port,
                 wants_runtime=True, description="policy + prompts + reward functions and/or reward model -> "
                 "RL-tuned model or LoRA adapter (TRL GRPOTrainer / RLOOTrainer, full/lora/qlora)", output_type="model")
