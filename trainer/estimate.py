"""Peak accelerator memory of a training stage, from the model's config alone (no weights, no torch).

Used by `lmforge estimate` (trainer/pipeline_estimate.py) before anyone rents a GPU. Everything is in bytes per GPU and
is a plain function of a `ModelShape` and the stage's settings, so it is testable by hand.

Notation: P parameters, h hidden_size, L layers, a attention heads, k key/value heads, d head_dim,
i intermediate_size, V vocab_size, r LoRA rank, b micro-batch rows (batch_size_per_device), s tokens per row
(max_length_tokens, an upper bound: rows are padded to the longest of their batch, packed rows are full; the
preflight, which has run the micro-batches, uses the mean row it measured instead, `row_tokens`: SmolLM2's chat
rows are ~46-50 tokens of max_length_tokens 64, and every activation term scales with them),
c bytes of the compute dtype (2 for bf16/fp16 mixed precision, 4 for fp32), w bytes of a stored weight,
W world size (nproc_per_node x nnodes, 1 with launcher local).

Parameters (llama-family decoder: llama, mistral, qwen2/3, gemma, phi3, smollm, ...):
    per layer  q: h x a d, k and v: h x k d each, o: a d x h, MLP gate, up: h x i, down: i x h
               (no gate for non-gated MLPs), two norms of h, biases where attention_bias / qkv bias
    total      V h (embeddings) + L x layer + h (final norm) + V h (lm_head, unless tie_word_embeddings)
    LoRA       r x (in + out) for every targeted linear layer (all-linear: the seven above, not lm_head)

Weights (component `weights`):
    full / lora   P x w, w = bytes of `dtype` (float32 4, bfloat16/float16 2). Under DeepSpeed with bf16/fp16
                  mixed precision the engine casts the module to 16 bits, so w = 2 (the fp32 copy is the
                  optimizer's master weights, below).
    qlora         targeted-or-not, every decoder linear layer is 4-bit (bitsandbytes Linear4bit): 0.5 byte per
                  weight plus the quantization constants: one fp32 absmax per 64-weight block (4/64 byte per
                  weight) or, with double_quant, one 8-bit absmax per block plus one fp32 constant per 256
                  blocks (1/64 + 4/16384 byte per weight). Embeddings, norms and lm_head stay unquantized and
                  `prepare_model_for_kbit_training` casts them to fp32: 4 bytes each.
    ZeRO-3 / FSDP full_shard: / W.   offload_param to CPU: 0 on the GPU.
Gradients (full training only): P x w at most (plain Trainer: gradients have the parameters' dtype; DeepSpeed
    bf16/fp16: 2). ZeRO-2, ZeRO-3, FSDP: / W. Which of them exist at the peak, see Peak.
Optimizer states (full training only), per trainable parameter:
    adamw_torch  2 states (m, v) in the parameters' dtype (torch keeps states in the param dtype): 2 w
    lion         1 fp32 state (bitsandbytes 32-bit): 4
    adafactor    factored second moment, about (rows + cols) per matrix: ~ 4 x 2 / h per parameter
    DeepSpeed with bf16/fp16 adds fp32 master weights (4) and keeps the states in fp32: Adam 4 + 8 = 12 bytes,
    the "K = 12" of the ZeRO paper. ZeRO-2, ZeRO-3, FSDP: / W. offload_optimizer to CPU: 0 on the GPU.
    Step temporaries (only when the peak is the optimizer step): torch's AdamW on CPU updates one tensor at a time
    and `exp_avg_sq.sqrt() / bias_correction2_sqrt` holds two temporaries of its size, 2 x the largest trainable
    tensor; on CUDA lmforge runs adamw_torch_fused (trainer/args.py), which has none.
Adapter (lora, qlora; component `adapter`): P_lora x (a weights + a gradients + optimizer states as above at a),
    a = 4: peft keeps adapters in fp32 (autocast_adapter_dtype); a = 2 for QLoRA under TRL's SFT, DPO, reward and
    GRPO trainers, which cast a quantized model's trainable parameters to bf16, and under DeepSpeed mixed precision.
    Sharded like full training.
Activations (component `activations`): the tensors autograd keeps for backward; trainer/activations.py holds
    their model, per layer and for the loss.
Peak: the largest of four moments, since the Trainer frees gradients after every optimizer step
    (zero_grad(set_to_none=True)) and backward creates them layer by layer while it frees that layer's activations:
    - start of backward: the activations above, and the gradients that exist then: lm_head's (for tied embeddings
      the embedding's, V h x w; it is made during the loss's backward) with grad_accumulation_steps 1, all of them
      with accumulation (from the second micro-batch on, the earlier micro-batches' gradients are there);
      ppo: the value model's activations too (its forward ran first, so autograd runs its backward after the
      policy's);
    - end of backward: all gradients (ppo: the value model's as well), the last layer's activations and its backward;
    - the optimizer step: all gradients and the step temporaries;
    - generation (ppo, grpo): the rollouts between two training steps, when no activations and no gradients exist:
      the KV cache and the generated logits (see Buffers).
    Between the first two, the layers trade activations for gradients one by one, so the total moves linearly and
    its largest value is at one end. LoRA's gradients are in `adapter` throughout.
Other models (component `other_models`): frozen copies at w bytes per parameter (sharded by ZeRO-3/FSDP):
    dpo full: the reference; ppo: the reward model, the value model and the reference when full; grpo full with
    beta > 0: the reference; a reward stage among grpo's inputs: its model. LoRA and QLoRA references are the
    policy with its adapter disabled. A reward model has P_s = P - lm_head + h parameters (a 1-wide score head).
    On CPU the frozen reward model stays memory-mapped from its safetensors file (transformers loads it so) and only
    the pages read are resident: every layer's weights, of the embedding only the rows of the tokens seen (a few
    pages): (P_s - V h) x w.
    ppo's value model (a copy of the reward model), value_model full: P_s x w weights, optimizer states as full
    training (2 w per parameter for AdamW), P_s x w gradients at the end of backward and the optimizer step;
    value_model lora: P_s x w frozen weights, and the adapter (the stage's lora settings, fp32) plus the whole
    score head, h, as weights, gradients and optimizer states like the policy's adapter. Its largest trainable
    tensor (full: the embedding, V h) sets AdamW's CPU temporaries when larger than the policy's.
Buffers (component `buffers`):
    CUDA context, cuBLAS workspaces and kernels: CUDA_CONTEXT_MIB (not counted by torch's allocator, but
    on the card); DDP with W > 1: gradient buckets, one more copy of the trainable gradients; ZeRO-2: the
    all-gather bucket, min(2e8, P) x 2 bytes; ZeRO-3 / FSDP: two gathered decoder layers in compute dtype
    (the live one and the prefetched one); qlora: the largest linear layer dequantized in compute dtype;
    ppo, grpo, only when the generation moment is the peak (a training step's activations usually outweigh it):
    the KV cache, L x 2 x k d x s x c per row, of the rows generated at once (ppo: b, TRL's
    local_rollout_forward_batch_size; grpo: b x grad_accumulation_steps, a generation batch) and the logits
    generation returns (ppo: R x V x 4 per rollout, R = max_new_tokens, kept until their log-probs are taken;
    grpo: one decoding step's, V x 4 per row);
    then the allocator's fragmentation margin, FRAGMENTATION of every tensor above.
    On CPU (the preflight's runs) instead of the CUDA context and the margin: the CPU runtime's own RSS,
    CPU_RUNTIME_MIB (+ CPU_BNB_RUNTIME_MIB for qlora), measured on a model whose tensors are negligible.
    `comparable` leaves out what torch's allocator does not count (the CUDA context, the fragmentation margin): the
    preflight compares it with torch's max allocated on CUDA and with the RSS above its baseline on CPU.

The estimate is meant for planning (does it fit, roughly how much headroom); the preflight stage measures the
real peak on the planned settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.activations import Activations, activations, loss_path
from trainer.memory_plan import Plan, adapter_bytes, compute_bytes, lora_target_names, row_tokens, weight_bytes
from trainer.shapes import ModelShape

GIB = 2**30
MIB = 2**20
CUDA_CONTEXT_MIB = 600  # CUDA context + cuBLAS/cuDNN workspaces + loaded kernels, as nvidia-smi shows them
# What a CPU training process's RSS gains in its first steps beyond its tensors (OpenMP/oneDNN runtime, kernels'
# scratch; bitsandbytes' CPU backend adds its own). Measured the way the preflight measures, on a model whose tensors
# are negligible (TRL SFTTrainer, a 1-layer hidden-64 llama, 16 tokens, 3 steps, mmap threshold pinned), less its
# tensors; the same with 1 or 2 threads.
CPU_RUNTIME_MIB = 15
CPU_BNB_RUNTIME_MIB = 8
FRAGMENTATION = 0.10  # the caching allocator's fragmentation and rounding, as a fraction of the tensors
QLORA_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax per 64 weights
QLORA_DOUBLE_QUANT_BLOCK = 256  # double quantization: one fp32 constant per 256 absmax values
ZERO2_ALLGATHER_ELEMENTS = 200_000_000  # configs/deepspeed/zero2*.json allgather_bucket_size
COMPONENTS = ("weights", "gradients", "optimizer", "adapter", "activations", "other_models", "buffers")


# ----------------------------------------------------------------------------------------------
# memory


@dataclass
class Breakdown:
    """Bytes per GPU by component, with a note saying what each holds."""

    bytes: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    params: int = 0
    trainable_params: int = 0
    untracked: int = 0  # bytes of `buffers` that torch's allocator does not count: the CUDA context, fragmentation

    @property
    def comparable(self) -> int:
        """What the preflight measures: torch's max allocated on CUDA (no context, no fragmentation), on CPU the RSS
        above the baseline (the CPU runtime included)."""
        return self.total - self.untracked

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def to_json(self) -> dict[str, Any]:
        return {"total_bytes": self.total, "total_gib": round(self.total / GIB, 3), "comparable_bytes": self.comparable,
                "params": self.params,
                "trainable_params": self.trainable_params,
                "components": {k: {"bytes": v, "gib": round(v / GIB, 3), "note": self.notes.get(k, "")}
                               for k, v in self.bytes.items()}}


def qlora_bytes_per_weight(double_quant: bool) -> float:
    """4-bit weight + its quantization constants (see the module docstring)."""
    if double_quant:
        return 0.5 + 1 / QLORA_BLOCK + 4 / (QLORA_BLOCK * QLORA_DOUBLE_QUANT_BLOCK)
    return 0.5 + 4 / QLORA_BLOCK


def optimizer_bytes_per_param(p: Plan, state_bytes: int, hidden_size: int) -> float:
    """Optimizer state bytes per trainable parameter (master weights included under DeepSpeed mixed precision)."""
    master = p.deepspeed and p.precision in ("bf16", "fp16")
    state = 4 if master else state_bytes
    per = {"adamw_torch": 2 * state, "lion": 4, "adafactor": state * 2 / hidden_size}[p.optimizer]
    return per + (4 if master else 0)


def optimizer_step_temp_bytes(shape: ModelShape, p: Plan, w: int, value_largest: int = 0) -> int:
    """Temporaries of the optimizer step. torch's AdamW on CPU runs one tensor at a time (no foreach kernels on CPU),
    and `exp_avg_sq.sqrt() / bias_correction2_sqrt` holds two temporaries the size of that tensor: 2 x the largest
    trainable tensor (ppo: of the policy's and the value model's, `value_largest` bytes). On CUDA lmforge asks for
    adamw_torch_fused (trainer/args.py), one kernel without temporaries; DeepSpeed steps its own flat buffers."""
    if p.device != "cpu" or p.optimizer != "adamw_torch" or p.deepspeed:
        return 0
    linears = shape.linears()
    if p.method == "full":
        largest = max([shape.vocab_size * shape.hidden_size] + [i * o for i, o in linears.values()]) * w
    else:
        largest = max(p.lora_rank * max(linears[t]) for t in lora_target_names(shape, p)) * adapter_bytes(p)
    return 2 * max(largest, value_largest)


@dataclass(frozen=True)
class ValueParts:
    """ppo's value model: `fixed` bytes (weights, and what trains: adapter, optimizer states), `grads` (full: every
    weight's gradient, there from its backward to the optimizer step), its activations, the bytes of its largest
    trainable tensor (for AdamW's CPU temporaries) and a note."""

    fixed: int
    grads: int
    acts: Activations
    largest: int
    note: str


def value_model_parts(p: Plan) -> ValueParts:
    """The value model of ppo: a copy of the reward model (p.reward_shape with a 1-wide score head), trained whole
    (value_method full: weights, gradients, optimizer states like full training) or as a LoRA adapter with the
    stage's lora settings plus the whole score head, its backbone frozen (value_method lora). Its activations are
    those of p.micro_batch rows through the score head, as full or LoRA training keeps them. Not quantized: its
    adapter is fp32 (16-bit under DeepSpeed mixed precision)."""
    vs = p.reward_shape
    assert vs is not None
    W = p.world_size
    ws = W if p.sharding in ("zero3", "fsdp_full_shard") and W > 1 else 1
    ss = W if p.sharding != "none" and W > 1 else 1
    w = weight_bytes(p)
    mixed = p.deepspeed and p.precision in ("bf16", "fp16")
    vp = vs.score_model_params()
    weights = vp * w // ws
    if p.value_method == "lora":
        trained = vs.lora_params(p.lora_rank, p.lora_targets) + vs.hidden_size  # the adapter and the score head
        aw = 2 if mixed else 4
        opt = 0 if p.offload_optimizer else round(trained * optimizer_bytes_per_param(p, aw, vs.hidden_size) / ss)
        linears = vs.linears()
        largest = max([vs.hidden_size] + [p.lora_rank * max(linears[t]) for t in lora_target_names(vs, p)]) * aw
        return ValueParts(fixed=weights + trained * aw // ws + trained * aw // ss + opt, grads=0,
                          acts=activations(vs, p, p.micro_batch, "score", lora=True), largest=largest,
                          note=f"value model {vp:,} params (frozen) + {trained:,} trained (LoRA rank {p.lora_rank} "
                               f"and the score head: {aw} B weights + {aw} B grads + optimizer states)")
    grad_w = 2 if mixed else w
    opt = 0 if p.offload_optimizer else round(vp * optimizer_bytes_per_param(p, w, vs.hidden_size) / ss)
    largest = max([vs.vocab_size * vs.hidden_size] + [i * o for i, o in vs.linears().values()]) * w
    return ValueParts(fixed=weights + opt, grads=vp * grad_w // ss,
                      acts=activations(vs, p, p.micro_batch, "score", lora=False), largest=largest,
                      note=f"value model {vp:,} params (trained whole: weights + {p.optimizer} states)")


def generation_bytes(shape: ModelShape, p: Plan) -> tuple[int, str]:
    """What the rollouts hold beside the models, between two training steps (no activations, no gradients then):
    the KV cache of the rows generated at once, L x 2 x k d x s x c each (ppo: p.micro_batch rows at a time, TRL's
    local_rollout_forward_batch_size; grpo: a whole generation batch, micro_batch x grad_accumulation_steps), and the
    logits generation returns (ppo: every rollout's p.response_tokens x V in fp32, kept until their log-probs are
    taken; grpo: one decoding step's)."""
    if not p.generation:
        return 0, ""
    c = compute_bytes(p)
    rollouts = p.micro_batch * p.grad_accumulation_steps
    kv_rows = p.micro_batch if p.kind == "ppo" else rollouts
    kv = round(kv_rows * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * row_tokens(p) * c)
    per_row = max(p.response_tokens, 1) if p.kind == "ppo" else 1
    logits = rollouts * per_row * shape.vocab_size * 4
    return kv + logits, f"generation: KV cache of {kv_rows} rollouts and {rollouts} x {per_row} fp32 logits"


def estimate_memory(shape: ModelShape, p: Plan) -> Breakdown:
    """Peak bytes per GPU of one training stage, by component."""
    W = p.world_size
    shard_states = p.sharding != "none" and W > 1
    shard_weights = p.sharding in ("zero3", "fsdp_full_shard") and W > 1
    ws = W if shard_weights else 1
    ss = W if shard_states else 1
    w, c = weight_bytes(p), compute_bytes(p)
    out = Breakdown(params=shape.params())
    b = out.bytes

    # weights of the model being trained
    if p.method == "qlora":
        quantized = shape.linear_params()
        per = qlora_bytes_per_weight(p.quant_double)
        b["weights"] = round(quantized * per) + (shape.params() - quantized) * 4
        out.notes["weights"] = (f"{quantized:,} linear weights in 4-bit nf4 ({per:.4f} B each with absmax"
                                f"{', double-quantized' if p.quant_double else ''}), {shape.params() - quantized:,} "
                                "others (embeddings, norms, head) in fp32")
    else:
        b["weights"] = shape.params() * w
        out.notes["weights"] = f"{shape.params():,} params x {w} B ({'16-bit under DeepSpeed' if w == 2 and p.deepspeed else p.dtype})"
    if shard_weights:
        b["weights"] //= ws
        out.notes["weights"] += f", / {W} ({p.sharding})"
    if p.offload_params:
        b["weights"], out.notes["weights"] = 0, out.notes["weights"] + ", offloaded to CPU"

    grad_w = 2 if (p.deepspeed and p.precision in ("bf16", "fp16")) else w
    if p.method == "full":
        out.trainable_params = shape.params()
        opt = optimizer_bytes_per_param(p, w, shape.hidden_size)
        b["optimizer"] = 0 if p.offload_optimizer else round(shape.params() * opt / ss)
        out.notes["optimizer"] = f"{p.optimizer}: {opt:g} B per trainable param" + \
            (f" / {W}" if shard_states else "") + (", offloaded to CPU" if p.offload_optimizer else "")
        b["adapter"] = 0
    else:
        lora_n = shape.lora_params(p.lora_rank, p.lora_targets)
        out.trainable_params = lora_n
        out.params += lora_n
        aw = adapter_bytes(p)
        opt = optimizer_bytes_per_param(p, aw, shape.hidden_size)
        b["gradients"], b["optimizer"] = 0, 0
        b["adapter"] = lora_n * aw // ws + lora_n * aw // ss + (0 if p.offload_optimizer else round(lora_n * opt / ss))
        out.notes["adapter"] = (f"{lora_n:,} LoRA params (rank {p.lora_rank}): {aw} B weights + {aw} B grads + "
                                f"{opt:g} B {p.optimizer} states each")
        out.notes["gradients"] = out.notes["optimizer"] = "frozen base: none (see adapter)"

    rows = 2 * p.micro_batch if p.kind in ("reward", "dpo") else p.micro_batch
    loss = loss_path(p.kind)
    acts = activations(shape, p, rows, loss, lora=p.method != "full")
    notes = [f"{rows} rows x {row_tokens(p):g} tokens{' (measured)' if p.row_tokens else ''}, "
             f"{p.attn_implementation}, checkpointing "
             f"{'on' if p.gradient_checkpointing else 'off'}, {loss} loss"]
    value = value_model_parts(p) if p.value_model and p.reward_shape is not None else None
    if value is not None:
        notes.append(f"+ value model ({p.value_method}, {p.micro_batch} rows, score head)")
    # The peak is the largest of four moments (module docstring, "Peak"). Full training: the Trainer frees the
    # gradients after each optimizer step (zero_grad(set_to_none=True)), and backward creates them as it goes; at the
    # start of backward only lm_head's gradient (the tied embedding's) exists, unless gradients accumulate over
    # micro-batches, when all of them are there from the second micro-batch on. ppo's value model runs its backward
    # after the policy's (its forward came first), so its activations are all there at the policy's start of backward.
    full = p.method == "full"
    all_grads = shape.params() * grad_w // ss if full else 0
    head_grad = shape.vocab_size * shape.hidden_size * grad_w // ss if full and loss != "score" else 0
    before = all_grads if p.grad_accumulation_steps > 1 else head_grad
    v_grads = value.grads if value else 0
    v_before = v_grads if p.grad_accumulation_steps > 1 else 0
    temp = 0 if p.offload_optimizer else optimizer_step_temp_bytes(shape, p, w, value.largest if value else 0)
    gen, gen_notes = generation_bytes(shape, p)
    phases = {"start of backward": (before, v_before, acts.start() + (value.acts.start() if value else 0), 0, 0),
              "end of backward": (all_grads, v_grads, value.acts.end() if value else acts.end(), 0, 0),
              "optimizer step": (all_grads, v_grads, 0, temp, 0),
              "generation": (0, 0, 0, 0, gen)}
    phase, (grads, v_grads, act, temp, gen) = max(phases.items(), key=lambda kv: sum(kv[1]))
    notes.append(f"peak at the {phase}")
    if full:
        b["gradients"] = grads
        which = "all" if grads == all_grads else "lm_head's (tied: the embedding's) only"
        out.notes["gradients"] = f"{which} at the {phase}: {grads * ss // grad_w:,} x {grad_w} B" + \
            (f" / {W} ({p.sharding})" if shard_states else "")
    value_temp = temp if value is not None and 2 * value.largest == temp and \
        temp > optimizer_step_temp_bytes(shape, p, w) else 0  # the value model's tensor is the largest
    if temp and not value_temp:  # the optimizer's own temporaries, with its states (LoRA: with the adapter's)
        b["optimizer" if full else "adapter"] += temp
        out.notes["optimizer" if full else "adapter"] += f" + {temp:,} B of step temporaries (AdamW on CPU)"
    others, other_notes = 0, []
    if value is not None:
        others += value.fixed + v_grads + value_temp
        other_notes.append(value.note + (f", its gradients at the {phase}" if v_grads else "") +
                           (f", {value_temp:,} B of AdamW's CPU temporaries for its largest tensor" if value_temp
                            else ""))
    if p.reward_shape is not None:
        rp = p.reward_shape.score_model_params()
        resident = rp - (p.reward_shape.embedding_params() if p.device == "cpu" else 0)
        others += resident * w // ws
        other_notes.append(f"reward model {rp:,} params (frozen)" + (
            f", {resident:,} resident (memory-mapped: the embedding's rows only as read)" if p.device == "cpu" else ""))
    if p.reference_copy:
        others += shape.params() * w // ws
        other_notes.append(f"reference copy {shape.params():,} params (frozen)")
    b["activations"] = act
    out.notes["activations"] = ", ".join(notes)
    b["other_models"] = others
    out.notes["other_models"] = "; ".join(other_notes) or "none"

    if p.device == "cpu":
        runtime = CPU_RUNTIME_MIB + (CPU_BNB_RUNTIME_MIB if p.method == "qlora" else 0)
        buf, buf_notes = runtime * MIB, [f"CPU runtime {runtime} MiB"]
    else:
        buf, buf_notes = CUDA_CONTEXT_MIB * MIB, [f"CUDA context {CUDA_CONTEXT_MIB} MiB"]
    if W > 1 and p.sharding == "none":
        buf += out.trainable_params * (grad_w if p.method == "full" else 4)
        buf_notes.append("DDP gradient buckets")
    if p.sharding == "zero2" and W > 1:
        buf += min(ZERO2_ALLGATHER_ELEMENTS, shape.params()) * 2
        buf_notes.append("ZeRO-2 all-gather bucket")
    if shard_weights:
        buf += 2 * shape.layer_params() * c
        buf_notes.append("2 gathered layers")
    if p.method == "qlora":
        buf += max(i * o for i, o in shape.linears().values()) * c
        buf_notes.append("largest linear dequantized")
    if p.generation:
        buf += gen
        buf_notes.append(gen_notes + ("" if gen else " (freed before the training step: not at the peak)"))
    if p.device == "cpu":  # no caching allocator: with the preflight's pinned mmap threshold each tensor is its own map
        b["buffers"] = buf
        out.notes["buffers"] = ", ".join(buf_notes)
        return out
    frag = round(FRAGMENTATION * (sum(b.values()) + buf - CUDA_CONTEXT_MIB * MIB))
    b["buffers"] = buf + frag
    out.untracked = CUDA_CONTEXT_MIB * MIB + frag
    out.notes["buffers"] = ", ".join(buf_notes) + f", {FRAGMENTATION:.0%} fragmentation margin"
    return out
