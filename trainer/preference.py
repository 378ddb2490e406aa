"""Preference helpers shared by the alignment recipes (reward, dpo, ppo, grpo), tokenize and eval.

- `preference_dataset` / `pair_example`: preference records {prompt, chosen, rejected} -> TRL's preference rows,
  identical pairs skipped and counted (`Pairs`);
- `PairData`: a preference stage's data, in memory or a tokenize stage's rows streamed from the store, with the
  pairs TRL drops counted;
- `AlignMetricsCallback`, `last_logged`: a method's own metrics under stable names;
- `heldout_pairwise`: a reward model's exact pairwise accuracy and margin on held-out pairs;
- `load_reward_model`: reloads a reward stage's artifact (`lmforge_model.json` kind `reward_model`).
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
from trainer import batching, data, models, tokens
from trainer.errors import SettingError
from trainer.job import JobSpec
from trainer.metrics import MetricsCallback

log = logging.getLogger(__name__)

REWARD_MODEL_KIND = "reward_model"


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
    """A DataError at `where` when no pair is `kept`, counting the pairs read, identical and dropped `why`."""
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
    """The last value of `key` in a trainer's log history, or None when it was never logged."""
    values = [h[key] for h in history if key in h]
    return float(values[-1]) if values else None


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
