"""shard: deterministic tars, seeded split, manifest per-shard counts, read back with webdataset."""
from __future__ import annotations

import tarfile

import webdataset as wds

from lmforge.config import parse_config
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from lmforge.records import iter_records
from lmforge.shards import iter_samples, shard_urls
from tests.helpers import basic_config


def run_branch(tmp_path, kinds, store=None, **shard):
    raw = basic_config(tmp_path, n=95, store=store, **shard)
    plan = make_plan(parse_config(raw, kinds, root=tmp_path), kinds)
    ctx = RunContext(plan=plan, kinds=kinds)
    for name in ("ingest", "shard"):
        execute_stage(ctx, name)
    return plan, plan.store.require("shard", plan.stages["shard"].artifact_id)


def test_split_counts_shard_layout_and_readback(tmp_path, kinds):
    plan, art = run_branch(tmp_path, kinds, max_count=20, validation_fraction=0.1)
    r = art.result
    assert (r["train_samples"], r["validation_samples"]) == (85, 10)  # round(95 * 0.1) = 10, exact
    assert r["num_shards"] == {"train": 5, "validation": 1}
    assert [(s["name"], s["samples"]) for s in r["shards"]] == [
        ("train-000000.tar", 20), ("train-000001.tar", 20), ("train-000002.tar", 20), ("train-000003.tar", 20),
        ("train-000004.tar", 5), ("validation-000000.tar", 10)]
    for s in r["shards"]:
        assert art.files[s["name"]]["sha256"] == s["sha256"] and art.files[s["name"]]["bytes"] == s["bytes"]
    # every record lands in exactly one split; webdataset reads the shards back
    ingest = plan.store.require("ingest", plan.stages["ingest"].artifact_id)
    train = list(iter_samples(art, "train"))
    val = list(iter_samples(art, "validation"))
    assert sorted(x["id"] for x in train + val) == sorted(x["id"] for x in iter_records(ingest))
    plain = [s["json"] for s in wds.WebDataset(shard_urls(art, "train"), shardshuffle=False).decode()]
    assert plain == train
    with tarfile.open(f"{art.path}/train-000000.tar") as tf:
        assert {m.mtime for m in tf} == {0}


def test_same_input_gives_byte_identical_shards_and_seed_changes_split(tmp_path, kinds):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, a = run_branch(tmp_path / "a", kinds)
    _, b = run_branch(tmp_path / "b", kinds)
    assert a.id == b.id
    assert [f["sha256"] for f in a.manifest["files"]] == [f["sha256"] for f in b.manifest["files"]]
    (tmp_path / "c").mkdir()
    _, c = run_branch(tmp_path / "c", kinds, seed=1)
    assert c.id != a.id
    val_a = {x["id"] for x in iter_samples(a, "validation")}
    val_c = {x["id"] for x in iter_samples(c, "validation")}
    assert len(val_a) == len(val_c) == 10 and val_a != val_c


def test_max_bytes_rolls_shards_over(tmp_path, kinds):
    _, art = run_branch(tmp_path, kinds, max_count=1000, max_bytes=8000, validation_fraction=0)
    assert art.result["validation_samples"] == 0 and art.result["num_shards"]["validation"] == 0
    # a shard closes once its sample payload reaches max_bytes (webdataset maxsize semantics)
    sizes = [s["samples"] for s in art.result["shards"]]
    assert len(sizes) == 2 and sum(sizes) == 95
    with tarfile.open(f"{art.path}/train-000000.tar") as tf:
        payload = [m.size for m in tf]
    assert sum(payload[:-1]) < 8000 <= sum(payload)
