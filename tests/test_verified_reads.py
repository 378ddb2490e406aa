"""Every read is verified (issue 10, section 4): flip one byte in an artifact of each kind that a later stage
reads, run that stage, and it fails before it uses the bytes, with an error naming the artifact and the file and
saying what to do; nothing is published. A raw file changed between plan and ingest fails ingest the same way,
and a plan hashes each raw file once per run.

One store per module (chat and text data, their shards, a tokenizer: seconds). Each test changes one byte and
puts it back. The flips keep the files well-formed where they can (a letter's case inside a JSON record), so
only the manifest's sha256 can tell. Two tests start a training process, which fails at its first read of the
damaged input, before any model loads; the rest fail in the stage's own process.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from lmforge.config import parse_config
from lmforge.errors import ArtifactError, DataError
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from tests.helpers import SFT_FAST, TINY_LLAMA, artifact, chat_rows, fact_docs, pipeline_config, write_jsonl

LENGTH = 64
SFT = {"kind": "sft", "inputs": ["shard", "tokenizer"], "base_model": {"config": TINY_LLAMA}, **SFT_FAST,
       "max_steps": 2}
STAGES: dict[str, dict[str, Any]] = {
    "ingest": {"kind": "ingest", "inputs": ["chat"], "retries": 0},
    "shard": {"kind": "shard", "inputs": ["ingest"], "validation_fraction": 0.1, "retries": 0},
    "ingest_text": {"kind": "ingest", "inputs": ["text"], "retries": 0},
    "shard_text": {"kind": "shard", "inputs": ["ingest_text"], "max_count": 40, "validation_fraction": 0.1,
                   "retries": 0},
    "tokenizer": {"kind": "tokenizer", "inputs": ["shard_text", "shard"], "vocab_size": 300, "min_frequency": 1,
                  "retries": 0},
    "sft": SFT,
    "sft_resume": {**SFT, "max_steps": 3},  # another id: its own checkpoint folder
    "base": {**SFT, "max_steps": 4},  # a model artifact that the tests publish themselves (a stand-in)
    "sft_on_base": {"kind": "sft", "inputs": ["shard", "base"], **SFT_FAST, "max_steps": 2},
    "pretrain": {"kind": "pretrain", "inputs": ["shard_text", "tokenizer"], "base_model": {"config": TINY_LLAMA},
                 **SFT_FAST, "max_steps": 2, "shuffle_buffer_rows": 0, "evaluate": False},  # streamed, in order
}
DATA = ["ingest", "shard", "ingest_text", "shard_text", "tokenizer"]


def pipeline(root: Path) -> dict[str, Any]:
    return pipeline_config("verified", root, {"chat": "chat", "text": "text"}, STAGES)


def plan_of(root: Path, kinds, force: list[str] | None = None):
    return make_plan(parse_config(pipeline(root), kinds, root=root), kinds, force)


@contextlib.contextmanager
def flipped(path: Path, needle: bytes | None = None) -> Iterator[int]:
    """One byte of `path` changed, put back afterwards: the first of `needle` (a letter: its case swaps, so a JSON
    record stays valid JSON) or else the middle byte. Yields its offset."""
    data = path.read_bytes()
    i = data.index(needle) if needle else len(data) // 2
    changed = bytearray(data)
    changed[i] ^= 0x20 if chr(data[i]).isalpha() else 0x01
    path.write_bytes(bytes(changed))
    try:
        yield i
    finally:
        path.write_bytes(data)


def damaged(art, rel: str) -> str:
    """The start of the error every reader gives for a damaged file of an artifact."""
    return f"artifact {art.kind}/{art.id}, file {rel}: content does not match its manifest (read "


def fix(stage: str) -> str:
    return f"rerun stage '{stage}' with --force (`lmforge run <config> --force {stage}`)."


@pytest.fixture(scope="module")
def root(tmp_path_factory, kinds_module):
    root = tmp_path_factory.mktemp("verified")
    write_jsonl(root / "data" / "chat.jsonl", chat_rows(200))
    write_jsonl(root / "data" / "text.jsonl", fact_docs(160))
    plan = plan_of(root, kinds_module)
    ctx = RunContext(plan=plan, kinds=kinds_module)
    for name in DATA:
        execute_stage(ctx, name)
    return root


@pytest.fixture(scope="module")
def base(root, kinds_module, tmp_path_factory):
    """A stand-in for a trained model artifact at stage `base`'s id: a config, weights (bytes nothing loads in
    these tests) and the tokenizer, published as a training stage leaves them."""
    plan = plan_of(root, kinds_module)
    sp = plan.stages["base"]
    staged = tmp_path_factory.mktemp("base")
    (staged / "config.json").write_text(json.dumps({**TINY_LLAMA, "vocab_size": 300}))
    (staged / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    tok = artifact(plan, "tokenizer")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tok.path) / f, staged / f)
    return plan.store.publish(sp.kind, sp.artifact_id, staged, {
        "kind": sp.kind, "output": {"type": "model", "data_kind": None}, "result": {},
        "produced_by": {"pipeline": "verified", "stage": "base"}})


def no_training_process(caplog) -> bool:
    return not any("training in a child process" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------------------------
# training stages


def test_sft_refuses_a_chat_shard_with_a_flipped_byte_and_publishes_nothing(root, kinds_module):
    from trainer.errors import TrainingError

    plan = plan_of(root, kinds_module, force=["sft"])
    shard = artifact(plan, "shard")
    with flipped(Path(shard.path) / "train-000000.tar", b"plus"):  # a letter inside a record: the tar still reads
        with pytest.raises(TrainingError) as e:
            execute_stage(RunContext(plan=plan, kinds=kinds_module), "sft")
    msg = str(e.value)
    assert f"ArtifactError: {damaged(shard, 'train-000000.tar')}" in msg and fix("shard") in msg
    sp = plan.stages["sft"]
    assert plan.store.get(sp.kind, sp.artifact_id) is None  # nothing published
    assert not Path(plan.store.checkpoint_path(sp.kind, sp.artifact_id)).exists()  # not one step trained
    assert "conversations from" not in msg  # no record was used: the child failed reading the first shard


def test_a_training_stage_refuses_a_damaged_tokenizer(root, kinds_module):
    from trainer.errors import TrainingError

    plan = plan_of(root, kinds_module)
    tok = artifact(plan, "tokenizer")
    with flipped(Path(tok.path) / "tokenizer.json"):
        with pytest.raises(TrainingError) as e:
            execute_stage(RunContext(plan=plan, kinds=kinds_module), "sft")
    msg = str(e.value)
    assert f"ArtifactError: {damaged(tok, 'tokenizer.json')}" in msg and fix("tokenizer") in msg
    assert plan.store.get("sft", plan.stages["sft"].artifact_id) is None


def test_a_training_stage_refuses_a_damaged_model_input_before_any_process_starts(root, kinds_module, base, caplog):
    plan = plan_of(root, kinds_module)
    with caplog.at_level(logging.INFO), flipped(Path(base.path) / "config.json", b"llama"):
        with pytest.raises(ArtifactError) as e:
            execute_stage(RunContext(plan=plan, kinds=kinds_module), "sft_on_base")
    assert str(e.value).startswith(damaged(base, "config.json")) and str(e.value).endswith(fix("base"))
    assert no_training_process(caplog)  # the parent's config check read config.json, and verified it first
    assert plan.store.get("sft", plan.stages["sft_on_base"].artifact_id) is None


def test_resume_refuses_a_checkpoint_with_a_flipped_byte_or_without_digests(root, kinds_module, tmp_path, caplog):
    """A crashed run left checkpoint-3 in the store; one byte of it changed since. The rerun fails before the
    training process starts, naming the checkpoint file; so does a DONE that lists no sha256 to check."""
    from trainer import checkpoint

    plan = plan_of(root, kinds_module)
    sp = plan.stages["sft_resume"]
    uri = plan.store.checkpoint_uri(sp.kind, sp.artifact_id)
    local = tmp_path / "checkpoint-3"
    local.mkdir()
    (local / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    (local / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    checkpoint.upload(local, uri, 3)
    stored = Path(uri) / "checkpoint-3"
    try:
        with caplog.at_level(logging.INFO), flipped(stored / "model.safetensors"):
            with pytest.raises(ArtifactError) as e:
                execute_stage(RunContext(plan=plan, kinds=kinds_module), "sft_resume")
        msg = str(e.value)
        assert msg.startswith(f"{uri}/checkpoint-3/model.safetensors: does not match its DONE listing (read 4096 "
                              "bytes, sha256 ")
        assert f"delete {uri}/checkpoint-3 to resume from the complete checkpoint before it" in msg
        assert no_training_process(caplog)

        (stored / "DONE").write_text(json.dumps({"step": 3}))  # a DONE without the file list
        with pytest.raises(ArtifactError) as e:
            execute_stage(RunContext(plan=plan, kinds=kinds_module), "sft_resume")
        assert str(e.value).startswith(f"{uri}/checkpoint-3: its DONE marker lists no files with sizes and sha256, "
                                       "so the checkpoint cannot be verified before resuming from it; delete ")
        assert plan.store.get(sp.kind, sp.artifact_id) is None
    finally:
        shutil.rmtree(uri)


def test_pretrain_stream_verifies_each_shard_before_its_first_row(root, kinds_module):
    """Streaming reads shard after shard; a damaged second shard fails the stream after the first shard's rows
    and before any row of its own, also in a DataLoader worker."""
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from lmforge.shards import shard_refs
    from trainer.stream import PackedTextStream, packed_rows

    plan = plan_of(root, kinds_module)
    text = artifact(plan, "shard_text")
    tok = AutoTokenizer.from_pretrained(artifact(plan, "tokenizer").path)
    refs = shard_refs(text, "train")
    assert len(refs) == 4  # 144 train documents, 40 per shard
    first = packed_rows(refs[:1], tok, LENGTH, where="test")
    assert len(first) > 5
    with flipped(Path(text.path) / "train-000001.tar", b"plus"):
        stream = PackedTextStream(refs, tok, LENGTH, where="stage p train split", endless=False, rank=0,
                                  world_size=1)
        rows = []
        with pytest.raises(ArtifactError) as e:
            for row in stream:
                rows.append(row["input_ids"])
        assert rows == first  # shard 0's rows, then the error: not one row of shard 1
        assert str(e.value).startswith(damaged(text, "train-000001.tar")) and str(e.value).endswith(fix("shard_text"))
        with pytest.raises(ArtifactError, match=r"file train-000001\.tar: content does not match its manifest"):
            list(DataLoader(stream, batch_size=None, num_workers=1))


def test_pretrain_stage_fails_on_a_damaged_shard_and_publishes_nothing(root, kinds_module):
    """The same, read by the Trainer's DataLoader in the training process: the stage fails, nothing is published."""
    from trainer.errors import TrainingError

    plan = plan_of(root, kinds_module)
    text = artifact(plan, "shard_text")
    with flipped(Path(text.path) / "train-000000.tar", b"plus"):
        with pytest.raises(TrainingError) as e:
            execute_stage(RunContext(plan=plan, kinds=kinds_module), "pretrain")
    msg = str(e.value)
    assert f"ArtifactError: {damaged(text, 'train-000000.tar')}" in msg and fix("shard_text") in msg
    sp = plan.stages["pretrain"]
    assert plan.store.get(sp.kind, sp.artifact_id) is None


