"""Settings of the training stages, shared by the stage configs (tasks/) and the recipes (trainer/).

Light on purpose (pydantic only): `tasks/` imports it when a config is parsed, long before any torch.
`TrainSettings` holds what every trainer method has (model, method, optimizer, schedule, checkpoints,
launch); each method adds its own fields in one flat subclass (`SftSettings`, `RewardSettings`, ...).
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from trainer.models import LoraSettings, Method, ModelSource

#: prompts every generative training stage answers before and after training, unless configured
DEFAULT_CONTROL_PROMPTS = ("What is 2 plus 3?", "Write one sentence about the sea.", "The capital of France is")


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_model: ModelSource | None = Field(
        None, description="Model to train, unless a model artifact is among the inputs: one of config, path, "
        "package+file (GGUF) or hub.")
    method: Method = Field("lora", description="full: train every weight; lora: train low-rank adapters on a "
                           "frozen base; qlora: lora on a 4-bit NF4 base (bitsandbytes).")
    lora: LoraSettings = Field(default_factory=LoraSettings, description="Adapter settings (lora, qlora).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype the base weights are loaded in (and QLoRA's compute dtype); float32 on CPU.")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Mixed precision. auto: bf16 on CUDA GPUs from Ampere on (compute capability 8.0+), "
        "fp16 with a dynamic loss scaler on older GPUs, fp32 on CPU. bf16 on CPU is torch's CPU autocast (fast only "
        "with AMX / AVX512-BF16; refused with deepspeed); fp16 needs a CUDA GPU. See trainer/distributed.py.")
    max_length_tokens: int = Field(1024, gt=0, description="Longest training sequence in tokens; longer ones are "
                                   "truncated. Must fit the model's max_position_embeddings.")
    max_steps: int | None = Field(None, gt=0, description="Optimizer steps to train; overrides epochs.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training split, when max_steps is not set.")
    batch_size_per_device: int = Field(8, gt=0, description="Samples (or packed rows) per device per micro-step.")
    grad_accumulation_steps: int = Field(1, gt=0, description="Micro-steps per optimizer step.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup"] = Field(
        "cosine", description="Learning-rate schedule after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    optimizer: Literal["adamw_torch", "lion", "adafactor"] = Field(
        "adamw_torch", description="adamw_torch, lion (bitsandbytes, 32-bit states) or adafactor.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass: less "
                                         "memory, about 20% slower.")
    seed: int = Field(0, description="Seed of weight init (config models), LoRA init, data order and dropout.")
    max_train_records: int | None = Field(None, gt=0, description="Use at most this many training records.")
    evaluate: bool = Field(True, description="Compute the loss on the validation split at the end.")
    checkpoint_every_steps: int | None = Field(200, gt=0, description="Save and upload a checkpoint every this "
                                               "many optimizer steps.")
    checkpoint_every_minutes: float | None = Field(None, gt=0, description="Also save one when this many minutes "
                                                   "passed since the last.")
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints kept in the store; older ones are "
                                  "deleted.")
    logging_steps: int = Field(10, gt=0, description="Log metrics every this many optimizer steps.")
    launcher: Literal["local", "torchrun", "deepspeed"] = Field(
        "local", description="local: one training process; torchrun: nproc_per_node processes per node, DDP (gloo on "
        "CPU) unless deepspeed or fsdp shards them, nnodes > 1 meet at rdzv_endpoint; deepspeed: DeepSpeed's own "
        "launcher on one node (needs deepspeed).")
    nproc_per_node: int = Field(1, gt=0, description="Training processes per node (one per GPU) with launcher "
                                "torchrun or deepspeed.")
    nnodes: int = Field(1, gt=0, description="Machines training together (launcher torchrun): node 0 is the `lmforge "
                        "run` of the stage, each other node runs `lmforge join CONFIG --stage NAME --node-rank K` "
                        "(docs/scale-out.md); node 0 hosts the rendezvous at rdzv_endpoint. The global batch is "
                        "batch_size_per_device x grad_accumulation_steps x nproc_per_node x nnodes.")
    rdzv_endpoint: str | None = Field(None, pattern=r"^\S+:\d+$", description="host:port of the torchrun rendezvous "
                                      "that every node reaches (e.g. the first node, 10.0.0.1:29400); needed with "
                                      "nnodes > 1. Unset: a standalone single-node rendezvous.")
    deepspeed: str | dict[str, Any] | None = Field(
        None, description="DeepSpeed ZeRO: a preset (zero2, zero2_offload, zero3, zero3_offload: "
        "configs/deepspeed/), a JSON file relative to the project root, or an inline mapping. Batch sizes, clipping "
        "and bf16/fp16 stay \"auto\" (filled from these settings); no optimizer/scheduler sections. Needs launcher "
        "torchrun or deepspeed; runs on CPU under torchrun (gloo).")
    fsdp: str | dict[str, Any] | None = Field(
        None, description="PyTorch FSDP, CUDA GPUs only: a preset (full_shard: configs/fsdp/), an accelerate config "
        "file (YAML/JSON; its fsdp_config block) or an inline fsdp_config mapping. Needs launcher torchrun; not "
        "with deepspeed.")
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes that prepare batches (0: in the "
                             "training process). sft, reward, dpo and grpo read and tokenize their shards before "
                             "training, so workers change the speed, never the batches; pretrain has its own field; "
                             "ppo builds its few prompts per update in process and ignores it.")
    prefetch_factor: int = Field(2, gt=0, description="Batches each DataLoader worker prepares ahead (num_workers > 0).")
    pin_memory: bool = Field(True, description="Page-locked batches for faster copies to the GPU; ignored on CPU.")
    cpu_threads: int = Field(1, gt=0, description="Math threads of each training process (torch intra-op, OpenMP, "
                             "MKL), set by the process itself whatever OMP_NUM_THREADS says. The same config, machine "
                             "and thread count give byte-identical CPU weights; another thread count sums in another "
                             "order (same result up to rounding, so it stays out of the id). 1 is fastest for tiny "
                             "models on small machines; raise it for larger models trained on CPU.")
    deterministic: bool = Field(True, description="Deterministic algorithms (torch.use_deterministic_algorithms, "
                                "cuDNN deterministic, cuBLAS workspace). On CPU training is then bit-reproducible; "
                                "on GPUs some kernels have no deterministic version: the result says "
                                "deterministic: false and names them. false: faster GPU kernels, no such promise.")
    control_prompts: list[str] = Field(
        default_factory=lambda: list(DEFAULT_CONTROL_PROMPTS),
        description="After training, the model before and after answer these prompts (greedy) side by side: a "
        "table on the stage's MLflow run and `generations.json` in the artifact. [] skips the check.")
    control_max_new_tokens: int = Field(32, gt=0, description="Tokens generated per control prompt.")

    #: settings that change how often the run checkpoints and logs, or how it is launched, never the
    #: model it produces; training stages keep them out of their artifact id
    RUN_ONLY: ClassVar[frozenset[str]] = frozenset({
        "checkpoint_every_steps", "checkpoint_every_minutes", "keep_checkpoints", "logging_steps", "launcher",
        "rdzv_endpoint", "control_prompts", "control_max_new_tokens", "num_workers", "prefetch_factor", "pin_memory",
        "cpu_threads"})

    @field_validator("deepspeed", "fsdp", mode="before")
    @classmethod
    def _known_preset(cls, v: Any, info) -> Any:
        """A preset name must exist (checked now); a file is read, and checked, when the stage starts."""
        from trainer.distributed import check_preset_name

        return check_preset_name(info.field_name, v)


class GroupedBatchSettings(TrainSettings):
    """Length-grouped micro-batches (trainer/batching.py): sft, reward and dpo, whose collators pad each
    micro-batch to its longest row."""

    group_by_length: bool = Field(True, description="Form each micro-batch from rows of similar length (a seeded "
                                  "shuffle, then sorted within a bounded buffer), so little compute goes to padding. "
                                  "Resume stays exact. false: the Trainer's random order.")
    length_group_buffer: int = Field(64, gt=0, description="Micro-batches per shuffle buffer that group_by_length "
                                     "sorts by length: larger groups tighter, smaller mixes the data more.")
    packing: Literal[False, "padding_free"] = Field(
        False, description="padding_free: the model sees each micro-batch's real tokens concatenated into one row "
        "(position_ids restart per row, no attention mask) and its output is put back in the padded layout, so no "
        "compute goes to padding and the loss is the padded step's; group_by_length is then ignored. false: padded "
        "micro-batches.")


class SftSettings(GroupedBatchSettings):
    """Every setting of an sft stage but kind and inputs."""

    assistant_only_loss: bool = Field(True, description="Loss on assistant tokens only (needs a chat template with "
                                      "{% generation %} markers; known stock templates get a marked copy).")
    packing: bool | Literal["padding_free"] = Field(
        False, description="padding_free: each micro-batch's conversations concatenated into one row (position_ids "
        "restart per conversation, no attention mask), so no compute goes to padding while the rows of a step and "
        "the loss stay those of the padded step; attention stays within each conversation (sdpa runs once per "
        "conversation, eager masks across them, flash-attention reads the position_ids); group_by_length is "
        "not needed and is ignored. true: TRL's packing into rows of max_length_tokens (packing_strategy), which "
        "changes how many conversations a step trains on. false: one padded row per conversation.")
    packing_strategy: Literal["bfd", "wrapped"] = Field(
        "bfd", validate_default=True, description="packing: true only. bfd: best-fit decreasing, whole "
        "conversations; wrapped: cut across conversations.")

    @field_validator("packing_strategy")
    @classmethod
    def _strategy_of_packing(cls, v: str, info: ValidationInfo) -> str:
        if v != "bfd" and info.data.get("packing") is not True:
            raise ValueError(f"packing_strategy {v} applies to packing: true only (packing is "
                             f"{info.data.get('packing')}); remove it")
        return v


class RewardSettings(GroupedBatchSettings):
    """Every setting of a reward stage but kind and inputs."""

    center_rewards_coefficient: float | None = Field(
        None, ge=0, description="Weight of a penalty on the mean reward squared, keeping rewards centered at zero "
        "(TRL center_rewards_coefficient; 0.01 is the usual value); null: no penalty.")


class DpoSettings(GroupedBatchSettings):
    """Every setting of a dpo stage but kind and inputs."""

    beta: float = Field(0.1, gt=0, description="DPO beta: how far the policy may move from the reference model; "
                        "higher keeps it closer.")
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = Field(
        "sigmoid", description="DPO loss: sigmoid (the DPO paper), ipo, hinge or robust.")
    sft_loss_weight: float = Field(
        0.0, ge=0, description="Weight of an added language-modelling loss on the chosen completions (RPO; TRL "
        "loss_type 'sft'). DPO alone can lower the chosen answers' likelihood along with the rejected ones' and "
        "degrade generation; 0.2-1.0 keeps the chosen answers likely. 0: plain DPO.")


# ----------------------------------------------------------------------------------------------
# grpo stage (GRPO and RLOO); the reward functions it names live in trainer/rewards.py (plain Python)


def _no_room_for_the_prompt(completion_tokens: int, info: ValidationInfo) -> str | None:
    """What is wrong with a completion of this many tokens (grpo, ppo): it must leave room for the prompt."""
    limit = info.data.get("max_length_tokens")
    if limit is not None and completion_tokens >= limit:
        return f"leaves no room for the prompt in max_length_tokens {limit}; lower it or raise max_length_tokens"
    return None


def _importable_reward_function(v: Any) -> Any:
    """`"module:fn"` or `{function: "module:fn", weight: w}`; the function is imported now, so a bad name
    fails when the config is parsed, at `stages.<name>.reward_functions[i]`."""
    from trainer.rewards import RewardFunctionError, load_reward_function

    if isinstance(v, str):
        v = {"function": v}
    if isinstance(v, dict) and isinstance(v.get("function"), str):
        try:
            load_reward_function(v["function"])
        except RewardFunctionError as e:
            raise PydanticCustomError("reward_function", "{problem}", {"problem": str(e)}) from None
    return v


class RewardFunctionRef(BaseModel):
    """One entry of `reward_functions:`; a plain string is `function` with weight 1."""

    model_config = ConfigDict(extra="forbid")

    function: str = Field(description="Import path module:function of a reward function fn(prompts, completions, "
                          "**kwargs) -> list[float | None], e.g. trainer.rewards:sum_correct.")
    weight: float = Field(1.0, description="Weight of this function's reward in the total reward.")


class GrpoSettings(TrainSettings):
    """Every setting of a grpo stage (algorithm grpo or rloo) but kind and inputs."""

    algorithm: Literal["grpo", "rloo"] = Field(
        "grpo", description="grpo: advantages are rewards normalized within each prompt's group of completions "
        "(TRL GRPOTrainer); rloo: advantages against the leave-one-out mean of the other completions (TRL "
        "RLOOTrainer).")
    reward_functions: list[Annotated[RewardFunctionRef, BeforeValidator(_importable_reward_function)]] = Field(
        default_factory=list, description="Reward functions by import path, each a string or {function, weight}; "
        "shipped: trainer.rewards:sum_correct, answer_match, answer_form, one_sentence. With a reward stage among the inputs "
        "its score is added too; at least one reward is required.")
    reward_model_weight: float = Field(1.0, description="Weight of the reward model's score (a reward stage among "
                                       "the inputs) in the total reward.")
    num_generations: int = Field(
        4, ge=2, validate_default=True, description="Completions sampled per prompt (the group the advantages "
        "compare). batch_size_per_device counts completions, so a step trains on batch_size_per_device * "
        "grad_accumulation_steps / num_generations prompts per process.")
    max_completion_tokens: int = Field(
        32, gt=0, validate_default=True, description="Longest sampled completion, in tokens. Prompts longer than "
        "max_length_tokens - max_completion_tokens are skipped and counted.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the training completions.")
    beta: float = Field(0.04, ge=0, description="KL coefficient against the starting policy (LoRA: the adapter "
                        "disabled; full: a frozen copy). 0: no KL term and no reference model.")
    epsilon: float = Field(0.2, gt=0, description="Clipping range of the policy ratio.")
    num_iterations: int = Field(1, ge=1, description="Optimizer passes over each batch of sampled completions.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="grpo only: divide advantages by the reward std of the group, of the batch, or not "
        "at all (Dr. GRPO).")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "dapo", description="grpo only: how token losses are averaged (TRL loss_type).")
    normalize_advantages: bool = Field(False, description="rloo only: normalize advantages to mean 0 and std 1 "
                                       "per batch.")
    max_validation_prompts: int | None = Field(
        None, gt=0, description="Held-out check: score greedy completions of at most this many distinct validation "
        "prompts, from the starting and the trained policy (all of them when unset).")

    @field_validator("num_generations")
    @classmethod
    def _groups_fit_a_step(cls, v: int, info: ValidationInfo) -> int:
        d = info.data
        if not all(k in d for k in ("batch_size_per_device", "grad_accumulation_steps", "launcher", "nproc_per_node")):
            return v  # reported at those fields
        procs = d["nproc_per_node"] * d.get("nnodes", 1) if d["launcher"] != "local" else 1
        per_step = d["batch_size_per_device"] * d["grad_accumulation_steps"] * procs
        if per_step % v:
            raise PydanticCustomError(
                "grpo_settings", "{problem}", {"problem": (
                    f"batch_size_per_device * grad_accumulation_steps * processes = {per_step} completions per step "
                    f"is not a multiple of num_generations {v}: each prompt's group of completions must fit in one "
                    "step; change batch_size_per_device or num_generations")})
        return v

    @field_validator("max_completion_tokens")
    @classmethod
    def _room_for_the_prompt(cls, v: int, info: ValidationInfo) -> int:
        problem = _no_room_for_the_prompt(v, info)
        if problem:
            raise PydanticCustomError("grpo_settings", "{problem}", {"problem": problem})
        return v

    @field_validator("scale_rewards", "loss_type", "normalize_advantages")
    @classmethod
    def _for_its_algorithm(cls, v: Any, info: ValidationInfo) -> Any:
        only = {"scale_rewards": "grpo", "loss_type": "grpo", "normalize_advantages": "rloo"}[info.field_name]
        algorithm = info.data.get("algorithm")
        if algorithm is not None and algorithm != only and v != cls.model_fields[info.field_name].default:
            raise PydanticCustomError("grpo_settings", "{problem}", {"problem": (
                f"applies to algorithm {only} only (algorithm is {algorithm}); remove it")})
        return v


class PretrainSettings(TrainSettings):
    """Every setting of a pretrain stage but kind and inputs."""

    method: Literal["full"] = Field("full", description="Pretraining trains every weight (full); the output is a "
                                    "full model.")
    evaluate: bool = Field(True, description="Loss and perplexity on the validation split before and after "
                           "training.")
    streaming: bool = Field(True, validate_default=True, description="Read the train shards as an endless stream, "
                            "split by rank and DataLoader worker, tokenized and packed on the fly (needs max_steps); "
                            "false: pack the whole split in memory first and train for epochs.")
    num_workers: int = Field(1, ge=0, description="DataLoader worker processes that read, tokenize and pack (0: in "
                             "the training process). Streaming splits the shards by worker, so it is part of the id.")
    prefetch_factor: int = Field(4, gt=0, description="Batches each worker prepares ahead (num_workers > 0).")
    shuffle_buffer_rows: int = Field(1000, ge=0, description="Streaming: the shard order is reshuffled every pass "
                                     "and packed rows are shuffled in a buffer of this many; 0 reads in order.")

    #: streaming splits the shards by worker: here num_workers changes the batches (prefetching and pinning do not)
    RUN_ONLY: ClassVar[frozenset[str]] = TrainSettings.RUN_ONLY - {"num_workers"}

    @field_validator("streaming")
    @classmethod
    def _stream_bounds(cls, v: bool, info: ValidationInfo) -> bool:
        if v and "max_steps" in info.data and info.data["max_steps"] is None:
            raise ValueError("streaming reads the shards as an endless stream of unknown length: set max_steps, or "
                             "streaming: false to train for epochs over the split packed in memory")
        if v and info.data.get("max_train_records") is not None:
            raise ValueError("max_train_records applies to streaming: false only; with streaming, max_steps bounds "
                             "the data read")
        return v

    @field_validator("lora")
    @classmethod
    def _no_lora(cls, v: LoraSettings) -> LoraSettings:
        if v != LoraSettings():
            raise ValueError("pretrain trains every weight (method full); remove lora")
        return v


# ----------------------------------------------------------------------------------------------
# ppo stage


def _ppo_problem(text: str) -> PydanticCustomError:
    return PydanticCustomError("ppo_settings", "{problem}", {"problem": text})


class PpoSettings(TrainSettings):
    """Every setting of a ppo stage but kind and inputs.

    A step is one PPO update: each process samples batch_size_per_device * grad_accumulation_steps responses,
    scores them, then optimizes the policy and value losses on them ppo_epochs times; `max_steps` counts updates.
    """

    max_new_tokens: int = Field(32, gt=0, validate_default=True, description="Longest sampled response, in tokens "
                                "(TRL response_length). Prompts longer than max_length_tokens - max_new_tokens are "
                                "skipped and counted.")
    temperature: float = Field(0.7, gt=0, description="Sampling temperature of the rollouts.")
    kl_coef: float = Field(0.05, ge=0, description="Weight of the per-token KL penalty against the reference (the "
                           "starting policy: LoRA adapter disabled, or a frozen copy), subtracted from the reward.")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="KL estimator of the penalty: k1 (log ratio) or k3 "
                                              "(lower variance).")
    ppo_epochs: int = Field(4, ge=1, description="Optimization passes over each batch of rollouts.")
    mini_batches: int = Field(1, ge=1, validate_default=True, description="Mini-batches each batch of rollouts is "
                              "split into per pass (one optimizer step each).")
    clip_range: float = Field(0.2, gt=0, description="Clipping range of the policy ratio.")
    value_clip_range: float = Field(0.2, gt=0, description="Clipping range of the value predictions.")
    value_loss_coef: float = Field(0.1, ge=0, description="Weight of the value loss in the total loss.")
    value_model: Literal["full", "lora"] = Field(
        "full", description="How the value model (a copy of the reward model) trains: full, every weight (TRL's "
        "recipe); lora, an adapter with the `lora` settings plus the whole score head, the backbone frozen: the "
        "update's backward pass and optimizer step skip the backbone's weights, so each update costs less.")
    gamma: float = Field(1.0, gt=0, le=1, description="Discount factor of the returns.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda of the advantages.")
    whiten_rewards: bool = Field(False, validate_default=True, description="Normalize the rewards per batch "
                                 "(needs at least 8 rollouts per mini-batch and process).")
    missing_eos_penalty: float | None = Field(None, gt=0, description="Subtracted from the score of a response "
                                              "that does not end with eos within max_new_tokens; null: none.")
    max_validation_prompts: int | None = Field(
        None, gt=0, description="Held-out check: greedy responses of the trained policy and of the reference to at "
        "most this many distinct validation prompts, scored by the reward model (all of them when unset).")

    @field_validator("deepspeed", "fsdp")
    @classmethod
    def _one_process_or_ddp(cls, v, info: ValidationInfo):
        if v is not None:
            raise _ppo_problem(f"the ppo stage trains in one process or with DDP (launcher torchrun); {info.field_name} "
                               "is not supported with TRL's PPOTrainer here yet: remove it")
        return v

    @field_validator("launcher")
    @classmethod
    def _qlora_in_one_process(cls, v: str, info: ValidationInfo) -> str:
        if v != "local" and info.data.get("method") == "qlora":
            raise _ppo_problem("ppo with method qlora trains in one process only (launcher local) for now; use "
                               "launcher local, or method lora or full with torchrun")
        return v

    @field_validator("max_new_tokens")
    @classmethod
    def _room_for_the_prompt(cls, v: int, info: ValidationInfo) -> int:
        problem = _no_room_for_the_prompt(v, info)
        if problem:
            raise _ppo_problem(f"{v} {problem}")
        return v

    @field_validator("mini_batches")
    @classmethod
    def _mini_batches_divide_the_batch(cls, v: int, info: ValidationInfo) -> int:
        d = info.data
        if "batch_size_per_device" in d and "grad_accumulation_steps" in d:
            local = d["batch_size_per_device"] * d["grad_accumulation_steps"]
            if local % v:
                raise _ppo_problem(f"batch_size_per_device * grad_accumulation_steps = {local} rollouts per process "
                                   f"do not split into {v} equal mini-batches; use a divisor of {local}")
        return v

    @field_validator("whiten_rewards")
    @classmethod
    def _enough_to_whiten(cls, v: bool, info: ValidationInfo) -> bool:
        d = info.data
        if v and all(k in d for k in ("batch_size_per_device", "grad_accumulation_steps", "mini_batches")):
            per_mini = d["batch_size_per_device"] * d["grad_accumulation_steps"] // d["mini_batches"]
            if per_mini < 8:
                raise _ppo_problem(f"whitening needs at least 8 rollouts per mini-batch and process, got {per_mini} "
                                   "(batch_size_per_device * grad_accumulation_steps / mini_batches); raise them or "
                                   "set whiten_rewards: false")
        return v
