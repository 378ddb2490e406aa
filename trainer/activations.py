"""What a micro-batch keeps alive for backward: the activation part of the memory estimate (trainer/estimate.py,
whose notation this uses: n = rows x s tokens, c compute bytes, h, a, k, d, i, V, r).

Activations (component `activations`): the tensors autograd keeps for backward, with n = rows x s tokens. A frozen
    linear layer keeps nothing (autograd saves a matmul's input only for its weight's gradient; bitsandbytes' 4-bit
    matmul saves only the quantized weight), so an input counts once, for whichever consumer keeps it.
    per layer   n x [ 2 (4 h + 4)               two RMSNorms: the fp32 input (the layer's input in fp32) and rsqrt
                    + 2 c h                     full: the normalized input of each norm's weight
                    + 2 c h                     full: the normalized outputs (the q/k/v and gate/up inputs)
                    + c (a d + 2 k d)           q and k after the rotary embedding, v (sdpa / flash)
                    + c a d + 4 a               attention output (o_proj's input too) and the fp32 logsumexp
                    + 3 c i                     gate (silu's input), silu(gate) and up (the product's inputs)
                    + c i ]                     full: act(gate) x up, down_proj's input
                  non-gated MLP: c i (the activation's input) + c i (full: down's input). eager attention instead
                  of the sdpa terms: q, k and v repeated to a heads (3 c a d), the fp32 softmax and its cast
                  (rows x a x s^2 x (4 + c)) and the output (c a d).
                + LoRA, per targeted module with input size `in`: A's output n x r x e, and with lora.dropout > 0 the
                  dropout's output n x in x e (A's input) and its mask, n x in x 1 on CUDA (a bool) but n x in x e
                  on CPU (ATen's CPU dropout multiplies by a noise tensor of the input's dtype); e = c, or 2 for
                  QLoRA under TRL (peft casts the input to the bf16 adapter; without dropout A keeps that cast copy).
                  Without dropout and cast, A keeps its input itself (the normalized outputs, down's input).
    model       kept: L x layer, or with gradient checkpointing L x n h c (each layer's input), + the rotary
                  cos and sin (2 n d c, shared by the layers)
                + final, at the loss's backward: the final norm (n (4 h + 4), + n c h full) and the loss:
                  sft: TRL's SFTTrainer computes lm_head and the cross-entropy in chunks of 256 tokens, each
                  recomputed in backward (loss_type chunked_nll, TRL's default): the gathered hidden states n h c
                  and one chunk's fp32 logits, log-softmax, its exp and their product, 4 x min(256, n) x V x 4;
                  pretrain, dpo, ppo: the logits of every position (pretrain: the model's own cross-entropy; dpo:
                  TRL's log-softmax of the policy's logits, a logsumexp per row over their fp32 logits; ppo: the
                  same over the response's positions, the policy asked for all logits), whose peak is the
                  log-softmax's backward: its saved input (output), the gradient coming in and the one going out,
                  3 n V x 4, plus lm_head's input n h c;
                  grpo: GRPOTrainer asks the model for the logits of the completion's last C + 1 positions only
                  (logits_to_keep, C = max_completion_tokens), divides C of them by the temperature and takes their
                  log-softmax: the same three tensors over rows x C positions, 3 rows C V x 4, plus n h c;
                  reward models: a 1-wide score head, n h c + n (c + 8)
                + one layer's backward: its gradients in flight, 2 c i n (gated; c i n otherwise)
    The start of backward holds kept + max(final, backward) and, with checkpointing, the recomputed layer with the
    backward: kept + max(final, layer + backward) (backward frees the loss's tensors before it recomputes a layer).
    rows: sft, pretrain, grpo b; reward and dpo 2b (chosen and rejected in one batch); ppo b for the policy
    plus b for the value model (a score head, no logits), whose layers keep what full training keeps
    (value_model full) or what LoRA training keeps (value_model lora).
"""
from __future__ import annotations

from dataclasses import dataclass

from trainer.memory_plan import TRL_BF16_QLORA_KINDS, Plan, compute_bytes, lora_target_names, row_tokens
from trainer.shapes import ModelShape

TRL_CE_CHUNK_TOKENS = 256  # trl SFTTrainer's loss_type chunked_nll (its default): tokens per lm_head chunk
CHUNK_LOSS_TENSORS = 4  # fp32 chunk x V tensors alive at once in a chunk: logits, log-softmax, its exp, their product