# ----------------------------------------------------------------------------------------------
# data stages and eval


def test_shard_stage_refuses_a_records_part_with_a_flipped_byte(root, kinds_module, tmp_path):
    from lmforge.records import iter_records
    from tasks import shard as shard_stage

    plan = plan_of(root, kinds_module)
    ingest = artifact(plan, "ingest")
    out = tmp_path / "out"
    out.mkdir()
    with flipped(Path(ingest.path) / "records" / "part-00000.jsonl", b"plus"):
        records = iter_records(ingest)
        with pytest.raises(ArtifactError) as e:
            next(records)  # before the first record
        assert str(e.value).startswith(damaged(ingest, "records/part-00000.jsonl"))
        assert str(e.value).endswith(fix("ingest"))
        with pytest.raises(ArtifactError, match=r"artifact ingest/\w+, file records/part-00000\.jsonl: content"):
            shard_stage.run(plan.cfg.stages["shard"], [ingest], out)
    assert list(out.iterdir()) == []  # not one shard written


@pytest.mark.parametrize("damage", ["shard_text", "ingest_text", "base"])
def test_eval_refuses_a_damaged_input_before_any_model_loads(root, kinds_module, base, tmp_path, damage):
    """The eval stage reads text shards or records (perplexity) and model artifacts: a flipped byte in any of
    them fails the stage while it resolves its inputs, before a model loads."""
    from tasks import eval as eval_stage

    plan = plan_of(root, kinds_module)
    data = "ingest_text" if damage == "ingest_text" else "shard_text"
    cfg = eval_stage.EvalConfig.model_validate({"kind": "eval", "inputs": ["base", data], "models": [
        {"name": "m", "input": "base"}], "perplexity": [{"input": data}]})
    art = base if damage == "base" else artifact(plan, data)
    rel = {"shard_text": "validation-000000.tar", "ingest_text": "records/part-00000.jsonl",
           "base": "model.safetensors"}[damage]
    with flipped(Path(art.path) / rel, None if damage == "base" else b"plus"):
        with pytest.raises(ArtifactError) as e:
            eval_stage.run(cfg, [base, artifact(plan, data)], tmp_path)
    assert str(e.value).startswith(damaged(art, rel)) and str(e.value).endswith(fix(damage))


