"""Tokenize once, stream always (issue 13 §4): the `tokenize` stage's token shards, reused by every sft that shares
them, streamed by the training process with bounded memory and exact resume.

Tiny models as in tests/test_trainer.py: a 2-layer Llama from a config and a tokenizer trained on the test's data.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmforge.config import parse_config
from lmforge.errors import ConfigError
from lmforge.store import ArtifactStore
from tests.helpers import (IDENTICAL, LONG, REPO, SFT_FAST, TINY_LLAMA, align_pipeline, align_store, artifact,
                           assert_pair_counts, chat_rows, chat_store, dpo, plan_of, preference_rows, reward, run_align,
                           run_stages, signal_after_first_checkpoint, train_pipeline, write_jsonl)

TOK = {"kind": "tokenize", "inputs": ["shard", "tokenizer"], "retries": 0}


def sft(**over) -> dict[str, Any]:
    return {"kind": "sft", "inputs": ["tokens", "tokenizer"], "base_model": {"config": TINY_LLAMA}, **SFT_FAST,
            "evaluate": True, "control_prompts": [], **over}


@pytest.fixture(scope="module")
def root(tmp_path_factory, kinds_module):
    return chat_store(tmp_path_factory.mktemp("tokenize"), kinds_module, chat_rows(200))


def test_token_rows_are_what_trl_prepares(root, kinds_module):
    """The tokenize stage's rows equal SFTTrainer's own prepared train_dataset (ids and labels), row for row."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from lmforge.shards import iter_samples

    plan, _ = run_stages(root, kinds_module, {"tokens": TOK, "sft": sft()}, ["tokens"])
    tokens = artifact(plan, "tokens")
    assert tokens.result["data_kind"] == "sft_tokens" and tokens.result["max_length_tokens"] == 64  # from the sft
    ours = [(r["input_ids"], r["labels"]) for r in iter_samples(tokens, "train")]
    tok = AutoTokenizer.from_pretrained(artifact(plan, "tokenizer").path)
    tok.chat_template = (Path(tokens.path) / "chat_template.jinja").read_text()
    import datasets
    chats = datasets.Dataset.from_list([{"messages": r["messages"]} for r in iter_samples(artifact(plan, "shard"))])
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"},
                                         vocab_size=len(tok)))
    trl = SFTTrainer(model=model, processing_class=tok, train_dataset=chats,
                     args=SFTConfig(output_dir=str(root / "trl"), max_length=64, assistant_only_loss=True,
                                    use_cpu=True, report_to=[], shuffle_dataset=False))
    theirs = [(r["input_ids"], r["labels"]) for r in trl.train_dataset]
    assert len(ours) == len(theirs) == tokens.result["train_rows"] > 100
    assert ours == theirs
    assert any(-100 in lab for _, lab in ours) and all(any(x != -100 for x in lab) for _, lab in ours)


@pytest.mark.slow  # two full pipelines; token-shard reuse is the plain cache of a stage id that settings of sft do not reach
def test_two_lmforge_runs_with_other_learning_rates_reuse_the_token_shards(root, kinds_module):
    """`lmforge run`, then the same command with another learning rate (-o): the second run reports the tokenize
    stage cached (its id depends on the data, tokenizer and row settings, not on the learning rate) and trains a new
    sft that streams the same token shards (its result names them)."""
    stages = {"tokens": TOK, "sft": sft(learning_rate=3e-3, max_steps=6, max_length_tokens=48)}  # 48: its own rows
    cfg = root / "reuse.yaml"
    cfg.write_text(yaml.safe_dump(train_pipeline(root, stages), sort_keys=False))
    summaries = []
    for i, extra in enumerate(([], ["-o", "stages.sft.learning_rate=0.001"])):
        out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(cfg), *extra, "--json",
                              str(root / f"reuse{i}.json")], cwd=root, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        summaries.append(json.loads((root / f"reuse{i}.json").read_text())["stages"])
    first, second = summaries
    assert (first["tokens"]["status"], first["sft"]["status"]) == ("ran", "ran")
    assert (second["tokens"]["status"], second["sft"]["status"]) == ("cached", "ran")  # not tokenized again
    made = second["tokens"]["artifact_id"]
    assert first["tokens"]["artifact_id"] == made and first["sft"]["artifact_id"] != second["sft"]["artifact_id"]
    store = ArtifactStore(str(root / "artifacts"))
    rows = store.require("tokenize", made).result["train_rows"]
    for s in summaries:
        r = store.require("sft", s["sft"]["artifact_id"]).result
        assert r["token_shards"] == f"tokenize/{made}"
        assert r["steps"] == 6 and r["train_rows"] == rows
        assert r["eval_loss"] is not None and r["train_loss_last"] < r["train_loss_first"]
        assert r["padding_fraction"] is not None


