"""ingest: the layouts users bring as they are (JSON arrays, Alpaca, ShareGPT, LLaMA-Factory and TRL preference
rows, parquet folders, save_to_disk folders), with exact records, streaming reads and bad rows named by file and row."""
from __future__ import annotations

import json
import time
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.config import parse_config
from lmforge.errors import DataError
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from tests.helpers import ingest, write_jsonl


def u(content):
    return {"role": "user", "content": content}


def a(content):
    return {"role": "assistant", "content": content}


def test_alpaca_json_array_with_system_and_history(tmp_path, kinds):
    (tmp_path / "alpaca_en_demo.json").write_text(json.dumps([
        {"instruction": "Add", "input": "2 and 3", "output": "5"},
        {"instruction": "And now?", "input": "", "output": "7", "system": "be brief",
         "history": [["Add 1 and 1", "2"], ["Add 2 and 2", "4"]]},
    ], indent=2))
    result, recs, _ = ingest(tmp_path, kinds, "alpaca_en_demo.json", kind="chat")
    assert recs == [
        {"messages": [u("Add\n\n2 and 3"), a("5")]},
        {"messages": [{"role": "system", "content": "be brief"}, u("Add 1 and 1"), a("2"), u("Add 2 and 2"), a("4"),
                      u("And now?"), a("7")]},
    ]
    assert (result["records"], result["rows_read"]) == (2, 2)


def test_sharegpt_json_array_with_system_and_tool_turns(tmp_path, kinds):
    (tmp_path / "glaive.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "weather?"},
                           {"from": "function_call", "value": '{"name": "w", "arguments": {}}'},
                           {"from": "observation", "value": '{"t": 20}'},
                           {"from": "gpt", "value": "20 degrees"}],
         "system": "you can call w", "tools": "[]"},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]},
    ]))
    _, recs, _ = ingest(tmp_path, kinds, "glaive.json", kind="chat")
    assert recs == [
        {"messages": [{"role": "system", "content": "you can call w"}, u("weather?"),
                      a('{"name": "w", "arguments": {}}'), {"role": "tool", "content": '{"t": 20}'}, a("20 degrees")]},
        {"messages": [u("q"), a("r")]},
    ]


def test_trl_prompt_completion_plain_and_conversational(tmp_path, kinds):
    write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "2+2=", "completion": "4"},
        {"prompt": [{"role": "system", "content": "math"}, u("2+3=")], "completion": [a("5")]},
    ])
    _, recs, _ = ingest(tmp_path, kinds, "pc.jsonl", kind="chat")
    assert recs == [{"messages": [u("2+2="), a("4")]},
                    {"messages": [{"role": "system", "content": "math"}, u("2+3="), a("5")]}]


def test_llamafactory_dpo_pairs_json_array(tmp_path, kinds):
    (tmp_path / "dpo_en_demo.json").write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi"}], "chosen": {"from": "gpt", "value": "hello"},
         "rejected": {"from": "gpt", "value": "go away"}},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                           {"from": "human", "value": "c"}],
         "chosen": {"from": "gpt", "value": "good"}, "rejected": {"from": "gpt", "value": "bad"}, "system": "sys"},
    ]))
    _, recs, _ = ingest(tmp_path, kinds, "dpo_en_demo.json", kind="preference")
    assert recs == [
        {"prompt": "hi", "chosen": "hello", "rejected": "go away"},  # one user turn: the same as a flat row
        {"prompt": "sys\na\nb\nc", "prompt_messages": [{"role": "system", "content": "sys"}, u("a"), a("b"), u("c")],
         "chosen": "good", "rejected": "bad"},
    ]


def test_trl_conversational_and_implicit_prompt_preference(tmp_path, kinds):
    write_jsonl(tmp_path / "trl.jsonl", [
        {"prompt": [u("q1"), a("r1"), u("q2")], "chosen": [a("yes")], "rejected": [a("no")]},
        {"prompt": [u("only")], "chosen": [a("c")], "rejected": [a("r")]},
        {"prompt": "flat", "chosen": "c", "rejected": "r"},
    ])
    write_jsonl(tmp_path / "implicit.jsonl", [
        {"chosen": [u("q1"), a("r1"), u("q2"), a("yes")], "rejected": [u("q1"), a("r1"), u("q2"), a("no")]},
    ])
    _, recs, _ = ingest(tmp_path, kinds, ["trl.jsonl", "implicit.jsonl"], kind="preference")
    multi = {"prompt": "q1\nr1\nq2", "prompt_messages": [u("q1"), a("r1"), u("q2")], "chosen": "yes", "rejected": "no"}
    assert recs == [multi, {"prompt": "only", "chosen": "c", "rejected": "r"},
                    {"prompt": "flat", "chosen": "c", "rejected": "r"}, multi]