# ----------------------------------------------------------------------------------------------
# raw files: checked at ingest, hashed once per plan


def _write_raw(path: Path, fmt: str, rows: list[dict[str, str]]) -> None:
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
        return
    if fmt == "json":  # one array, streamed
        path.write_text(json.dumps(rows, indent=1))
        return
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(text, mtime=0) if fmt == "jsonl.gz" else text)


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet", "json"])
def test_ingest_refuses_a_raw_file_that_changed_after_the_plan(tmp_path, kinds, fmt):
    rows = [{"text": f"document {i}: some words"} for i in range(30)]
    path = tmp_path / "data" / f"text.{fmt}"
    path.parent.mkdir()
    _write_raw(path, fmt, rows)
    raw = {"name": "raw", "store": str(tmp_path / "artifacts"), "datasets": {"text": {"path": f"data/text.{fmt}",
                                                                                      "kind": "text"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["text"], "retries": 0}}}
    plan = make_plan(parse_config(raw, kinds, root=tmp_path), kinds)
    planned = plan.datasets["text"].files[0]
    rows[17]["text"] = "document 17: some Words"  # one letter, after the plan hashed the file
    _write_raw(path, fmt, rows)
    with pytest.raises(DataError) as e:
        execute_stage(RunContext(plan=plan, kinds=kinds), "ingest")
    assert str(e.value).startswith(f"{planned.uri}: changed since the plan hashed it (now {path.stat().st_size} "
                                   "bytes, sha256 ")
    assert f"used {planned.bytes} bytes, {planned.sha256[:12]}…). run the command again" in str(e.value)
    assert plan.store.get("ingest", plan.stages["ingest"].artifact_id) is None  # no mislabeled artifact


