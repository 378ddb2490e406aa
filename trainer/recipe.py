"""Steps every recipe (trainer/<method>.py) runs alike, so each recipe reads top to bottom as its own steps.

- `base_and_tokenizer`: where the model comes from and its tokenizer (a tokenizer artifact's, else the model's
  own), with `max_length_tokens` checked against the model's positions;
- `load_policy`: the model a preference or RL recipe (dpo, ppo, grpo) trains, and the LoRA config TRL applies;
- `run_figures`: the result fields every recipe reports about the run itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer import models
from trainer.job import JobSpec, materialize
from trainer.metrics import peak_memory_mb


def base_and_tokenizer(spec: JobSpec, s, work: Path) -> tuple[models.Resolved, Any]:
    """(resolved model source, tokenizer); a model artifact keeps its tokenizer, chat template included."""
    res = models.resolve(s.base_model, spec.model, work)
    tokenizer_dir = materialize(spec.tokenizer, work) if spec.tokenizer else None
    tokenizer = models.load_tokenizer(res, tokenizer_dir)
    models.check_max_length(models.load_config(res), s.max_length_tokens, res)
    return res, tokenizer


def load_policy(res: models.Resolved, tokenizer, s, work: Path):
    """(policy, peft_config) of a preference or RL recipe:
    - qlora: the 4-bit base with a fresh adapter, as a PeftModel (peft_config None);
    - lora: the full-precision model and the LoraConfig that TRL applies (so the reference can be the same model
      with its adapter disabled);
    - full: the model itself (peft_config None)."""
    if s.method == "qlora":
        model, _ = models.load_for_training(res, tokenizer, method="qlora", lora=s.lora, seed=s.seed, work_dir=work,
                                            dtype=s.dtype, gradient_checkpointing=s.gradient_checkpointing)
        return model, None
    model, _ = models.load_for_training(res, tokenizer, method="full", lora=s.lora, seed=s.seed, work_dir=work,
                                        dtype=s.dtype)
    if s.method == "full":
        return model, None
    from peft import LoraConfig

    models.check_lora_targets(model, s.lora.target_modules, res.describe)
    return model, LoraConfig(r=s.lora.rank, lora_alpha=s.lora.alpha, lora_dropout=s.lora.dropout,
                             target_modules=s.lora.target_modules, bias="none", task_type="CAUSAL_LM")


def run_figures(spec: JobSpec, train_seconds: float, checkpoints) -> dict[str, Any]:
    """Training time, peak memory, the step the run resumed from and the checkpoints it uploaded."""
    return {"train_seconds": round(train_seconds, 2), "peak_memory_mb": round(peak_memory_mb(), 1),
            "resumed_from_step": spec.resume_step or 0, "checkpoints_uploaded": checkpoints.uploaded}
