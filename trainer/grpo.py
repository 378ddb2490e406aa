"""GRPO / RLOO recipe: a policy (an SFT model) + prompts + rewards -> an RL-tuned model or LoRA adapter, with
TRL's GRPOTrainer or RLOOTrainer (generation with transformers on the training device; no vLLM).

Runs in the training process (`trainer.entry`), top to bottom:
tokenizer -> prompts (from preference or chat shards; prompts too long for a completion skipped and
counted) -> rewards (functions named in the config and/or a reward model artifact) -> policy (full, LoRA,
QLoRA) -> held-out reward of the starting policy -> GRPOConfig / RLOOConfig -> trainer with checkpoint and
metrics callbacks -> train (resuming when a checkpoint was restored) -> held-out reward of the trained
policy -> save -> result.

Prompts (`trainer.prompts`): a preference record gives its `prompt`, a chat record its turns before the last
assistant turn; with a chat template they become chat turns. Each prompt carries an `answer` column for the
rewards: the record's `answer` field, else its demonstrated answer (`chosen`, or the last assistant turn).

The reward of a completion is the weighted sum of the reward functions' values and the reward model's
score (TRL sums them; `None` from a function means not scored). The reference for the KL term is the
starting policy: the adapter disabled (lora), or a frozen copy (full; saved to the work dir so TRL can
load it); `beta: 0` drops both.

Held-out check: greedy completions of the distinct validation prompts, from the starting policy (before
training) and from the trained policy, scored by the same rewards. `eval_reward_start` and
`eval_reward_trained` are the measurable improvement; training rewards are sampled, these are not.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer import batching, checkpoint, models
from trainer.args import training_args
from trainer.errors import SettingError
from trainer.job import JobSpec, materialize, rank
from trainer.preference import AlignMetricsCallback, last_logged, load_reward_model
from trainer.prompts import distinct, load_splits, prompt_ids
from trainer.recipe import base_and_tokenizer, load_policy, run_figures
from trainer.rewards import load_reward_function
from trainer.settings import GrpoSettings

log = logging.getLogger(__name__)

#: GRPOTrainer / RLOOTrainer log keys -> MLflow metric names (train/loss etc. come from MetricsCallback);
#: each reward's mean is added as train/reward/<name> (`reward_log_keys`)
RL_LOG_KEYS = {
    "reward": "train/reward", "reward_std": "train/reward_std", "kl": "train/kl",
    "completions/mean_length": "train/completion_length", "completions/clipped_ratio": "train/completion_clipped_ratio",
    "entropy": "train/entropy", "clip_ratio/region_mean": "train/clip_ratio",
    "frac_reward_zero_std": "train/frac_reward_zero_std",
}
REWARD_MODEL_NAME = "reward_model"
RM_BATCH = 32  # completions per reward-model forward pass in the held-out check


# ----------------------------------------------------------------------------------------------
# rewards


@dataclass
class Rewards:
    """The reward sources in TRL's order (functions, then the reward model), with stable names and weights."""

    funcs: list[Any]  # callables and/or a sequence-classification model
    names: list[str]  # metric names: the function's name (made unique), `reward_model`
    weights: list[float]
    processing_classes: list[Any]  # None for functions, the reward model's tokenizer
    sources: dict[str, str] = field(default_factory=dict)  # name -> import path / artifact

    def log_keys(self) -> dict[str, str]:
        return {**RL_LOG_KEYS, **{f"rewards/{n}/mean": f"train/reward/{n}" for n in self.names}}


