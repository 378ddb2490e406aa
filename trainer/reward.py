"""Reward recipe: preference shards -> a sequence-classification reward model, with TRL's RewardTrainer.

Runs in the training process (`trainer.entry`), top to bottom:
tokenizer -> preference pairs (identical pairs skipped and counted) -> model (AutoModelForSequenceClassification,
num_labels=1, full or LoRA) -> RewardConfig -> trainer with checkpoint and metrics callbacks -> train (resuming
when a checkpoint was restored) -> held-out pairwise accuracy and margin -> save -> result.

The reward model is always saved as a full model (a LoRA run is merged first): `config.json` (a
`...ForSequenceClassification` architecture), `model.safetensors`, the tokenizer and `lmforge_model.json`
with `"kind": "reward_model"`. `trainer.preference.load_reward_model` reloads it.

Traps handled here: RewardTrainer silently drops pairs whose prompt + chosen or prompt + rejected is longer
than `max_length` (counted: `dropped_too_long`); TRL configs default to gradient checkpointing and bf16.
The preference helpers it shares with dpo, ppo and grpo live in `trainer.preference`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from trainer import batching, checkpoint, models
from trainer.args import training_args
from trainer.errors import SettingError
from trainer.job import JobSpec, rank
from trainer.preference import REWARD_MODEL_KIND, AlignMetricsCallback, PairData, heldout_pairwise, last_logged
from trainer.recipe import base_and_tokenizer, run_figures
from trainer.settings import RewardSettings

log = logging.getLogger(__name__)

#: RewardTrainer's log keys -> MLflow metric names (train/loss, eval/loss come from MetricsCallback)
#: eval/reward_accuracy and eval/margin are computed exactly by `heldout_pairwise` (TRL averages per-batch means)
REWARD_LOG_KEYS = {"accuracy": "train/reward_accuracy", "margin": "train/margin", "mean_reward": "train/mean_reward",
                   "eval_mean_reward": "eval/mean_reward"}


def load_for_reward_training(res: models.Resolved, tokenizer, s: RewardSettings, work: Path):
    """A sequence-classification model with one output (the reward) on the base model's backbone."""
    from transformers import AutoModelForSequenceClassification, set_seed

    dtype = models._dtype(s.dtype)
    set_seed(s.seed)  # the score head is initialized at random
    if res.kind == "config":
        config = models.load_config(res)
        if "vocab_size" not in res.config:
            config.vocab_size = len(tokenizer)
        for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if k not in res.config:
                setattr(config, k, getattr(tokenizer, k))
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    else:
        if res.kind in ("path", "hub", "artifact"):
            name, kwargs = res.pretrained_args()
        else:  # an adapter (merged into its base) or a GGUF file (dequantized): a plain copy first
            plain = work / "base-plain"
            models.load_plain(res, tokenizer, seed=s.seed, dtype=s.dtype).save_pretrained(plain)
            name, kwargs = str(plain), {}
        try:
            model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1, dtype=dtype, **kwargs)
        except (OSError, ValueError) as e:
            raise SettingError(res.field, f"cannot load {res.describe} as a sequence-classification model: "
                               f"{str(e).splitlines()[0]}") from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id  # the reward is read at the last non-pad token
    if s.method == "full":
        return model
    from peft import LoraConfig, get_peft_model

    models.check_lora_targets(model, s.lora.target_modules, res.describe)
    # task_type SEQ_CLS: peft trains the whole new score head (modules_to_save) next to the adapters
    config = LoraConfig(r=s.lora.rank, lora_alpha=s.lora.alpha, lora_dropout=s.lora.dropout,
                        target_modules=s.lora.target_modules, bias="none", task_type="SEQ_CLS")
    return get_peft_model(model, config)


def train(spec: JobSpec) -> dict[str, Any]:
    from transformers import PrinterCallback
    from trl import RewardConfig, RewardTrainer

    s = RewardSettings.model_validate(spec.settings)
    if s.method == "qlora":
        raise SettingError("method", "the reward stage trains method full or lora; qlora is not supported for "
                           "sequence-classification reward models yet; use lora")
    work, out = Path(spec.work_dir), Path(spec.output_dir)

    # 1. tokenizer
    res, tokenizer = base_and_tokenizer(spec, s, work)

    # 2. data: identical pairs skipped here and too-long ones dropped by the trainer (counted), or a tokenize
    #    stage's rows streamed from the store
    pairs = PairData.load(spec, s, tokenizer, "reward")

    # 3. model
    model = load_for_reward_training(res, tokenizer, s, work)

    # 4. trainer
    targs = training_args(s, work)
    if pairs.steps:
        targs["max_steps"] = pairs.steps  # a stream has no length: the epochs become steps
    args = RewardConfig(**targs, center_rewards_coefficient=s.center_rewards_coefficient)
    ckpt = checkpoint.callback_for(spec, s)
    metrics = AlignMetricsCallback(spec.tracking_uri, spec.mlflow_run_id, REWARD_LOG_KEYS)
    # TRL drops pairs whose prompt + chosen or prompt + rejected is longer than max_length_tokens, silently
    trainer, dropped = pairs.trainer(RewardTrainer, s, spec.stage, f"longer than max_length_tokens "
                                     f"{s.max_length_tokens}", model=model, args=args, processing_class=tokenizer,
                                     callbacks=[ckpt, metrics])
    trainer.remove_callback(PrinterCallback)
    packed = batching.padding_free(trainer, s)  # packing: padding_free: the forwards skip the padding
    meter = batching.PaddingMeter(trainer, packed)  # padding_fraction and non-pad tokens/s, measured

    # 5. train (resumes from the newest uploaded checkpoint; SIGTERM -> checkpoint, then Preempted)
    state = checkpoint.train_resumable(trainer, spec, ckpt)
    ev = trainer.evaluate() if trainer.eval_dataset is not None else {}
    if trainer.eval_dataset is not None:
        ev["eval_accuracy"], ev["eval_margin"], scored = heldout_pairwise(trainer)
        log.info("held-out: pairwise accuracy %.4f, mean margin %.4f over %d pairs", ev["eval_accuracy"],
                 ev["eval_margin"], scored)
        if state.is_world_process_zero:
            metrics._send({"eval/reward_accuracy": ev["eval_accuracy"], "eval/margin": ev["eval_margin"]},
                          state.global_step)

    # 6. save: always a full sequence-classification model (LoRA merged), with its tokenizer
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if rank() == 0:
        final = trainer.accelerator.unwrap_model(trainer.model)
        if s.method != "full":
            final = final.merge_and_unload()
        final.save_pretrained(str(out), safe_serialization=True)
        tokenizer.save_pretrained(out)
        info = {"format": "full", "kind": REWARD_MODEL_KIND, "method": s.method,
                "architecture": "AutoModelForSequenceClassification", "num_labels": 1,
                "base": {"kind": "artifact_ref", "ref": spec.model.model_dump()} if spec.model else res.to_json()}
        (out / models.MODEL_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))

    # 7. result
    history = state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    return {
        "method": s.method,
        "base_model": res.describe,
        **pairs.result(trainer, state, s),
        "dropped_too_long": dropped,
        "steps": state.global_step,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "train_reward_accuracy_last": last_logged(history, "accuracy"),
        "train_margin_last": last_logged(history, "margin"),
        "eval_loss": ev.get("eval_loss"),
        "eval_reward_accuracy": ev.get("eval_accuracy"),
        "eval_margin": ev.get("eval_margin"),
        **run_figures(spec, metrics.train_seconds, ckpt),
        **meter.result(metrics.train_seconds),
        "trainable_parameters": trainable,
    }