def layer_bytes_per_token(shape: ModelShape, p: Plan, lora: bool) -> float:
    """Bytes one decoder layer keeps for backward per token (the module docstring's per-layer formula).

    A frozen linear layer keeps nothing: autograd saves a matmul's input only for its weight's gradient, and
    bitsandbytes' 4-bit matmul saves only the quantized weight. So an input is kept once, by whichever consumer needs
    it: every linear layer under full training, LoRA's A matrix when lora.dropout is 0 (with dropout it keeps the
    dropout's output instead)."""
    c, h, a, k, d, i = compute_bytes(p), shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, \
        shape.intermediate_size
    full = not lora
    targets = set(lora_target_names(shape, p)) if lora else set()
    dropout = lora and p.lora_dropout > 0
    # peft casts a LoRA layer's input to the adapter's dtype (bf16 under TRL's QLoRA; no copy when they agree)
    la = 2 if p.method == "qlora" and p.kind in TRL_BF16_QLORA_KINDS else c
    cast = lora and la != c

    def input_kept(*consumers: str) -> bool:
        return full or (not dropout and not cast and bool(targets & set(consumers)))

    norm = 4 * h + 4 + (c * h if full else 0)  # fp32 input and rsqrt; the normalized input when its weight trains
    out = 2 * norm + (c * h if input_kept("q_proj", "k_proj", "v_proj") else 0) + \
        (c * h if input_kept("gate_proj", "up_proj") else 0)
    if p.attn_implementation == "eager":  # q; k, v repeated to a heads; the fp32 softmax and its cast; the output
        out += c * a * d * 3 + row_tokens(p) * a * (4 + c) + c * a * d
    else:  # q, k after the rotary embedding, v, the output and an fp32 logsumexp per head
        out += c * (a * d + 2 * k * d) + c * a * d + 4 * a
    if shape.gated_mlp:  # gate (silu's input), silu(gate) and up (the product's inputs)
        out += 3 * c * i
    else:  # up (the activation's input)
        out += c * i
    out += c * i if input_kept("down_proj") else 0  # act(gate) x up, down_proj's input
    if lora:  # A's output; dropout's output and mask, or without dropout the cast input (each target its own)
        linears = shape.linears()
        mask = la if p.device == "cpu" else 1  # CPU dropout multiplies by a noise tensor; CUDA keeps a bool mask
        for t in targets:
            out += la * p.lora_rank + ((la + mask) * linears[t][0] if dropout else la * linears[t][0] if cast else 0)
    return out


@dataclass(frozen=True)
class Activations:
    """What a micro-batch keeps alive, in bytes (see `Activations` in the module docstring).

    kept: what every layer keeps until its backward (gradient checkpointing: each layer's input), plus the rotary
    cos/sin; final: the final norm's and the loss's own tensors during the loss's backward; layer: one layer's saved
    tensors (recomputed one at a time under checkpointing); backward: a layer's gradients in flight during its
    backward."""

    kept: int
    final: int
    layer: int
    backward: int
    checkpointing: bool

    def start(self) -> int:
        """At the start of backward: all of `kept`, and the loss's backward or the first layer's, whichever is more
        (the loss's tensors are freed before backward reaches a layer)."""
        return self.kept + max(self.final, (self.layer if self.checkpointing else 0) + self.backward)

    def end(self) -> int:
        """At the end of backward: the last layer's saved tensors and its gradients in flight."""
        return self.layer + self.backward


def activations(shape: ModelShape, p: Plan, rows: int, loss: str = "plain", lora: bool = False) -> Activations:
    """Activations of `rows` rows of p.seq_tokens tokens. loss: "chunked" (TRL SFT's chunked_nll), "plain" (the
    model's own cross-entropy, or a log-softmax, over all logits), "completion" (GRPO: the log-softmax of the
    logits of the p.response_tokens completion tokens only) or "score" (a 1-wide score head)."""
    c, h, n = compute_bytes(p), shape.hidden_size, round(rows * row_tokens(p))
    layer = round(n * layer_bytes_per_token(shape, p, lora))
    rope = 2 * n * shape.head_dim * c
    kept = rope + (shape.num_layers * n * h * c if p.gradient_checkpointing else shape.num_layers * layer)
    final = n * (4 * h + 4 + (0 if lora else c * h))  # the final norm, as a layer's norm
    if loss == "chunked":  # the gathered hidden states, one chunk's fp32 logits-sized tensors
        final += n * h * c + CHUNK_LOSS_TENSORS * min(TRL_CE_CHUNK_TOKENS, n) * shape.vocab_size * 4
    elif loss == "plain":  # lm_head's input; at log-softmax's backward its saved output, its gradient in and out
        final += n * h * c + 3 * n * shape.vocab_size * 4
    elif loss == "completion":  # the same three fp32 logits-sized tensors, over the completion's positions only
        final += n * h * c + 3 * rows * min(p.response_tokens, row_tokens(p)) * shape.vocab_size * 4
    else:
        final += n * h * c + n * (c + 8)
    backward = n * shape.intermediate_size * c * (2 if shape.gated_mlp else 1)
    return Activations(kept=kept, final=final, layer=layer, backward=backward, checkpointing=p.gradient_checkpointing)


def loss_path(kind: str) -> str:
    """How the stage's trainer computes its token loss: TRL's SFTTrainer chunks the lm_head and cross-entropy
    (loss_type chunked_nll, TRL's default); GRPOTrainer asks the model for the logits of the completion only
    (logits_to_keep); reward models have a 1-wide score head; the others (pretrain, dpo, ppo) materialize the logits
    of the whole micro-batch."""
    return {"sft": "chunked", "grpo": "completion", "reward": "score"}.get(kind, "plain")