def load_rewards(s: GrpoSettings, spec: JobSpec, work: Path) -> Rewards:
    funcs, names, weights, procs, sources = [], [], [], [], {}
    for i, ref in enumerate(s.reward_functions):
        try:
            fn = load_reward_function(ref.function)
        except ValueError as e:
            raise SettingError(f"reward_functions[{i}]", str(e)) from None
        name = base = ref.function.rsplit(":", 1)[1].rsplit(".", 1)[-1]
        k = 2
        while name in names or name == REWARD_MODEL_NAME:
            name, k = f"{base}_{k}", k + 1
        funcs.append(fn)
        names.append(name)
        weights.append(ref.weight)
        procs.append(None)
        sources[name] = ref.function
    if spec.reward_model is not None:
        rm, rm_tok = load_reward_model(materialize(spec.reward_model, work))
        rm.eval().requires_grad_(False)
        if rm_tok.pad_token is None:
            rm_tok.pad_token = rm_tok.eos_token
        rm.config.pad_token_id = rm_tok.pad_token_id  # the score is read at the last non-pad token (as TRL sets it)
        funcs.append(rm)
        names.append(REWARD_MODEL_NAME)
        weights.append(s.reward_model_weight)
        procs.append(rm_tok)
        sources[REWARD_MODEL_NAME] = spec.reward_model.describe()
    if not funcs:
        raise SettingError("reward_functions", "no reward: name reward functions (e.g. trainer.rewards:sum_correct) "
                           "and/or add a reward stage to this stage's inputs")
    return Rewards(funcs, names, weights, procs, sources)


def score(rewards: Rewards, prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> tuple[list[float], dict[str, list[float]]]:
    """(total reward per completion, {name: values}) the way the trainers compute them: each function
    called with TRL's arguments, the reward model on prompt + completion, NaN for "not scored", the total a
    weighted sum over the scored ones (NaN when none scored)."""
    import torch
    from trl.data_utils import apply_chat_template

    per: dict[str, list[float]] = {}
    for fn, name, proc in zip(rewards.funcs, rewards.names, rewards.processing_classes, strict=True):
        if isinstance(fn, torch.nn.Module):
            if isinstance(prompts[0], list):
                texts = [apply_chat_template({"messages": p + c}, proc)["text"]
                         for p, c in zip(prompts, completions, strict=True)]
            else:
                texts = [p + c for p, c in zip(prompts, completions, strict=True)]
            device = next(fn.parameters()).device
            per[name] = []
            for i in range(0, len(texts), RM_BATCH):
                enc = proc(text=texts[i:i + RM_BATCH], return_tensors="pt", padding=True, padding_side="right",
                           add_special_tokens=False)
                with torch.inference_mode():
                    per[name] += fn(**enc.to(device)).logits[:, 0].float().tolist()
        else:
            out = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=None,
                     log_extra=lambda *a, **k: None, log_metric=lambda *a, **k: None, **columns)
            per[name] = [math.nan if v is None else float(v) for v in out]
    totals = []
    for i in range(len(prompts)):
        vals = [(per[n][i], w) for n, w in zip(rewards.names, rewards.weights, strict=True) if not math.isnan(per[n][i])]
        totals.append(sum(v * w for v, w in vals) if vals else math.nan)
    return totals, per


def _nanmean(xs: list[float]) -> float | None:
    vals = [x for x in xs if not math.isnan(x)]
    return sum(vals) / len(vals) if vals else None


