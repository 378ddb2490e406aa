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
`trainer.reward.load_reward_model`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from lmforge.config import StageConfig
from lmforge.errors import ConfigError
from lmforge.stage import Port, StageDef, StageRuntime, TrainedResult
from lmforge.store import Artifact
from tasks.sft import launch_training, model_source_identity
from trainer.settings import RewardSettings

log = logging.getLogger(__name__)


class RewardStageConfig(StageConfig, RewardSettings):
    kind: Literal["reward"] = Field(description="Reward model on preference shards (TRL RewardTrainer).")

    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | RewardSettings.RUN_ONLY

    def settings(self) -> dict:
        """As in sft: a base model enters the id by its content, never by its path."""
        return model_source_identity(super().settings(), self.base_model, self.project_root)

    def trainer_settings(self) -> dict:
        return self.model_dump(mode="json", include=set(RewardSettings.model_fields))


class RewardResult(TrainedResult):
    method: str
    base_model: str
    train_records: int
    validation_records: int
    skipped_identical_pairs: int
    dropped_too_long: int
    train_pairs: int
    validation_pairs: int
    token_shards: str | None = None  # kind/id of the tokenize stage's token shards this stage streamed
    steps: int
    epochs: float
    train_loss_first: float | None
    train_loss_last: float | None
    train_reward_accuracy_last: float | None
    train_margin_last: float | None
    eval_loss: float | None
    eval_reward_accuracy: float | None
    eval_margin: float | None
    train_seconds: float
    peak_memory_mb: float
    trainable_parameters: int
    resumed_from_step: int
    checkpoints_uploaded: list[int]


def run(cfg: RewardStageConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> RewardResult:
    if cfg.method == "qlora":  # before any process starts
        raise ConfigError([f"stages.{runtime.stage}.method: the reward stage trains method full or lora; qlora is "
                           "not supported for sequence-classification reward models yet; use lora"])
    return RewardResult(**launch_training("reward", cfg, inputs, out, runtime))


def check_inputs(stage: str, inputs: list[Port]) -> None:
    """Exactly one preference shards input, at most one tokenizer and one (non-reward) model."""
    shards = [p for p in inputs if p.type == "shards"]
    if len(shards) != 1 or shards[0].data_kind not in ("preference", f"{stage}_tokens"):
        got = ", ".join(p.describe() for p in shards) or "none"
        also = f" (or a tokenize stage's {stage}_tokens shards)" if stage in ("dpo", "reward") else ""
        raise ValueError(f"{stage} reads exactly one preference shards input{also} (got {got})")
    for i, p in enumerate(inputs):
        if p.type not in ("shards", "tokenizer", "model"):
            raise ValueError(f"input {i} is {p.describe()}; {stage} reads preference shards, a tokenizer and a model")
        if p.type == "model" and p.data_kind == "reward":
            raise ValueError(f"input {i} is a reward model; {stage} starts from a policy model (e.g. an sft stage)")
    for t in ("tokenizer", "model"):
        if sum(p.type == t for p in inputs) > 1:
            raise ValueError(f"{stage} takes at most one {t} input")


def output_port(cfg: RewardStageConfig, inputs: list[Port]) -> Port:
    check_inputs("reward", inputs)
    has_model = any(p.type == "model" for p in inputs)
    if cfg.base_model is None and not has_model:
        raise ValueError("reward needs a base model: set base_model (config, path, package+file or hub) or add a "
                         "model stage to inputs")
    if cfg.base_model is not None and has_model:
        raise ValueError("both base_model and a model input are given; keep one of them")
    has_tokenizer = any(p.type == "tokenizer" for p in inputs)
    if cfg.base_model is not None and cfg.base_model.config is not None and not has_tokenizer:
        raise ValueError("a base_model built from config has no tokenizer; add a tokenizer stage to inputs")
    return Port("model", "reward")


STAGE = StageDef(kind="reward", version="1", code=("trainer.entry", "trainer.reward", "trainer.tokens"),  # the child's code
                 config=RewardStageConfig, run=run, output_port=output_port,
                 wants_runtime=True, description="preference shards -> reward model (TRL RewardTrainer, full/lora)",
                 output_type="model")
