"""`lmforge estimate`: exact memory components of a tiny Llama against hand-computed numbers, sharding, the GPU
catalog, the CLI on the demo pipeline (and a 7B-shaped model that needs a smaller micro-batch), and the cost."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from lmforge.errors import ConfigError
from trainer import gpus as G
from trainer.estimate import CPU_BNB_RUNTIME_MIB, CPU_RUNTIME_MIB, CUDA_CONTEXT_MIB, MIB, Plan, estimate_memory
from trainer.shapes import shape_from_config

REPO = Path(__file__).resolve().parent.parent
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}
LLAMA_7B = ("{model_type: llama, hidden_size: 4096, intermediate_size: 11008, num_hidden_layers: 32, "
            "num_attention_heads: 32, num_key_value_heads: 32, vocab_size: 32000, max_position_embeddings: 4096}")
# tiny: head_dim 16; per layer q 64x64 + k 64x32 + v 64x32 + o 64x64 + gate, up, down 64x128 = 36864, norms 128
LAYER = 4096 + 2048 + 2048 + 4096 + 3 * 8192 + 128
PARAMS = 100 * 64 + 2 * LAYER + 64 + 100 * 64  # embeddings, layers, final norm, lm_head
TRAINED = ("pretrain", "sft", "reward", "dpo", "ppo")


def tiny_plan(**kw) -> Plan:
    base = dict(kind="sft", method="full", dtype="bfloat16", precision="bf16", micro_batch=2, seq_tokens=8)
    return Plan(**{**base, **kw})


# one decoder layer of TINY, bytes per token kept for backward under full training at c bytes (module docstring)
def full_layer_per_token(c: int) -> int:
    h, a, k, d, i = 64, 4, 2, 16, 128
    return 2 * (4 * h + 4) + 2 * c * h + 2 * c * h + c * (a * d + 2 * k * d) + c * a * d + 4 * a + 3 * c * i + c * i


def test_tiny_llama_full_components_exact():
    shape = shape_from_config(TINY, "tiny")
    assert shape.params() == PARAMS == 86848
    est = estimate_memory(shape, tiny_plan(micro_batch=8, seq_tokens=32))
    b = est.bytes
    assert b["weights"] == PARAMS * 2 == 173696  # bf16
    assert b["optimizer"] == PARAMS * 2 * 2  # AdamW m and v in the params' dtype
    assert b["adapter"] == 0 and b["other_models"] == 0
    # the peak is the start of backward: of the gradients only lm_head's exists (made during the loss's backward)
    assert b["gradients"] == 100 * 64 * 2 and "start of backward" in est.notes["activations"]
    # activations: n = 8 rows x 32 tokens = 256, c = 2
    assert full_layer_per_token(2) == 2456
    layer = 256 * 2456
    kept = 2 * layer + 2 * 256 * 16 * 2  # 2 layers + rotary cos, sin
    final = 256 * (4 * 64 + 4 + 2 * 64) + 256 * 64 * 2 + 4 * 256 * 100 * 4  # final norm, gathered hidden, one chunk
    assert b["activations"] == kept + max(final, 256 * 128 * 2 * 2) == 1815552
    tensors = 173696 + 12800 + 2 * 173696 + 1815552
    assert b["buffers"] == CUDA_CONTEXT_MIB * MIB + round(0.1 * tensors)
    assert est.total == sum(b.values())


def test_full_training_peak_moments():
    """Gradients at the peak: all of them at the end of backward (a small batch), with gradient accumulation (the
    earlier micro-batches' are there), and at the optimizer step with its CPU temporaries."""
    shape = shape_from_config(TINY, "t")
    small = estimate_memory(shape, tiny_plan())  # n = 16: one layer's activations < the gradients
    assert small.bytes["gradients"] == PARAMS * 2 and "end of backward" in small.notes["activations"]
    assert small.bytes["activations"] == 16 * 2456 + 16 * 128 * 2 * 2  # the last layer and its backward
    big = estimate_memory(shape, tiny_plan(micro_batch=8, seq_tokens=32, grad_accumulation_steps=2))
    assert big.bytes["gradients"] == PARAMS * 2 and big.bytes["activations"] == 1815552
    cpu = tiny_plan(dtype="float32", precision="fp32", micro_batch=1, seq_tokens=4, device="cpu")
    step = estimate_memory(shape, cpu)
    assert "optimizer step" in step.notes["activations"] and step.bytes["activations"] == 0
    # AdamW on CPU: two temporaries of the largest trainable tensor (gate/up/down, 64 x 128) in fp32
    assert step.bytes["optimizer"] == PARAMS * 8 + 2 * 64 * 128 * 4 and step.bytes["gradients"] == PARAMS * 4
    assert estimate_memory(shape, replace(cpu, device="cuda")).bytes["optimizer"] == PARAMS * 8  # fused: none


def test_loss_tensors_chunked_for_sft_whole_for_pretrain():
    """sft: TRL's chunked cross-entropy keeps 4 fp32 tensors of 256 tokens x V; pretrain (the model's own loss):
    log-softmax's output and the gradients in and out of it, 3 x n x V fp32."""
    shape = shape_from_config(TINY, "t")
    plan = tiny_plan(micro_batch=4, seq_tokens=256)  # n = 1024 > one chunk
    sft = estimate_memory(shape, plan).bytes["activations"]
    pre = estimate_memory(shape, replace(plan, kind="pretrain")).bytes["activations"]
    assert pre - sft == 3 * 1024 * 100 * 4 - 4 * 256 * 100 * 4


def test_grpo_loss_keeps_the_logits_of_the_completion_only():
    """grpo: GRPOTrainer asks for the logits of the completion's positions (logits_to_keep): its log-softmax's three
    fp32 tensors cover rows x C positions, not every one of the n tokens as the model's own loss (pretrain)."""
    shape = shape_from_config(TINY, "t")
    grpo = tiny_plan(kind="grpo", method="lora", lora_rank=4, micro_batch=8, seq_tokens=32, response_tokens=4)
    est = estimate_memory(shape, grpo)
    pre = estimate_memory(shape, replace(grpo, kind="pretrain")).bytes["activations"]
    assert "completion loss" in est.notes["activations"]
    assert pre - est.bytes["activations"] == 3 * (8 * 32 - 8 * 4) * 100 * 4 == 268800


PPO_CPU = dict(kind="ppo", method="lora", lora_rank=4, lora_dropout=0.0, dtype="float32", precision="fp32",
               device="cpu", micro_batch=2, seq_tokens=8, value_model=True, generation=True, response_tokens=4)


def test_ppo_value_model_full_reward_model_and_generation():
    """ppo, value_model full, on CPU: the value model (P_s = backbone + a 1-wide score head) with its weights, AdamW
    states and, at the end of backward, its gradients; the frozen reward model memory-mapped, resident but for its
    embedding; the rollouts' KV cache and logits are gone by the training step."""
    from trainer.estimate import generation_bytes

    shape = shape_from_config(TINY, "t")
    ps = 100 * 64 + 2 * LAYER + 64 + 64  # embeddings, layers, final norm, score head
    assert shape.score_model_params() == ps == 80512
    est = estimate_memory(shape, tiny_plan(**PPO_CPU, reward_shape=shape))
    b = est.bytes
    # end of backward (n = 2 rows x 8 tokens = 16): every value gradient, and the value model's last layer (full
    # training keeps its normalized inputs too, c = 4) with its backward; the policy's LoRA gradients are in adapter
    assert "peak at the end of backward" in est.notes["activations"]
    assert b["activations"] == 16 * full_layer_per_token(4) + 16 * 128 * 4 * 2 == 86400
    value = ps * 4 + ps * 8 + ps * 4  # fp32 weights, AdamW m and v, gradients
    reward = (ps - 100 * 64) * 4  # memory-mapped: the embedding's rows only as read
    assert b["other_models"] == value + reward == 1584640
    assert b["adapter"] == 8192 * (4 + 4 + 8) and b["buffers"] == CPU_RUNTIME_MIB * MIB  # no KV cache at the peak
    assert "not at the peak" in est.notes["buffers"]
    # the rollouts: the KV cache of b rows (L x 2 x k d x s x c each) and every rollout's R x V fp32 logits
    assert generation_bytes(shape, tiny_plan(**PPO_CPU)) == (
        2 * 2 * 2 * 32 * 8 * 4 + 2 * 4 * 100 * 4, "generation: KV cache of 2 rollouts and 2 x 4 fp32 logits")
    # on a GPU the whole reward model is on the card
    gpu = estimate_memory(shape, tiny_plan(**{**PPO_CPU, "device": "cuda"}, reward_shape=shape))
    assert gpu.bytes["other_models"] == value + ps * 4


def test_ppo_value_model_lora():
    """value_model lora: the value model's weights frozen, a LoRA adapter (the stage's lora settings) and the whole
    score head trained: weights, gradients and AdamW states at 4 + 4 + 8 bytes; no full gradients, and its layers keep
    what LoRA training keeps."""
    shape = shape_from_config(TINY, "t")
    full = estimate_memory(shape, tiny_plan(**PPO_CPU, reward_shape=shape))
    est = estimate_memory(shape, tiny_plan(**PPO_CPU, reward_shape=shape, value_method="lora"))
    ps, trained = 80512, 8192 + 64  # the adapter (rank 4, all-linear) and the score head
    assert est.bytes["other_models"] == ps * 4 + trained * (4 + 4 + 8) + (ps - 100 * 64) * 4 == 750592
    assert "peak at the start of backward" in est.notes["activations"]
    policy = estimate_memory(shape, tiny_plan(**{**PPO_CPU, "value_model": False})).bytes["activations"]
    # the value model's activations: LoRA layers (dropout 0: A keeps its input) and a score head, 16 tokens
    from trainer.activations import activations

    assert est.bytes["activations"] == policy + activations(shape, tiny_plan(**PPO_CPU), 2, "score", lora=True).start()
    assert est.total < full.total


def test_lora_dropout_and_qlora_bf16_adapter_activations():
    shape = shape_from_config(TINY, "t")
    plan = tiny_plan(method="lora", lora_rank=4, micro_batch=8, seq_tokens=32)
    act = {d: estimate_memory(shape, replace(plan, device=d)).bytes["activations"] for d in ("cuda", "cpu")}
    inputs = 6 * 64 + 128  # the inputs of q, k, v, o, gate, up (64) and down (128), per token
    # the dropout mask: a bool on CUDA, a noise tensor of c bytes on CPU; 2 layers x 256 tokens
    assert act["cpu"] - act["cuda"] == 2 * 256 * inputs * (2 - 1)
    # without dropout, A keeps the normalized outputs and down's input (shared), not a copy and a mask per module
    nodrop = estimate_memory(shape, replace(plan, lora_dropout=0.0)).bytes["activations"]
    assert act["cuda"] - nodrop == 2 * 256 * (inputs * (2 + 1) - (2 * 64 + 128) * 2)
    # QLoRA under TRL: bf16 adapter (weights, gradients, AdamW states in bf16) and bf16 LoRA-branch activations
    q = estimate_memory(shape, replace(plan, method="qlora", dtype="float32", precision="fp32", device="cpu"))
    lo = estimate_memory(shape, replace(plan, dtype="float32", precision="fp32", device="cpu"))
    assert q.bytes["adapter"] == 8192 * (2 + 2 + 4) and lo.bytes["adapter"] == 8192 * (4 + 4 + 8)
    assert lo.bytes["activations"] - q.bytes["activations"] == 2 * 256 * (inputs * (8 - 4) + 7 * 4 * (4 - 2))


def test_buffers_on_cpu_are_the_runtime_and_what_the_preflight_compares():
    """On CUDA the preflight's measurement (torch's max allocated) sees neither the context nor the allocator's
    fragmentation; on CPU the buffers are the runtime's own RSS (and bitsandbytes', and QLoRA's dequantized linear)
    with no margin, and the RSS above the baseline sees them all."""
    shape = shape_from_config(TINY, "t")
    gpu = estimate_memory(shape, tiny_plan())
    assert gpu.comparable == gpu.total - gpu.bytes["buffers"] == gpu.to_json()["comparable_bytes"]
    cpu = estimate_memory(shape, tiny_plan(device="cpu"))
    assert cpu.bytes["buffers"] == CPU_RUNTIME_MIB * MIB and cpu.comparable == cpu.total
    q = estimate_memory(shape, tiny_plan(method="qlora", device="cpu"))
    assert q.bytes["buffers"] == (CPU_RUNTIME_MIB + CPU_BNB_RUNTIME_MIB) * MIB + 64 * 128 * 2  # + gate/up/down in bf16


def test_param_count_matches_transformers():
    """The analytic count equals the parameters of the model transformers builds (llama, and qwen2 with its qkv
    biases and tied embeddings)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for cfg in (TINY, {**TINY, "model_type": "qwen2", "tie_word_embeddings": True}):
        body = dict(cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(body.pop("model_type"), **body))
        assert shape_from_config(cfg, "t").params() == sum(p.numel() for p in model.parameters()), cfg["model_type"]


def test_deepspeed_mixed_precision_keeps_fp32_master_and_states():
    est = estimate_memory(shape_from_config(TINY, "t"), tiny_plan(dtype="float32", deepspeed=True))
    assert est.bytes["weights"] == PARAMS * 2  # the engine casts to bf16
    assert est.bytes["optimizer"] == PARAMS * 12  # fp32 master 4 + m 4 + v 4


def test_lora_adapter_exact_and_below_full():
    shape = shape_from_config(TINY, "t")
    lora = estimate_memory(shape, tiny_plan(method="lora", lora_rank=4, lora_dropout=0.0))
    full = estimate_memory(shape, tiny_plan())
    per_layer = 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + 3 * (64 + 128))
    assert lora.trainable_params == 2 * per_layer == 8192
    assert lora.bytes["adapter"] == 8192 * (4 + 4 + 8)  # fp32 weights, grads, AdamW m and v
    assert lora.bytes["gradients"] == lora.bytes["optimizer"] == 0
    assert lora.bytes["weights"] == full.bytes["weights"]
    assert lora.total < full.total


def test_qlora_weights_are_4bit_with_absmax():
    shape = shape_from_config(TINY, "t")
    q = estimate_memory(shape, tiny_plan(method="qlora", lora_rank=4))
    linear = 2 * (LAYER - 128)
    # 0.5 byte + one 8-bit absmax per 64 weights + one fp32 constant per 256 blocks; the rest fp32
    assert q.bytes["weights"] == linear // 2 + linear // 64 + linear * 4 // (64 * 256) + (PARAMS - linear) * 4
    assert q.bytes["weights"] == 36864 + 1152 + 18 + 13120 * 4
    nodq = estimate_memory(shape, tiny_plan(method="qlora", lora_rank=4, quant_double=False))
    assert nodq.bytes["weights"] == linear // 2 + linear * 4 // 64 + (PARAMS - linear) * 4
    big = shape_from_config({**TINY, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                             "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}, "7b")
    w = estimate_memory(big, tiny_plan(method="qlora")).bytes["weights"]
    assert w / big.params() < 0.7  # ~4-bit: 0.52 B per linear weight, fp32 embeddings and head


def test_sharding_ddp_zero2_zero3():
    shape = shape_from_config(TINY, "t")
    acc = dict(grad_accumulation_steps=2)  # all gradients exist at the peak
    one = estimate_memory(shape, tiny_plan(dtype="float32", deepspeed=True, **acc)).bytes
    ddp = estimate_memory(shape, tiny_plan(world_size=4, **acc)).bytes
    ds = dict(dtype="float32", deepspeed=True, world_size=4)
    z2 = estimate_memory(shape, tiny_plan(sharding="zero2", **ds, **acc)).bytes
    z3 = estimate_memory(shape, tiny_plan(sharding="zero3", **ds, **acc)).bytes
    assert ddp["weights"] == PARAMS * 2 and ddp["optimizer"] == PARAMS * 4  # replicated
    assert z2["weights"] == one["weights"] and z2["gradients"] == PARAMS * 2 // 4 and z2["optimizer"] == PARAMS * 12 // 4
    assert z3["weights"] == one["weights"] // 4 == PARAMS * 2 // 4
    assert z3["activations"] == one["activations"]  # each GPU runs its own micro-batch


def test_attention_and_checkpointing_change_activations_exactly():
    shape = shape_from_config(TINY, "t")
    plan = tiny_plan(micro_batch=8, seq_tokens=32, grad_accumulation_steps=2)  # n = 256; the peak: start of backward
    sdpa = estimate_memory(shape, plan).bytes["activations"]
    eager = estimate_memory(shape, replace(plan, attn_implementation="eager")).bytes["activations"]
    # per layer and token: q, k, v repeated to 4 heads instead of q, k, v at 2 kv heads, the fp32 softmax and its
    # bf16 cast (4 heads x 32 keys) instead of the logsumexp
    assert eager - sdpa == 2 * 256 * (2 * (3 * 64 - (64 + 2 * 32)) + 4 * 32 * (4 + 2) - 4 * 4)
    ckpt = estimate_memory(shape, replace(plan, gradient_checkpointing=True)).bytes["activations"]
    # each layer's input + rotary cos, sin + one recomputed layer and its backward; the loss's tensors are freed by then
    layer = 256 * 2456
    assert ckpt == 2 * 256 * 64 * 2 + 2 * 256 * 16 * 2 + layer + 256 * 128 * 2 * 2 == 841728
    assert sdpa - ckpt == 2 * layer - 2 * 256 * 64 * 2 - (layer + 256 * 128 * 2 * 2) + \
        (256 * (4 * 64 + 4 + 2 * 64) + 256 * 64 * 2 + 4 * 256 * 100 * 4)


def test_flops_model():
    shape = shape_from_config(TINY, "t")
    f = 2 * (2 * (LAYER - 128) + 100 * 64) + 2 * 2 * 8 * 4 * 16  # 2 P_mm + 2 L s a d
    assert G.forward_flops_per_token(shape, 8) == f
    assert G.train_flops_per_token(shape, tiny_plan()) == 3 * f
    assert G.train_flops_per_token(shape, tiny_plan(method="lora", lora_rank=4)) == 2 * f + 6 * 8192
    assert G.step_flops(shape, tiny_plan(grad_accumulation_steps=3)) == 2 * 3 * 8 * 3 * f


def test_catalog_loads_and_a_bad_entry_names_the_field(tmp_path):
    cat = G.load_catalog()
    assert list(cat.gpus) == ["RTX 4090", "L4", "L40S", "A100 40GB", "A100 80GB", "H100 80GB", "H200", "GB10"]
    assert cat.gpus["H200"].memory_gib == 140.4 and cat.gpus["GB10"].arch == "aarch64"
    mine = tmp_path / "mine.yaml"
    mine.write_text("gpus:\n  MyGPU: {memory_gib: 32, peak_bf16_tflops: 100, usd_per_hour: 0.7}\n")
    assert G.load_catalog([mine]).gpus["MyGPU"].usd_per_hour == 0.7
    mine.write_text("gpus:\n  MyGPU: {memory_gib: -1, peak_bf16_tflops: 100, usd_per_hour: 0.7, vram: 3}\n")
    with pytest.raises(ConfigError) as e:
        G.load_catalog([mine])
    assert "gpus.MyGPU.memory_gib: Input should be greater than 0, got -1" in str(e.value)
    assert "gpus.MyGPU.vram: Extra inputs are not permitted" in str(e.value)


def test_cost_formula():
    gpu = G.Gpu(memory_gib=80, peak_bf16_tflops=989.4, usd_per_hour=2.5)
    rates = G.Rates(disk_usd_per_gib_month=0.1, transfer_usd_per_gib=0.09)
    c = G.cost(10.0, gpu, rates, world_size=2, margin=0.2, checkpoint_gib=3.0, checkpoints_saved=4, keep_checkpoints=2)
    assert c["gpu_hours"] == 20.0 and c["compute_usd"] == 20 * 2.5 * 1.2
    assert c["disk_usd"] == round(3 * 3.0 * 0.1 * 10 / 730, 4) and c["transfer_usd"] == round(5 * 3.0 * 0.09, 4)
    assert c["total_usd"] == round(60 + 3 * 3.0 * 0.1 * 10 / 730 + 5 * 3.0 * 0.09, 4)


def _cli(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "flows.cli", "estimate", "configs/demo.yaml", "--json", *args],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_cli_demo_every_stage_component_and_gpu():
    r = _cli()
    assert list(r["stages"]) == list(TRAINED)
    cat = G.load_catalog()
    for name, s in r["stages"].items():
        assert s["model"]["params"] == 346752 and s["model"]["vocab_size"] == 400  # tokenizer stage's vocab_size
        assert set(s["memory"]["components"]) == {"weights", "gradients", "optimizer", "adapter", "activations",
                                                  "other_models", "buffers"}
        assert list(s["gpus"]) == list(cat.gpus)
        for g, row in s["gpus"].items():
            assert row["fits"] is True and row["suggestion"] is None, (name, g)
            # cost = hours x price x (1 + margin) + disk + transfer
            c = row["cost"]
            assert c["compute_usd"] == round(row["hours"] * cat.gpus[g].usd_per_hour * 1.2, 4)
            # the total is the unrounded sum, rounded: each part is rounded to 4 places on its own
            assert c["total_usd"] == pytest.approx(c["compute_usd"] + c["disk_usd"] + c["transfer_usd"], abs=2e-4)
    assert r["stages"]["sft"]["memory"]["components"]["weights"]["bytes"] == 346752 * 4  # dtype float32 default
    assert r["stages"]["dpo"]["memory"]["components"]["adapter"]["bytes"] > 0


def test_cli_7b_llama_needs_a_smaller_micro_batch_on_a_24gb_card():
    """A 7B-shaped Llama (config only): dpo with QLoRA, micro-batch 16 x accum 2 does not fit an RTX 4090; the
    largest micro-batch that does is 2, with accum 16 keeping the global batch of 32."""
    # the demo's sft starts from a fresh model of its own (not from pretrain), and reward/dpo/ppo from sft
    r = _cli("-o", f"stages.pretrain.base_model.config={LLAMA_7B}", "-o", f"stages.sft.base_model.config={LLAMA_7B}",
             "-o", "stages.dpo.method=qlora",
             "-o", "stages.dpo.dtype=bfloat16", "-o", "stages.dpo.max_length_tokens=512",
             "-o", "stages.dpo.grad_accumulation_steps=2", "--gpu", "RTX 4090")
    dpo = r["stages"]["dpo"]
    assert dpo["model"]["params"] == 6738415616
    row = dpo["gpus"]["RTX 4090"]
    assert row["fits"] is False and row["headroom_gib"] < 0
    s = row["suggestion"]
    assert (s["batch_size_per_device"], s["grad_accumulation_steps"], s["global_batch"]) == (2, 16, 32)
    assert s["total_gib"] <= 23.99
    full = r["stages"]["sft"]["gpus"]["RTX 4090"]["suggestion"]  # full fine-tuning of 7B in fp32: no micro-batch fits
    assert full["does_not_fit_at_micro_batch_1"] is True and full["batch_size_per_device"] is None
    assert full["alternatives_that_fit_at_micro_batch_1"] == ["method: qlora", "method: qlora + gradient_checkpointing"]
    pre = r["stages"]["pretrain"]["gpus"]["RTX 4090"]["suggestion"]  # pretrain cannot switch to LoRA
    assert pre["alternatives_that_fit_at_micro_batch_1"] == [] and "use a larger GPU" in pre["advice"]


def test_table_has_a_to_fit_column_only_where_a_gpu_does_not_fit(capsys):
    """The demo fits every GPU: no column of empty cells. A 7B dpo that does not fit an RTX 4090: the column, with
    the micro-batch that fits, and empty where it fits."""
    from flows.cli import main

    assert main(["estimate", str(REPO / "configs" / "demo.yaml")]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.lstrip().startswith("GPU ")]
    assert len(headers) == len(TRAINED) and all(h.rstrip().endswith("cost $") for h in headers), headers
    assert "suggestion" not in out and "to fit" not in out
    assert main(["estimate", str(REPO / "configs" / "demo.yaml"), "-o", f"stages.sft.base_model.config={LLAMA_7B}",
                 "-o", "stages.dpo.method=qlora", "-o", "stages.dpo.dtype=bfloat16", "-o",
                 "stages.dpo.max_length_tokens=512", "-o", "stages.dpo.grad_accumulation_steps=2",
                 "--gpu", "RTX 4090", "--gpu", "H200"]) == 0
    dpo = capsys.readouterr().out.split("\ndpo (dpo, qlora)")[1].split("\n\n")[0].splitlines()
    assert dpo[2].rstrip().endswith("cost $  to fit on this GPU")
    assert dpo[3].startswith("  RTX 4090    NO") and dpo[3].endswith(
        "batch_size_per_device 2 x grad_accumulation_steps 16 (" + dpo[3].rsplit("(", 1)[1])
    assert dpo[4].startswith("  H200        yes") and dpo[4].split()[-1].replace(".", "").isdigit()  # fits: no text


def test_hub_model_without_cached_config_names_the_field(capsys):
    from flows.cli import main

    rc = main(["estimate", str(REPO / "configs" / "demo.yaml"), "-o", "stages.pretrain.base_model={hub: nobody/none}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "stages.pretrain.base_model.hub: the config.json of 'nobody/none' is not in the local Hugging Face cache" in err
    assert "copy its contents into base_model.config" in err
