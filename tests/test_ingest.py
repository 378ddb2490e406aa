"""ingest: every format and data kind, and every kind of bad input, with exact messages and counts."""
from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.errors import DataError
from lmforge.records import iter_records
from tests.helpers import ingest, write_jsonl


def test_jsonl_text_with_ids_and_counts(tmp_path, kinds):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, {"text": "two", "meta": 1}])
    (tmp_path / "a.jsonl").write_text((tmp_path / "a.jsonl").read_text() + "\n\n")  # blank lines are fine
    result, recs, art = ingest(tmp_path, kinds, "a.jsonl")
    assert recs == [{"text": "one"}, {"text": "two"}]
    assert (result["records"], result["bad_records"], result["per_dataset"]) == (2, {}, {"src": 2})
    ids = [r["id"] for r in iter_records(art)]
    sha = art.manifest["inputs"][0]["files"][0]["sha256"]
    assert ids == [f"{sha[:12]}:1", f"{sha[:12]}:2"]


def test_gzip_parquet_txt_formats(tmp_path, kinds):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "zipped"}) + "\n")
    pq.write_table(pa.table({"body": ["p1", "p2"]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("line one\n\nline two\n")
    result, recs, _ = ingest(tmp_path, kinds, ["a.jsonl.gz", "b.parquet"], columns={"text": "body"})
    assert recs == [{"text": "zipped"}, {"text": "p1"}, {"text": "p2"}]
    _, recs, _ = ingest(tmp_path, kinds, "c.txt", txt_unit="line")
    assert recs == [{"text": "line one"}, {"text": "line two"}]
    _, recs, _ = ingest(tmp_path, kinds, "c.txt")
    assert recs == [{"text": "line one\n\nline two\n"}]


def test_chat_from_messages_instruction_rows_and_sharegpt(tmp_path, kinds):
    write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"instruction": "Add", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi", "output": "hi", "system": "be brief"},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ])
    _, recs, _ = ingest(tmp_path, kinds, "chat.jsonl", kind="chat")
    assert recs == [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "Add\n\n2 and 3"}, {"role": "assistant", "content": "5"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hi"},
                      {"role": "assistant", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]


def test_preference(tmp_path, kinds):
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    _, recs, _ = ingest(tmp_path, kinds, "p.jsonl", kind="preference")
    assert recs == [{"prompt": "p", "chosen": "c", "rejected": "r"}]


def test_missing_file_and_empty_glob(tmp_path, kinds):
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "nope.jsonl")
    assert str(e.value).startswith("datasets.src.path: 'nope.jsonl' does not exist")
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "*.parquet")
    assert str(e.value).startswith("datasets.src.path: '*.parquet' matched no files")


@pytest.mark.parametrize("line, reason, message", [
    ('{"text": "ok"', "invalid_json", "invalid JSON: Expecting ',' delimiter at column 14"),
    (b'{"text": "caf\xe9"}', "not_utf8", "not valid UTF-8 (byte 0xe9 at column 14)"),
    ('{"txt": "wrong field"}', "schema", "does not fit the text schema: missing field 'text' (have: txt)"),
    ('{"text": 5}', "schema", "does not fit the text schema: field 'text' must be a string, got int"),
    ('["a list"]', "schema", "does not fit the text schema: expected a JSON object, got list"),
])
def test_bad_line_fails_with_file_and_line_or_is_skipped_and_counted(tmp_path, kinds, line, reason, message):
    path = tmp_path / "bad.jsonl"
    good = [json.dumps({"text": f"good {i}"}).encode() for i in range(9)]
    path.write_bytes(b"\n".join(good[:2] + [line if isinstance(line, bytes) else line.encode()] + good[2:]) + b"\n")
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "bad.jsonl")
    assert str(e.value) == f"{path}:3: {message}. fix the row, or set on_bad_record: skip on the ingest stage"
    result, recs, _ = ingest(tmp_path, kinds, "bad.jsonl", stage={"on_bad_record": "skip"})
    assert result["bad_records"] == {reason: 1}
    assert result["records"] == 9 and len(recs) == 9
    assert result["bad_examples"] == [f"{path}:3: {message}"]


def test_too_many_bad_rows_fail_even_with_skip(tmp_path, kinds):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}] + ["{broken"] * 3)
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "a.jsonl", stage={"on_bad_record": "skip", "max_bad_fraction": 0.5})
    assert str(e.value).startswith("max_bad_fraction: 3 of 4 rows are bad (75% > max_bad_fraction 0.5)")


def test_empty_dataset(tmp_path, kinds):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "empty.jsonl")
    assert str(e.value).startswith(f"datasets.src: no records in {tmp_path / 'empty.jsonl'}")
    write_jsonl(tmp_path / "allbad.jsonl", ["{x"])
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "allbad.jsonl", stage={"on_bad_record": "skip"})
    assert "(1 bad rows skipped: {'invalid_json': 1})" in str(e.value)


def test_non_utf8_txt_and_corrupt_gzip_and_parquet(tmp_path, kinds):
    (tmp_path / "a.txt").write_bytes(b"fine\nbad \xff here\n")
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "a.txt")
    assert str(e.value).startswith(f"{tmp_path / 'a.txt'}:2: not valid UTF-8 (byte 0xff)")
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:40])
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "b.jsonl.gz")
    assert str(e.value).startswith(f"{tmp_path / 'b.jsonl.gz'}: cannot read jsonl.gz file")
    (tmp_path / "c.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "c.parquet")
    assert str(e.value).startswith(f"{tmp_path / 'c.parquet'}: not a readable parquet file")


def test_parquet_schema_error_names_the_row(tmp_path, kinds):
    pq.write_table(pa.table({"prompt": ["p", "p2"], "chosen": ["c", None], "rejected": ["r", "r2"]}),
                   tmp_path / "p.parquet")
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "p.parquet", kind="preference")
    assert str(e.value).startswith(
        f"{tmp_path / 'p.parquet'}: row 2: does not fit the preference schema: field 'chosen' must be a string, got NoneType")


def test_unknown_extension_needs_format(tmp_path, kinds):
    (tmp_path / "data.csv").write_text("text\nx\n")
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "data.csv")
    assert str(e.value) == ("datasets.src.path: cannot tell the format of "
                            f"'{tmp_path / 'data.csv'}' from its name. set format: to one of json, jsonl, jsonl.gz, parquet, txt, or point path at a "
                            "folder written by datasets' save_to_disk")
