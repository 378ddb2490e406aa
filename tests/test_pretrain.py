"""pretrain stage: causal-LM training on packed text shards, streamed by rank and worker, resumable.

The same tiny Llama and on-the-fly tokenizer as tests/test_trainer.py. The text is learnable: documents of
arithmetic facts ("3 plus 4 equals 7."), so the held-out loss falls visibly within a few dozen steps. The
text split is cut into small shards (40 records each) so the stream has shards to split across readers.
The data stages run once per module; the from-scratch run (killed once, then resumed) is shared by the
tests that build on its artifact.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lmforge.config import parse_config
from lmforge.errors import ConfigError
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from tests.helpers import (SFT_FAST, TINY_LLAMA, artifact, chat_rows, fact_docs, pipeline_config, plan_of, run_config,
                           signal_after_first_checkpoint, write_jsonl)

LENGTH = 64
FAST = {"max_length_tokens": LENGTH, "batch_size_per_device": 8, "learning_rate": 3e-3, "warmup_steps": 2,
        "logging_steps": 1, "retries": 0}


def pipeline(root: Path, stages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return pipeline_config("pretrain", root, {"text": "text", "chat": "chat"}, {
        "ingest_text": {"kind": "ingest", "inputs": ["text"], "retries": 0},
        "shard_text": {"kind": "shard", "inputs": ["ingest_text"], "max_count": 40, "validation_fraction": 0.1,
                       "retries": 0},
        "ingest_chat": {"kind": "ingest", "inputs": ["chat"], "retries": 0},
        "shard_chat": {"kind": "shard", "inputs": ["ingest_chat"], "validation_fraction": 0.1, "retries": 0},
        "tokenizer": {"kind": "tokenizer", "inputs": ["shard_text", "shard_chat"], "vocab_size": 300,
                      "min_frequency": 1, "retries": 0},
        **stages,
    })


def make(root: Path, kinds, stages: dict[str, dict[str, Any]]):
    return plan_of(pipeline(root, stages), kinds, root)


def run_stages(root: Path, kinds, stages: dict[str, dict[str, Any]], names: list[str]):
    return run_config(pipeline(root, stages), kinds, root, names)


def pretrain(**over) -> dict[str, Any]:
    return {"kind": "pretrain", "inputs": ["shard_text", "tokenizer"], "base_model": {"config": TINY_LLAMA},
            **FAST, **over}


#: the from-scratch run: streamed, 2 DataLoader workers, checkpoints every 10 steps
SCRATCH = pretrain(max_steps=120, num_workers=2, checkpoint_every_steps=10, keep_checkpoints=2)


@pytest.fixture(scope="module")
def root(tmp_path_factory, kinds_module):
    root = tmp_path_factory.mktemp("pretrain")
    write_jsonl(root / "data" / "text.jsonl", fact_docs(400))
    write_jsonl(root / "data" / "chat.jsonl", chat_rows(200))
    run_stages(root, kinds_module, {}, ["ingest_text", "shard_text", "ingest_chat", "shard_chat", "tokenizer"])
    return root


def _tokenizer(plan):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(artifact(plan, "tokenizer").path)


# ----------------------------------------------------------------------------------------------
# the stream: every packed row exactly once across ranks and DataLoader workers (no training)


def _read_split(urls, tok, ranks: int, workers: int, **kw) -> dict[int, list[tuple[int, ...]]]:
    """{reader: its rows} for one pass, each rank through its own DataLoader with `workers` workers."""
    from torch.utils.data import DataLoader

    from trainer.stream import PackedTextStream

    by_reader: dict[int, list[tuple[int, ...]]] = {}
    for rank in range(ranks):
        s = PackedTextStream(urls, tok, LENGTH, where="test", endless=False, rank=rank, world_size=ranks, **kw)
        dl = DataLoader(s, batch_size=None, num_workers=workers)  # worker w yields item w, w + W, ... (in order)
        for i, row in enumerate(dl):
            by_reader.setdefault(rank * workers + i % workers, []).append(tuple(row["input_ids"]))
    return by_reader


def test_stream_gives_every_packed_row_once_across_2_ranks_x_2_workers(root, kinds_module):
    from lmforge.shards import shard_refs
    from trainer.stream import packed_rows

    plan = make(root, kinds_module, {})
    tok = _tokenizer(plan)
    urls = shard_refs(artifact(plan, "shard_text"), "train")
    assert len(urls) == 9  # 360 train records, 40 per shard
    every = [tuple(r) for r in packed_rows(urls, tok, LENGTH, where="test")]
    assert len(every) > 100 and all(len(r) == LENGTH for r in every)
    assert len(set(every)) > 0.95 * len(every)  # rows are distinct enough for the count to mean something
    eos = tok.eos_token_id
    assert sum(r.count(eos) for r in every) >= 300  # documents are separated by EOS

    # 9 shards >= 4 readers: each reader reads only its own shards, in a shuffled order, rows shuffled too
    by_reader = _read_split(urls, tok, ranks=2, workers=2, shuffle_buffer_rows=16, seed=3)
    assert sorted(by_reader) == [0, 1, 2, 3] and all(by_reader.values())
    assert Counter(r for rows in by_reader.values() for r in rows) == Counter(every)
    # 3 shards < 4 readers: every reader packs all three and keeps every 4th row; shares differ by one at most
    few = [tuple(r) for r in packed_rows(urls[:3], tok, LENGTH, where="test")]
    by_reader = _read_split(urls[:3], tok, ranks=2, workers=2)
    assert Counter(r for rows in by_reader.values() for r in rows) == Counter(few)
    sizes = sorted(len(v) for v in by_reader.values())
    assert sizes[-1] - sizes[0] <= 1 and sum(sizes) == len(few)
    assert by_reader[0] == few[0::4] and by_reader[3] == few[3::4]  # unshuffled: row j goes to reader j % 4


def test_stream_is_endless_deterministic_and_reshuffled_every_pass(root, kinds_module):
    import itertools

    from lmforge.shards import shard_refs
    from trainer.stream import PackedTextStream, packed_rows

    plan = make(root, kinds_module, {})
    tok = _tokenizer(plan)
    urls = shard_refs(artifact(plan, "shard_text"), "train")
    n = len(packed_rows(urls, tok, LENGTH, where="test"))
    stream = lambda: PackedTextStream(urls, tok, LENGTH, where="test", seed=1, shuffle_buffer_rows=32,
                                      rank=0, world_size=1)
    first = [tuple(r["input_ids"]) for r in itertools.islice(stream(), 2 * n + 5)]
    again = [tuple(r["input_ids"]) for r in itertools.islice(stream(), 2 * n + 5)]
    assert first == again  # the position alone says which row comes next
    pass0, pass1 = first[:n], first[n:2 * n]
    assert Counter(pass0) == Counter(pass1) and pass0 != pass1  # the same rows, another order
    assert first[2 * n:] == [tuple(r) for r in itertools.islice(stream().rows(2, 0, 1), 5)]  # pass 2 starts


@pytest.mark.s3
def test_stream_reads_shards_from_an_s3_store_in_dataloader_workers(s3, root, kinds_module, tmp_path):
    from lmforge.shards import shard_refs
    from trainer.stream import packed_rows

    write_jsonl(tmp_path / "data" / "text.jsonl", fact_docs(120, seed=5))
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(10))
    raw = pipeline(tmp_path, {})
    raw["store"] = "s3://lmforge-test/pretrain-stream"
    plan = make_plan(parse_config(raw, kinds_module, root=tmp_path), kinds_module)
    ctx = RunContext(plan=plan, kinds=kinds_module)
    for name in ("ingest_text", "shard_text"):
        execute_stage(ctx, name)
    urls = shard_refs(artifact(plan, "shard_text"), "train")
    assert len(urls) == 3 and all(u.url.startswith("s3://lmforge-test/pretrain-stream/shard/") for u in urls)
    tok = _tokenizer(make(root, kinds_module, {}))
    every = [tuple(r) for r in packed_rows(urls, tok, LENGTH, where="test")]
    by_reader = _read_split(urls, tok, ranks=1, workers=2, shuffle_buffer_rows=8)  # forked workers open s3://
    assert sorted(by_reader) == [0, 1] and len(every) > 20
    assert Counter(r for rows in by_reader.values() for r in rows) == Counter(every)


def test_a_reader_without_rows_is_an_error_not_an_endless_loop(root, kinds_module):
    from lmforge.errors import DataError
    from lmforge.shards import shard_refs
    from trainer.stream import PackedTextStream

    plan = make(root, kinds_module, {})
    urls = shard_refs(artifact(plan, "shard_text"), "validation")
    s = PackedTextStream(urls, _tokenizer(plan), 4096, where="stage p train split", rank=0, world_size=1)
    with pytest.raises(DataError) as e:
        next(iter(s))
    assert str(e.value) == ("stage p train split: reader 0 of 1 got no full row of 4096 tokens from 1 shard(s). add "
                            "text, lower max_length_tokens, or use fewer ranks or DataLoader workers (num_workers)")


# ----------------------------------------------------------------------------------------------
# from scratch: killed after a checkpoint, resumed at that step, then checked end to end


@pytest.fixture(scope="module")
def scratch(root, kinds_module):
    """The from-scratch run, SIGKILLed after its first uploaded checkpoint, then rerun: (plan, step killed at)."""
    killed_at, errors = signal_after_first_checkpoint(make(root, kinds_module, {"pt": SCRATCH}), kinds_module, "pt")
    from trainer.errors import TrainingError

    assert len(errors) == 1 and isinstance(errors[0], TrainingError), errors
    plan, out = run_stages(root, kinds_module, {"pt": SCRATCH}, ["pt"])
    assert out["pt"]["status"] == "ran"
    return plan, killed_at


def test_pretrain_from_scratch_resumes_at_the_checkpoint_step_and_learns(scratch):
    plan, killed_at = scratch
    art = artifact(plan, "pt")
    r = art.result
    assert art.manifest["output"] == {"type": "model", "data_kind": None}
    assert 10 <= killed_at < 120 and killed_at % 10 == 0
    assert (r["resumed_from_step"], r["steps"]) == (killed_at, 120)
    assert r["checkpoints_uploaded"] == list(range(killed_at + 10, 120, 10))  # only after the resume point
    # every step trained on 8 full rows of 64 tokens, the steps before the kill included
    assert r["tokens"] == 120 * 8 * LENGTH
    assert (r["from_scratch"], r["streaming"], r["train_shards"], r["train_rows"]) == (True, True, 9, None)
    # the 40 held-out documents (one shard) + EOS each, cut into rows of 64 tokens
    from lmforge.shards import iter_samples

    tok = _tokenizer(plan)
    held_out = list(iter_samples(artifact(plan, "shard_text"), "validation"))
    tokens = sum(len(tok(d["text"], add_special_tokens=False)["input_ids"]) + 1 for d in held_out)
    assert len(held_out) == 40 and r["validation_rows"] == tokens // LENGTH
    # the measurable improvement: held-out loss and perplexity of the random init vs the trained model
    before, after = r["validation_loss_before"], r["validation_loss_after"]
    assert before > math.log(288) - 0.5  # about uniform over the 288 tokens at the start
    assert after < before - 3.0, r
    assert r["validation_perplexity_after"] == pytest.approx(math.exp(after), rel=1e-4)
    assert r["validation_perplexity_before"] == pytest.approx(math.exp(before), rel=1e-4)
    assert r["train_loss_last"] < r["train_loss_first"] - 3.0  # the history spans both attempts
    assert r["tokens_per_s"] > 0 and r["peak_memory_mb"] > 100 and r["parameters"] > 50_000


def test_pretrain_artifact_is_a_full_model_that_reloads_and_generates(scratch):
    import torch
    from safetensors.torch import load_file

    from trainer import models

    plan, _ = scratch
    art = artifact(plan, "pt")
    assert {"config.json", "model.safetensors", "tokenizer.json", "lmforge_model.json"} <= set(art.files)
    assert "training_args.bin" not in art.files
    info = json.loads(Path(art.path, "lmforge_model.json").read_text())
    assert (info["format"], info["method"], info["trained_with"]) == ("full", "full", "pretrain")
    # every weight moved away from the seeded initialization
    tok = _tokenizer(plan)
    init = models.load_plain(models.Resolved("config", "base_model.config", "tiny", config=TINY_LLAMA), tok, seed=0)
    trained = load_file(f"{art.path}/model.safetensors")
    assert set(trained) <= set(init.state_dict())
    assert [k for k, v in trained.items() if torch.equal(v, init.state_dict()[k])] == []
    # reloads from the folder alone and continues a fact in the format it learned
    model, tok = models.load_trained(Path(art.path))
    prompt = tok("2 plus 3 equals 5. 4 plus 4 equals", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.lstrip()[:1].isdigit() and "." in text, text


def test_sft_on_the_pretrain_artifact(scratch, root, kinds_module):
    plan, _ = scratch
    stages = {"pt": SCRATCH,
              "sft": {"kind": "sft", "inputs": ["shard_chat", "pt"], "method": "lora", "max_steps": 4,
                      "lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}, "evaluate": False,
                      "control_prompts": [], **SFT_FAST}}
    plan, out = run_stages(root, kinds_module, stages, ["pt", "sft"])
    assert out["pt"]["status"] == "cached"
    pt, sft = artifact(plan, "pt"), artifact(plan, "sft")
    r = sft.result
    assert r["base_model"] == f"pretrain artifact {pt.id}" and r["steps"] == 4
    assert math.isfinite(r["train_loss_first"]) and r["train_loss_last"] < r["train_loss_first"]
    assert sft.manifest["inputs"][1]["artifact_id"] == pt.id


@pytest.mark.slow
def test_continued_pretraining_in_memory_for_an_epoch(scratch, root, kinds_module):
    """A model artifact as the start, the split packed in memory, one epoch: its starting validation loss is
    exactly the from-scratch run's final one (same weights, same held-out rows)."""
    plan, _ = scratch
    stages = {"pt": SCRATCH,
              "more": {"kind": "pretrain", "inputs": ["shard_text", "pt"], **FAST, "streaming": False, "epochs": 1,
                       "num_workers": 0, "learning_rate": 1e-3, "logging_steps": 5}}
    plan, _ = run_stages(root, kinds_module, stages, ["more"])
    pt, r = artifact(plan, "pt").result, artifact(plan, "more").result
    assert (r["from_scratch"], r["streaming"], r["base_model"]) == (False, False, f"pretrain artifact "
                                                                    f"{artifact(plan, 'pt').id}")
    assert r["train_rows"] > 100 and r["steps"] == math.ceil(r["train_rows"] / 8)
    assert r["tokens"] == r["train_rows"] * LENGTH
    assert r["validation_loss_before"] == pytest.approx(pt["validation_loss_after"], rel=1e-5)
    assert r["validation_loss_after"] < r["validation_loss_before"]


