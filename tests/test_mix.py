"""mix: exact counts by weights and epochs, realised proportions, determinism, bad configs, shard after mix."""
from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from lmforge.config import parse_config
from lmforge.errors import ConfigError, DataError
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from lmforge.records import RecordWriter, iter_records
from lmforge.shards import iter_samples
from lmforge.store import ArtifactStore
from tasks.mix import MixConfig, MixResult, plan_counts, run
from tests.helpers import text_rows, write_jsonl

SIZES = {"a": 10, "b": 30, "c": 60}


def config(tmp: Path, mix: dict, sizes: dict[str, int] = SIZES, extra: dict | None = None) -> dict:
    """Text datasets a, b, c (texts prefixed by their name) ingested as ia, ib, ic, and a stage `mix` over them."""
    for name, n in sizes.items():
        write_jsonl(tmp / "data" / f"{name}.jsonl", text_rows(n, prefix=name))
    stages = {f"i{name}": {"kind": "ingest", "inputs": [name], "retries": 0} for name in sizes}
    stages["mix"] = {"kind": "mix", "inputs": [f"i{name}" for name in sizes], "retries": 0, **mix}
    return {"name": "t", "store": str(tmp / "artifacts"), "tracking": f"sqlite:///{tmp / 'mlflow.db'}",
            "datasets": {name: {"path": f"data/{name}.jsonl", "kind": "text"} for name in sizes},
            "stages": {**stages, **(extra or {})}}


def run_all(tmp: Path, raw: dict, kinds):
    plan = make_plan(parse_config(raw, kinds, root=tmp), kinds)
    ctx = RunContext(plan=plan, kinds=kinds, tracker=None, parent_run_id=None)
    for name in plan.stages:
        execute_stage(ctx, name)
    return plan


def artifact(plan, name: str):
    sp = plan.stages[name]
    return plan.store.require(sp.kind, sp.artifact_id)


def source_of(rec: dict) -> str:
    return "i" + rec["text"].split(" ", 1)[0]


def mixed(tmp: Path, mix: dict, kinds, sizes: dict[str, int] = SIZES):
    plan = run_all(tmp, config(tmp, mix, sizes), kinds)
    art = artifact(plan, "mix")
    return plan, art, list(iter_records(art))


def copies_per_record(recs: list[dict], source: str) -> Counter:
    """{copies: how many records of `source` appear that many times}."""
    return Counter(Counter(r["id"] for r in recs if source_of(r) == source).values())


def figures(result: dict) -> dict:
    return {s: {k: v for k, v in r.items() if k != "input"} for s, r in result["sources"].items()}


def source_figures(records_in: int, records_out: int, times_repeated: int, proportion: float) -> dict:
    """One source's figures in a mix result where the realised proportion is exactly the one requested."""
    return {"records_in": records_in, "records_out": records_out, "times_repeated": times_repeated,
            "requested_proportion": proportion, "realised_proportion": proportion}


def output_bytes(art) -> dict[str, bytes]:
    return {p: (Path(art.path) / p).read_bytes() for p in sorted(art.files)}


# ---------------------------------------------------------------------------------------------
# counts


def test_weights_up_and_downsample_to_exact_counts(tmp_path, kinds):
    plan, art, recs = mixed(tmp_path, {"weights": {"ia": 1, "ib": 1, "ic": 2}, "total": 100}, kinds)
    res = art.result
    assert res["records"] == 100 and res["mode"] == "weights" and res["limiting_source"] is None
    assert figures(res) == {  # a: 10 records -> 25 (every record twice, 5 of them three times); b, c: subsets
        "ia": source_figures(10, 25, 3, 0.25),
        "ib": source_figures(30, 25, 1, 0.25),
        "ic": source_figures(60, 50, 1, 0.5)}
    assert res["sources"]["ia"]["input"] == f"ingest/{plan.stages['ia'].artifact_id}"
    assert Counter(source_of(r) for r in recs) == {"ia": 25, "ib": 25, "ic": 50}
    assert copies_per_record(recs, "ia") == {2: 5, 3: 5}
    assert copies_per_record(recs, "ib") == {1: 25} and copies_per_record(recs, "ic") == {1: 50}
    assert len({source_of(r) for r in recs[:10]}) > 1  # interleaved, not one source after the other
    originals = {r["id"]: r for s in ("ia", "ib", "ic") for r in iter_records(artifact(plan, s))}
    assert all(originals[r["id"]] == r for r in recs)  # records as they came in, ids kept
    report = json.loads((Path(art.path) / "mix_report.json").read_text())
    assert report["sources"] == res["sources"] and report["total"] == {"records": 100, "from": "config"}
    assert report["weights"] == {"ia": 1.0, "ib": 1.0, "ic": 2.0} and report["seed"] == 0
    metrics = MixResult.model_validate(res).metrics()  # what the executor logs to MLflow
    assert metrics["sources/ia/realised_proportion"] == 0.25 and metrics["sources/ia/times_repeated"] == 3.0
    assert metrics["sources/ic/records_out"] == 50.0 and metrics["records"] == 100.0


