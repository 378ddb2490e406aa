"""The TrainingArguments every recipe shares, from the stage's settings.

One place decides the device, precision, optimizer, schedule, batch sizes, logging and the distributed
strategy (DDP, DeepSpeed ZeRO, FSDP), so sft, reward, dpo and the RL recipes train the same way. Each recipe
passes the result to its TRL config class (`SFTConfig(**training_args(s, work), packing=...)`). Checkpoints are
taken by `trainer.checkpoint.CheckpointCallback`, never by the Trainer's own save strategy.

- precision: `trainer.distributed.resolve_precision` (auto: bf16 from Ampere on, fp16 with a loss scaler on older
  GPUs, fp32 on CPU); the combination of launcher, deepspeed, fsdp and precision is checked first.
- optimizer: adamw_torch is torch's fused AdamW on CUDA (unless DeepSpeed offloads the optimizer to the CPU).
- deepspeed / fsdp: the checked config (a preset or file was already read by the stage process).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainer import distributed
from trainer.job import rank, world_size

log = logging.getLogger(__name__)

#: settings name -> transformers `optim`
OPTIMIZERS = {"adamw_torch": "adamw_torch", "lion": "lion_32bit", "adafactor": "adafactor"}


def training_args(s, work: Path) -> dict[str, Any]:
    """Keyword arguments for any TrainingArguments subclass (on CPU: fp32 unless asked, no activation checkpointing
    unless asked). Raises SettingError for a combination this machine cannot run."""
    import torch

    on_gpu = torch.cuda.is_available()
    settings = s.model_dump()
    precision = distributed.check(settings, distributed.device_capability())
    ds = distributed.load_deepspeed(s.deepspeed)
    fsdp = distributed.load_fsdp(s.fsdp)
    optim = OPTIMIZERS[s.optimizer]
    if optim == "adamw_torch" and on_gpu and not distributed.deepspeed_offloads(ds) \
            and not (fsdp or {}).get("cpu_offload"):
        optim = "adamw_torch_fused"
    strategy: dict[str, Any] = {}
    if ds is not None:
        strategy["deepspeed"] = ds
        if not on_gpu:
            distributed.init_deepspeed_on_cpu()
            strategy["accelerator_config"] = {"use_configured_state": True}
    if fsdp is not None:
        strategy.update(fsdp=True, fsdp_config=fsdp)
    if rank() == 0:
        how = "DeepSpeed ZeRO-%s" % ds["zero_optimization"]["stage"] if ds else "FSDP" if fsdp else (
            "DDP" if world_size() > 1 else "one process")
        log.info("training on %s, %s, precision %s (asked %s), optimizer %s, %d process(es)",
                 "CUDA" if on_gpu else "CPU", how, precision, s.precision, optim, world_size())
    return dict(
        output_dir=str(work / "checkpoints"), seed=s.seed, data_seed=s.seed,
        use_cpu=not on_gpu and ds is None,  # DeepSpeed on CPU goes through its own (gloo) process group
        bf16=precision == "bf16", fp16=precision == "fp16",
        activation_checkpointing=s.gradient_checkpointing,  # transformers 5 name; TRL 1.12 defaults it on
        max_steps=s.max_steps or -1, num_train_epochs=s.epochs,
        per_device_train_batch_size=s.batch_size_per_device, per_device_eval_batch_size=s.batch_size_per_device,
        gradient_accumulation_steps=s.grad_accumulation_steps,
        learning_rate=s.learning_rate, lr_scheduler_type=s.lr_scheduler, warmup_steps=s.warmup_steps,
        weight_decay=s.weight_decay, max_grad_norm=s.max_grad_norm, optim=optim,
        max_length=s.max_length_tokens,
        save_strategy="no", save_total_limit=1,  # CheckpointCallback decides when; one local copy is enough
        eval_strategy="no", logging_steps=s.logging_steps, logging_first_step=True,
        report_to="none", disable_tqdm=True, include_num_input_tokens_seen="non_padding",
        dataloader_num_workers=s.num_workers, dataloader_pin_memory=on_gpu and s.pin_memory,
        dataloader_prefetch_factor=s.prefetch_factor if s.num_workers > 0 else None,
        ddp_backend=None if on_gpu or world_size() == 1 else "gloo", ddp_find_unused_parameters=False,
        **strategy,
    )