def test_a_plan_hashes_each_raw_file_once_per_run(tmp_path, kinds, monkeypatch):
    import lmforge.store as store

    hashed: list[str] = []
    real = store.sha256_file

    def counting(path, *a, **kw):
        hashed.append(Path(path).name)
        return real(path, *a, **kw)

    monkeypatch.setattr(store, "sha256_file", counting)
    write_jsonl(tmp_path / "data" / "text.jsonl", [{"text": f"doc {i}"} for i in range(5)])
    raw = {"name": "once", "store": str(tmp_path / "artifacts"),
           "datasets": {"text": {"path": "data/text.jsonl", "kind": "text"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["text"], "retries": 0}}}
    cfg = parse_config(raw, kinds, root=tmp_path)
    first = make_plan(cfg, kinds).datasets["text"].id  # `lmforge run` plans in the CLI, then again in the flow
    assert make_plan(cfg, kinds).datasets["text"].id == first
    assert hashed.count("text.jsonl") == 1
    write_jsonl(tmp_path / "data" / "text.jsonl", [{"text": f"doc {i}!"} for i in range(5)])  # size and mtime change
    assert make_plan(cfg, kinds).datasets["text"].id != first
    assert hashed.count("text.jsonl") == 2


# ----------------------------------------------------------------------------------------------
# object storage: downloads, the copy downloaded before, ETags


