"""The settings of one training stage that shape its memory (`Plan`), and the bytes per element they imply.

Shared by the estimate (trainer/estimate.py) and its activation model (trainer/activations.py); the notation is
trainer/estimate.py's.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from trainer.shapes import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: kinds whose TRL trainer casts a QLoRA model's trainable (adapter) parameters to bf16 (SFT, DPO, reward, GRPO)
TRL_BF16_QLORA_KINDS = frozenset({"sft", "dpo", "reward", "grpo"})

AttnImpl = Literal["sdpa", "flash_attention_2", "eager"]
Sharding = Literal["none", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op"]
Device = Literal["cuda", "cpu"]


@dataclass
class Plan:
    """The settings of one training stage that shape its memory (a stage's settings, made concrete)."""

    kind: str  # sft | pretrain | reward | dpo | ppo | grpo
    method: str  # full | lora | qlora
    dtype: str = "float32"
    precision: str = "bf16"  # resolved: bf16 | fp16 | fp32
    micro_batch: int = 8
    grad_accumulation_steps: int = 1
    seq_tokens: int = 1024
    row_tokens: float = 0  # tokens a row really has as trained, when known (the preflight measures it); 0: seq_tokens
    gradient_checkpointing: bool = False
    attn_implementation: AttnImpl = "sdpa"
    optimizer: str = "adamw_torch"
    world_size: int = 1
    sharding: Sharding = "none"
    deepspeed: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    lora_rank: int = 16
    lora_targets: list[str] | str = "all-linear"
    lora_dropout: float = 0.05
    quant_double: bool = True
    reference_copy: bool = False  # a frozen full copy of the policy (dpo/ppo/grpo full)
    reward_shape: ModelShape | None = None  # ppo (and grpo with a reward stage): the reward model's backbone
    value_model: bool = False  # ppo: a trained copy of the reward model
    value_method: str = "full"  # ppo's value_model setting: full (every weight trains) | lora (adapter + score head)
    generation: bool = False  # ppo, grpo: rollouts with a KV cache
    response_tokens: int = 0  # ppo max_new_tokens, grpo max_completion_tokens: the generated tokens of a rollout
    device: Device = "cuda"  # cpu: the preflight's CPU runs (dropout masks and AdamW temporaries differ)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reward_shape"] = asdict(self.reward_shape) if self.reward_shape else None
        return out


def row_tokens(p: Plan) -> float:
    """s: the tokens of a row as the model computes on it: measured (the preflight's mean padded row of the
    micro-batches it ran) when known, else max_length_tokens, the upper bound."""
    return p.row_tokens or p.seq_tokens


def compute_bytes(p: Plan) -> int:
    return 4 if p.precision == "fp32" else 2


def weight_bytes(p: Plan) -> int:
    """Bytes of a stored (unquantized) weight: the dtype, or 16 bits under DeepSpeed mixed precision."""
    if p.deepspeed and p.precision in ("bf16", "fp16"):
        return 2
    return DTYPE_BYTES[p.dtype]


def adapter_bytes(p: Plan) -> int:
    """Bytes of a LoRA parameter (and of its gradient and AdamW states, which torch keeps in the parameter's dtype):
    peft keeps adapters in fp32 (autocast_adapter_dtype); TRL's trainers cast a QLoRA model's trainable parameters
    to bf16 (the QLoRA paper's recipe); DeepSpeed mixed precision holds 16 bits."""
    if (p.deepspeed and p.precision in ("bf16", "fp16")) or (p.method == "qlora" and p.kind in TRL_BF16_QLORA_KINDS):
        return 2
    return 4


def lora_target_names(shape: ModelShape, p: Plan) -> list[str]:
    linears = shape.linears()
    return list(linears) if p.lora_targets == "all-linear" else [t.rsplit(".", 1)[-1] for t in p.lora_targets]