def greedy_completions(model, tokenizer, prompts: list, max_new_tokens: int, batch_size: int):
    """(completions in the prompts' format, completion token ids): greedy, left-padded batches, cut after eos."""
    import torch

    conversational = isinstance(prompts[0], list)
    device = next(model.parameters()).device
    completions, ids = [], []
    was_training = model.training
    model.eval()
    for i in range(0, len(prompts), batch_size):
        chunk = [prompt_ids(tokenizer, p) for p in prompts[i:i + batch_size]]
        width = max(len(c) for c in chunk)
        input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(c)) + c for c in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        for row in out[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[:row.index(tokenizer.eos_token_id) + 1]
            ids.append(row)
            text = tokenizer.decode(row, skip_special_tokens=True)
            completions.append([{"role": "assistant", "content": text}] if conversational else text)
    model.train(was_training)
    return completions, ids


def heldout(model, tokenizer, rows: list[dict[str, Any]], rewards: Rewards, s: GrpoSettings) -> dict[str, Any]:
    """Mean total reward (and per reward) of the policy's greedy completions of the held-out prompts."""
    if not rows:
        return {"reward": None, "per_reward": {}, "samples": []}
    prompts = [r["prompt"] for r in rows]
    completions, ids = greedy_completions(model, tokenizer, prompts, s.max_completion_tokens,
                                          max(s.batch_size_per_device, 8))
    totals, per = score(rewards, prompts, completions, ids, {"answer": [r["answer"] for r in rows]})
    samples = [{"prompt": _text(p), "completion": _text(c), "reward": None if math.isnan(t) else round(t, 4)}
               for p, c, t in zip(prompts, completions, totals, strict=True)]
    return {"reward": _nanmean(totals), "per_reward": {n: _nanmean(v) for n, v in per.items()}, "samples": samples}


def _text(x) -> str:
    return x if isinstance(x, str) else x[-1]["content"]


# ----------------------------------------------------------------------------------------------
# the recipe


def train(spec: JobSpec) -> dict[str, Any]:
    import datasets
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    s = GrpoSettings.model_validate(spec.settings)
    work, out = Path(spec.work_dir), Path(spec.output_dir)

    # 1. tokenizer (a model artifact keeps its tokenizer, chat template included)
    res, tokenizer = base_and_tokenizer(spec, s, work)

    # 2. prompts: training ones (repeats kept: they are samples), distinct held-out ones
    train_p, eval_p = load_splits(spec, tokenizer, s, ("max_completion_tokens", s.max_completion_tokens),
                                  f"stage {spec.stage}")
    eval_rows = distinct(eval_p.rows, s.max_validation_prompts)
    train_keys = {json.dumps(r["prompt"], sort_keys=True) for r in train_p.rows}
    seen_in_train = sum(json.dumps(r["prompt"], sort_keys=True) in train_keys for r in eval_rows)

    # 3. rewards
    rewards = load_rewards(s, spec, work)

    # 4. policy; the reference for the KL term is the starting policy
    model, peft_config = load_policy(res, tokenizer, s, work)
    if s.method == "full" and s.beta > 0:
        # TRL loads the full reference with from_pretrained(model.name_or_path): give it the starting weights
        ref_dir = work / f"reference-{rank()}"
        model.save_pretrained(ref_dir, safe_serialization=True)
        model.config._name_or_path = str(ref_dir)

    # 5. held-out reward of the starting policy (before any checkpoint is restored)
    before = heldout(model, tokenizer, eval_rows, rewards, s)

    # 6. trainer
    targs = training_args(s, work)
    targs.pop("max_length", None)  # GRPO/RLOO: prompt length is checked above, completions by max_completion_length
    targs["include_num_input_tokens_seen"] = "no"  # the RL trainers count prompt + completion tokens themselves
    common = dict(num_generations=s.num_generations, max_completion_length=s.max_completion_tokens,
                  temperature=s.temperature, beta=s.beta, epsilon=s.epsilon, num_iterations=s.num_iterations,
                  reward_weights=rewards.weights)
    if s.algorithm == "grpo":
        args = GRPOConfig(**targs, **common, scale_rewards=s.scale_rewards, loss_type=s.loss_type)
        trainer_cls = GRPOTrainer
    else:
        args = RLOOConfig(**targs, **common, normalize_advantages=s.normalize_advantages)
        trainer_cls = RLOOTrainer
    ckpt = checkpoint.callback_for(spec, s)
    metrics = AlignMetricsCallback(spec.tracking_uri, spec.mlflow_run_id, rewards.log_keys())
    train_ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_p.rows])
    trainer = trainer_cls(model=model, reward_funcs=list(rewards.funcs), args=args, train_dataset=train_ds,
                          processing_class=tokenizer, reward_processing_classes=list(rewards.processing_classes),
                          peft_config=peft_config, callbacks=[ckpt, metrics])
    trainer.reward_func_names = list(rewards.names)  # stable metric names: rewards/<name>/mean
    trainer.remove_callback(PrinterCallback)
    meter = batching.PaddingMeter(trainer)  # padding_fraction and non-pad tokens/s, measured

    # 7. train (resumes from the newest uploaded checkpoint; SIGTERM -> checkpoint, then Preempted)
    state = checkpoint.train_resumable(trainer, spec, ckpt)

    # 8. held-out reward of the trained policy
    policy = trainer.accelerator.unwrap_model(trainer.model)
    after = heldout(policy, tokenizer, eval_rows, rewards, s)
    if eval_rows:
        log.info("held-out reward over %d prompts: %.4f (starting policy) -> %.4f (trained)", len(eval_rows),
                 before["reward"] if before["reward"] is not None else math.nan,
                 after["reward"] if after["reward"] is not None else math.nan)
        if state.is_world_process_zero:
            sent = {"eval/reward_start": before["reward"], "eval/reward": after["reward"]}
            for n in rewards.names:
                sent[f"eval/reward/{n}_start"] = before["per_reward"].get(n)
                sent[f"eval/reward/{n}"] = after["per_reward"].get(n)
            metrics._send({k: v for k, v in sent.items() if v is not None}, state.global_step)

    # 9. save: the model (full) or adapter (lora, qlora, on top of the input model artifact) and tokenizer
    trainer.save_model(str(out))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    if rank() == 0:
        (out / "training_args.bin").unlink(missing_ok=True)  # a pickle; the settings are in the manifest
        shutil.rmtree(out / "ref", ignore_errors=True)  # qlora: TRL's frozen copy of the initial adapter
        info = models.write_model_info(out, method=s.method, base=res, base_ref=spec.model, tokenizer=tokenizer,
                                       seed=s.seed, dtype=s.dtype)
        info["trained_with"] = s.algorithm
        info["rewards"] = rewards.sources
        (out / models.MODEL_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
        (out / "heldout_generations.json").write_text(json.dumps(
            {"start": before["samples"], "trained": after["samples"]}, indent=2, ensure_ascii=False))
    else:
        info = {}

    # 10. result
    history = state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    train_rewards = [h["reward"] for h in history if h.get("reward") is not None]
    return {
        "algorithm": s.algorithm,
        "method": s.method,
        "base_model": res.describe,
        "format": info.get("format", ""),
        "rewards": rewards.sources,
        "reward_weights": dict(zip(rewards.names, rewards.weights, strict=True)),
        "train_records": train_p.records,
        "validation_records": eval_p.records,
        "dropped_prompt_too_long": train_p.too_long + eval_p.too_long,
        "train_prompts": len(train_p.rows),
        "validation_prompts": len(eval_rows),
        "validation_prompts_seen_in_train": seen_in_train,
        "steps": state.global_step,
        "epochs": round(float(state.epoch or 0), 4),
        "completions_per_step": s.batch_size_per_device * s.grad_accumulation_steps * args.world_size,
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": losses[-1] if losses else None,
        "train_reward_first": float(train_rewards[0]) if train_rewards else None,
        "train_reward_last": float(train_rewards[-1]) if train_rewards else None,
        "train_kl_last": last_logged(history, "kl"),
        "train_completion_length_last": last_logged(history, "completions/mean_length"),
        "eval_reward_start": before["reward"],
        "eval_reward_trained": after["reward"],
        "eval_reward_by_source_start": before["per_reward"],
        "eval_reward_by_source_trained": after["per_reward"],
        **run_figures(spec, metrics.train_seconds, ckpt),
        **meter.result(metrics.train_seconds),
        "trainable_parameters": trainable,
    }

