"""DPO recipe: an SFT model + preference shards -> a preference-tuned model or LoRA adapter, with TRL's DPOTrainer.

Runs in the training process (`trainer.entry`), top to bottom:
tokenizer -> preference pairs (identical pairs skipped and counted) -> policy and reference model ->
DPOConfig -> trainer with checkpoint and metrics callbacks -> train (resuming when a checkpoint was
restored) -> held-out reward accuracy and margins -> save -> result.

The reference model is the SFT model the run starts from:
- lora: the policy is the SFT model plus a new adapter (TRL applies `peft_config`); the reference is the
  same model with the adapter disabled, so no second copy is held;
- full: an explicit frozen copy (`ref_model`), eval mode, no gradients;
- qlora: the 4-bit base with its adapter comes in as a PeftModel; TRL then keeps a frozen copy of the
  fresh (zero-update) adapter as "ref", which equals the base model.

Trap: DPOTrainer silently drops pairs whose prompt alone reaches `max_length` (its `keep_start` truncation
would leave no completion token). They are counted (`dropped_prompt_too_long`) and logged.
"""
from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

from trainer import batching, checkpoint, models
from trainer.args import training_args
from trainer.errors import SettingError
from trainer.job import JobSpec, rank
from trainer.preference import AlignMetricsCallback, PairData, last_logged
from trainer.recipe import base_and_tokenizer, load_policy, run_figures
from trainer.settings import DpoSettings

log = logging.getLogger(__name__)

#: DPOTrainer's log keys -> MLflow metric names (train/loss, eval/loss come from MetricsCallback)
DPO_LOG_KEYS = {
    "rewards/accuracies": "train/reward_accuracy", "rewards/margins": "train/margin",
    "rewards/chosen": "train/reward_chosen", "rewards/rejected": "train/reward_rejected",
    "logps/chosen": "train/logp_chosen", "logps/rejected": "train/logp_rejected",
    "eval_rewards/accuracies": "eval/reward_accuracy", "eval_rewards/margins": "eval/margin",
    "eval_rewards/chosen": "eval/reward_chosen", "eval_rewards/rejected": "eval/reward_rejected",
}


REFERENCE = {"full": "frozen copy", "lora": "adapter disabled", "qlora": "frozen copy of the initial adapter"}


def train(spec: JobSpec) -> dict[str, Any]:
    from transformers import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    s = DpoSettings.model_validate(spec.settings)
    work, out = Path(spec.work_dir), Path(spec.output_dir)
    if spec.model is None:
        raise SettingError("inputs", "dpo starts from a model: add an sft stage's output to this stage's inputs")

    # 1. tokenizer (a model artifact keeps its tokenizer, chat template included)
    res, tokenizer = base_and_tokenizer(spec, s, work)

    # 2. data: identical pairs skipped here and prompts that fill max_length dropped by the trainer (counted), or
    #    a tokenize stage's rows (skipped and dropped there) streamed from the store
    pairs = PairData.load(spec, s, tokenizer, "dpo")

    # 3. policy and reference
    model, peft_config = load_policy(res, tokenizer, s, work)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if s.method == "full" else None

    # 4. trainer
    losses = {s.loss_type: 1.0, **({"sft": s.sft_loss_weight} if s.sft_loss_weight else {})}
    targs = training_args(s, work)
    if pairs.steps:
        targs["max_steps"] = pairs.steps  # a stream has no length: the epochs become steps
    args = DPOConfig(**targs, beta=s.beta, loss_type=list(losses), loss_weights=list(losses.values()),
                     truncation_mode="keep_start", precompute_ref_log_probs=False)
    ckpt = checkpoint.callback_for(spec, s)
    metrics = AlignMetricsCallback(spec.tracking_uri, spec.mlflow_run_id, DPO_LOG_KEYS)
    # TRL drops pairs whose prompt alone reaches max_length_tokens (no completion token left), silently
    trainer, dropped = pairs.trainer(DPOTrainer, s, spec.stage, f"with a prompt of max_length_tokens "
                                     f"{s.max_length_tokens} or more", model=model, ref_model=ref_model, args=args,
                                     processing_class=tokenizer, peft_config=peft_config, callbacks=[ckpt, metrics])
    trainer.remove_callback(PrinterCallback)
    packed = batching.padding_free(trainer, s)  # packing: padding_free: the forwards skip the padding
    meter = batching.PaddingMeter(trainer, packed)  # padding_fraction and non-pad tokens/s, measured

    # 5. train (resumes from the newest uploaded checkpoint; SIGTERM -> checkpoint, then Preempted)
    state = checkpoint.train_resumable(trainer, spec, ckpt)
    ev = trainer.evaluate() if trainer.eval_dataset is not None else {}

    # 6. save: the model (full) or adapter (lora, qlora, on top of the input model artifact) and tokenizer
    trainer.save_model(str(out))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if rank() == 0:
        (out / "training_args.bin").unlink(missing_ok=True)  # a pickle; the settings are in the manifest
        info = models.write_model_info(out, method=s.method, base=res, base_ref=spec.model, tokenizer=tokenizer,
                                       seed=s.seed, dtype=s.dtype)
        info["trained_with"] = "dpo"
        (out / models.MODEL_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
    else:
        info = {}

    # 7. result
    history = state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    return {
        "method": s.method,
        "base_model": res.describe,
        "format": info.get("format", ""),
        "reference": REFERENCE[s.method],
        **pairs.result(trainer, state, s),
        "dropped_prompt_too_long": dropped,
        "steps": state.global_step,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "train_reward_accuracy_last": last_logged(history, "rewards/accuracies"),
        "train_margin_last": last_logged(history, "rewards/margins"),
        "eval_loss": ev.get("eval_loss"),
        "eval_reward_accuracy": ev.get("eval_rewards/accuracies"),
        "eval_margin": ev.get("eval_rewards/margins"),
        **run_figures(spec, metrics.train_seconds, ckpt),
        **meter.result(metrics.train_seconds),
        "trainable_parameters": trainable,
    }
