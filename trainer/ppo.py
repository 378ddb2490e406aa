"""PPO recipe: an SFT policy + a reward model + prompts -> an RL-tuned model or LoRA adapter, with TRL's
PPOTrainer (`trl.experimental.ppo`, TRL 1.12: 1.13 removed PPO, which is why trl is pinned to 1.12.x).

Runs in the training process (`trainer.entry`), top to bottom:
tokenizer (the policy artifact's; the reward model's must be the same) -> prompts (`trainer.prompts`; prompts
too long for a response skipped and counted) -> policy (full, LoRA, QLoRA), reward model (frozen)
and value model (a trainable copy of the reward model, the usual TRL recipe) -> PPOConfig -> trainer with
checkpoint and metrics callbacks -> train (resuming when a checkpoint was restored) -> held-out reward of the
trained policy and of the reference -> save -> result.

One step is one PPO update: each process samples `batch_size_per_device * grad_accumulation_steps` responses
(at most `max_new_tokens`, cut after the first eos), the reward model scores them, the per-token KL to the
reference times `kl_coef` is subtracted, GAE advantages come from the value model, and the clipped policy and
value losses are optimized `ppo_epochs` times over `mini_batches` mini-batches. TRL logs every update; the
metrics go to the stage's MLflow run as `train/reward` (the reward model's mean score), `train/kl`,
`train/policy_loss`, `train/value_loss`, `train/entropy`, ... (`PPO_LOG_KEYS`), every `logging_steps` updates.

Reference: lora - the policy with its adapter disabled (no second copy); full - a frozen copy (TRL's
`create_reference_model`); qlora - the 4-bit base with the adapter disabled (the SFT model, quantized). The
value model is a full-precision copy of the reward model, trained whole (TRL's recipe) or, with `value_model: lora`,
as an adapter and its score head (`value_with_adapter`).

Where the reward is read: trainer/rollouts.py (a rollout is read at its eos with the chat template's end of turn
appended, as the reward model was trained).

Checkpoints and resume: TRL's PPOTrainer runs its own loop. It calls the callbacks' `on_step_end` and saves a
checkpoint when asked, but it has no `resume_from_checkpoint`, its checkpoints lack the value model, it ignores
`should_training_stop`, and it shuffles the prompts with a DataLoader whose position cannot be restored.
`ResumablePPOTrainer` adds exactly those: checkpoints hold policy (model or adapter), value model, optimizer,
scheduler, RNG states and trainer_state.json (step, log history); `train(resume_from_checkpoint=...)` loads them
all, continues the step and episode counters and runs only the remaining updates; the prompts come in an order
that is a function of the seed and the update number, so a resumed run samples from the same prompts it would
have; a SIGTERM ends the loop after its checkpoint is uploaded. `checkpoint.train_resumable` drives it like
every other recipe.

Held-out check (`evaluate`): greedy responses of the trained policy and of the reference (the starting policy)
to the distinct validation prompts, scored by the reward model exactly as in training (the response cut after
its first eos, the end of turn appended). `eval_reward_start` and `eval_reward_trained` are the measurable
improvement; the responses, token ids and scores go into `heldout_generations.json` in the artifact.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainer import checkpoint, models
from trainer.args import training_args
from trainer.errors import SettingError
from trainer.job import JobSpec, materialize, rank, world_size
from trainer.metrics import peak_memory_mb
from trainer.preference import AlignMetricsCallback, last_logged, load_reward_model
from trainer.prompts import distinct, load_splits
from trainer.recipe import base_and_tokenizer, load_policy, run_figures
from trainer.rollouts import (RolloutBatches, append_turn_end, check_reward_model, heldout_rewards, rollout_pad_token,
                              turn_end_suffix)
from trainer.settings import PpoSettings

log = logging.getLogger(__name__)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # PPO lives in trl.experimental in 1.12, pinned for it

#: PPOTrainer's log keys -> MLflow metric names
PPO_LOG_KEYS = {
    "objective/scores": "train/reward", "objective/kl": "train/kl", "objective/non_score_reward": "train/kl_penalty",
    "objective/rlhf_reward": "train/rlhf_reward", "policy/entropy_avg": "train/entropy",
    "objective/entropy": "train/response_entropy", "loss/policy_avg": "train/policy_loss",
    "loss/value_avg": "train/value_loss", "policy/approxkl_avg": "train/approx_kl",
    "policy/clipfrac_avg": "train/policy_clip_fraction", "val/clipfrac_avg": "train/value_clip_fraction",
    "val/ratio": "train/ratio", "val/num_eos_tokens": "train/eos_tokens", "lr": "train/learning_rate",
    "episode": "train/episodes",
}
REFERENCE = {"full": "frozen copy", "lora": "adapter disabled", "qlora": "adapter disabled (4-bit base)"}
VALUE_DIR = "value_model"  # inside a checkpoint folder: the value model (TRL's checkpoints hold the policy only)
HELDOUT_FILE = "heldout_generations.json"


# ----------------------------------------------------------------------------------------------
# TRL's PPOTrainer, made resumable


class _Stop(Exception):
    """Ends TRL's PPO loop after a requested stop's checkpoint was saved and uploaded."""


class _ContinueCounters(TrainerCallback):
    """First callback: TRL's train() zeroes the step and episode counters just before on_train_begin."""

    def __init__(self, trainer: "Any"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        step, history = self.trainer.resumed
        state.global_step, state.max_steps = step, self.trainer.total_updates
        state.episode = step * args.batch_size
        state.log_history = list(history)


class _StopWhenAsked(TrainerCallback):
    """Last callback: TRL's loop ignores `should_training_stop` (a SIGTERM); stop once the checkpoint is uploaded."""

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_training_stop and not control.should_save and state.global_step < state.max_steps:
            raise _Stop

    def on_save(self, args, state, control, **kwargs):
        if control.should_training_stop and state.global_step < state.max_steps:
            raise _Stop


def _ppo_trainer_class():
    from transformers import Trainer
    from trl.experimental.ppo import PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_loop
    from trl.experimental.utils import get_reward as trl_get_reward

    class ResumablePPOTrainer(PPOTrainer):
        """PPOTrainer plus complete checkpoints and `train(resume_from_checkpoint=...)` (see the module doc)."""

        def __init__(self, *args, rows: list[dict[str, Any]], turn_end: list[int], **kwargs):
            super().__init__(*args, **kwargs)
            self.rows, self.turn_end = rows, turn_end
            self.total_updates = self.args.num_total_batches
            self.resumed: tuple[int, list[dict[str, Any]]] = (0, [])
            self.callback_handler.callbacks.insert(0, _ContinueCounters(self))
            self.add_callback(_StopWhenAsked())

        @property
        def policy(self):
            return self.accelerator.unwrap_model(self.model).policy

        @property
        def value(self):
            return self.accelerator.unwrap_model(self.model).value_model

        def get_reward(self, model, query_responses, pad_token_id: int, context_length: int):
            """TRL's `get_reward`; the reward model reads eos-terminated responses with the end of turn appended."""
            if model is self.reward_model and self.turn_end:
                query_responses = append_turn_end(query_responses, pad_token_id, context_length, self.turn_end,
                                                  self.processing_class.eos_token_id)
            return trl_get_reward(model, query_responses, pad_token_id, context_length)

        def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
            """The policy alone (full model or adapter). TRL's version saves the wrapper's state dict under DDP."""
            if self.args.should_save:
                self.policy.save_pretrained(output_dir or self.args.output_dir, safe_serialization=True)

        def _save_checkpoint(self, model, trial):
            # transformers' checkpoint (policy via save_model, optimizer, scheduler, RNG, trainer state), skipping
            # TRL's override, which only adds a model card; then the value model, which TRL leaves out
            Trainer._save_checkpoint(self, model, trial)
            if self.args.should_save:
                folder = Path(self.args.output_dir) / f"{checkpoint.PREFIX}{self.state.global_step}"
                self.value.save_pretrained(folder / VALUE_DIR, safe_serialization=True)

        def train(self, resume_from_checkpoint: str | None = None):
            total = self.total_updates
            if resume_from_checkpoint:
                self.resumed = self._restore(Path(resume_from_checkpoint))
            done = self.resumed[0]
            self.dataloader = RolloutBatches(
                self.rows, self.data_collator, seed=self.args.seed, start=done, total=total,
                per_update=self.args.batch_size, local=self.args.local_batch_size,
                process=self.accelerator.process_index)
            self.args.num_total_batches = total - done  # TRL's loop runs this many updates
            ppo_loop.get_reward = self.get_reward  # the loop calls the module's get_reward by name
            try:
                super().train()
            except _Stop:
                pass
            finally:
                self.args.num_total_batches = total
                ppo_loop.get_reward = trl_get_reward
            return self.state

        def _restore(self, folder: Path) -> tuple[int, list[dict[str, Any]]]:
            import torch
            from safetensors.torch import load_file

            state = json.loads((folder / "trainer_state.json").read_text())
            load_policy_weights(self.policy, folder)
            self.value.load_state_dict(load_file(str(folder / VALUE_DIR / "model.safetensors")))
            self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True))
            self.lr_scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
            self._load_rng_state(str(folder))  # last: nothing may draw from the RNGs before the loop starts
            return int(state["global_step"]), state.get("log_history", [])

    return ResumablePPOTrainer


