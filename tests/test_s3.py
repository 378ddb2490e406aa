"""Object storage against a real S3 server (SeaweedFS): same ids as file://, shards read back, no leaks."""
from __future__ import annotations

import json
import logging

import fsspec
import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import pipeline
from lmforge.records import iter_records
from lmforge.shards import iter_samples
from lmforge.store import ArtifactStore
from tests.helpers import basic_config, write_config

pytestmark = pytest.mark.s3


def test_s3_store_matches_file_store_and_reads_back(s3, tmp_path, caplog, capfd):
    caplog.set_level(logging.INFO)
    local_dir, s3_dir = tmp_path / "local", tmp_path / "remote"
    local_dir.mkdir()
    s3_dir.mkdir()
    local_cfg = write_config(local_dir, basic_config(local_dir))
    raw = basic_config(s3_dir, store="s3://lmforge-test/runs/a")
    fs = fsspec.filesystem("s3")
    fs.put_file(str(s3_dir / "data/text.jsonl"), "lmforge-test/raw/text.jsonl")  # raw input on S3 too
    raw["datasets"]["text"]["path"] = "s3://lmforge-test/raw/text.jsonl"
    remote_cfg = write_config(s3_dir, raw)

    local = pipeline(config_path=str(local_cfg))
    remote = pipeline(config_path=str(remote_cfg))
    ids = {n: s["artifact_id"] for n, s in local["stages"].items()}
    assert {n: s["artifact_id"] for n, s in remote["stages"].items()} == ids  # paths and stores are not in ids
    assert remote["ran"] == 4

    store = ArtifactStore("s3://lmforge-test/runs/a")
    assert sorted(a.kind for a in store.list()) == ["ingest", "ingest", "shard", "shard"]
    shard = store.require("shard", ids["shard"])
    local_shard = ArtifactStore(str(local_dir / "artifacts")).require("shard", ids["shard"])
    assert [f["sha256"] for f in shard.manifest["files"]] == [f["sha256"] for f in local_shard.manifest["files"]]
    assert list(iter_samples(shard, "train")) == list(iter_samples(local_shard, "train"))
    assert len(list(iter_samples(shard, "validation"))) == 5
    assert len(list(iter_records(store.require("ingest", ids["ingest"])))) == 50
    shard.verify()

    again = pipeline(config_path=str(remote_cfg))
    assert (again["ran"], again["cached"]) == (0, 4)

    # the S3 secret never reaches MLflow, manifests or logs
    secret = s3.secret_key
    client = MlflowClient(f"sqlite:///{s3_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert len(runs) == 10
    for r in runs:
        blob = json.dumps([r.data.params, r.data.tags])
        assert secret not in blob and s3.access_key not in blob
    for a in store.list():
        assert secret not in json.dumps(a.manifest)
    out, err = capfd.readouterr()
    assert secret not in out + err + caplog.text


def test_half_written_artifact_on_s3_does_not_exist(s3):
    fs = fsspec.filesystem("s3")
    fs.pipe_file("lmforge-test/runs/half/shard/abc/train-000000.tar", b"partial")
    store = ArtifactStore("s3://lmforge-test/runs/half")
    assert store.get("shard", "abc") is None and store.list() == []


def test_secret_redaction_helpers(monkeypatch):
    from lmforge.tracking import RedactingFilter, flatten, redact

    monkeypatch.setenv("MY_API_TOKEN", "tok-1234567890")
    assert redact("postgresql://bob:hunter2pw@db:5432/mlflow") == "postgresql://bob:***@db:5432/mlflow"
    assert redact("using tok-1234567890 now") == "using *** now"
    # by value, not by name: settings whose names contain "token" stay visible; a secret value is hidden anywhere
    assert flatten({"a": {"max_length_tokens": 64, "pad_token": "<pad>", "b": 1}, "max_new_tokens": 16,
                    "url": "s3://k:tok-1234567890@bucket", "note": "key tok-1234567890", "password": "x"}) == \
        {"a.max_length_tokens": "64", "a.pad_token": "<pad>", "a.b": "1", "max_new_tokens": "16",
         "url": "s3://k:***@bucket", "note": "key ***", "password": "x"}
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "key is %s", ("tok-1234567890",), None)
    RedactingFilter().filter(rec)
    assert rec.getMessage() == "key is ***"
