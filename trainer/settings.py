"""Settings of the training stages, shared by the stage configs (tasks/) and the recipes (trainer/).

Light on purpose (pydantic only): `tasks/` imports it when a config is parsed, long before any torch.
`TrainSettings` holds what every trainer method has (model, method, optimizer, schedule, checkpoints,
launch); each method adds its own fields in one flat subclass (`SftSettings`, later DPO, reward, ...).
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer.models import LoraSettings, Method, ModelSource

#: prompts every generative training stage answers before and after training, unless configured
DEFAULT_CONTROL_PROMPTS = ("What is 2 plus 3?", "Write one sentence about the sea.", "The capital of France is")


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_model: ModelSource | None = Field(
        None, description="Model to train, unless a model artifact is among the inputs: one of config, path, "
        "package+file (GGUF) or hub.")
    method: Method = Field("lora", description="full: train every weight; lora: train low-rank adapters on a "
                           "frozen base; qlora: lora on a 4-bit NF4 base (bitsandbytes).")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="Adapter settings (lora, qlora).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the base weights are loaded in (and QLoRA's compute dtype); float32 on CPU.")
    bf16: bool = Field(False, description="bf16 mixed precision (GPUs from Ampere on); keep false on CPU.")
    max_length_tokens: int = Field(1024, gt=0, description="Longest training sequence in tokens; longer ones are "
                                   "truncated. Must fit the model's max_position_embeddings.")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to train; overrides epochs.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training split, when max_steps is not set.")
    batch_size_per_device: int = Field(8, gt=0, description="Samples (or packed rows) per device per micro-step.")
    grad_accumulation_steps: int = Field(1, gt=0, description="Micro-steps per optimizer step.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "cosine", description="Learning-rate schedule after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    optimizer: Literal["adamw_torch", "lion", "adafactor"] = Field(
        "adamw_torch", description="adamw_torch, lion (bitsandbytes, 32-bit states) or adafactor.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass: less "
                                         "memory, about 20% slower.")
    seed: int = Field(0, description="Seed of weight init (config models), LoRA init, data order and dropout.")
    max_train_records: int | None = Field(None, gt=0, description="Use at most this many training records.")
    evaluate: bool = Field(True, description="Compute the loss on the validation split at the end.")
    checkpoint_every_steps: int | None = Field(200, gt=0, description="Save and upload a checkpoint every this "
                                               "many optimizer steps.")
    checkpoint_every_minutes: float | None = Field(None, gt=0, description="Also save one when this many minutes "
                                                   "passed since the last.")
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints kept in the store; older ones are "
                                  "deleted.")
    logging_steps: int = Field(10, gt=0, description="Log metrics every this many optimizer steps.")
    launcher: Literal["local", "torchrun"] = Field("local", description="local: one training process; torchrun: "
                                                   "nproc_per_node processes with DDP (gloo on CPU).")
    nproc_per_node: int = Field(1, gt=0, description="Training processes (GPUs) with launcher torchrun.")
    control_prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_CONTROL_PROMPTS),
        description="After training, the model before and after answer these prompts (greedy) side by side: a "
        "table on the stage's MLflow run and `generations.json` in the artifact. [] skips the check.")
    control_max_new_tokens: int = Field(32, gt=0, description="Tokens generated per control prompt.")

    #: settings that change how often the run checkpoints and logs, or how it is launched, never the
    #: model it produces; training stages keep them out of their artifact id
    RUN_ONLY: ClassVar[frozenset[str]] = frozenset({
        "checkpoint_every_steps", "checkpoint_every_minutes", "keep_checkpoints", "logging_steps", "launcher",
        "control_prompts", "control_max_new_tokens"})


class SftSettings(TrainSettings):
    """Every setting of an sft stage but kind and inputs."""

    assistant_only_loss: bool = Field(True, description="Loss on assistant tokens only (needs a chat template with "
                                      "{% generation %} markers; known stock templates get a marked copy).")
    packing: bool = Field(False, description="Pack several conversations into each row of max_length_tokens (no "
                          "padding; attention stays within each conversation).")
    packing_strategy: Literal["bfd", "wrapped"] = Field(
        "bfd", description="bfd: best-fit decreasing, whole conversations; wrapped: cut across conversations.")


class RewardSettings(TrainSettings):
    """Every setting of a reward stage but kind and inputs."""

    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="Weight of a penalty on the mean reward squared, keeping rewards centered at zero "
        "(TRL center_rewards_coefficient; 0.01 is the usual value); null: no penalty.")


class DpoSettings(TrainSettings):
    """Every setting of a dpo stage but kind and inputs."""

    beta: float = Field(0.1, gt=0, description="DPO beta: how far the policy may move from the reference model; "
                        "higher keeps it closer.")
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = Field(
        "sigmoid", description="DPO loss: sigmoid (the DPO paper), ipo, hinge or robust.")