def test_parquet_file_and_folder(tmp_path, kinds):
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"prompt": ["p1"], "chosen": ["c1"], "rejected": ["r1"]}), tmp_path / "pq/part-0.parquet")
    pq.write_table(pa.table({"prompt": ["p2", "p3"], "chosen": ["c2", "c3"], "rejected": ["r2", "r3"]}),
                   tmp_path / "pq/part-1.parquet")
    result, recs, _ = ingest(tmp_path, kinds, "pq", kind="preference")
    assert recs == [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in (1, 2, 3)]
    _, recs, _ = ingest(tmp_path, kinds, "pq/part-1.parquet", kind="preference")
    assert [r["prompt"] for r in recs] == ["p2", "p3"]


def test_save_to_disk_folder(tmp_path, kinds):
    import datasets

    datasets.Dataset.from_list([
        {"messages": [u("hi"), a("hello")]},
        {"messages": [u("2+2"), a("4")]},
    ]).save_to_disk(str(tmp_path / "saved"))
    result, recs, art = ingest(tmp_path, kinds, "saved", kind="chat")
    assert recs == [{"messages": [u("hi"), a("hello")]}, {"messages": [u("2+2"), a("4")]}]
    files = art.manifest["inputs"][0]["files"]
    assert [(f["format"], f["uri"]) for f in files] == [("hf_disk", str(tmp_path / "saved"))]
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "x"}])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "dd", format="hf_disk")
    assert str(e.value) == (f"datasets.src.path: '{tmp_path / 'dd'}' is a saved DatasetDict (it holds "
                            f"dataset_dict.json), not one split. point path at one split's folder, e.g. "
                            f"{tmp_path / 'dd'}/train")
    _, recs, _ = ingest(tmp_path, kinds, "dd/train")
    assert recs == [{"text": "x"}]


def test_saved_dataset_changed_since_plan_fails(tmp_path, kinds, monkeypatch):
    import datasets

    import tasks.ingest as ingest_mod

    datasets.Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "saved"))
    real = ingest_mod.saved_dataset_files

    def tamper(fs, path):  # a file changes between the plan's hash and the read
        arrow = next(p for p in (tmp_path / "saved").iterdir() if p.suffix == ".arrow")
        arrow.write_bytes(arrow.read_bytes() + b"\0")
        return real(fs, path)

    monkeypatch.setattr(ingest_mod, "saved_dataset_files", tamper)
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "saved")
    assert str(e.value).startswith(f"{tmp_path / 'saved'}: changed since the plan hashed it")


@pytest.mark.parametrize("name, content, kind, message", [
    ("bad.json", [{"text": "ok"}, {"text": "ok"}, {"txt": "x"}], "text",
     "element 3: does not fit the text schema: missing field 'text' (have: txt)"),
    ("bad.json", [{"messages": [u("q"), a("r")]}, {"conversations": [{"from": "robot", "value": "x"}]}], "chat",
     "element 2: does not fit the chat schema: conversations[0].role must be one of system, user, assistant, tool "
     "(ShareGPT: human, gpt, system, user, assistant, tool, function_call, observation), got 'robot'"),
    ("bad.json", [{"question": "q", "answer": "a"}], "chat",
     "element 1: does not fit the chat schema: no chat layout fits (have: answer, question); expected one of: "
     "'messages' [{role, content}]; ShareGPT 'conversations' [{from, value}] (+ 'system'); Alpaca "
     "'instruction'/'input'/'output' (+ 'system', 'history' [[user, assistant], ...]); TRL 'prompt'/'completion' "
     "(strings or message lists)"),
    ("bad.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}, {"prompt": "p", "chosen": "c"}], "preference",
     "2: does not fit the preference schema: missing field 'rejected' (have: chosen, prompt); expected one of: "
     "'prompt'/'chosen'/'rejected' strings; TRL conversational 'prompt' [messages] with 'chosen'/'rejected' [one "
     "assistant message]; implicit prompt: 'chosen'/'rejected' full conversations equal up to their last (assistant) "
     "message; LLaMA-Factory 'conversations' [{from, value}] with 'chosen'/'rejected' {from, value} (+ 'system')"),
    ("bad.jsonl", [{"chosen": [u("q"), a("yes")], "rejected": [u("other q"), a("no")]}], "preference",
     "1: does not fit the preference schema: implicit-prompt row: 'chosen' and 'rejected' must be the same "
     "conversation up to their last message, and hold a prompt before it; they differ at message 0 (2 vs 2 messages)"),
    ("bad.jsonl", [{"prompt": [u("q")], "chosen": [a("x"), a("y")], "rejected": [a("n")]}], "preference",
     "1: does not fit the preference schema: field 'chosen' must be one assistant message, got assistant, assistant"),
])
def test_bad_rows_name_file_row_and_expected_layout(tmp_path, kinds, name, content, kind, message):
    path = tmp_path / name
    if name.endswith(".json"):
        path.write_text(json.dumps(content))
        where = f"{path}: {message}"
    else:
        write_jsonl(path, content)
        where = f"{path}:{message}"
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, name, kind=kind)
    assert str(e.value) == f"{where}. fix the row, or set on_bad_record: skip on the ingest stage"


