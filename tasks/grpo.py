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

import logging
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from lmforge.config import StageConfig
from lmforge.stage import Port, StageDef, StageRuntime, TrainedResult
from lmforge.store import Artifact
from tasks.sft import launch_training, model_source_identity
from trainer.settings import GrpoSettings

log = logging.getLogger(__name__)


class GrpoStageConfig(StageConfig, GrpoSettings):
    kind: Literal["grpo"] = Field(description="Online RL from rewards: GRPO or RLOO (TRL GRPOTrainer / "
                                  "RLOOTrainer).")

    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | GrpoSettings.RUN_ONLY

    def settings(self) -> dict:
        """As in sft: a base model enters the id by its content. Each reward function enters by its import
        path and the sha256 of its source (when Python can show it)."""
        from trainer.rewards import load_reward_function, source_sha256

        out = model_source_identity(super().settings(), self.base_model, self.project_root)
        for entry in out["reward_functions"]:
            entry["source_sha256"] = source_sha256(load_reward_function(entry["function"]))
        return out

    def trainer_settings(self) -> dict:
        return self.model_dump(mode="json", include=set(GrpoSettings.model_fields))


class GrpoResult(TrainedResult):
    algorithm: str
    method: str
    base_model: str
    format: str
    rewards: dict[str, str]  # metric name -> import path, or the reward model artifact
    reward_weights: dict[str, float]
    train_records: int
    validation_records: int
    dropped_prompt_too_long: int
    train_prompts: int
    validation_prompts: int  # distinct validation prompts of the held-out check
    validation_prompts_seen_in_train: int
    steps: int
    epochs: float
    completions_per_step: int
    train_loss_first: float | None
    train_loss_last: float | None
    train_reward_first: float | None
    train_reward_last: float | None
    train_kl_last: float | None
    train_completion_length_last: float | None
    eval_reward_start: float | None
    eval_reward_trained: float | None
    eval_reward_by_source_start: dict[str, float | None]
    eval_reward_by_source_trained: dict[str, float | None]
    train_seconds: float
    peak_memory_mb: float
    trainable_parameters: int
    resumed_from_step: int
    checkpoints_uploaded: list[int]


def is_reward_model(a: Artifact) -> bool:
    return a.manifest.get("output", {}).get("data_kind") == "reward"


def run(cfg: GrpoStageConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> GrpoResult:
    reward_models = [a for a in inputs if is_reward_model(a)]
    policy_inputs = [a for a in inputs if not is_reward_model(a)]
    return GrpoResult(**launch_training("grpo", cfg, policy_inputs, out, runtime,
                                        reward_model=reward_models[0] if reward_models else None))


def output_port(cfg: GrpoStageConfig, inputs: list[Port]) -> Port:
    shards = [p for p in inputs if p.type == "shards"]
    if len(shards) != 1 or shards[0].data_kind not in ("preference", "chat"):
        got = ", ".join(p.describe() for p in shards) or "none"
        raise ValueError(f"grpo reads exactly one preference or chat shards input, for its prompts (got {got})")
    for i, p in enumerate(inputs):
        if p.type not in ("shards", "tokenizer", "model"):
            raise ValueError(f"input {i} is {p.describe()}; grpo reads shards, a tokenizer, a policy model and a "
                             "reward model")
    policies = [p for p in inputs if p.type == "model" and p.data_kind != "reward"]
    reward_models = [p for p in inputs if p.type == "model" and p.data_kind == "reward"]
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
