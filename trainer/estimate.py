"""Peak accelerator memory of a training stage, from the model's config alone (no weights, no torch).

Used by `lmforge estimate` (flows/estimate.py) before anyone rents a GPU. Everything is in bytes per GPU and
is a plain function of a `ModelShape` and the stage's settings, so it is testable by hand.

Notation: P parameters, h hidden_size, L layers, a attention heads, k key/value heads, d head_dim,
i intermediate_size, V vocab_size, r LoRA rank, b micro-batch rows (batch_size_per_device), s tokens per row
(max_length_tokens, an upper bound: rows are padded to the longest of their batch, packed rows are full),
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
Gradients (full training only): P x w (plain Trainer: gradients have the parameters' dtype; DeepSpeed bf16/fp16:
    2). ZeRO-2, ZeRO-3, FSDP: / W.
Optimizer states (full training only), per trainable parameter:
    adamw_torch  2 states (m, v) in the parameters' dtype (torch keeps states in the param dtype): 2 w
    lion         1 fp32 state (bitsandbytes 32-bit): 4
    adafactor    factored second moment, about (rows + cols) per matrix: ~ 4 x 2 / h per parameter
    DeepSpeed with bf16/fp16 adds fp32 master weights (4) and keeps the states in fp32: Adam 4 + 8 = 12 bytes,
    the "K = 12" of the ZeRO paper. ZeRO-2, ZeRO-3, FSDP: / W. offload_optimizer to CPU: 0 on the GPU.
Adapter (lora, qlora; component `adapter`): peft keeps adapters in fp32 (autocast_adapter_dtype), so
    P_lora x (4 weights + 4 gradients + optimizer states as above at fp32). Sharded like full training.
Activations (component `activations`), with n = rows x s tokens:
    per layer   n x [ h (2c + 8)             two RMSNorms: an fp32 copy of the input and the normalized output
                    + c (a d + 2 k d)        q, k, v
                    + c (a d + k d)          q and k after the rotary embedding
                    + c a d                  attention output (o_proj input)
                    + 4 c i ]                gate, up, act(gate), act(gate) x up (2 c i without a gate)
                + attention: sdpa / flash_attention_2 keep the output and an fp32 logsumexp: rows x a x s x 4;
                  eager keeps the fp32 softmax and its cast: rows x a x s^2 x (4 + c), and with k < a the
                  repeated k and v: n x 2 c a d
                + LoRA: n x c x r per targeted module (the A output), plus n x in x (c + 1) per targeted module
                  when lora.dropout > 0 (peft's dropout copy of the input and its mask)
    model       L x layer, or with gradient checkpointing L x n h c (each layer's input) + one layer recomputed
                + n h c (embedding output) + n h (c + 4) (final norm)
                + logits n V (c + 8): the head's output, the fp32 log-softmax the loss keeps for backward and
                  the fp32 gradient that starts backward (reward models: a 1-wide score head instead).
    rows: sft, pretrain, grpo b; reward and dpo 2b (chosen and rejected in one batch); ppo b for the policy
    plus b for the value model (a score head, no logits).
Other models (component `other_models`): frozen copies at w bytes per parameter (sharded by ZeRO-3/FSDP):
    dpo full: the reference; ppo: the reward model, the value model (trained fully: weights, gradients and
    optimizer like full training), and the reference when full; grpo full with beta > 0: the reference; a reward
    stage among grpo's inputs: its model. LoRA and QLoRA references are the policy with its adapter disabled.
Buffers (component `buffers`):
    CUDA context, cuBLAS workspaces and kernels: CUDA_CONTEXT_MIB (not counted by torch's allocator, but
    on the card); DDP with W > 1: gradient buckets, one more copy of the trainable gradients; ZeRO-2: the
    all-gather bucket, min(2e8, P) x 2 bytes; ZeRO-3 / FSDP: two gathered decoder layers in compute dtype
    (the live one and the prefetched one); qlora: the largest linear layer dequantized in compute dtype;
    ppo, grpo: the generation KV cache for b x grad_accumulation_steps rows, L x 2 x k d x s x c each;
    then the allocator's fragmentation margin, FRAGMENTATION of every tensor above.

The estimate is meant for planning (does it fit, roughly how much headroom); the preflight stage measures the
real peak on the planned settings.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from trainer.errors import SettingError

GIB = 2**30
MIB = 2**20
CUDA_CONTEXT_MIB = 600  # CUDA context + cuBLAS/cuDNN workspaces + loaded kernels, as nvidia-smi shows them
FRAGMENTATION = 0.10  # the caching allocator's fragmentation and rounding, as a fraction of the tensors
QLORA_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax per 64 weights
QLORA_DOUBLE_QUANT_BLOCK = 256  # double quantization: one fp32 constant per 256 absmax values
ZERO2_ALLGATHER_ELEMENTS = 200_000_000  # configs/deepspeed/zero2*.json allgather_bucket_size
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COMPONENTS = ("weights", "gradients", "optimizer", "adapter", "activations", "other_models", "buffers")

AttnImpl = Literal["sdpa", "flash_attention_2", "eager"]
Sharding = Literal["none", "zero2", "zero3", "fsdp_full_shard", "fsdp_shard_grad_op"]
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: model types whose decoder has the llama layout (separate q/k/v/o, a gated or plain MLP, RMSNorm)
LLAMA_FAMILY = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                          "phi3", "olmo", "olmo2", "granite", "cohere", "stablelm", "smollm3", "starcoder2",
                          "internlm2", "deepseek", "yi"})
NON_GATED = frozenset({"starcoder2", "stablelm"})


@dataclass(frozen=True)
class ModelShape:
    """What the memory and FLOPs formulas need from a model config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    gated_mlp: bool = True
    attention_bias: bool = False
    source: str = ""

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by peft's module name."""
        h, qd, kd, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        out = {"q_proj": (h, qd), "k_proj": (h, kd), "v_proj": (h, kd), "o_proj": (qd, h), "up_proj": (h, i),
               "down_proj": (i, h)}
        if self.gated_mlp:
            out["gate_proj"] = (h, i)
        return out

    def layer_params(self) -> int:
        """Parameters of one decoder layer: its linears, their biases and two norms."""
        n = sum(i * o for i, o in self.linears().values()) + 2 * self.hidden_size
        if self.attention_bias:
            n += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return n

    def linear_params(self) -> int:
        """Weights of every decoder linear layer (the ones QLoRA quantizes)."""
        return self.num_layers * sum(i * o for i, o in self.linears().values())

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """lm_head weights that are not the embeddings (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def backbone_params(self) -> int:
        """Everything but lm_head: embeddings, layers, final norm."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size

    def params(self) -> int:
        return self.backbone_params() + self.head_params()

    def score_model_params(self) -> int:
        """A reward/value model on this backbone: a 1-wide score head instead of lm_head."""
        return self.backbone_params() + self.hidden_size

    def matmul_params(self, lm_head: bool = True) -> int:
        """Parameters used in a matmul per token (FLOPs): the layers' linears and the head (tied or not)."""
        return self.linear_params() + (self.vocab_size * self.hidden_size if lm_head else self.hidden_size)

    def lora_params(self, rank: int, targets: list[str] | str) -> int:
        linears = self.linears()
        names = list(linears) if targets == "all-linear" else [t.rsplit(".", 1)[-1] for t in targets]
        unknown = [t for t in names if t not in linears]
        if unknown:
            raise SettingError("lora.target_modules", f"{', '.join(unknown)} not among the linear layers the "
                               f"estimate knows for {self.model_type} ({', '.join(linears)}); use those names or "
                               "all-linear")
        return self.num_layers * sum(rank * (linears[t][0] + linears[t][1]) for t in names)


