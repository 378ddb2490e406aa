"""pretrain: text shards -> a causal language model, trained from scratch or continued.

Inputs: one text `shards` artifact, plus
- from scratch: `base_model.config` (an architecture, e.g. a small llama) and a `tokenizer` artifact;
- continued: a `model` artifact of an earlier stage (pretrain or a full sft), or `base_model` path,
  package+file (GGUF) or hub; its own tokenizer unless a `tokenizer` artifact is given.
The train split is streamed from the store (webdataset, split by rank and DataLoader worker), tokenized and
packed into rows of exactly max_length_tokens with EOS between documents (`trainer.stream`); the validation
split is packed in memory and scored before and after training. Training runs in a child process with
checkpoints in the store (a rerun resumes at the step it reached) and metrics on the stage's MLflow run.

Output: a `model` artifact: `config.json` + `model.safetensors`, the tokenizer, and `lmforge_model.json`
(`format: full`, `trained_with: pretrain`); `trainer.models.load_trained` reloads it and an sft stage can
take it as its `model` input.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from lmforge.port import Port
from lmforge.stage import StageDef, StageRuntime
from lmforge.store import Artifact
from tasks.training import (TrainingConfig, TrainingResult, check_input_types, check_model_source, launch_training,
                            wrong_shards)
from trainer.settings import PretrainSettings


class PretrainConfig(TrainingConfig, PretrainSettings):
    kind: Literal["pretrain"] = Field(description="Causal-LM training on text shards, from scratch or continued "
                                      "(transformers Trainer, packed rows).")


class PretrainResult(TrainingResult):
    from_scratch: bool
    streaming: bool
    train_shards: int
    train_rows: int | None  # rows packed in memory; None when streaming (not counted ahead)
    validation_rows: int
    tokens: int
    tokens_per_s: float
    train_loss_first: float | None
    train_loss_last: float | None
    validation_loss_before: float | None
    validation_loss_after: float | None
    validation_perplexity_before: float | None
    validation_perplexity_after: float | None
    parameters: int


def run(cfg: PretrainConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> PretrainResult:
    return PretrainResult(**launch_training("pretrain", cfg, inputs, out, runtime))


def output_port(cfg: PretrainConfig, inputs: list[Port]) -> Port:
    got = wrong_shards(inputs, ("text",))
    if got is not None:
        raise ValueError(f"pretrain reads exactly one text shards input (got {got}); chat shards go to sft, "
                         "preference shards to reward or dpo")
    check_input_types(inputs, "pretrain", "text shards")
    models = [p for p in inputs if p.type == "model"]
    if models and models[0].data_kind == "reward":
        raise ValueError("the model input is a reward model (sequence classification); pretrain continues a causal "
                         "LM: give it a pretrain or sft stage")
    check_model_source(cfg, inputs, "pretrain needs a model: set base_model (config to start from scratch, or path, "
                       "package+file or hub) or add a model stage to inputs to continue it")
    return Port("model")


STAGE = StageDef(kind="pretrain", version="1", code=("trainer.entry", "trainer.pretrain"),  # the child's code
                 config=PretrainConfig, run=run, output_port=output_port,
                 wants_runtime=True,
                 description="text shards -> causal LM from scratch or continued (packed rows, streamed shards)",
                 output_type="model")
