"""Artifact store and ids: manifest last, verification on read, stable ids, safe replacement."""
from __future__ import annotations

import json

import pytest

from lmforge.config import parse_config
from lmforge.errors import ArtifactError
from lmforge.plan import make_plan
from lmforge.store import ArtifactStore, artifact_id
from tests.helpers import basic_config


def staged(tmp_path, files: dict[str, bytes]):
    d = tmp_path / "staged"
    d.mkdir()
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    return d


def test_artifact_id_depends_on_kind_version_config_inputs_only():
    base = artifact_id("shard", "1", {"a": 1, "b": [1, 2]}, ["x"])
    assert base == artifact_id("shard", "1", {"b": [1, 2], "a": 1}, ["x"])  # key order is irrelevant
    assert len({base, artifact_id("filter", "1", {"a": 1, "b": [1, 2]}, ["x"]),
                artifact_id("shard", "2", {"a": 1, "b": [1, 2]}, ["x"]),
                artifact_id("shard", "1", {"a": 2, "b": [1, 2]}, ["x"]),
                artifact_id("shard", "1", {"a": 1, "b": [1, 2]}, ["y"])}) == 5


def test_publish_writes_manifest_last_and_lists_files(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    art = store.publish("k", "abc", staged(tmp_path, {"a.txt": b"hello", "sub/b.bin": b"\x00\x01"}), {"result": {"n": 1}})
    assert [f["path"] for f in art.manifest["files"]] == ["a.txt", "sub/b.bin"]
    assert art.files["a.txt"]["sha256"] == "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert store.get("k", "abc").manifest == json.loads((tmp_path / "store/k/abc/manifest.json").read_text())
    assert [a.id for a in store.list()] == ["abc"] and store.find("ab").id == "abc"
    with art.open("a.txt") as f:
        assert f.read() == b"hello"


def test_folder_without_manifest_does_not_exist(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    (tmp_path / "store/k/half").mkdir(parents=True)
    (tmp_path / "store/k/half/part.bin").write_bytes(b"partial")
    assert store.get("k", "half") is None and store.list() == []
    with pytest.raises(ArtifactError, match="no finished artifact"):
        store.require("k", "half")
    # a later publish of the same id replaces the leftovers
    art = store.publish("k", "half", staged(tmp_path, {"x": b"1"}), {})
    assert sorted(p.name for p in (tmp_path / "store/k/half").iterdir()) == ["manifest.json", "x"]
    assert art.files.keys() == {"x"}


def test_reading_a_modified_file_fails_verification(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    art = store.publish("k", "abc", staged(tmp_path, {"a.txt": b"hello"}), {})
    (tmp_path / "store/k/abc/a.txt").write_bytes(b"HELLO")
    with pytest.raises(ArtifactError, match="content does not match its manifest"):
        with art.open("a.txt") as f:
            f.read()
    with pytest.raises(ArtifactError):
        art.verify()


def _replace_keeps_the_old_artifact_whole(store: ArtifactStore, tmp_path) -> None:
    store.publish("k", "abc", staged(tmp_path, {"a.txt": b"v1", "sub/b.txt": b"b1"}), {"result": {"v": 1}})
    base = store.artifact_path("k", "abc")
    store.fs.makedirs(f"{base}/_checkpoints/checkpoint-1", exist_ok=True)
    store.fs.pipe_file(f"{base}/_checkpoints/checkpoint-1/DONE", b"ckpt")
    (tmp_path / "staged").rename(tmp_path / "old")
    # without replace, an existing artifact is never overwritten
    kept = store.publish("k", "abc", staged(tmp_path, {"a.txt": b"v2"}), {"result": {"v": 2}})
    assert kept.result == {"v": 1} and store.fs.cat_file(f"{base}/a.txt") == b"v1"
    # a forced run: its checkpoints move first (training starts at step 0), the old result stays readable
    stamp = store.history_stamp()
    store.retire_checkpoints("k", "abc", stamp)
    store.fs.invalidate_cache()
    assert not store.fs.exists(f"{base}/_checkpoints/checkpoint-1/DONE")
    store.require("k", "abc").verify()
    # then the publish moves the old manifest and files to the same history folder
    new = store.publish("k", "abc", tmp_path / "staged", {"result": {"v": 2}}, replace=True, history_stamp=stamp)
    store.fs.invalidate_cache()
    assert new.result == {"v": 2} and store.fs.cat_file(f"{base}/a.txt") == b"v2"
    assert sorted(new.files) == ["a.txt"] and not store.fs.exists(f"{base}/sub/b.txt")
    old = f"{base}/_history/{stamp}"
    assert json.loads(store.fs.cat_file(f"{old}/manifest.json"))["result"] == {"v": 1}
    assert store.fs.cat_file(f"{old}/a.txt") == b"v1" and store.fs.cat_file(f"{old}/sub/b.txt") == b"b1"
    assert store.fs.cat_file(f"{old}/_checkpoints/checkpoint-1/DONE") == b"ckpt"
    assert [p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{base}/_history", detail=False)] == [stamp]


def test_replace_keeps_the_old_artifact_and_checkpoints_whole(tmp_path):
    _replace_keeps_the_old_artifact_whole(ArtifactStore(str(tmp_path / "store")), tmp_path)


@pytest.mark.s3
def test_replace_keeps_the_old_artifact_and_checkpoints_whole_on_s3(s3, tmp_path):
    _replace_keeps_the_old_artifact_whole(ArtifactStore("s3://lmforge-test/replace"), tmp_path)


def test_ids_do_not_depend_on_paths_or_store(tmp_path, kinds):
    a, b = tmp_path / "a", tmp_path / "b"
    ids = []
    for root, store in ((a, "artifacts"), (b, str(tmp_path / "elsewhere"))):
        root.mkdir()
        raw = basic_config(root)
        raw["store"] = store
        raw["datasets"]["text"]["path"] = str(root / "data/text.jsonl")  # absolute vs relative spelling
        plan = make_plan(parse_config(raw, kinds, root=root), kinds)
        ids.append({n: s.artifact_id for n, s in plan.stages.items()})
    assert ids[0] == ids[1]
    # orchestration settings do not change ids; output settings do, for that stage and downstream only
    raw = basic_config(a)
    base = make_plan(parse_config(raw, kinds, root=a), kinds).stages
    raw["stages"]["ingest"]["retries"] = 5
    raw["stages"]["shard"]["timeout_seconds"] = 60
    assert {n: s.artifact_id for n, s in make_plan(parse_config(raw, kinds, root=a), kinds).stages.items()} == \
        {n: s.artifact_id for n, s in base.items()}
    raw["stages"]["ingest"]["part_records"] = 7
    changed = make_plan(parse_config(raw, kinds, root=a), kinds).stages
    assert {n for n in base if base[n].artifact_id != changed[n].artifact_id} == {"ingest", "shard"}
    # default values written out explicitly do not change the id
    raw = basic_config(a)
    raw["stages"]["shard"]["seed"] = 0
    assert make_plan(parse_config(raw, kinds, root=a), kinds).stages["shard"].artifact_id == base["shard"].artifact_id


def test_raw_data_content_changes_ingest_id(tmp_path, kinds):
    raw = basic_config(tmp_path)
    before = make_plan(parse_config(raw, kinds, root=tmp_path), kinds).stages
    with open(tmp_path / "data/text.jsonl", "a") as f:
        f.write('{"text": "one more"}\n')
    after = make_plan(parse_config(raw, kinds, root=tmp_path), kinds).stages
    assert {n for n in before if before[n].artifact_id != after[n].artifact_id} == {"ingest", "shard"}