def shape_from_config(cfg: dict[str, Any], source: str, vocab_size: int | None = None) -> ModelShape:
    """A ModelShape from a transformers config dict (a config.json, a `base_model.config`, AutoConfig.to_dict()).

    `vocab_size` fills a missing vocab_size (a config-built model takes its tokenizer's size)."""
    cfg = dict(cfg.get("text_config") or cfg) if isinstance(cfg.get("text_config"), dict) else dict(cfg)
    model_type = str(cfg.get("model_type", ""))
    if model_type not in LLAMA_FAMILY:
        raise SettingError("base_model", f"model_type {model_type!r} ({source}): the estimate knows the llama-style "
                           f"decoder layout only ({', '.join(sorted(LLAMA_FAMILY))}); use one of those or add "
                           "its layout to trainer/estimate.py")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
               if cfg.get(k) is None]
    if missing or (cfg.get("vocab_size") is None and vocab_size is None):
        cfg = {**_defaults(model_type), **cfg}  # what transformers fills in when it builds this config
    vocab = cfg.get("vocab_size") if cfg.get("vocab_size") is not None else vocab_size
    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelShape(
        model_type=model_type, vocab_size=int(vocab), hidden_size=h, num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or h // heads), intermediate_size=int(cfg["intermediate_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), gated_mlp=model_type not in NON_GATED,
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")), source=source)


def _defaults(model_type: str) -> dict[str, Any]:
    """transformers' defaults for a model type (imports transformers: only when a config leaves fields out)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type).to_dict()


def shape_from_gguf(path: str, source: str) -> ModelShape:
    """A ModelShape from a GGUF file's metadata (the `gguf` package reads the header; tensors stay on disk)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def value(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = value("general.architecture")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    heads = int(value(f"{arch}.attention.head_count"))
    h = int(value(f"{arch}.embedding_length"))
    cfg = {"model_type": "llama" if arch not in LLAMA_FAMILY else arch, "hidden_size": h,
           "num_hidden_layers": int(value(f"{arch}.block_count")), "num_attention_heads": heads,
           "num_key_value_heads": int(value(f"{arch}.attention.head_count_kv", heads)),
           "head_dim": int(value(f"{arch}.attention.key_length", h // heads)),
           "intermediate_size": int(value(f"{arch}.feed_forward_length")),
           "vocab_size": len(tokens.data) if tokens is not None else None,
           "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    return shape_from_config(cfg, source)


# ----------------------------------------------------------------------------------------------
# memory


@dataclass
class Plan:
    """The settings of one training stage that shape its memory (a stage's settings, made concrete)."""

    kind: str  # sft | pretrain | reward | dpo | ppo | grpo
    method: str  # full | lora | qlora
    dtype: str = "float32"
    precision: str = "bf16"  # resolved: bf16 | fp16 | fp32
    micro_batch: int = 8
    grad_accumulation_steps: int = 1
    seq_tokens: int = 1024
    gradient_checkpointing: bool = False
    attn_implementation: AttnImpl = "sdpa"
    optimizer: str = "adamw_torch"
    world_size: int = 1
    sharding: Sharding = "none"
    deepspeed: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    lora_rank: int = 16
    lora_targets: list[str] | str = "all-linear"
    lora_dropout: float = 0.05
    quant_double: bool = True
    reference_copy: bool = False  # a frozen full copy of the policy (dpo/ppo/grpo full)
    reward_shape: ModelShape | None = None  # ppo (and grpo with a reward stage): the reward model's backbone
    value_model: bool = False  # ppo: a trained copy of the reward model
    generation: bool = False  # ppo, grpo: rollouts with a KV cache

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reward_shape"] = asdict(self.reward_shape) if self.reward_shape else None
        return out


@dataclass
class Breakdown:
    """Bytes per GPU by component, with a note saying what each holds."""

    bytes: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    params: int = 0
    trainable_params: int = 0

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def to_json(self) -> dict[str, Any]:
        return {"total_bytes": self.total, "total_gib": round(self.total / GIB, 3), "params": self.params,
                "trainable_params": self.trainable_params,
                "components": {k: {"bytes": v, "gib": round(v / GIB, 3), "note": self.notes.get(k, "")}
                               for k, v in self.bytes.items()}}


def compute_bytes(p: Plan) -> int:
    return 4 if p.precision == "fp32" else 2


def weight_bytes(p: Plan) -> int:
    """Bytes of a stored (unquantized) weight: the dtype, or 16 bits under DeepSpeed mixed precision."""
    if p.deepspeed and p.precision in ("bf16", "fp16"):
        return 2
    return DTYPE_BYTES[p.dtype]


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


def activation_bytes(shape: ModelShape, p: Plan, rows: int, logits: bool = True, lora: bool = False) -> int:
    """Activations kept for backward by `rows` rows of p.seq_tokens tokens (formulas in the module docstring)."""
    c, s = compute_bytes(p), p.seq_tokens
    n = rows * s
    h, a, k, d, i = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size
    per_token = h * (2 * c + 8) + c * (a * d + 2 * k * d) + c * (a * d + k * d) + c * a * d + \
        (4 if shape.gated_mlp else 2) * c * i
    layer = n * per_token
    if p.attn_implementation == "eager":
        layer += rows * a * s * s * (4 + c) + (n * 2 * c * a * d if k < a else 0)
    else:
        layer += rows * a * s * 4
    if lora:
        linears = shape.linears()
        names = list(linears) if p.lora_targets == "all-linear" else [t.rsplit(".", 1)[-1] for t in p.lora_targets]
        layer += sum(n * c * p.lora_rank + (n * linears[t][0] * (c + 1) if p.lora_dropout > 0 else 0) for t in names)
    if p.gradient_checkpointing:
        body = shape.num_layers * n * h * c + layer
    else:
        body = shape.num_layers * layer
    head = n * shape.vocab_size * (c + 8) if logits else n * (c + 8)
    return body + n * h * c + n * h * (c + 4) + head


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
        b["gradients"] = shape.params() * grad_w // ss
        out.notes["gradients"] = f"{shape.params():,} x {grad_w} B" + (f" / {W} ({p.sharding})" if shard_states else "")
        opt = optimizer_bytes_per_param(p, w, shape.hidden_size)
        b["optimizer"] = 0 if p.offload_optimizer else round(shape.params() * opt / ss)
        out.notes["optimizer"] = f"{p.optimizer}: {opt:g} B per trainable param" + \
            (f" / {W}" if shard_states else "") + (", offloaded to CPU" if p.offload_optimizer else "")
        b["adapter"] = 0
    else:
        lora_n = shape.lora_params(p.lora_rank, p.lora_targets)
        out.trainable_params = lora_n
        out.params += lora_n
        aw = 2 if (p.deepspeed and p.precision in ("bf16", "fp16")) else 4
        opt = optimizer_bytes_per_param(p, 4, shape.hidden_size)
        b["gradients"], b["optimizer"] = 0, 0
        b["adapter"] = lora_n * aw // ws + lora_n * aw // ss + (0 if p.offload_optimizer else round(lora_n * opt / ss))
        out.notes["adapter"] = (f"{lora_n:,} LoRA params (rank {p.lora_rank}): {aw} B weights + {aw} B grads + "
                                f"{opt:g} B {p.optimizer} states each")
        out.notes["gradients"] = out.notes["optimizer"] = "frozen base: none (see adapter)"

    rows = 2 * p.micro_batch if p.kind in ("reward", "dpo") else p.micro_batch
    act = activation_bytes(shape, p, rows, logits=p.kind != "reward", lora=p.method != "full")
    notes = [f"{rows} rows x {p.seq_tokens} tokens, {p.attn_implementation}, checkpointing "
             f"{'on' if p.gradient_checkpointing else 'off'}"]
    others, other_notes = 0, []
    if p.value_model and p.reward_shape is not None:
        act += activation_bytes(p.reward_shape, p, p.micro_batch, logits=False)
        notes.append("+ value model")
        vp = p.reward_shape.score_model_params()
        others += vp * w // ws + vp * grad_w // ss + (0 if p.offload_optimizer else
                                                      round(vp * optimizer_bytes_per_param(p, w, shape.hidden_size) / ss))
        other_notes.append(f"value model {vp:,} params (trained)")
    if p.reward_shape is not None:
        rp = p.reward_shape.score_model_params()
        others += rp * w // ws
        other_notes.append(f"reward model {rp:,} params (frozen)")
    if p.reference_copy:
        others += shape.params() * w // ws
        other_notes.append(f"reference copy {shape.params():,} params (frozen)")
    b["activations"] = act
    out.notes["activations"] = ", ".join(notes)
    b["other_models"] = others
    out.notes["other_models"] = "; ".join(other_notes) or "none"

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
        kv_rows = p.micro_batch * p.grad_accumulation_steps
        buf += kv_rows * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * p.seq_tokens * c
        buf_notes.append(f"KV cache of {kv_rows} rollouts")
    frag = round(FRAGMENTATION * (sum(b.values()) + buf - CUDA_CONTEXT_MIB * MIB))
    b["buffers"] = buf + frag
    out.notes["buffers"] = ", ".join(buf_notes) + f", {FRAGMENTATION:.0%} fragmentation margin"
    return out
