"""Pretrain recipe: text shards -> a causal LM, from scratch (a config) or continued (a model), with the
transformers Trainer on rows packed to exactly `max_length_tokens`.

Runs in the training process (`trainer.entry`), top to bottom:
tokenizer -> data (a stream split by rank and worker, or the split packed in memory) -> model (full) ->
Trainer with checkpoint and metrics callbacks -> validation loss of the starting model -> train (resuming
when a checkpoint was restored; the Trainer skips the batches this rank's stream already gave) -> validation
loss after -> save -> result. The validation loss is the mean over every held-out token, the same number on
any number of ranks (`validation_loss`), logged as `eval/loss` and `eval/perplexity` at step 0 and at the end.

Packing (see `trainer.stream`): each document's tokens, then EOS, concatenated and cut into rows of
max_length_tokens; no padding, every token is a label. Attention runs across document boundaries within a
row (the usual pretraining setup); EOS tells the model where a document ended.

Why the plain Trainer and not TRL's SFTTrainer with packing: the rows are already packed token ids, so
there is nothing left for SFTTrainer to do, and its dataset preparation does not take a torch stream.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from lmforge.errors import DataError
from trainer import batching, checkpoint, models, stream
from trainer.args import training_args
from trainer.job import JobSpec, rank
from trainer.metrics import MetricsCallback
from trainer.recipe import base_and_tokenizer, run_figures
from trainer.settings import PretrainSettings

log = logging.getLogger(__name__)


def train(spec: JobSpec) -> dict[str, Any]:
    import datasets
    from transformers import PrinterCallback, Trainer, TrainingArguments

    s = PretrainSettings.model_validate(spec.settings)
    work, out = Path(spec.work_dir), Path(spec.output_dir)

    # 1. tokenizer
    res, tokenizer = base_and_tokenizer(spec, s, work)

    # 2. data: the train split streamed (or packed in memory), the validation split packed in memory
    where = f"stage {spec.stage} train split"
    if s.streaming:
        train_ds = stream.PackedTextStream(spec.train_shards, tokenizer, s.max_length_tokens, where=where, seed=s.seed,
                                           shuffle_buffer_rows=s.shuffle_buffer_rows)
        train_rows = None  # unknown without reading the whole split
    else:
        rows = stream.packed_rows(spec.train_shards, tokenizer, s.max_length_tokens, where=where,
                                  max_records=s.max_train_records)
        if not rows:
            raise DataError(where, f"no full row of {s.max_length_tokens} tokens", "add text or lower "
                            "max_length_tokens")
        train_ds, train_rows = datasets.Dataset.from_dict({"input_ids": rows}), len(rows)
        log.info("%s: %d rows of %d tokens packed in memory", where, train_rows, s.max_length_tokens)
    held_out: list[list[int]] = []
    if s.evaluate and spec.validation_shards:
        held_out = stream.packed_rows(spec.validation_shards, tokenizer, s.max_length_tokens,
                                      where=f"stage {spec.stage} validation split")
        if not held_out:
            log.warning("the validation split holds no full row of %d tokens: no validation loss",
                        s.max_length_tokens)

    # 3. model: built from a config (seeded) or loaded; every weight trains
    model, _ = models.load_for_training(res, tokenizer, method="full", lora=s.lora, seed=s.seed, work_dir=work,
                                        dtype=s.dtype, gradient_checkpointing=s.gradient_checkpointing)

    # 4. trainer (max_length is TRL's setting; the rows are packed to max_length_tokens above)
    args = TrainingArguments(**{k: v for k, v in training_args(s, work).items() if k != "max_length"})
    ckpt = checkpoint.callback_for(spec, s)
    metrics = MetricsCallback(spec.tracking_uri, spec.mlflow_run_id)
    trainer = stream.trainer_class(Trainer)(model=model, args=args, train_dataset=train_ds,
                                            data_collator=stream.collate, processing_class=tokenizer,
                                            callbacks=[ckpt, metrics])
    trainer.remove_callback(PrinterCallback)
    meter = batching.PaddingMeter(trainer)  # padding_fraction and non-pad tokens/s, measured

    # 5. validation loss of the starting model (a resumed run's too: the checkpoint loads inside train)
    before = validation_loss(model, held_out, s.batch_size_per_device) if held_out else None
    if before is not None and rank() == 0:
        metrics._send({"eval/loss": before, "eval/perplexity": _perplexity(before)}, 0)

    # 6. train (resumes from the newest uploaded checkpoint; SIGTERM -> checkpoint, then Preempted)
    state = checkpoint.train_resumable(trainer, spec, ckpt)
    after = validation_loss(trainer.model, held_out, s.batch_size_per_device) if held_out else None
    if after is not None and rank() == 0:
        metrics._send({"eval/loss": after, "eval/perplexity": _perplexity(after)}, state.global_step)

    # 7. save: the full model and tokenizer, as safetensors
    trainer.save_model(str(out))
    if rank() == 0:
        (out / "training_args.bin").unlink(missing_ok=True)  # a pickle; the settings are in the manifest
        info = models.write_model_info(out, method="full", base=res, base_ref=spec.model, tokenizer=tokenizer,
                                       seed=s.seed, dtype=s.dtype)
        info["trained_with"] = "pretrain"
        (out / models.MODEL_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))

    # 8. result
    losses = [h["loss"] for h in state.log_history if "loss" in h]  # includes steps before a resume
    if before is not None:
        log.info("validation loss %.4f -> %.4f (perplexity %.2f -> %.2f) over %d rows", before, after,
                 math.exp(before), math.exp(after), len(held_out))
    return {
        "base_model": res.describe,
        "from_scratch": res.kind == "config",
        "streaming": s.streaming,
        "train_shards": len(spec.train_shards),
        "train_rows": train_rows,
        "validation_rows": len(held_out),
        "steps": state.global_step,
        "tokens": int(state.num_input_tokens_seen),  # all ranks; every token of a packed row is trained on
        "tokens_per_s": round((metrics.tokens_end - metrics.tokens_begin) / max(metrics.train_seconds, 1e-9), 1),
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "validation_loss_before": before,
        "validation_loss_after": after,
        "validation_perplexity_before": _perplexity(before),
        "validation_perplexity_after": _perplexity(after),
        "parameters": sum(p.numel() for p in model.parameters()),
        **run_figures(spec, metrics.train_seconds, ckpt),
        **meter.result(metrics.train_seconds),
    }


def validation_loss(model, rows: list[list[int]], batch_size: int) -> float:
    """Mean next-token loss over every held-out token (rows are full, so every row weighs the same).

    Every rank scores every row and gets the same number, with no collective (ZeRO-3 needs the same forwards
    on every rank); Trainer.evaluate would pad uneven per-rank shares with repeated rows under DDP."""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            ids = torch.tensor(rows[i:i + batch_size], dtype=torch.long, device=device)
            n = ids.shape[0] * (ids.shape[1] - 1)  # the model shifts: L - 1 predictions per row
            total += float(model(input_ids=ids, labels=ids).loss) * n
            count += n
    model.train(was_training)
    return total / count


def _perplexity(loss: float | None) -> float | None:
    return None if loss is None else round(math.exp(min(loss, 50.0)), 4)
