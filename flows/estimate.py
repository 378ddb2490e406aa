"""`lmforge estimate CONFIG`: for every training stage, peak GPU memory by component, fit, time and cost per GPU.

The model of each stage comes from its config alone: `base_model.config`, a local folder's config.json, a GGUF's
header, a hub model's config.json only when it is in the local Hugging Face cache; a stage without base_model takes
the model of the training stage among its inputs (sft <- pretrain), and a config-built model without vocab_size
takes the vocab_size of the tokenizer stage upstream (the most it can have). Formulas: trainer/estimate.py
(memory) and trainer/gpus.py (fit, time, cost). Estimates are for CUDA GPUs of compute capability 8.0+ (the
whole catalog), so `precision: auto` is bf16.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from lmforge.config import PipelineConfig
from lmforge.errors import ConfigError
from trainer import gpus as G
from trainer.errors import SettingError
from trainer.estimate import COMPONENTS, GIB, ModelShape, Plan, estimate_memory, shape_from_config, shape_from_gguf

TRAINING_KINDS = ("pretrain", "sft", "reward", "dpo", "ppo", "grpo")
AMPERE = (8, 0)


def _fail(name: str, e: SettingError) -> ConfigError:
    return ConfigError([f"stages.{name}.{e.field}: {e.problem}"])


def tokenizer_vocab(cfg: PipelineConfig, name: str) -> int | None:
    """vocab_size of the nearest tokenizer stage upstream of `name` (breadth first), if any."""
    todo, seen = list(cfg.stages[name].inputs), set()
    while todo:
        n = todo.pop(0)
        if n in seen or n not in cfg.stages:
            continue
        seen.add(n)
        if cfg.stages[n].kind == "tokenizer":
            return int(cfg.stages[n].vocab_size)
        todo += cfg.stages[n].inputs
    return None


def model_shape(cfg: PipelineConfig, name: str) -> ModelShape:
    """The architecture a training stage trains: its base_model, or the model of the training stage it reads."""
    st = cfg.stages[name]
    src = getattr(st, "base_model", None)
    if src is not None:
        try:
            return source_shape(st, name, tokenizer_vocab(cfg, name))
        except SettingError as e:
            raise _fail(name, e) from None
    upstream = [i for i in st.inputs if i in cfg.stages and cfg.stages[i].kind in TRAINING_KINDS
                and cfg.stages[i].kind != "reward"]
    if not upstream:
        raise ConfigError([f"stages.{name}.base_model: no base model and no training stage among the inputs "
                           f"({', '.join(st.inputs)}); set base_model (config, path, package+file or hub)"])
    return model_shape(cfg, upstream[0])


def reward_shape(cfg: PipelineConfig, name: str) -> ModelShape | None:
    rewards = [i for i in cfg.stages[name].inputs if i in cfg.stages and cfg.stages[i].kind == "reward"]
    return model_shape(cfg, rewards[0]) if rewards else None


def source_shape(st, name: str, vocab: int | None) -> ModelShape:
    src = st.base_model
    if src.config is not None:
        return shape_from_config(src.config, f"stages.{name}.base_model.config", vocab)
    if src.path is not None:
        f = st.local_path(src.path) / "config.json"
        if not f.is_file():
            raise SettingError("base_model.path", f"{f} does not exist; the estimate reads the model's config.json "
                               "from the folder: point base_model.path at a save_pretrained folder")
        return shape_from_config(json.loads(f.read_text()), str(f))
    if src.package is not None:
        from trainer.models import gguf_location

        f = gguf_location(src.package, src.file or "")
        return shape_from_gguf(str(f), f"GGUF {f.name} ({src.package})")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(src.hub, "config.json", revision=src.revision)
    if not isinstance(cached, str):
        raise SettingError("base_model.hub", f"the config.json of {src.hub!r} is not in the local Hugging Face cache "
                           "and the estimate downloads nothing; download it once (`huggingface-cli download "
                           f"{src.hub} config.json`), or copy its contents into base_model.config")
    return shape_from_config(json.loads(Path(cached).read_text()), f"hub {src.hub} (cached config.json)")


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
        raise _fail(name, e) from None
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
                reward_shape=rshape, value_model=kind == "ppo", generation=kind in ("ppo", "grpo"))
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


def _gib(b: int) -> str:
    return f"{b / GIB:.2f}"


def format_table(report: dict[str, Any]) -> str:
    lines = [f"pipeline {report['pipeline']}: peak GPU memory per stage (GiB per GPU), attention "
             f"{report['attn_implementation']}, time from FLOPs at MFU {report['mfu']} unless measured, cost with a "
             f"{report['margin']:.0%} margin (example prices: edit configs/gpus.yaml)"]
    for name, s in report["stages"].items():
        p, m = s["plan"], s["memory"]
        lines.append("")
        lines.append(f"{name} ({s['kind']}, {s['method']}): {s['model']['model_type']} {s['model']['params']:,} params "
                     f"from {s['model']['source']}; micro {p['micro_batch']} x accum {p['grad_accumulation_steps']} x "
                     f"world {p['world_size']}, {p['seq_tokens']} tokens, {p['precision']}, "
                     f"{p['sharding'] if p['sharding'] != 'none' else 'no sharding'}, checkpointing "
                     f"{'on' if p['gradient_checkpointing'] else 'off'}")
        comps = m["components"]
        lines.append("  " + "  ".join(f"{k} {comps[k]['gib']:.3f}" for k in COMPONENTS) + f"  = total {m['total_gib']:.3f}")
        lines.append(f"  {'GPU':<11} {'fits':<4} {'headroom':>16} {'step s':>9} {'hours':>9} {'cost $':>10}  suggestion")
        for g, r in s["gpus"].items():
            head = f"{r['headroom_gib']:.1f} GiB {r['headroom_pct']:.0f}%"
            hours = f"{r['hours']:.4g}" if r["hours"] is not None else "-"
            usd = f"{r['cost']['total_usd']:.2f}" if r["cost"] else "-"
            sug = r.get("suggestion")
            if sug is None:
                text = ""
            elif sug.get("batch_size_per_device"):
                text = (f"batch_size_per_device {sug['batch_size_per_device']} x grad_accumulation_steps "
                        f"{sug['grad_accumulation_steps']} ({sug['total_gib']:.1f} GiB)")
            else:
                text = f"no fit at micro-batch 1: {sug['advice']}"
            lines.append(f"  {g:<11} {'yes' if r['fits'] else 'NO':<4} {head:>16} {r['step_seconds']:>9.4g} "
                         f"{hours:>9} {usd:>10}  {text}")
    return "\n".join(lines)