@pytest.mark.s3
def test_s3_downloads_are_verified_and_so_is_a_copy_downloaded_before(s3, tmp_path, caplog, monkeypatch):
    import lmforge.store as store_mod
    from lmforge.store import ArtifactStore, fingerprint
    from trainer.job import ArtifactRef, materialize

    store = ArtifactStore("s3://lmforge-test/verified")
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "tokenizer.json").write_text('{"model": "plus"}')
    weights = bytes(range(256)) * 8192  # 2 MiB: beyond what a config-only check fetches
    (staged / "weights.bin").write_bytes(weights)
    art = store.publish("tokenizer", "t1", staged, {"result": {}, "produced_by": {"stage": "tok"}})
    ref = ArtifactRef.of(art)
    dest = materialize(ref, tmp_path / "work", verify=False)  # the parent's config check: the small files only
    assert sorted(p.name for p in dest.iterdir()) == ["tokenizer.json"]
    assert materialize(ref, tmp_path / "work") == dest  # the training process: everything
    assert (dest / "weights.bin").read_bytes() == weights and (dest / ".complete").exists()

    (dest / "weights.bin").write_bytes(b"changed locally")  # the copy changed after its download
    with caplog.at_level(logging.WARNING):
        assert materialize(ref, tmp_path / "work") == dest
    assert (dest / "weights.bin").read_bytes() == weights  # downloaded again
    assert any("no longer matches its manifest" in r.getMessage() for r in caplog.records)

    store.fs.pipe_file(f"{art.path}/weights.bin", b"changed in the store")
    with pytest.raises(ArtifactError) as e:
        materialize(ref, tmp_path / "elsewhere")
    assert str(e.value).startswith("artifact tokenizer/t1, file weights.bin: content does not match its manifest "
                                   "(read 20 bytes, sha256 ")
    assert str(e.value).endswith(fix("tok"))
    assert not (tmp_path / "elsewhere" / "inputs" / "tokenizer-t1" / ".complete").exists()

    # a raw file on S3 is hashed once while its ETag stays the same
    reads: list[str] = []
    real = store_mod._sha256_stream
    monkeypatch.setattr(store_mod, "_sha256_stream", lambda fs, p: reads.append(p) or real(fs, p))
    path = "lmforge-test/raw/text.jsonl"
    store.fs.pipe_file(path, b'{"text": "a"}\n')
    first = fingerprint(store.fs, path)
    assert fingerprint(store.fs, path) == first and len(reads) == 1
    store.fs.pipe_file(path, b'{"text": "b"}\n')
    store.fs.invalidate_cache(path)
    assert fingerprint(store.fs, path)[0] != first[0] and len(reads) == 2