def test_largest_remainder_and_default_total():
    sizes = {"ia": 10, "ib": 30, "ic": 60}
    thirds = MixConfig(kind="mix", inputs=list(sizes), weights={"ia": 1, "ib": 1, "ic": 1}, total=100)
    counts, share, limiting = plan_counts(thirds, sizes)
    assert counts == {"ia": 34, "ib": 33, "ic": 33}  # 33.33 each: the remainder goes to the first input
    assert share == {s: Fraction(1, 3) for s in sizes} and limiting is None
    odd = MixConfig(kind="mix", inputs=list(sizes), weights={"ia": 0.2, "ib": 0.3, "ic": 0.5}, total=7)
    assert plan_counts(odd, sizes)[0] == {"ia": 1, "ib": 2, "ic": 4}  # 1.4, 2.1, 3.5: c's .5 wins the 7th
    default = MixConfig(kind="mix", inputs=list(sizes), weights={"ia": 1, "ib": 1, "ic": 2})
    assert plan_counts(default, sizes) == ({"ia": 10, "ib": 10, "ic": 20},
                                           {"ia": Fraction(1, 4), "ib": Fraction(1, 4), "ic": Fraction(1, 2)}, "ia")
    limited_by_c = MixConfig(kind="mix", inputs=list(sizes), weights={"ia": 1, "ib": 1, "ic": 20})
    assert plan_counts(limited_by_c, sizes)[0::2] == ({"ia": 3, "ib": 3, "ic": 60}, "ic")  # 66 = floor(60 / (20/22))


def test_default_total_uses_the_limiting_source_whole(tmp_path, kinds):
    _, art, recs = mixed(tmp_path, {"weights": {"ia": 1, "ib": 1, "ic": 2}}, kinds)
    assert art.result["records"] == 40 and art.result["limiting_source"] == "ia"
    assert {s: (r["records_out"], r["times_repeated"]) for s, r in art.result["sources"].items()} == \
        {"ia": (10, 1), "ib": (10, 1), "ic": (20, 1)}
    assert len({r["id"] for r in recs}) == 40  # no record repeats
    report = json.loads((Path(art.path) / "mix_report.json").read_text())
    assert report["total"] == {"records": 40, "from": "default: ia used whole, no record repeated"}


def test_epochs(tmp_path, kinds):
    _, art, recs = mixed(tmp_path, {"epochs": {"ia": 2.0, "ib": 0.5, "ic": 1.5}, "seed": 3}, kinds)
    assert art.result["records"] == 20 + 15 + 90 and art.result["mode"] == "epochs"
    assert figures(art.result) == {
        "ia": source_figures(10, 20, 2, 0.16),
        "ib": source_figures(30, 15, 1, 0.12),
        "ic": source_figures(60, 90, 2, 0.72)}
    assert copies_per_record(recs, "ia") == {2: 10}  # every record exactly twice
    assert copies_per_record(recs, "ib") == {1: 15}  # a seeded half
    assert copies_per_record(recs, "ic") == {1: 30, 2: 30}  # once, and a seeded half again


# ---------------------------------------------------------------------------------------------
# determinism