def test_streamed_epochs_become_steps(root, kinds_module):
    """Two epochs of the streamed split: ceil(rows / batch) x 2 optimizer steps, as the Trainer counts a map-style
    epoch; the length-grouped stream pads far less than the rows would in a random order."""
    plan, _ = run_stages(root, kinds_module, {"tokens": TOK, "sft_ep": sft(epochs=2, batch_size_per_device=16)},
                  ["tokens", "sft_ep"])
    rows = artifact(plan, "tokens").result["train_rows"]
    r = artifact(plan, "sft_ep").result
    assert r["steps"] == 2 * -(-rows // 16)
    assert 1.9 < r["epochs"] < 2.2


# padding_free is slow (three training processes more); its in-process exactness tests are tests/test_packing.py's
@pytest.mark.parametrize("packing", [False, pytest.param("padding_free", marks=pytest.mark.slow)],
                         ids=["padded", "padding_free"])
def test_resumed_streamed_run_ends_with_the_same_weights(root, kinds_module, tmp_path, packing):
    """SIGKILL after a checkpoint, rerun: the stream skips what the checkpoint consumed and the weights equal an
    uninterrupted run's, bit for bit (also with padding-free packing, which trains on no padding at all)."""
    import torch
    from safetensors.torch import load_file

    stage = sft(method="full", max_steps=40, checkpoint_every_steps=2, evaluate=False, seed=1,
                **({"packing": packing} if packing else {}))
    stages = {"tokens": TOK, "resume": stage}
    run_stages(root, kinds_module, stages, ["tokens"])
    plan = plan_of(train_pipeline(root, stages), kinds_module, root)
    killed_at, _ = signal_after_first_checkpoint(plan, kinds_module, "resume")
    plan, _ = run_stages(root, kinds_module, stages, ["resume"])
    resumed = artifact(plan, "resume")
    assert resumed.result["resumed_from_step"] == killed_at > 0
    if packing:
        assert resumed.result["padding_fraction"] == 0.0
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(200))  # a second store, same data
    plan2, _ = run_stages(tmp_path, kinds_module, {"tokens": TOK, "resume": {**stage, "checkpoint_every_steps": None}},
                          ["ingest", "shard", "tokenizer", "tokens", "resume"])
    straight = artifact(plan2, "resume")
    assert straight.id == resumed.id and straight.result["resumed_from_step"] == 0
    a, b = load_file(f"{resumed.path}/model.safetensors"), load_file(f"{straight.path}/model.safetensors")
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_row_settings_must_agree_with_the_reader(root, kinds_module):
    bad = {"tokens": {**TOK, "max_length_tokens": 32}, "sft": sft()}
    with pytest.raises(ConfigError) as e:
        parse_config(train_pipeline(root, bad), kinds_module, root=root)
    assert "stages.tokens.max_length_tokens: 32 differs from stages.sft.max_length_tokens (64)" in str(e.value)
    two = {"tokens": TOK, "a": sft(), "b": sft(max_length_tokens=48)}
    with pytest.raises(ConfigError) as e:
        parse_config(train_pipeline(root, two), kinds_module, root=root)
    assert "stages.tokens.max_length_tokens: stages a and b read these token shards" in str(e.value)
    other_inputs = {"tokens": {**TOK, "inputs": ["shard"], "base_model": {"config": TINY_LLAMA}}, "sft": sft()}
    with pytest.raises(ConfigError) as e:
        parse_config(train_pipeline(root, other_inputs), kinds_module, root=root)
    assert "stages.tokens.inputs: the tokenizer/model inputs [] differ from stage sft's" in str(e.value)


def long_chat_rows(n: int) -> list[dict[str, Any]]:
    """Conversations of ~100 tokens: numbers spelt out, so the rows fill most of max_length_tokens."""
    words = "zero one two three four five six seven eight nine".split()
    rows = []
    for i in range(n):
        q = " ".join(words[(i * k) % 10] for k in range(1, 12))
        a = " ".join(words[(i + k * k) % 10] for k in range(90))
        rows.append({"messages": [{"role": "user", "content": f"Spell {i}: {q}"},
                                  {"role": "assistant", "content": a}]})
    return rows


MEMORY_CAP_MB = 32  # what the training process may grow by when the data grows; the large set is well above it