def test_parquet_and_saved_dataset_bad_rows_name_the_row(tmp_path, kinds):
    import datasets

    datasets.Dataset.from_list([{"text": "ok"}, {"text": None}]).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "saved")
    assert str(e.value).startswith(f"{tmp_path / 'saved'}: row 2: does not fit the text schema: field 'text' must be "
                                   "a string, got NoneType")


def test_broken_json_array_and_array_read_as_jsonl(tmp_path, kinds):
    (tmp_path / "cut.json").write_text('[{"text": "a"}, {"text": "b"}, {"text": ')
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "cut.json")
    assert str(e.value).startswith(f"{tmp_path / 'cut.json'}: element 3: invalid JSON (")
    assert "a .json file must hold one JSON array of row objects ([{...}, {...}]) or one JSON object per line" \
        in str(e.value)
    (tmp_path / "scalar.json").write_text('"just a string"')
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "scalar.json")
    assert str(e.value).startswith(f"{tmp_path / 'scalar.json'}: element 1: invalid JSON (the top-level value is "
                                   "not an array)")
    (tmp_path / "lines.json").write_text('{"text": "a"}\n{"text": "b"}\n')  # JSON Lines named .json
    _, recs, _ = ingest(tmp_path, kinds, "lines.json")
    assert recs == [{"text": "a"}, {"text": "b"}]
    (tmp_path / "array.data").write_text('[\n  {"text": "a"}\n]\n')
    with pytest.raises(DataError) as e:
        ingest(tmp_path, kinds, "array.data", format="jsonl")
    assert str(e.value) == (
        f"{tmp_path / 'array.data'}:1: invalid JSON: Expecting value at column 2 (this file starts with '[': a JSON "
        "array, not JSON Lines; set format: json on the dataset, or name the file .json). fix the row, or set "
        "on_bad_record: skip on the ingest stage")
    _, recs, _ = ingest(tmp_path, kinds, "array.data", format="json")
    assert recs == [{"text": "a"}]


def test_large_json_array_is_streamed_not_loaded_whole(tmp_path, kinds):
    """A ~50 MB array is read element by element: peak Python memory stays far below the file's size."""
    path = tmp_path / "big.json"
    row = {"instruction": "x" * 400, "input": "", "output": "y" * 600}
    n = 48_000
    with open(path, "w") as f:
        f.write("[\n")
        for i in range(n):
            f.write(json.dumps({**row, "instruction": f"{i} " + row["instruction"]}) + (",\n" if i < n - 1 else "\n"))
        f.write("]\n")
    size = path.stat().st_size
    assert size > 48 * 2**20
    raw = {"name": "t", "store": str(tmp_path / "artifacts"),
           "datasets": {"src": {"path": "big.json", "kind": "chat"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["src"], "part_records": 10_000}}}
    plan = make_plan(parse_config(raw, kinds, root=tmp_path), kinds)
    t0 = time.perf_counter()
    tracemalloc.start()
    try:
        execute_stage(RunContext(plan=plan, kinds=kinds), "ingest")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    result = plan.store.require("ingest", plan.stages["ingest"].artifact_id).result
    assert (result["records"], result["rows_read"], result["bytes_read"]) == (n, n, size)
    assert peak < size / 5, f"peak {peak / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"
    assert time.perf_counter() - t0 < 60
