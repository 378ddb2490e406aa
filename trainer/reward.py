"""Reward recipe: preference shards -> a sequence-classification reward model, with TRL's RewardTrainer.

Runs in the training process (`trainer.entry`), top to bottom:
tokenizer -> preference pairs (identical pairs skipped and counted) -> model (AutoModelForSequenceClassification,
num_labels=1, full or LoRA) -> RewardConfig -> trainer with checkpoint and metrics callbacks -> train (resuming
when a checkpoint was restored) -> held-out pairwise accuracy and margin -> save -> result.

The reward model is always saved as a full model (a LoRA run is merged first): `config.json` (a
`...ForSequenceClassification` architecture), `model.safetensors`, the tokenizer and `lmforge_model.json`
with `"kind": "reward_model"`. `load_reward_model` reloads it.

Traps handled here: RewardTrainer silently drops pairs whose prompt + chosen or prompt + rejected is longer
than `max_length` (counted: `dropped_too_long`); TRL configs default to gradient checkpointing and bf16.
The preference helpers (`preference_dataset`, `AlignMetricsCallback`) are shared with `trainer.dpo`.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import DataError
from lmforge.records import prompt_turns
from lmforge.shards import ShardRef
from trainer import batching, checkpoint, data, models, tokens
from trainer.args import training_args
from trainer.errors import SettingError
from trainer.job import JobSpec, materialize, rank
from trainer.metrics import MetricsCallback, peak_memory_mb
from trainer.settings import RewardSettings

log = logging.getLogger(__name__)

REWARD_MODEL_KIND = "reward_model"

#: RewardTrainer's log keys -> MLflow metric names (train/loss, eval/loss come from MetricsCallback)
#: eval/reward_accuracy and eval/margin are computed exactly by `heldout_pairwise` (TRL averages per-batch means)
REWARD_LOG_KEYS = {"accuracy": "train/reward_accuracy", "margin": "train/margin", "mean_reward": "train/mean_reward",
                   "eval_mean_reward": "eval/mean_reward"}


# ----------------------------------------------------------------------------------------------
# shared with trainer.dpo


@dataclass
class Pairs:
    """The usable preference pairs of one split, and how many were skipped."""

    dataset: Any  # datasets.Dataset with prompt, chosen, rejected (conversational or plain text), or None
    records: int  # records read from the shards
    identical: int  # chosen == rejected: no preference to learn, skipped


def preference_dataset(shards: list[ShardRef], where: str, conversational: bool,
                       max_records: int | None = None) -> Pairs:
    """Preference records {prompt, chosen, rejected} -> a TRL preference dataset, without identical pairs.

    conversational: the prompt's turns (`prompt_messages`, else `prompt` as one user turn) and chosen/rejected
    assistant turns, rendered by the tokenizer's chat template (as in SFT); otherwise plain text, prompt +
    completion (a multi-turn prompt's contents joined by newlines).
    """
    import datasets

    rows, records, identical = [], 0, 0
    for rec in data.iter_records(shards):
        if max_records is not None and records >= max_records:
            break
        row = pair_example(rec, conversational, where)
        records += 1
        if row is None:
            identical += 1
            continue
        rows.append(row)
    if shards and not records:
        raise DataError(where, "the shards hold no records", "check the upstream stages' drop counts")
    if identical:
        log.warning("%s: %d of %d pairs have chosen == rejected (nothing to prefer) and are skipped", where,
                    identical, records)
    log.info("%s: %d preference pairs from %d shard(s)", where, len(rows), len(shards))
    return Pairs(datasets.Dataset.from_list(rows) if rows else None, records, identical)


def pair_example(rec: dict[str, Any], conversational: bool, where: str) -> dict[str, Any] | None:
    """One preference record -> TRL's {prompt, chosen, rejected} (see `preference_dataset`); None when chosen ==
    rejected (nothing to prefer). A record without the three strings is a DataError naming it."""
    missing = [k for k in ("prompt", "chosen", "rejected") if not isinstance(rec.get(k), str)]
    if missing:
        raise DataError(where, f"record {rec.get('id', '?')} has no string {', '.join(missing)} "
                        f"(fields: {', '.join(sorted(rec))})", "feed this stage shards of preference records")
    if rec["chosen"] == rec["rejected"]:
        return None
    if conversational:  # a multi-turn prompt keeps its turns (records' prompt_messages)
        return {"prompt": prompt_turns(rec), "chosen": [{"role": "assistant", "content": rec["chosen"]}],
                "rejected": [{"role": "assistant", "content": rec["rejected"]}]}
    return {"prompt": rec["prompt"], "chosen": rec["chosen"], "rejected": rec["rejected"]}


def require_pairs(pairs: Pairs, kept: int, where: str, why: str) -> None:
    if kept == 0:
        raise DataError(where, f"no preference pair is left to train on: {pairs.records} read, {pairs.identical} "
                        f"with chosen == rejected, {pairs.records - pairs.identical} {why}",
                        "raise max_length_tokens or check the data")


class AlignMetricsCallback(MetricsCallback):
    """MetricsCallback plus the method's own metrics (reward accuracy, margins) under stable names."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, keys: dict[str, str]):
        super().__init__(tracking_uri, run_id)
        self.keys = keys

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        super().on_log(args, state, control, logs=logs, **kwargs)
        if not state.is_world_process_zero or not logs:
            return
        extra = {self.keys[k]: float(v) for k, v in logs.items() if k in self.keys and v is not None}
        if extra:
            self._send(extra, state.global_step)


def last_logged(history: list[dict[str, Any]], key: str) -> float | None:
    values = [h[key] for h in history if key in h]
    return float(values[-1]) if values else None


# ----------------------------------------------------------------------------------------------
# the reward model


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


def heldout_pairwise(trainer) -> tuple[float, float, int]:
    """(accuracy, mean margin, pairs) of the reward model on the prepared validation pairs, over every pair.

    RewardTrainer.evaluate reports the mean of per-batch means, which is off when the last batch is short.
    """
    import torch

    model = trainer.model
    model.eval()
    wins, margins = [], []
    for batch in trainer.get_eval_dataloader():
        batch = trainer._prepare_inputs(batch)
        with torch.no_grad():
            scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        chosen, rejected = scores.chunk(2)  # the collator stacks all chosen, then all rejected
        margin = trainer.accelerator.gather_for_metrics(chosen - rejected)
        margins.append(margin.float().cpu())
        wins.append((margin > 0).float().cpu())
    margin, win = torch.cat(margins), torch.cat(wins)
    return float(win.mean()), float(margin.mean()), len(margin)


@dataclass
class PairData:
    """A preference stage's (dpo, reward) data, one of two ways:
    - in memory, from preference records: identical pairs skipped here, and the pairs TRL drops while it prepares
      them (too long) counted once the trainer is built (`trainer`);
    - a tokenize stage's rows streamed from the store (trainer/tokens.py), skipped and dropped there.
    """

    train: Any  # datasets.Dataset of {prompt, chosen, rejected}, or a tokens.TokenRowStream
    eval: Any  # datasets.Dataset or None
    steps: int | None  # a stream's optimizer steps (it has no length); None in memory
    token_data: dict[str, Any] | None
    train_pairs: Pairs | None = None
    eval_pairs: Pairs | None = None

    @classmethod
    def load(cls, spec: JobSpec, s, tokenizer, kind: str) -> PairData:
        if spec.token_data is not None:
            train, eval_ds, steps = tokens.stream_data(spec, s, tokenizer, kind)
            return cls(train, eval_ds, steps, spec.token_data)
        conversational = bool(tokenizer.chat_template)
        train_pairs = preference_dataset(spec.train_shards, f"stage {spec.stage} train split", conversational,
                                         s.max_train_records)
        eval_pairs = (preference_dataset(spec.validation_shards, f"stage {spec.stage} validation split",
                                         conversational) if s.evaluate and spec.validation_shards else None)
        require_pairs(train_pairs, len(train_pairs.dataset) if train_pairs.dataset is not None else 0,
                      f"stage {spec.stage}", "other")
        return cls(train_pairs.dataset, eval_pairs.dataset if eval_pairs is not None else None, None, None,
                   train_pairs, eval_pairs)

    @property
    def streamed(self) -> bool:
        return self.token_data is not None

    def trainer(self, base, s, stage: str, why: str, **kwargs):
        """(`base` built on this data, pairs dropped): in memory, micro-batches grouped by length and the pairs TRL
        dropped `why` counted (it says nothing): logged, a failure when no training pair is left, an emptied
        validation set dropped; streamed, the tokenize stage's count."""
        trainer = tokens.build_trainer(base, self.train, eval_dataset=self.eval, **kwargs)
        if self.streamed:
            return trainer, sum(self.token_data["dropped_no_label"].values())
        batching.group_by_length(trainer, s)  # micro-batches of similar length: little padding
        dropped_train = len(self.train) - len(trainer.train_dataset)
        dropped_eval = len(self.eval) - len(trainer.eval_dataset) if self.eval is not None else 0
        if dropped_train or dropped_eval:
            log.warning("%d train and %d validation pairs are %s and are skipped", dropped_train, dropped_eval, why)
        require_pairs(self.train_pairs, len(trainer.train_dataset), f"stage {stage}", why)
        if self.eval is not None and len(trainer.eval_dataset) == 0:
            trainer.eval_dataset = None
        return trainer, dropped_train + dropped_eval

    def result(self, trainer, state, s) -> dict[str, Any]:
        """The record and pair counts, the token shards streamed and the epochs done, for the stage's result."""
        if self.streamed:
            counts = tokens.pair_counts(self.token_data, self.train.rows)
            epochs = tokens.epochs_done(state.global_step, s, self.train.rows)
        else:
            tp, ep = self.train_pairs, self.eval_pairs
            counts = {"train_records": tp.records, "validation_records": ep.records if ep is not None else 0,
                      "skipped_identical_pairs": tp.identical + (ep.identical if ep is not None else 0),
                      "train_pairs": len(trainer.train_dataset)}
            epochs = round(float(state.epoch or 0), 4)
        return {**counts, "validation_pairs": len(trainer.eval_dataset) if trainer.eval_dataset is not None else 0,
                "token_shards": self.token_data["artifact"] if self.streamed else None, "epochs": epochs}


def load_reward_model(folder: Path):
    """(model, tokenizer) of a reward model artifact: `model(**tok(text)).logits[:, 0]` is the reward."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    info = json.loads((Path(folder) / models.MODEL_INFO).read_text())
    if info.get("kind") != REWARD_MODEL_KIND:
        raise SettingError("inputs", f"{folder} is not a reward model (lmforge_model.json kind: {info.get('kind')!r})")
    return AutoModelForSequenceClassification.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder))


def train(spec: JobSpec) -> dict[str, Any]:
    from transformers import PrinterCallback
    from trl import RewardConfig, RewardTrainer

    s = RewardSettings.model_validate(spec.settings)
    if s.method == "qlora":
        raise SettingError("method", "the reward stage trains method full or lora; qlora is not supported for "
                           "sequence-classification reward models yet; use lora")
    work, out = Path(spec.work_dir), Path(spec.output_dir)

    # 1. tokenizer
    res = models.resolve(s.base_model, spec.model, work)
    tokenizer_dir = materialize(spec.tokenizer, work) if spec.tokenizer else None
    tokenizer = models.load_tokenizer(res, tokenizer_dir)
    models.check_max_length(models.load_config(res), s.max_length_tokens, res)

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
    meter = batching.PaddingMeter(trainer)  # padding_fraction and non-pad tokens/s, measured

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
        "train_seconds": round(metrics.train_seconds, 2),
        "peak_memory_mb": round(peak_memory_mb(), 1),
        **meter.result(metrics.train_seconds),
        "trainable_parameters": trainable,
        "resumed_from_step": spec.resume_step or 0,
        "checkpoints_uploaded": ckpt.uploaded,
    }
