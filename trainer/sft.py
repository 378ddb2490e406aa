"""SFT recipe: chat shards -> a fine-tuned model or LoRA adapter, with TRL's SFTTrainer.

Runs in the training process (`trainer.entry`), top to bottom:
tokenizer -> model (full / LoRA / QLoRA) -> data -> chat template for assistant-only loss -> SFTConfig
-> trainer with checkpoint and metrics callbacks -> train (resuming when a checkpoint was restored)
-> evaluate -> save -> result. The settings are the `sft` stage's config (tasks/sft.py subclasses
`SftSettings`); they cross the process boundary as JSON.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lmforge.errors import DataError
from trainer import batching, chat_templates, checkpoint, data, distributed, models, tokens
from trainer.args import training_args
from trainer.job import JobSpec, rank
from trainer.metrics import MetricsCallback
from trainer.recipe import base_and_tokenizer, run_figures
from trainer.settings import SftSettings

log = logging.getLogger(__name__)


def train(spec: JobSpec) -> dict[str, Any]:
    from transformers import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    s = SftSettings.model_validate(spec.settings)
    work, out = Path(spec.work_dir), Path(spec.output_dir)

    # 1. tokenizer
    res, tokenizer = base_and_tokenizer(spec, s, work)

    # 2. data, and a chat template that marks assistant turns for assistant-only loss
    streamed = spec.token_data is not None
    if streamed:  # a tokenize stage's rows, streamed from the store (trainer/tokens.py)
        train_ds, eval_ds, steps = tokens.stream_data(spec, s, tokenizer, "sft")
    else:
        train_ds = data.chat_dataset(spec.train_shards, f"stage {spec.stage} train split", s.max_train_records)
        eval_ds = data.chat_dataset(spec.validation_shards, f"stage {spec.stage} validation split") \
            if s.evaluate else None
        if s.assistant_only_loss:
            marked = chat_templates.training_template(tokenizer, train_ds[:20]["messages"])
            if marked is not None:
                tokenizer.chat_template = marked  # renders the same text; saved with the model

    # padding-free packing without a tokenize stage: token rows made here the way that stage makes them
    padding_free = s.packing == "padding_free"
    records = len(train_ds) if not streamed else None
    dropped = 0
    if padding_free and not streamed:
        train_ds, dropped = tokens.sft_rows(tokenizer, train_ds, max_length=s.max_length_tokens,
                                            assistant_only_loss=s.assistant_only_loss,
                                            where=f"stage {spec.stage} train split")
        if train_ds is None:
            raise DataError(f"stage {spec.stage} train split", f"none of the {records} conversations has an assistant "
                            f"token within max_length_tokens {s.max_length_tokens}", "raise max_length_tokens")
        if eval_ds is not None:
            eval_ds, _ = tokens.sft_rows(tokenizer, eval_ds, max_length=s.max_length_tokens,
                                         assistant_only_loss=s.assistant_only_loss,
                                         where=f"stage {spec.stage} validation split")

    # 3. model: full, or LoRA adapters on a full-precision (lora) or 4-bit NF4 (qlora) base
    model, _ = models.load_for_training(res, tokenizer, method=s.method, lora=s.lora, seed=s.seed, work_dir=work,
                                        dtype=s.dtype, gradient_checkpointing=s.gradient_checkpointing)

    # 4. trainer
    targs = training_args(s, work)
    if streamed:
        targs["max_steps"] = steps  # a stream has no length: the epochs become steps (see _token_data)
    if padding_free:  # the rows are cut to max_length_tokens already; TRL refuses max_length without its packing
        targs["max_length"] = None
        # no padding to leave out, and the pad id can be a real token (eos) inside a row: count every token
        targs["include_num_input_tokens_seen"] = "all"
        # TRL's collator concatenates a micro-batch's rows into one, position_ids restarting per row and no
        # attention mask; SFTTrainer.compute_loss passes use_cache=False, attention runs per row (packed_sdpa;
        # eager's block-diagonal mask) and the loss is the padded step's (per assistant token)
        batching.use_packed_attention(model)
    args = SFTConfig(**targs, packing=s.packing is True, packing_strategy=s.packing_strategy,
                     padding_free=padding_free,
                     assistant_only_loss=s.assistant_only_loss and not (streamed or padding_free))  # rows carry labels
    ckpt = checkpoint.callback_for(spec, s)
    metrics = MetricsCallback(spec.tracking_uri, spec.mlflow_run_id)
    trainer = tokens.build_trainer(SFTTrainer, train_ds, model=model, args=args, eval_dataset=eval_ds,
                                   processing_class=tokenizer, callbacks=[ckpt, metrics])
    trainer.remove_callback(PrinterCallback)  # with tqdm off it prints every log dict; MetricsCallback logs progress
    if not streamed and not padding_free:
        batching.group_by_length(trainer, s)  # micro-batches of similar length: little padding
    meter = batching.PaddingMeter(trainer)  # padding_fraction and non-pad tokens/s, measured
    if streamed:
        dropped = spec.token_data["dropped_no_label"]["train"]  # counted once, by the tokenize stage
    elif not padding_free:
        dropped = 0 if s.packing else len(train_ds) - len(trainer.train_dataset)
    if dropped and not streamed:  # TRL drops them silently: truncation left no assistant token to learn from
        log.warning("%d of %d conversations have no assistant token within max_length_tokens %d and are skipped",
                    dropped, records, s.max_length_tokens)

    # 5. train (resumes from the newest uploaded checkpoint; SIGTERM -> checkpoint, then Preempted)
    state = checkpoint.train_resumable(trainer, spec, ckpt)
    eval_loss = trainer.evaluate()["eval_loss"] if eval_ds is not None else None

    # 6. save: the model (or adapter) and tokenizer, as safetensors
    trainer.save_model(str(out))
    if rank() == 0:
        (out / "training_args.bin").unlink(missing_ok=True)  # a pickle; the settings are in the manifest
        info = models.write_model_info(out, method=s.method, base=res, base_ref=spec.model, tokenizer=tokenizer,
                                       seed=s.seed, dtype=s.dtype)
    else:
        info = {}

    # 7. result
    losses = [h["loss"] for h in state.log_history if "loss" in h]  # includes steps before a resume
    trainable = distributed.parameter_count(model)  # also under ZeRO-3, where a shard's numel() is 0
    quantized = models.count_4bit_layers(model) if s.method == "qlora" else 0
    return {
        "method": s.method,
        "base_model": res.describe,
        "format": info.get("format", ""),
        "train_records": train_ds.rows + dropped if streamed else records,
        "train_rows": train_ds.rows if streamed else len(trainer.train_dataset),  # after tokenizing, dropping, packing
        "dropped_fully_masked": dropped,
        "validation_records": len(eval_ds) if eval_ds is not None else 0,
        "token_shards": spec.token_data["artifact"] if streamed else None,  # streamed rows of a tokenize stage
        "steps": state.global_step,
        "epochs": tokens.epochs_done(state.global_step, s, train_ds.rows) if streamed
        else round(float(state.epoch or 0), 4),
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "eval_loss": eval_loss,
        "tokens": int(state.num_input_tokens_seen),  # non-padding tokens fed to the model, all ranks
        "tokens_per_s": round((metrics.tokens_end - metrics.tokens_begin) / max(metrics.train_seconds, 1e-9), 1),
        **run_figures(spec, metrics.train_seconds, ckpt),
        **meter.result(metrics.train_seconds),
        "trainable_parameters": trainable,
        "quantized_linear_layers": quantized,
    }

