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

import logging
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from lmforge.config import StageConfig
from lmforge.stage import Port, StageDef, StageRuntime, TrainedResult
from lmforge.store import Artifact
from tasks.sft import launch_training, model_source_identity
from trainer.settings import PretrainSettings

log = logging.getLogger(__name__)


class PretrainConfig(StageConfig, PretrainSettings):
    kind: Literal["pretrain"] = Field(description="Causal-LM training on text shards, from scratch or continued "
                                      "(transformers Trainer, packed rows).")

    #: how often to checkpoint and log, how to launch, prefetching and pinning: kept out of the id
    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | PretrainSettings.RUN_ONLY

    def settings(self) -> dict:
        """A local `base_model.path` or package GGUF enters the id as its content, as in sft."""
        return model_source_identity(super().settings(), self.base_model, self.project_root)

    def trainer_settings(self) -> dict:
        """Every training setting, including the orchestration ones the training process needs."""
        return self.model_dump(mode="json", include=set(PretrainSettings.model_fields))


class PretrainResult(TrainedResult):
    base_model: str
    from_scratch: bool
    streaming: bool
    train_shards: int
    train_rows: int | None  # rows packed in memory; None when streaming (not counted ahead)
    validation_rows: int
    steps: int
    tokens: int
    tokens_per_s: float
    train_seconds: float
    train_loss_first: float | None
    train_loss_last: float | None
    validation_loss_before: float | None
    validation_loss_after: float | None
    validation_perplexity_before: float | None
    validation_perplexity_after: float | None
    parameters: int
    peak_memory_mb: float
    resumed_from_step: int
    checkpoints_uploaded: list[int]


def run(cfg: PretrainConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> PretrainResult:
    return PretrainResult(**launch_training("pretrain", cfg, inputs, out, runtime))


def output_port(cfg: PretrainConfig, inputs: list[Port]) -> Port:
    shards = [p for p in inputs if p.type == "shards"]
    if len(shards) != 1 or shards[0].data_kind != "text":
        got = ", ".join(p.describe() for p in shards) or "none"
        raise ValueError(f"pretrain reads exactly one text shards input (got {got}); chat shards go to sft, "
                         "preference shards to reward or dpo")
    for i, p in enumerate(inputs):
        if p.type not in ("shards", "tokenizer", "model"):
            raise ValueError(f"input {i} is {p.describe()}; pretrain reads text shards, a tokenizer and a model")
    for t in ("tokenizer", "model"):
        if sum(p.type == t for p in inputs) > 1:
            raise ValueError(f"pretrain takes at most one {t} input")
    models = [p for p in inputs if p.type == "model"]
    if models and models[0].data_kind == "reward":
        raise ValueError("the model input is a reward model (sequence classification); pretrain continues a causal "
                         "LM: give it a pretrain or sft stage")
    if cfg.base_model is None and not models:
        raise ValueError("pretrain needs a model: set base_model (config to start from scratch, or path, package+file "
                         "or hub) or add a model stage to inputs to continue it")
    if cfg.base_model is not None and models:
        raise ValueError("both base_model and a model input are given; keep one of them")
    has_tokenizer = any(p.type == "tokenizer" for p in inputs)
    if cfg.base_model is not None and cfg.base_model.config is not None and not has_tokenizer:
        raise ValueError("a base_model built from config has no tokenizer; add a tokenizer stage to inputs")
    return Port("model")


STAGE = StageDef(kind="pretrain", version="1", code=("trainer.entry", "trainer.pretrain"),  # the child's code
                 config=PretrainConfig, run=run, output_port=output_port,
                 wants_runtime=True,
                 description="text shards -> causal LM from scratch or continued (packed rows, streamed shards)",
                 output_type="model")
