"""The GPU catalog (configs/gpus.yaml), and for one stage on one GPU: fit, step time, hours and cost.

Fit: the estimate (trainer/estimate.py) against `memory_gib`; headroom = memory - estimate, in GiB and as a % of
the memory. A stage that does not fit gets the largest micro-batch that does, with gradient accumulation raised
so that micro x accum x world_size stays the configured global batch (micro-batches that divide micro x accum);
if not even micro-batch 1 fits, the alternatives that would (gradient checkpointing, LoRA, QLoRA, ZeRO-3) are
named.

Time, from a FLOPs model (per token, P_mm = parameters used in matmuls: the decoder linears and the head):
    forward          F = 2 P_mm + 2 L s a d              (attention scores and values, causal: half of 4 L s a d)
    full training    3 F                                  (backward = 2 forward), + F with gradient checkpointing
    lora / qlora     2 F + 6 P_lora                       (forward, backward through the frozen weights for the
                                                           activations' gradients only, the adapter's full 6 P)
    reward           2 sequences per pair, a score head instead of lm_head
    dpo              2 sequences per pair, each trained, plus the reference's forward F
    ppo              per rollout token: generation F (policy), reference, reward and value forwards (3 F), then
                     ppo_epochs x (policy training + value training)
    grpo             generation F, the reference's forward F when beta > 0, num_iterations x training
    tokens per step  = micro x accum x world_size x s (s = max_length_tokens: an upper bound for padded rows)
    step time        = FLOPs per step / world_size / (peak bf16 TFLOPS x MFU)
Generation (ppo, grpo) is memory-bound, so their real steps are slower than this: run a preflight.
A measured throughput replaces the FLOPs model: `step_seconds_measured(tokens_per_step, tokens_per_s)`; the
preflight stage will supply tokens/s per GPU kind (not built yet).

Cost:
    gpu_hours      = hours x world_size
    compute_usd    = gpu_hours x usd_per_hour x (1 + margin)
    disk_usd       = (keep_checkpoints + 1) x checkpoint_gib x disk_usd_per_gib_month x hours / 730
    transfer_usd   = (checkpoints saved + the final model) x checkpoint_gib x transfer_usd_per_gib
    total_usd      = compute_usd + disk_usd + transfer_usd
A checkpoint holds the trainable weights (at w bytes; adapters fp32) and their optimizer states.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lmforge.errors import ConfigError
from trainer.estimate import GIB, Plan, estimate_memory
from trainer.shapes import ModelShape

REPO = Path(__file__).resolve().parent.parent
CATALOG = REPO / "configs" / "gpus.yaml"
HOURS_PER_MONTH = 730


class Gpu(BaseModel):
    """One GPU kind of the catalog."""

    model_config = ConfigDict(extra="forbid")

    memory_gib: float = Field(gt=0, description="Accelerator memory usable by CUDA, in GiB (nvidia-smi total / "
                              "1024); for unified-memory machines, what the GPU can allocate.")
    peak_bf16_tflops: float = Field(gt=0, description="Peak dense bf16 tensor throughput (fp32 accumulate), TFLOPS.")
    usd_per_hour: float = Field(ge=0, description="What one GPU of this kind costs you per hour, in USD.")
    arch: str = Field("x86_64", description="CPU architecture of the host (aarch64 for GB10 / Grace machines).")
    note: str = Field("", description="Free text shown with the estimate.")


class Rates(BaseModel):
    """Storage and transfer prices."""

    model_config = ConfigDict(extra="forbid")

    disk_usd_per_gib_month: float = Field(0.10, ge=0, description="Object storage or volume, USD per GiB-month.")
    transfer_usd_per_gib: float = Field(0.09, ge=0, description="Uploads and downloads of checkpoints and the "
                                        "final model, USD per GiB.")


class Catalog(BaseModel):
    """configs/gpus.yaml: GPU kinds by name, and the storage rates."""

    model_config = ConfigDict(extra="forbid")

    gpus: dict[str, Gpu] = Field(description="GPU kinds by name; add your own entries.")
    rates: Rates = Field(default_factory=Rates, description="Storage and transfer prices.")


def load_catalog(paths: list[str | Path] | None = None) -> Catalog:
    """The shipped catalog, with the entries of each extra file added (a name given again replaces it)."""
    merged: dict[str, Any] = {"gpus": {}}
    for path in [CATALOG, *(paths or [])]:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError([f"GPU catalog {path}: cannot read it ({e.strerror}); give an existing YAML file"])
        if not isinstance(raw, dict):
            raise ConfigError([f"GPU catalog {path}: expected a mapping with gpus: and rates:"])
        try:
            Catalog.model_validate({"gpus": {}, **raw})
        except ValidationError as e:
            raise ConfigError([f"GPU catalog {path}: {'.'.join(str(x) for x in err['loc'])}: {err['msg']}"
                               + (f", got {err['input']!r}" if not isinstance(err["input"], dict) else "")
                               for err in e.errors()]) from None
        merged["gpus"].update(raw.get("gpus") or {})
        if "rates" in raw:
            merged["rates"] = raw["rates"]
    return Catalog.model_validate(merged)


# ----------------------------------------------------------------------------------------------
# FLOPs and time


def forward_flops_per_token(shape: ModelShape, seq_tokens: int, lm_head: bool = True) -> int:
    return 2 * shape.matmul_params(lm_head) + 2 * shape.num_layers * seq_tokens * shape.num_heads * shape.head_dim


def train_flops_per_token(shape: ModelShape, p: Plan, lm_head: bool = True) -> int:
    f = forward_flops_per_token(shape, p.seq_tokens, lm_head)
    if p.method == "full":
        return 3 * f + (f if p.gradient_checkpointing else 0)
    return 2 * f + 6 * shape.lora_params(p.lora_rank, p.lora_targets) + (f if p.gradient_checkpointing else 0)


def step_flops(shape: ModelShape, p: Plan, ppo_epochs: int = 1, num_iterations: int = 1,
               reference_forward: bool = False) -> int:
    """FLOPs of one optimizer step over every GPU (formulas in the module docstring)."""
    tokens = p.micro_batch * p.grad_accumulation_steps * p.world_size * p.seq_tokens
    f = forward_flops_per_token(shape, p.seq_tokens)
    if p.kind == "reward":
        return 2 * tokens * train_flops_per_token(shape, p, lm_head=False)
    if p.kind == "dpo":
        return 2 * tokens * (train_flops_per_token(shape, p) + f)
    if p.kind == "ppo":
        value = 3 * forward_flops_per_token(p.reward_shape or shape, p.seq_tokens, lm_head=False)
        return tokens * (f + 3 * f + ppo_epochs * (train_flops_per_token(shape, p) + value))
    if p.kind == "grpo":
        return tokens * (f + (f if reference_forward else 0) + num_iterations * train_flops_per_token(shape, p))
    return tokens * train_flops_per_token(shape, p)


def step_seconds_flops(flops: int, world_size: int, gpu: Gpu, mfu: float) -> float:
    return flops / world_size / (gpu.peak_bf16_tflops * 1e12 * mfu)


def step_seconds_measured(tokens_per_step: int, tokens_per_s: float) -> float:
    """The hook for a measured throughput (a preflight run on this GPU kind): tokens/s over all processes."""
    return tokens_per_step / tokens_per_s


# ----------------------------------------------------------------------------------------------
# fit, suggestions, cost


def fit(total_bytes: int, gpu: Gpu) -> dict[str, Any]:
    cap = gpu.memory_gib * GIB
    return {"fits": total_bytes <= cap, "headroom_gib": round((cap - total_bytes) / GIB, 2),
            "headroom_pct": round(100 * (cap - total_bytes) / cap, 1)}


def suggest(shape: ModelShape, p: Plan, gpu: Gpu) -> dict[str, Any] | None:
    """The largest micro-batch (keeping the global batch) that fits; else which alternatives would fit at 1."""
    local = p.micro_batch * p.grad_accumulation_steps
    for m in sorted((m for m in range(1, p.micro_batch) if local % m == 0), reverse=True):
        q = _with(p, micro_batch=m, grad_accumulation_steps=local // m)
        est = estimate_memory(shape, q)
        if fit(est.total, gpu)["fits"]:
            return {"batch_size_per_device": m, "grad_accumulation_steps": local // m,
                    "global_batch": m * (local // m) * p.world_size, "total_gib": round(est.total / GIB, 2)}
    one = _with(p, micro_batch=1, grad_accumulation_steps=local)
    tries = {"gradient_checkpointing: true": {"gradient_checkpointing": True},
             "method: lora": {"method": "lora"}, "method: qlora": {"method": "qlora"},
             "method: qlora + gradient_checkpointing": {"method": "qlora", "gradient_checkpointing": True}}
    if p.kind == "pretrain":  # pretrain trains every weight
        tries = {k: v for k, v in tries.items() if "method" not in v}
    if p.world_size > 1:
        tries["deepspeed: zero3"] = {"sharding": "zero3", "deepspeed": True}
    fitting = [name for name, change in tries.items() if fit(estimate_memory(shape, _with(one, **change)).total, gpu)["fits"]]
    return {"batch_size_per_device": None, "does_not_fit_at_micro_batch_1": True,
            "alternatives_that_fit_at_micro_batch_1": fitting,
            "advice": ("try " + ", or ".join(fitting)) if fitting else
            "none of gradient checkpointing, LoRA, QLoRA or ZeRO-3 fits one GPU of this kind: use a larger GPU, "
            "more GPUs with ZeRO-3 (nproc_per_node), or a shorter max_length_tokens"}


def _with(p: Plan, **change: Any) -> Plan:
    from dataclasses import replace

    return replace(p, **change)


def checkpoint_bytes(shape: ModelShape, p: Plan) -> int:
    """One checkpoint: the trainable weights and their optimizer states (adapters in fp32)."""
    from trainer.estimate import optimizer_bytes_per_param
    from trainer.memory_plan import DTYPE_BYTES

    if p.method == "full":
        return shape.params() * DTYPE_BYTES[p.dtype] + round(
            shape.params() * optimizer_bytes_per_param(p, DTYPE_BYTES[p.dtype], shape.hidden_size))
    n = shape.lora_params(p.lora_rank, p.lora_targets)
    return n * 4 + round(n * optimizer_bytes_per_param(p, 4, shape.hidden_size))


def cost(hours: float, gpu: Gpu, rates: Rates, world_size: int, margin: float, checkpoint_gib: float,
         checkpoints_saved: int, keep_checkpoints: int) -> dict[str, float]:
    gpu_hours = hours * world_size
    compute = gpu_hours * gpu.usd_per_hour * (1 + margin)
    disk = (keep_checkpoints + 1) * checkpoint_gib * rates.disk_usd_per_gib_month * hours / HOURS_PER_MONTH
    transfer = (checkpoints_saved + 1) * checkpoint_gib * rates.transfer_usd_per_gib
    return {"gpu_hours": round(gpu_hours, 4), "compute_usd": round(compute, 4), "disk_usd": round(disk, 4),
            "transfer_usd": round(transfer, 4), "total_usd": round(compute + disk + transfer, 4)}


def checkpoints_saved(steps: int | None, every: int | None) -> int:
    """Checkpoints a run of `steps` optimizer steps saves and uploads, one every `every` steps."""
    return steps // every if steps and every else 0