def test_same_seed_same_bytes_other_seed_other_order(tmp_path, kinds):
    mix = {"epochs": {"ia": 1.0, "ib": 1.0, "ic": 1.0}}
    _, first, recs = mixed(tmp_path / "one", mix, kinds)
    # another store and another bucket size (many shuffle buckets): the same artifact id and bytes
    _, again, _ = mixed(tmp_path / "two", {**mix, "bucket_records": 7}, kinds)
    assert again.id == first.id and output_bytes(again) == output_bytes(first)
    assert len(output_bytes(first)) == 2  # records/part-00000.jsonl and mix_report.json
    _, other, other_recs = mixed(tmp_path / "three", {**mix, "seed": 1}, kinds)
    assert other.id != first.id
    assert [r["id"] for r in other_recs] != [r["id"] for r in recs]  # another order ...
    assert sorted(r["id"] for r in other_recs) == sorted(r["id"] for r in recs)  # ... of the same records
    _, sub1, s1 = mixed(tmp_path / "four", {"weights": {"ia": 1, "ib": 1, "ic": 1}, "total": 45}, kinds)
    _, sub2, s2 = mixed(tmp_path / "five", {"weights": {"ia": 1, "ib": 1, "ic": 1}, "total": 45, "seed": 9}, kinds)
    assert {r["id"] for r in s1 if source_of(r) == "ic"} != {r["id"] for r in s2 if source_of(r) == "ic"}


# ---------------------------------------------------------------------------------------------
# bad input


def problems(raw: dict, kinds) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds, root=Path("."))
    return e.value.problems


def test_mixed_kinds_refused(tmp_path, kinds):
    raw = config(tmp_path, {"weights": {"ia": 1, "ip": 1}}, sizes={"a": 5})
    raw["datasets"]["p"] = {"path": "data/p.jsonl", "kind": "preference"}
    raw["stages"]["ip"] = {"kind": "ingest", "inputs": ["p"]}
    raw["stages"]["mix"]["inputs"] = ["ia", "ip"]
    assert problems(raw, kinds) == [
        "stages.mix.inputs: inputs mix data kinds: ia (text records), ip (preference records); mix combines one "
        "kind (text, chat or preference)"]
    raw["stages"]["sh"] = {"kind": "shard", "inputs": ["ia"]}
    raw["stages"]["mix"] = {"kind": "mix", "inputs": ["ia", "sh"], "epochs": {"ia": 1, "sh": 1}}
    assert problems(raw, kinds) == [
        "stages.mix.inputs: inputs mix records and shards: ia (text records), sh (text shards); mix reads one "
        "type: mix the records before a shard stage, or shard every source first"]
    raw["stages"]["mix"] = {"kind": "mix", "inputs": ["ia", "a"], "epochs": {"ia": 1, "a": 1}}
    assert problems(raw, kinds) == [
        "stages.mix.inputs: mix reads records (ingest, filter, dedup) or shards; a is neither: ia (text records), "
        "a (text dataset). Put an ingest stage in front of a dataset"]


def test_bad_weights_refused_all_at_once(tmp_path, kinds):
    raw = config(tmp_path, {"weights": {"ia": 1, "ib": 1, "ic": 1}})
    ins = ["ia", "ib", "ic"]
    bad = {
        "unknown": {"weights": {"ia": 1, "ib": 1, "ic": 1, "web": 2}},
        "missing": {"weights": {"ia": 1, "ib": 1}},
        "zero": {"weights": {"ia": 0, "ib": -1, "ic": 1}},
        "both": {"weights": {"ia": 1, "ib": 1, "ic": 1}, "epochs": {"ia": 1, "ib": 1, "ic": 1}},
        "neither": {"total": 10},
        "total_epochs": {"epochs": {"ia": 1, "ib": 1, "ic": 1}, "total": 10},
        "twice": {"inputs": ["ia", "ia"], "epochs": {"ia": 1}},
        "epochs_missing": {"epochs": {"ia": 1, "ib": 2}},
    }
    for name, body in bad.items():
        raw["stages"][name] = {"kind": "mix", "inputs": ins, **body}
    got = problems(raw, kinds)
    assert got == [
        "stages.unknown.weights: value error, 'web' is not an input of this stage (inputs: ia, ib, ic), got "
        "{'ia': 1, 'ib': 1, 'ic': 1, 'web': 2}",
        "stages.missing.weights: value error, input 'ic' has no weight; give every input one (or drop the input), "
        "got {'ia': 1, 'ib': 1}",
        "stages.zero.weights.ia: must be > 0, got 0",
        "stages.zero.weights.ib: must be > 0, got -1",
        "stages.both: value error, set exactly one of `weights` (sampling ratios) or `epochs` (passes per input), "
        "got both, got " + repr({"kind": "mix", "inputs": ins, **bad["both"]}),
        "stages.neither: value error, set exactly one of `weights` (sampling ratios) or `epochs` (passes per "
        "input), got neither, got " + repr({"kind": "mix", "inputs": ins, **bad["neither"]}),
        "stages.total_epochs: value error, `total` applies to `weights` only; with `epochs` each input's count is "
        "its records x epochs: drop `total`, or switch to `weights`, got "
        + repr({"kind": "mix", "inputs": ins, **bad["total_epochs"]}),
        "stages.twice.inputs: value error, ia listed more than once; a source is weighted once, name it once, got "
        "['ia', 'ia']",
        "stages.epochs_missing.epochs: value error, input 'ic' has no epochs value; give every input one (or drop "
        "the input), got {'ia': 1, 'ib': 2}",
    ]