@pytest.mark.slow  # a memory bound, not a behaviour the other stream tests miss; runs in make test-all
def test_a_data_set_larger_than_the_memory_cap_trains_with_bounded_rss(root, kinds_module, tmp_path, monkeypatch):
    """The same streamed sft on 180 and on 27,000 rows of ~128 tokens (whose ids and labels alone take more than
    1.5x MEMORY_CAP_MB as Python lists, as a map-style data set held them): the training process's peak RSS grows
    by less than MEMORY_CAP_MB, since it holds one token shard and one shuffle buffer, never the data set.
    Measured: 670 MB vs 676 MB."""
    # glibc keeps freed blocks of the (threaded) training process in its arenas, so its peak RSS wanders by tens of
    # MB from run to run; with the mmap threshold pinned (as the preflight does) RSS follows what is live
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    stage = sft(max_length_tokens=128, max_steps=8, evaluate=False, checkpoint_every_steps=None)
    stages = {"tokens": {**TOK, "rows_per_shard": 2000}, "s": stage}
    names = ["ingest", "shard", "tokenizer", "tokens", "s"]
    write_jsonl(tmp_path / "small" / "data" / "chat.jsonl", long_chat_rows(200))
    small_plan, _ = run_stages(tmp_path / "small", kinds_module, stages, names)
    small = artifact(small_plan, "s").result

    write_jsonl(tmp_path / "big" / "data" / "chat.jsonl", long_chat_rows(30_000))
    big_plan, _ = run_stages(tmp_path / "big", kinds_module, stages, names)
    tokens = artifact(big_plan, "tokens").result
    big = artifact(big_plan, "s").result
    n, toks = tokens["train_rows"], tokens["tokens"]["train"]
    in_memory_mb = (2 * (n * 56 + 8 * toks)) / 2**20  # two int lists per row (list header + pointers)
    assert n > 25_000 and tokens["num_shards"]["train"] > 12
    assert in_memory_mb > 1.5 * MEMORY_CAP_MB, in_memory_mb
    assert big["train_rows"] == n and big["steps"] == 8
    assert big["token_shards"] == f"tokenize/{artifact(big_plan, 'tokens').id}"
    grew = big["peak_memory_mb"] - small["peak_memory_mb"]
    print(f"peak RSS {small['peak_memory_mb']} MB (180 rows) vs {big['peak_memory_mb']} MB ({n} rows, "
          f"{toks} tokens, {in_memory_mb:.0f} MB as lists)")
    assert grew < MEMORY_CAP_MB, (small["peak_memory_mb"], big["peak_memory_mb"], in_memory_mb)


def test_a_damaged_token_shard_stops_the_training_and_names_the_file(root, kinds_module):
    """A byte flipped in a token shard after it was published: the sft that streams it fails before training on
    it, naming the tokenize artifact, the file and the stage to rerun; nothing is published."""
    from trainer.errors import TrainingError
    from lmforge.errors import ArtifactError

    stages = {"tokens": TOK, "sft_dmg": sft(max_steps=4, learning_rate=7e-3, evaluate=False)}
    plan, _ = run_stages(root, kinds_module, stages, ["tokens"])
    made = artifact(plan, "tokens")
    shard = Path(made.path) / "train-000000.tar"
    good = shard.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x01
    shard.write_bytes(bytes(bad))
    try:
        with pytest.raises((TrainingError, ArtifactError)) as e:
            run_stages(root, kinds_module, stages, ["sft_dmg"])
    finally:
        shard.write_bytes(good)
    msg = str(e.value)
    assert f"artifact tokenize/{made.id}, file train-000000.tar: content does not match its manifest" in msg
    assert "rerun stage 'tokens' with --force" in msg
    assert plan.store.get("sft", plan.stages["sft_dmg"].artifact_id) is None


def test_a_preflight_tries_an_sft_that_streams_token_shards(root, kinds_module):
    """preflight takes its training stage's inputs: the token shards, whose row settings follow that stage."""
    stages = {"tokens": TOK, "sft_pf": sft(max_steps=20), "pf": {"kind": "preflight", "stage": "sft_pf",
                                                                 "steps": 3, "retries": 0}}
    plan, out = run_stages(root, kinds_module, stages, ["tokens", "pf"])
    r = artifact(plan, "pf").result
    assert plan.stages["pf"].inputs == ["tokens", "tokenizer"] and r["reload_ok"] and r["steps"] == 3


# ----------------------------------------------------------------------------------------------
# dpo and reward rows (tests/helpers.py preference_rows: 120 good pairs, 6 identical, 5 too long)