def value_with_adapter(value_model, s: PpoSettings) -> None:
    """`value_model: lora`: a LoRA adapter (the stage's `lora` settings) injected into the value model in place, the
    backbone frozen, the score head trained whole. In place and not as a PeftModel, because TRL's policy-and-value
    wrapper reaches the backbone as `getattr(value_model, value_model.base_model_prefix)`, which a PeftModel answers
    with the whole classifier. A checkpoint's value model then holds the frozen weights too (its state dict), and
    `_restore` loads it back into the same injected layout."""
    from peft import LoraConfig, inject_adapter_in_model

    value_model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=s.lora.rank, lora_alpha=s.lora.alpha, lora_dropout=s.lora.dropout,
                                       target_modules=s.lora.target_modules, exclude_modules=["score"], bias="none"),
                            value_model)
    for name, p in value_model.named_parameters():
        if "lora_" in name or name.startswith("score."):
            p.requires_grad_(True)


def load_policy_weights(policy, folder: Path) -> None:
    """Checkpointed policy weights into the live policy, in place (the optimizer holds these tensors)."""
    from safetensors.torch import load_file

    if (folder / "adapter_model.safetensors").is_file():
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(policy, load_file(str(folder / "adapter_model.safetensors")))
        if result.unexpected_keys:
            raise RuntimeError(f"checkpoint {folder.name}: adapter weights the policy does not have: "
                               f"{result.unexpected_keys[:5]}")
        return
    weights = load_file(str(folder / "model.safetensors"))
    missing, unexpected = policy.load_state_dict(weights, strict=False)
    # save_pretrained writes a tied weight (lm_head = embeddings) once: it is restored through its twin
    params = policy.state_dict()
    loaded = {params[k].data_ptr() for k in weights}
    untied = [k for k in missing if params[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise RuntimeError(f"checkpoint {folder.name} does not fit the policy: missing {untied[:5]}, unexpected "
                           f"{unexpected[:5]}")


# ----------------------------------------------------------------------------------------------
# metrics


class PpoMetricsCallback(AlignMetricsCallback):
    """PPO's per-update metrics under stable names, every `logging_steps` updates (and the first and last one),
    and a progress line with the update rate and an ETA."""

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        step = state.global_step
        if step % args.logging_steps == 0 or step in (self.start_step + 1, state.max_steps):
            super().on_log(args, state, control, logs=logs, **kwargs)
        if not state.is_world_process_zero or not logs or "objective/scores" not in logs:
            return
        now = time.monotonic()
        if now - self._last_progress < self.progress_every_s and step < state.max_steps:
            return
        self._last_progress = now
        rate = (step - self.start_step) / max(now - self._t0, 1e-9)
        eta = (state.max_steps - step) / rate if rate > 0 else float("inf")
        log.info("update %d/%d (%.0f%%): reward %.4f, kl %.4f, policy loss %.4f, value loss %.4f, %.2f s/update, "
                 "peak %.0f MB, ETA %.0fs", step, state.max_steps, 100 * step / max(state.max_steps, 1),
                 logs["objective/scores"], logs.get("objective/kl", float("nan")),
                 logs.get("loss/policy_avg", float("nan")), logs.get("loss/value_avg", float("nan")),
                 1 / rate if rate > 0 else 0.0, peak_memory_mb(), eta)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# ----------------------------------------------------------------------------------------------
# the recipe


def train(spec: JobSpec) -> dict[str, Any]:
    # TRL's PolicyAndValueWrapper reads the policy's deprecated `is_gradient_checkpointing`
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    import datasets
    from transformers import DataCollatorWithPadding, PrinterCallback, set_seed
    from trl.experimental.ppo import PPOConfig

    s = PpoSettings.model_validate(spec.settings)
    work, out = Path(spec.work_dir), Path(spec.output_dir)
    if spec.model is None:
        raise SettingError("inputs", "ppo starts from a policy model: add an sft stage's output to this stage's inputs")
    if spec.reward_model is None:
        raise SettingError("inputs", "ppo needs a reward model: add a reward stage's output to this stage's inputs")

    # 1. tokenizer: the policy artifact's own (ppo takes no tokenizer input); the reward model's must be the same
    res, tokenizer = base_and_tokenizer(spec, s, work)
    saved_padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # PPO's queries are left-padded

    # 2. prompts: too long for a response -> skipped and counted
    train_prompts, eval_prompts = load_splits(spec, tokenizer, s, ("max_new_tokens", s.max_new_tokens),
                                              f"stage {spec.stage} train split")

    # TRL's PPO masks by `ids != pad`: pad with a token that is neither the eos nor in any prompt (rollouts.py)
    saved_pad = tokenizer.pad_token
    pad = rollout_pad_token(tokenizer, train_prompts.rows + eval_prompts.rows, turn_end_suffix(tokenizer))
    if pad is not None:
        log.info("ppo pads with %r: the tokenizer's pad %r is its eos or occurs in the prompts", pad, saved_pad)
        tokenizer.pad_token = pad

    # 3. policy, reward model (frozen) and value model (a trainable copy of the reward model)
    set_seed(s.seed)
    # qlora: the 4-bit base with a fresh adapter comes in as a PeftModel; lora: TRL applies `peft_config`
    policy, peft_config = load_policy(res, tokenizer, s, work)
    ref_model, reference = None, REFERENCE[s.method]
    if s.method == "lora" and world_size() > 1:
        # TRL reaches the adapter-disabled reference through the DDP wrapper, and fails there
        ref_model, reference = copy.deepcopy(policy).eval().requires_grad_(False), "frozen copy (DDP)"
    rm_dir = materialize(spec.reward_model, work)
    reward_model, reward_tokenizer = load_reward_model(rm_dir)
    check_reward_model(reward_model, reward_tokenizer, tokenizer, s, spec.reward_model.describe())
    reward_model = reward_model.to(models._dtype(s.dtype)).eval().requires_grad_(False)
    value_model = load_reward_model(rm_dir)[0].to(models._dtype(s.dtype))
    if s.value_model == "lora":
        value_with_adapter(value_model, s)
    if s.gradient_checkpointing:  # (qlora's policy got it with its 4-bit preparation)
        for m in (value_model,) if s.method == "qlora" else (policy, value_model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # 4. trainer: max_steps counts PPO updates of batch_size_per_device * grad_accumulation_steps rollouts a process
    per_update = s.batch_size_per_device * s.grad_accumulation_steps * world_size()
    episodes = s.max_steps * per_update if s.max_steps else max(per_update, int(s.epochs * len(train_prompts.rows)))
    kwargs = training_args(s, work)
    kwargs.pop("max_length")  # PPOConfig bounds the response (response_length), the prompts are filtered above
    args = PPOConfig(**kwargs, total_episodes=episodes, response_length=s.max_new_tokens, stop_token="eos",
                     temperature=s.temperature, kl_coef=s.kl_coef, kl_estimator=s.kl_estimator,
                     num_ppo_epochs=s.ppo_epochs, num_mini_batches=s.mini_batches, cliprange=s.clip_range,
                     cliprange_value=s.value_clip_range, vf_coef=s.value_loss_coef, gamma=s.gamma, lam=s.lam,
                     whiten_rewards=s.whiten_rewards, missing_eos_penalty=s.missing_eos_penalty,
                     local_rollout_forward_batch_size=s.batch_size_per_device, num_sample_generations=0)
    # PPOTrainer builds its own Accelerator, which takes its mixed precision from the environment, not from args
    os.environ["ACCELERATE_MIXED_PRECISION"] = args.mixed_precision
    ckpt = checkpoint.callback_for(spec, s)
    metrics = PpoMetricsCallback(spec.tracking_uri, spec.mlflow_run_id, PPO_LOG_KEYS)
    trainer = _ppo_trainer_class()(
        args=args, processing_class=tokenizer, model=policy, ref_model=ref_model, reward_model=reward_model,
        value_model=value_model, train_dataset=datasets.Dataset.from_list(
            [{"input_ids": r["input_ids"]} for r in train_prompts.rows]),
        data_collator=DataCollatorWithPadding(tokenizer), peft_config=peft_config, callbacks=[ckpt, metrics],
        rows=train_prompts.rows, turn_end=turn_end_suffix(reward_tokenizer))
    trainer.remove_callback(PrinterCallback)
    log.info("ppo: %d updates of %d rollouts (%d prompts), %s policy, reference: %s", trainer.total_updates,
             per_update, len(train_prompts.rows), s.method, reference)

    # 5. train (resumes from the newest uploaded checkpoint; SIGTERM -> checkpoint, then Preempted)
    state = checkpoint.train_resumable(trainer, spec, ckpt)

    # 6. held-out: the trained policy and the reference on the distinct validation prompts, same reward model
    heldout = []
    if eval_prompts.rows:
        heldout = heldout_rewards(trainer, distinct(eval_prompts.rows, s.max_validation_prompts), tokenizer, s)
    start = _mean([h["reference"]["reward"] for h in heldout])
    trained = _mean([h["policy"]["reward"] for h in heldout])
    if heldout:
        log.info("held-out reward over %d prompts: %.4f (reference) -> %.4f (trained)", len(heldout), start, trained)
        if state.is_world_process_zero:
            metrics._send({"eval/reward_start": start, "eval/reward": trained}, state.global_step)

    # 7. save: the policy (full model, or adapter on top of the input model artifact) and the tokenizer
    tokenizer.padding_side, tokenizer.pad_token = saved_padding_side, saved_pad
    for config in (trainer.policy.config, trainer.policy.generation_config):  # the artifact keeps its own pad
        config.pad_token_id = tokenizer.pad_token_id
    info: dict[str, Any] = {}
    if rank() == 0:
        trainer.policy.save_pretrained(str(out), safe_serialization=True)
        info = models.write_model_info(out, method=s.method, base=res, base_ref=spec.model, tokenizer=tokenizer,
                                       seed=s.seed, dtype=s.dtype)
        info.update(trained_with="ppo", reward_model=spec.reward_model.model_dump())
        (out / models.MODEL_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
        if heldout:
            (out / HELDOUT_FILE).write_text(json.dumps(heldout, indent=1))

    # 8. result
    history = [h for h in state.log_history if "objective/scores" in h]  # includes updates before a resume
    rewards = [h["objective/scores"] for h in history]
    return {
        "method": s.method,
        "base_model": res.describe,
        "reward_model": spec.reward_model.describe(),
        "format": info.get("format", ""),
        "reference": reference,
        "train_records": train_prompts.records,
        "validation_records": eval_prompts.records,
        "dropped_prompt_too_long": train_prompts.too_long + eval_prompts.too_long,
        "train_prompts": len(train_prompts.rows),
        "validation_prompts": len(heldout),
        "steps": state.global_step,
        "episodes": int(state.episode),
        "rollouts_per_step": per_update,
        "epochs": round(float(state.epoch or 0), 4),
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
        "train_kl_last": last_logged(history, "objective/kl"),
        "train_policy_loss_last": last_logged(history, "loss/policy_avg"),
        "train_value_loss_last": last_logged(history, "loss/value_avg"),
        "train_entropy_last": last_logged(history, "policy/entropy_avg"),
        "eval_reward_start": start,
        "eval_reward_trained": trained,
        **run_figures(spec, metrics.train_seconds, ckpt),
        "trainable_parameters": sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad),
        "value_parameters": sum(p.numel() for p in trainer.value.parameters() if p.requires_grad),
    }
