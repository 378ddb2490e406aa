"""Config validation: every problem at once, each with its path, and the CLI's exit codes."""
from __future__ import annotations

import pytest

from flows.cli import main
from lmforge.config import load_config, parse_config
from lmforge.errors import ConfigError
from tests.helpers import basic_config, write_config


def problems(raw, kinds) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds)
    return e.value.problems


def test_valid_config_builds_dag_in_dependency_order(tmp_path, kinds):
    cfg = load_config(write_config(tmp_path, basic_config(tmp_path)), kinds)
    assert cfg.topo_order() == ["ingest", "shard", "ingest_pairs", "shard_pairs"]
    assert cfg.dependants({"ingest"}) == {"ingest", "shard"}
    assert cfg.stages["shard"].max_count == 20
    assert cfg.root == tmp_path  # no pyproject/.git above: the config's folder is the root


def test_every_problem_is_reported_with_its_path(tmp_path, kinds):
    raw = basic_config(tmp_path)
    raw["stages"]["shard"]["max_count"] = 0
    raw["stages"]["shard"]["validation_fraction"] = 1.5
    raw["stages"]["shard"]["maxcount"] = 3
    raw["stages"]["ingest"]["on_bad_record"] = "ignore"
    raw["stages"]["extra"] = {"kind": "shardd", "inputs": ["ingest"]}
    raw["datasets"]["text"]["kind"] = "txt"
    raw["bogus_top"] = 1
    got = problems(raw, kinds)
    assert "stages.shard.max_count: must be > 0, got 0" in got
    assert "stages.shard.validation_fraction: must be < 1, got 1.5" in got
    assert any(p.startswith("stages.shard.maxcount: unknown field (did you mean 'max_count'?)") for p in got)
    assert "stages.ingest.on_bad_record: must be one of 'fail' or 'skip', got 'ignore'" in got
    assert any(p.startswith("stages.extra.kind: unknown stage kind 'shardd' (did you mean 'shard'?)") for p in got)
    assert "datasets.text.kind: must be one of 'text', 'chat' or 'preference', got 'txt'" in got
    assert any(p.startswith("bogus_top: unknown field") for p in got)
    assert len(got) == 7, got


def test_dangling_reference_cycle_and_type_mismatch(tmp_path, kinds):
    raw = basic_config(tmp_path)
    raw["stages"]["shard"]["inputs"] = ["ingset"]
    assert problems(raw, kinds) == [
        "stages.shard.inputs[0]: 'ingset' is not a dataset or a stage (did you mean 'ingest'?)"]

    raw = basic_config(tmp_path)
    raw["stages"]["ingest"]["inputs"] = ["shard"]
    got = problems(raw, kinds)
    assert len(got) == 1 and got[0].startswith("stages: cycle ") and "ingest" in got[0] and "shard" in got[0]

    raw = basic_config(tmp_path)
    raw["stages"]["shard"]["inputs"] = ["text"]  # shard reads records, not raw datasets
    assert problems(raw, kinds) == ["stages.shard.inputs: input 0 is text dataset; shard reads records"]

    raw = basic_config(tmp_path)
    raw["stages"]["ingest"]["inputs"] = ["text", "pairs"]
    assert problems(raw, kinds) == [
        "stages.ingest.inputs: inputs mix data kinds ['preference', 'text']; ingest needs one kind"]


def test_name_collision_and_missing_sections(tmp_path, kinds):
    raw = basic_config(tmp_path)
    raw["stages"]["text"] = {"kind": "ingest", "inputs": ["pairs"]}
    assert "stages.text: name also used by datasets.text; give them different names" in problems(raw, kinds)
    got = problems({"store": "x"}, kinds)
    assert "stages: required; declare at least one stage" in got
    assert any(p.startswith("name: required field is missing") for p in got)


def test_overrides_apply_before_validation(tmp_path, kinds):
    path = write_config(tmp_path, basic_config(tmp_path))
    cfg = load_config(path, kinds, ["stages.shard.max_count=7", "stages.shard.seed=3"])
    assert (cfg.stages["shard"].max_count, cfg.stages["shard"].seed) == (7, 3)
    with pytest.raises(ConfigError) as e:
        load_config(path, kinds, ["stages.shard.max_count=-1", "nonsense"])
    assert "override 'nonsense': expected KEY=VALUE" in str(e.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path, kinds):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nstages:\n  a: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, kinds)
    assert f"{path}:4:1: invalid YAML" in str(e.value)


def test_cli_validate_exit_codes_and_text(tmp_path, capsys):
    raw = basic_config(tmp_path)
    good = write_config(tmp_path, raw, "good.yaml")
    assert main(["validate", str(good)]) == 0
    assert "OK:" in capsys.readouterr().out
    raw["stages"]["shard"]["max_count"] = 0
    raw["stages"]["shard"]["inputs"] = ["nope"]
    bad = write_config(tmp_path, raw, "bad.yaml")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "2 problems in the pipeline config" in err
    assert "stages.shard.max_count: must be > 0, got 0" in err
    assert "stages.shard.inputs[0]: 'nope' is not a dataset or a stage" in err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_demo_config_is_valid(kinds):
    from tests.helpers import REPO

    cfg = load_config(REPO / "configs" / "demo.yaml", kinds)
    assert cfg.root == REPO and cfg.store_url == str(REPO / "artifacts")
    assert cfg.tracking_uri == f"sqlite:///{REPO / 'mlflow.db'}"


@pytest.mark.parametrize("name", ["../evil", "a/b", ".hidden", "sp ace"])
def test_a_stage_name_that_is_not_a_plain_name_is_refused_by_validate(tmp_path, kinds, capsys, name):
    raw = basic_config(tmp_path)
    raw["stages"][name] = {"kind": "shard", "inputs": ["ingest"]}
    assert main(["validate", str(write_config(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert f"stages: stage name {name!r} must match" in err and "no slashes" in err