# ----------------------------------------------------------------------------------------------
# configs that cannot work: caught when the pipeline is parsed, naming the field


def test_bad_pretrain_configs_name_the_field(root, kinds_module):
    bad = {
        "on_chat": pretrain(inputs=["shard_chat", "tokenizer"], max_steps=5),
        "no_tokenizer": pretrain(inputs=["shard_text"], max_steps=5),
        "no_model": {**pretrain(max_steps=5), "base_model": None},
        "endless": pretrain(),
        "lora": pretrain(max_steps=5, lora={"rank": 4}),
        "capped": pretrain(max_steps=5, max_train_records=10),
        "method": pretrain(max_steps=5, method="lora"),
    }
    with pytest.raises(ConfigError) as e:
        parse_config(pipeline(root, bad), kinds_module, root=root)
    assert sorted(e.value.problems) == sorted([
        "stages.on_chat.inputs: pretrain reads exactly one text shards input (got chat shards); chat shards go to sft, "
        "preference shards to reward or dpo",
        "stages.no_tokenizer.inputs: a base_model built from config has no tokenizer; add a tokenizer stage to inputs",
        "stages.no_model.inputs: pretrain needs a model: set base_model (config to start from scratch, or path, "
        "package+file or hub) or add a model stage to inputs to continue it",
        "stages.endless.streaming: value error, streaming reads the shards as an endless stream of unknown length: "
        "set max_steps, or streaming: false to train for epochs over the split packed in memory, got True",
        "stages.lora.lora: value error, pretrain trains every weight (method full); remove lora, got {'rank': 4}",
        "stages.capped.streaming: value error, max_train_records applies to streaming: false only; with streaming, "
        "max_steps bounds the data read, got True",
        "stages.method.method: must be one of 'full', got 'lora'",
    ])


