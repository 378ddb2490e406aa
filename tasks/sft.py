"""sft: chat shards -> a fine-tuned model (full) or LoRA adapter (lora, qlora), with TRL's SFTTrainer.

Inputs: one chat `shards` artifact, plus optionally a `tokenizer` artifact and/or a `model` artifact
(an earlier stage's model to continue from; otherwise `base_model` says where the model comes from).
The training runs in a child process (`trainer.launch`): checkpoints go to the stage's checkpoint URI as
they are saved, so a rerun after a failure or SIGTERM resumes; metrics go to the stage's MLflow run.
Before the child starts, the settings that need only the model's config are checked here (sequence
length, LoRA target modules, bitsandbytes for qlora), so a bad config fails in seconds.

Output: a `model` artifact: `config.json` + `model.safetensors` (full) or `adapter_config.json` +
`adapter_model.safetensors` (lora, qlora), the tokenizer, and `lmforge_model.json` (how to reload it).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from lmforge.port import Port
from lmforge.stage import StageDef, StageRuntime
from lmforge.store import Artifact
from tasks.training import TrainingConfig, TrainingResult, check_model_inputs, launch_training
from trainer.settings import SftSettings


class SftConfig(TrainingConfig, SftSettings):
    kind: Literal["sft"] = Field(description="Supervised fine-tuning on chat shards (TRL SFTTrainer).")


class SftResult(TrainingResult):
    method: str
    format: str
    train_records: int
    train_rows: int
    dropped_fully_masked: int
    validation_records: int
    token_shards: str | None = None  # kind/id of the tokenize stage's token shards this stage streamed
    epochs: float
    train_loss_first: float | None
    train_loss_last: float | None
    eval_loss: float | None
    tokens: int
    tokens_per_s: float
    trainable_parameters: int
    quantized_linear_layers: int


def run(cfg: SftConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> SftResult:
    return SftResult(**launch_training("sft", cfg, inputs, out, runtime))


def output_port(cfg: SftConfig, inputs: list[Port]) -> Port:
    check_model_inputs(cfg, inputs, "sft", ("chat", "sft_tokens"),
                       "chat shards (or a tokenize stage's sft_tokens shards)")
    return Port("model")


STAGE = StageDef(kind="sft", version="1", code=("trainer.entry", "trainer.sft", "trainer.tokens"),  # the child's code
                 config=SftConfig, run=run, output_port=output_port, wants_runtime=True,
                 description="chat shards -> fine-tuned model or LoRA adapter (TRL SFTTrainer, full/lora/qlora)",
                 output_type="model")