@pytest.fixture(scope="module")
def align_root(tmp_path_factory, kinds_module):
    return align_store(tmp_path_factory.mktemp("tokenize-align"), kinds_module, chat_rows(200), preference_rows())


PAIR_TOK = {"kind": "tokenize", "inputs": ["shard_pairs", "sft"], "retries": 0}


def test_preference_rows_are_what_dpo_and_reward_trainers_prepare(align_root, kinds_module):
    """dpo rows (prompt, chosen, rejected ids) and reward rows (chosen, rejected ids) equal DPOTrainer's and
    RewardTrainer's own prepared datasets on the same pairs, and the skip/drop counts are the trainers' own."""
    import datasets
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    from lmforge.shards import iter_samples
    from trainer.preference import pair_example

    stages = {"dtok": PAIR_TOK, "rtok": PAIR_TOK, "d": {**dpo(), "inputs": ["dtok", "sft"]},
              "r": {**reward(), "inputs": ["rtok", "sft"]}}
    plan, _ = run_align(align_root, kinds_module, stages, ["dtok", "rtok"])
    dtok, rtok = artifact(plan, "dtok"), artifact(plan, "rtok")
    assert (dtok.result["rows"], rtok.result["rows"]) == ("dpo", "reward")  # from the reading stages
    assert dtok.id != rtok.id
    for a in (dtok, rtok):
        assert sum(a.result["skipped_identical"].values()) == IDENTICAL
        assert sum(a.result["dropped_no_label"].values()) == LONG

    tok = AutoTokenizer.from_pretrained(artifact(plan, "sft").path)
    pairs = [pair_example(r, bool(tok.chat_template), "test") for r in iter_samples(artifact(plan, "shard_pairs"))]
    pairs = datasets.Dataset.from_list([p for p in pairs if p is not None])
    cfg = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    common = dict(use_cpu=True, report_to=[], max_length=64)
    policy = LlamaForCausalLM(LlamaConfig(**cfg, vocab_size=len(tok)))
    d = DPOTrainer(model=policy, ref_model=copy.deepcopy(policy), processing_class=tok, train_dataset=pairs,
                   args=DPOConfig(output_dir="/tmp/lmforge-test-dpo", **common))
    fields = ("prompt_ids", "chosen_ids", "rejected_ids")
    assert [[r[f] for f in fields] for r in iter_samples(dtok)] == [[r[f] for f in fields] for r in d.train_dataset]
    m = LlamaForSequenceClassification(LlamaConfig(**cfg, vocab_size=len(tok), num_labels=1,
                                                   pad_token_id=tok.pad_token_id))
    r = RewardTrainer(model=m, processing_class=tok, train_dataset=pairs,
                      args=RewardConfig(output_dir="/tmp/lmforge-test-reward", **common))
    fields = ("chosen_ids", "rejected_ids")
    assert [[x[f] for f in fields] for x in iter_samples(rtok)] == [[x[f] for f in fields] for x in r.train_dataset]


def test_dpo_and_reward_stream_token_rows(align_root, kinds_module):
    """dpo and reward on a tokenize stage's rows: trained from the stream, with the exact counts of the
    in-memory path (tests/helpers.py assert_pair_counts), held-out accuracy, and the token artifact named."""
    stages = {"dtok": PAIR_TOK, "rtok": PAIR_TOK, "d": {**dpo(max_steps=6), "inputs": ["dtok", "sft"]},
              "r": {**reward(max_steps=6), "inputs": ["rtok", "sft"]}}
    plan, _ = run_align(align_root, kinds_module, stages, ["dtok", "rtok", "d", "r"])
    for name, tok, dropped in (("d", "dtok", "dropped_prompt_too_long"), ("r", "rtok", "dropped_too_long")):
        res = artifact(plan, name).result
        assert_pair_counts(res, dropped)
        assert res["token_shards"] == f"tokenize/{artifact(plan, tok).id}"
        assert res["steps"] == 6 and res["eval_reward_accuracy"] is not None
        assert res["padding_fraction"] is not None
    with pytest.raises(ConfigError) as e:  # one token artifact cannot serve two training kinds
        parse_config(align_pipeline(align_root, {"tok": PAIR_TOK, "d": {**dpo(), "inputs": ["tok", "sft"]},
                                                 "r": {**reward(), "inputs": ["tok", "sft"]}}),
                     kinds_module, root=align_root)
    assert "stages.tok.rows: stages of kinds dpo, reward read these token shards" in str(e.value)