def test_empty_source_names_its_weight(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    arts = []
    for name, n in (("full", 3), ("empty", 0)):
        with store.staging("ingest", name) as staged:
            with RecordWriter(staged) as w:
                for i in range(n):
                    w.write({"id": f"{name}{i}", "text": f"t{i}"})
            arts.append(store.publish("ingest", name, staged, {"result": {"records": n, "data_kind": "text"},
                                                               "output": {"type": "records", "data_kind": "text"}}))
    cfg = MixConfig(kind="mix", inputs=["f", "e"], weights={"f": 1, "e": 1})
    with pytest.raises(DataError) as e, store.staging("mix", "x") as out:
        run(cfg, arts, out)
    assert str(e.value) == ("weights.e: input 'e' (ingest/empty) holds no records, so it cannot give its share. fix "
                            "what emptied it upstream, or drop 'e' from inputs and weights")


# ---------------------------------------------------------------------------------------------
# what comes after, and shards inputs


def test_mix_feeds_shard(tmp_path, kinds):
    extra = {"shard": {"kind": "shard", "inputs": ["mix"], "validation_fraction": 0.2, "max_count": 30,
                       "retries": 0}}
    raw = config(tmp_path, {"weights": {"ia": 1, "ib": 1, "ic": 2}, "total": 100}, extra=extra)
    plan = run_all(tmp_path, raw, kinds)
    assert plan.stages["mix"].port.describe() == "text records"
    sh = artifact(plan, "shard")
    train, val = list(iter_samples(sh, "train")), list(iter_samples(sh, "validation"))
    assert len(train) + len(val) == 100 and len(val) == 20
    assert not {r["id"] for r in train} & {r["id"] for r in val}  # every copy of a record in one split
    assert Counter(source_of(r) for r in train + val) == {"ia": 25, "ib": 25, "ic": 50}


def test_shards_inputs_mix_train_and_keep_validation(tmp_path, kinds):
    shards = {f"s{n}": {"kind": "shard", "inputs": [f"i{n}"], "validation_fraction": 0.1, "max_count": 16,
                        "retries": 0} for n in SIZES}
    raw = config(tmp_path, {"weights": {"sa": 1, "sb": 1, "sc": 2}, "total": 40, "max_count": 16},
                 extra=shards)
    raw["stages"]["mix"]["inputs"] = ["sa", "sb", "sc"]
    raw["stages"]["mix"] = raw["stages"].pop("mix")  # after the shard stages (order is only cosmetic)
    plan = run_all(tmp_path, raw, kinds)
    assert plan.stages["mix"].port.describe() == "text shards"
    art = artifact(plan, "mix")
    res = art.result
    assert {s: (r["records_in"], r["records_out"], r["times_repeated"]) for s, r in res["sources"].items()} == \
        {"sa": (9, 10, 2), "sb": (27, 10, 1), "sc": (54, 20, 1)}  # train splits; 10% of each held out
    assert res["validation"] == {"sa": 1, "sb": 3, "sc": 6} and res["validation_samples"] == 10
    assert res["train_samples"] == 40 and res["num_shards"] == {"train": 3, "validation": 1}
    train, val = list(iter_samples(art, "train")), list(iter_samples(art, "validation"))
    assert Counter("s" + r["text"][0] for r in train) == {"sa": 10, "sb": 10, "sc": 20}
    held_out = {r["id"] for s in ("sa", "sb", "sc") for r in iter_samples(artifact(plan, s), "validation")}
    assert sorted(r["id"] for r in val) == sorted(held_out)  # validation kept whole, each record once
    assert [s["samples"] for s in res["shards"]] == [16, 16, 8, 10]
    report = json.loads((Path(art.path) / "mix_report.json").read_text())
    assert report["split"] == "train; every source's validation split kept whole"
    assert report["validation"] == res["validation"] and report["sources"] == res["sources"]
    assert MixResult.model_validate(res).metrics()["sources/sa/times_repeated"] == 2.0