def test_sequence_length_beyond_the_model_limit(root, kinds_module):
    with pytest.raises(ConfigError) as e:
        run_stages(root, kinds_module, {"long": pretrain(max_steps=5, max_length_tokens=256)}, ["long"])
    assert str(e.value) == ("1 problem in the pipeline config:\n  - stages.long.max_length_tokens: 256 is beyond the "
                            "model's max_position_embeddings 128 (a new llama model from base_model.config); set "
                            "max_length_tokens to 128 or less")


def test_prefetch_and_pinning_stay_out_of_the_id_but_workers_do_not(root, kinds_module):
    ids = {}
    for name, over in {"a": {}, "b": {"prefetch_factor": 8, "pin_memory": False, "checkpoint_every_steps": 7},
                       "c": {"num_workers": 2}}.items():
        ids[name] = make(root, kinds_module, {"p": pretrain(max_steps=5, **over)}).stages["p"].artifact_id
    assert ids["a"] == ids["b"] != ids["c"]


# ----------------------------------------------------------------------------------------------
# slow: exact resume of the stream, and DDP with 2 ranks x 2 workers


@pytest.mark.slow  # the default suite proves streamed resume with tests/test_tokenize.py's sft stream
def test_streamed_resume_ends_with_the_same_weights_as_an_uninterrupted_run(root, kinds_module, tmp_path):
    """60 steps of 8 rows run through the 9 shards more than twice: the resumed run skips exactly the batches
    each worker gave before the kill, across passes, and ends bit for bit where an uninterrupted run ends."""
    import torch
    from safetensors.torch import load_file

    stage = pretrain(max_steps=60, num_workers=2, checkpoint_every_steps=5, shuffle_buffer_rows=50, seed=1,
                     evaluate=False, control_prompts=[])
    killed_at, _ = signal_after_first_checkpoint(make(root, kinds_module, {"again": stage}), kinds_module, "again")
    plan, _ = run_stages(root, kinds_module, {"again": stage}, ["again"])
    resumed = artifact(plan, "again")
    assert resumed.result["resumed_from_step"] == killed_at > 0
    write_jsonl(tmp_path / "data" / "text.jsonl", fact_docs(400))  # a second store, same data
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(200))
    plan2, _ = run_stages(tmp_path, kinds_module, {"again": {**stage, "checkpoint_every_steps": None}},
                          ["ingest_text", "shard_text", "ingest_chat", "shard_chat", "tokenizer", "again"])
    straight = artifact(plan2, "again")
    assert straight.id == resumed.id and straight.result["resumed_from_step"] == 0
    a, b = load_file(f"{resumed.path}/model.safetensors"), load_file(f"{straight.path}/model.safetensors")
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.slow
def test_ddp_with_2_ranks_x_2_workers_streams_and_scores_exactly(scratch, root, kinds_module):
    single = artifact(scratch[0], "pt").result
    stage = pretrain(max_steps=20, launcher="torchrun", nproc_per_node=2, batch_size_per_device=4, num_workers=2,
                     checkpoint_every_steps=10, control_prompts=[])
    plan, _ = run_stages(root, kinds_module, {"ddp": stage}, ["ddp"])
    r = artifact(plan, "ddp").result
    assert (r["steps"], r["checkpoints_uploaded"]) == (20, [10])
    assert r["tokens"] == 20 * 2 * 4 * LENGTH  # both ranks' rows, all full
    # the same seeded init scored on the same rows: the DDP number equals the single-process one
    assert r["validation_loss_before"] == pytest.approx(single["validation_loss_before"], rel=1e-6)
    assert r["validation_loss_after"] < r["validation_loss_before"] - 1.5, r
