"""reward: preference shards -> a reward model (sequence classification, one score), with TRL's RewardTrainer.

Inputs: one preference `shards` artifact ({prompt, chosen, rejected} records), plus optionally a `tokenizer`
artifact and/or a `model` artifact (e.g. the sft stage's model: its backbone gets a new score head;
otherwise `base_model` says where the model comes from). Pairs with chosen == rejected are skipped and
counted (`skipped_identical_pairs`); pairs longer than `max_length_tokens` are counted too (`dropped_too_long`).
The training runs in a child process (`trainer.launch`), with checkpoints in the store (a rerun resumes)
and metrics on the stage's MLflow run (`train/loss`, `train/reward_accuracy`, `train/margin`,
`eval/reward_accuracy`, `eval/margin`, ...). The result carries the held-out pairwise accuracy and mean
margin on the shards' validation split.

Output: a `model` artifact with data kind `reward`: a full `...ForSequenceClassification` model (LoRA merged),
the tokenizer, and `lmforge_model.json` with `"kind": "reward_model"`; reload it with
`trainer.preference.load_reward_model`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from lmforge.errors import ConfigError
from lmforge.port import Port
from lmforge.stage import StageDef, StageRuntime
from lmforge.store import Artifact
from tasks.training import (PreferenceResult, TrainingConfig, check_model_source, check_preference_inputs,
                            launch_training)
from trainer.settings import RewardSettings


class RewardStageConfig(TrainingConfig, RewardSettings):
    kind: Literal["reward"] = Field(description="Reward model on preference shards (TRL RewardTrainer).")


class RewardResult(PreferenceResult):
    dropped_too_long: int


def run(cfg: RewardStageConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> RewardResult:
    if cfg.method == "qlora":  # before any process starts
        raise ConfigError([f"stages.{runtime.stage}.method: the reward stage trains method full or lora; qlora is "
                           "not supported for sequence-classification reward models yet; use lora"])
    return RewardResult(**launch_training("reward", cfg, inputs, out, runtime))


def output_port(cfg: RewardStageConfig, inputs: list[Port]) -> Port:
    check_preference_inputs("reward", inputs)
    check_model_source(cfg, inputs, "reward needs a base model: set base_model (config, path, package+file or hub) "
                       "or add a model stage to inputs")
    return Port("model", "reward")


STAGE = StageDef(kind="reward", version="1",
                 code=("trainer.entry", "trainer.reward", "trainer.tokens"),  # the child's code
                 config=RewardStageConfig, run=run, output_port=output_port,
                 wants_runtime=True, description="preference shards -> reward model (TRL RewardTrainer, full/lora)",
                 output_type="model")
