"""The TrainingArguments every recipe shares, from the stage's settings.

One place decides the device, precision, optimizer, schedule, batch sizes, logging and DDP backend, so
sft, reward, dpo and the RL recipes train the same way. Each recipe passes the result to its TRL config
class (`SFTConfig(**training_args(s, work), packing=...)`). Checkpoints are taken by
`trainer.checkpoint.CheckpointCallback`, never by the Trainer's own save strategy.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.job import world_size

#: settings name -> transformers `optim`
OPTIMIZERS = {"adamw_torch": "adamw_torch", "lion": "lion_32bit", "adafactor": "adafactor"}


def training_args(s, work: Path) -> dict[str, Any]:
    """Keyword arguments for any TrainingArguments subclass (CPU-safe: no bf16, no activation checkpointing)."""
    import torch

    on_gpu = torch.cuda.is_available()
    return dict(
        output_dir=str(work / "checkpoints"), seed=s.seed, data_seed=s.seed,
        use_cpu=not on_gpu, bf16=s.bf16 and on_gpu, fp16=False,
        activation_checkpointing=s.gradient_checkpointing,  # transformers 5 name; TRL 1.12 defaults it on
        max_steps=s.max_steps or -1, num_train_epochs=s.epochs,
        per_device_train_batch_size=s.batch_size_per_device, per_device_eval_batch_size=s.batch_size_per_device,
        gradient_accumulation_steps=s.grad_accumulation_steps,
        learning_rate=s.learning_rate, lr_scheduler_type=s.lr_scheduler, warmup_steps=s.warmup_steps,
        weight_decay=s.weight_decay, max_grad_norm=s.max_grad_norm, optim=OPTIMIZERS[s.optimizer],
        max_length=s.max_length_tokens,
        save_strategy="no", save_total_limit=1,  # CheckpointCallback decides when; one local copy is enough
        eval_strategy="no", logging_steps=s.logging_steps, logging_first_step=True,
        report_to="none", disable_tqdm=True, include_num_input_tokens_seen="non_padding",
        ddp_backend=None if on_gpu or world_size() == 1 else "gloo", ddp_find_unused_parameters=False,
    )
