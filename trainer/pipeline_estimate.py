"""`lmforge estimate`'s report: every training stage of a pipeline against every GPU kind of the catalog.

For each stage: its model (trainer/shapes.py), its peak GPU memory by component (trainer/estimate.py), and per GPU
whether it fits, the step time, hours and cost (trainer/gpus.py). Estimates are for CUDA GPUs of compute
capability 8.0+ (the whole catalog), so `precision: auto` is bf16.
"""
from __future__ import annotations

from typing import Any, Mapping

from lmforge.config import PipelineConfig
from lmforge.errors import ConfigError
from trainer import gpus as G
from trainer.errors import SettingError
from trainer.estimate import GIB, Plan, estimate_memory
from trainer.shapes import TRAINING_KINDS, ModelShape, config_error, model_shape, reward_shape

AMPERE = (8, 0)


def response_tokens(st: Any) -> int:
    """The generated tokens of a rollout: ppo's max_new_tokens, grpo's max_completion_tokens (0 for the others)."""
    if st.kind == "ppo":
        return int(st.max_new_tokens)
    if st.kind == "grpo":
        return int(st.max_completion_tokens)
    return 0


def stage_plan(cfg: PipelineConfig, name: str, attn: str) -> tuple[Plan, ModelShape, dict[str, Any]]:
    """The memory plan of a training stage from its settings; also its model and kind-specific numbers."""
    from trainer.distributed import load_deepspeed, load_fsdp, resolve_precision

    st = cfg.stages[name]
    shape = model_shape(cfg, name)
    world = st.nproc_per_node * st.nnodes if st.launcher != "local" else 1
    sharding, offload_opt, offload_params = "none", False, False
    try:
        ds = load_deepspeed(st.deepspeed, st.project_root)
        fsdp = load_fsdp(st.fsdp, st.project_root)
        precision = resolve_precision(st.precision, AMPERE)
    except SettingError as e:
        raise config_error(name, e) from None
    if ds is not None:
        zero = ds.get("zero_optimization", {})
        sharding = {2: "zero2", 3: "zero3"}.get(zero.get("stage", 0), "none")
        offload_opt = (zero.get("offload_optimizer") or {}).get("device", "none") != "none"
        offload_params = (zero.get("offload_param") or {}).get("device", "none") != "none"
    elif fsdp is not None:
        sharding = "fsdp_full_shard" if fsdp.get("reshard_after_forward", True) else "fsdp_shard_grad_op"
        offload_opt = offload_params = bool(fsdp.get("cpu_offload", False))
    kind = st.kind
    rshape = reward_shape(cfg, name) if kind in ("ppo", "grpo") else None
    plan = Plan(kind=kind, method=st.method, dtype=st.dtype, precision=precision,
                micro_batch=st.batch_size_per_device, grad_accumulation_steps=st.grad_accumulation_steps,
                seq_tokens=st.max_length_tokens, gradient_checkpointing=st.gradient_checkpointing,
                attn_implementation=attn, optimizer=st.optimizer, world_size=world, sharding=sharding,
                deepspeed=ds is not None, offload_optimizer=offload_opt, offload_params=offload_params,
                lora_rank=st.lora.rank, lora_targets=st.lora.target_modules, lora_dropout=st.lora.dropout,
                quant_double=st.lora.double_quant,
                reference_copy=st.method == "full" and (kind in ("dpo", "ppo") or (kind == "grpo" and st.beta > 0)),
                reward_shape=rshape, value_model=kind == "ppo", value_method=getattr(st, "value_model", "full"),
                generation=kind in ("ppo", "grpo"), response_tokens=response_tokens(st))
    extra = {"ppo_epochs": getattr(st, "ppo_epochs", 1), "num_iterations": getattr(st, "num_iterations", 1),
             "reference_forward": kind == "grpo" and getattr(st, "beta", 0) > 0}
    return plan, shape, extra


def estimate(cfg: PipelineConfig, catalog: G.Catalog, *, gpu_names: list[str] | None = None, mfu: float = 0.35,
             margin: float = 0.2, attn: str = "sdpa",
             measured_tokens_per_s: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """Every training stage against every (chosen) GPU kind, as one JSON-able dict.

    `measured_tokens_per_s[stage][gpu]`: a measured throughput (a preflight on that GPU kind) that replaces the
    FLOPs model for that pair."""
    names = gpu_names or list(catalog.gpus)
    unknown = [g for g in names if g not in catalog.gpus]
    if unknown:
        raise ConfigError([f"--gpu {g!r}: not in the GPU catalog; known: {', '.join(catalog.gpus)} (add your own "
                           "entry with --catalog FILE)" for g in unknown])
    if not 0 < mfu <= 1:
        raise ConfigError([f"--mfu {mfu}: expected a fraction in (0, 1], e.g. 0.35"])
    if margin < 0:
        raise ConfigError([f"--margin {margin}: expected 0 or more, e.g. 0.2 for 20%"])
    stages: dict[str, Any] = {}
    for name in cfg.topo_order():
        st = cfg.stages[name]
        if st.kind not in TRAINING_KINDS:
            continue
        plan, shape, extra = stage_plan(cfg, name, attn)
        mem = estimate_memory(shape, plan)
        tokens_per_step = plan.micro_batch * plan.grad_accumulation_steps * plan.world_size * plan.seq_tokens
        flops = G.step_flops(shape, plan, **extra)
        ckpt_gib = G.checkpoint_bytes(shape, plan) / GIB
        saved = G.checkpoints_saved(st.max_steps, st.checkpoint_every_steps)
        per_gpu = {}
        for g in names:
            gpu = catalog.gpus[g]
            row: dict[str, Any] = G.fit(mem.total, gpu)
            row["suggestion"] = None if row["fits"] else G.suggest(shape, plan, gpu)
            tps = (measured_tokens_per_s or {}).get(name, {}).get(g)
            if tps:
                row["step_seconds"] = round(G.step_seconds_measured(tokens_per_step, tps), 4)
                row["time_from"] = f"measured {tps:,.0f} tokens/s"
            else:
                row["step_seconds"] = round(G.step_seconds_flops(flops, plan.world_size, gpu, mfu), 4)
                row["time_from"] = f"FLOPs model at MFU {mfu}"
            if st.max_steps:
                row["hours"] = round(row["step_seconds"] * st.max_steps / 3600, 4)
                row["cost"] = G.cost(row["hours"], gpu, catalog.rates, plan.world_size, margin, ckpt_gib, saved,
                                     st.keep_checkpoints)
            else:
                row["hours"], row["cost"] = None, None
                row["note"] = "epochs-based: steps depend on the split size, unknown before the data stages ran; " \
                    "set max_steps for hours and cost"
            per_gpu[g] = row
        stages[name] = {
            "kind": st.kind, "method": plan.method,
            "model": {"source": shape.source, "model_type": shape.model_type, "params": shape.params(),
                      "hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
                      "vocab_size": shape.vocab_size},
            "plan": {k: v for k, v in plan.to_json().items() if k != "reward_shape"},
            "memory": mem.to_json(), "tokens_per_step": tokens_per_step, "flops_per_step": flops,
            "steps": st.max_steps, "checkpoint_gib": round(ckpt_gib, 4), "checkpoints_saved": saved,
            "gpus": per_gpu}
    return {"pipeline": cfg.name, "mfu": mfu, "margin": margin, "attn_implementation": attn, "stages": stages}
