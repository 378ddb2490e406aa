"""Artifact identity follows the code and the environment: code fingerprints in ids, reruns explained by the
plan, `--accept-code-change`, the environment in manifests and MLflow, and paths resolved against the root."""
from __future__ import annotations

import ast
import json
import logging
import shutil
from importlib import metadata
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.cli import main
from lmforge import fingerprint, provenance
from lmforge.config import load_config, parse_config
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from lmforge.store import ArtifactStore, folder_fingerprint
from tests.helpers import basic_config, write_config, write_jsonl

SOURCE = '''"""Module docstring."""
import os


def f(x):
    """Docstring."""
    return x + 1  # a comment
'''


READ_SOURCE, LIBRARY_VERSION = fingerprint._read_source, fingerprint._library_version


@pytest.fixture(autouse=True)
def _fresh_fingerprints():
    """Fingerprints are cached per process: every test starts and ends with none (tests edit sources/versions)."""
    fingerprint.cache_clear()
    yield
    fingerprint.cache_clear()


def edit_module(monkeypatch, rel: str, extra: str = "\n_EDITED = 1\n") -> None:
    """Make the fingerprint read `rel` (e.g. tasks/ingest.py) with `extra` appended: a real code change."""

    def read(path: Path) -> str:
        text = READ_SOURCE(path)
        return text + extra if path.as_posix().endswith("/" + rel) else text

    monkeypatch.setattr(fingerprint, "_read_source", read)
    fingerprint.cache_clear()


def fake_library_version(monkeypatch, dist: str, version: str) -> str:
    """Make the fingerprint see `dist` at `version`; returns the installed version."""
    monkeypatch.setattr(fingerprint, "_library_version", lambda d: version if d == dist else LIBRARY_VERSION(d))
    fingerprint.cache_clear()
    return LIBRARY_VERSION(dist)


def run_stages(cfg, kinds) -> dict[str, str]:
    """Run every stage of a plan in order through the executor (no Prefect); returns {stage: status}."""
    plan = make_plan(cfg, kinds)
    ctx = RunContext(plan=plan, kinds=kinds)
    return {n: execute_stage(ctx, n)["status"] for n in plan.stages}


# ----------------------------------------------------------------------------------------------
# the fingerprint itself


def test_comments_docstrings_and_formatting_do_not_count_a_real_change_does():
    same = SOURCE.replace('"""Module docstring."""', '"""Another docstring."""').replace("# a comment", "") \
        .replace("return x + 1", "return (x +\n            1)").replace('"""Docstring."""', "# only a comment")
    assert fingerprint.normalized_source(same) == fingerprint.normalized_source(SOURCE)
    assert fingerprint.normalized_source(SOURCE.replace("x + 1", "x + 2")) != fingerprint.normalized_source(SOURCE)
    # a string that is not a docstring is code
    assert fingerprint.normalized_source(SOURCE.replace("import os", "import os\nNAME = 'a'")) != \
        fingerprint.normalized_source(SOURCE.replace("import os", "import os\nNAME = 'b'"))


def test_stage_fingerprint_changes_with_its_code_not_with_its_comments(monkeypatch, kinds):
    sft, shard = fingerprint.for_stage(kinds["sft"]), fingerprint.for_stage(kinds["shard"])
    edit_module(monkeypatch, "trainer/sft.py", '\n# a comment\ndef _unused():\n    """Just a docstring."""\n')
    # an empty function with only a docstring is still a new function: code
    assert fingerprint.for_stage(kinds["sft"]).fingerprint != sft.fingerprint
    edit_module(monkeypatch, "trainer/sft.py", "\n# only a comment, and blank lines\n\n\n")
    assert fingerprint.for_stage(kinds["sft"]) == sft
    edit_module(monkeypatch, "trainer/sft.py")
    changed = fingerprint.for_stage(kinds["sft"])
    assert changed.fingerprint != sft.fingerprint
    assert {p for p in sft.modules if changed.modules[p] != sft.modules[p]} == {"trainer/sft.py"}
    assert fingerprint.diff(sft.to_json(), changed) == (["trainer/sft.py"], [])
    assert fingerprint.for_stage(kinds["shard"]) == shard  # a stage that does not use trainer/sft.py


def test_import_walk_covers_stage_recipe_and_project_imports_not_excluded_modules(kinds):
    sft = fingerprint.for_stage(kinds["sft"])
    # the stage module, the child's entry point and recipe (StageDef.code), what they import (also inside
    # functions: tasks/training.py, which tasks/sft.py imports, imports trainer.launch in launch_training)
    for path in ("tasks/sft.py", "trainer/entry.py", "trainer/sft.py", "trainer/launch.py", "trainer/checkpoint.py",
                 "lmforge/store.py", "lmforge/config.py"):
        assert path in sft.modules, path
    for kind in kinds:  # excluded: cannot shape an artifact's content
        mods = fingerprint.for_stage(kinds[kind]).modules
        assert not {"lmforge/tracking.py", "trainer/metrics.py", "lmforge/log.py", "lmforge/provenance.py",
                    "lmforge/errors.py", "trainer/errors.py", "tasks/__init__.py"} & set(mods), kind
        assert all(not p.startswith("/") and p.endswith(".py") for p in mods)
    assert "trainer/grpo.py" in fingerprint.for_stage(kinds["grpo"]).modules
    assert "tasks/evaluation/engine.py" in fingerprint.for_stage(kinds["eval"]).modules
    assert "trainer/sft.py" not in fingerprint.for_stage(kinds["shard"]).modules
    # exact library versions, from the same walk: trl implies transformers implies tokenizers
    v = metadata.version
    assert fingerprint.for_stage(kinds["shard"]).libraries == {"webdataset": v("webdataset")}
    assert fingerprint.for_stage(kinds["dedup"]).libraries == {"datasketch": v("datasketch")}
    # ingest reads JSON arrays with ijson and save_to_disk folders with datasets: their versions shape its records
    assert fingerprint.for_stage(kinds["ingest"]).libraries == {"datasets": v("datasets"), "ijson": v("ijson")}
    libs = sft.libraries
    assert {k: libs[k] for k in ("trl", "transformers", "tokenizers", "torch", "peft")} == \
        {k: v(k) for k in ("trl", "transformers", "tokenizers", "torch", "peft")}
    assert fingerprint.for_stage(kinds["eval"]).libraries["lm-eval"] == v("lm-eval")


def test_imports_relative_in_functions_submodules_and_not_type_checking():
    src = ("from typing import TYPE_CHECKING\nfrom . import store\nfrom .config import StageConfig\n"
           "import trainer.sft\nfrom trainer import checkpoint, Something\n"
           "if TYPE_CHECKING:\n    from trainer import ppo\nelse:\n    import json\n"
           "def f():\n    from lmforge.shards import shard_urls\n    import trl.experimental\n")
    found = fingerprint._imported_modules(ast.parse(src), "lmforge")
    assert sorted(found) == sorted(["typing", "lmforge", "lmforge.store", "lmforge.config", "trainer", "trainer.sft",
                                    "trainer.checkpoint", "json", "lmforge.shards", "trl", "trl.experimental"])


def test_the_same_in_another_checkout(tmp_path, monkeypatch, kinds):
    # (its speed is a benchmark's business, not a timed assertion: on a loaded
    # 2-core CI machine even process time doubles)
    before = {k: fingerprint.for_stage(s) for k, s in kinds.items()}
    for pkg in fingerprint.PACKAGES:
        shutil.copytree(fingerprint.ROOT / pkg, tmp_path / "checkout" / pkg,
                        ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(fingerprint, "ROOT", tmp_path / "checkout")
    fingerprint.cache_clear()
    assert {k: fingerprint.for_stage(s) for k, s in kinds.items()} == before
    (tmp_path / "checkout/trainer/models.py").write_text((fingerprint.ROOT / "trainer/models.py").read_text() + "\nX = 1\n")
    fingerprint.cache_clear()
    after = {k: fingerprint.for_stage(s) for k, s in kinds.items()}
    assert {k for k in kinds if after[k] != before[k]} == \
        {k for k in kinds if "trainer/models.py" in before[k].modules} >= {"sft", "dpo", "reward", "eval"}


# ----------------------------------------------------------------------------------------------
# ids and plans


def test_code_change_reruns_the_stage_and_its_dependants_and_says_why(tmp_path, monkeypatch, kinds):
    cfg = parse_config(basic_config(tmp_path), kinds, root=tmp_path)
    assert run_stages(cfg, kinds) == dict.fromkeys(["ingest", "shard", "ingest_pairs", "shard_pairs"], "ran")
    before = make_plan(cfg, kinds).stages
    assert {s.action for s in before.values()} == {"cached"}

    edit_module(monkeypatch, "tasks/ingest.py")
    after = make_plan(cfg, kinds).stages
    assert {n: (s.action, s.reason) for n, s in after.items()} == {
        "ingest": ("run", "code changed: tasks/ingest.py"),
        "shard": ("run", "input changed: ingest (will run)"),
        "ingest_pairs": ("run", "code changed: tasks/ingest.py"),
        "shard_pairs": ("run", "input changed: ingest_pairs (will run)")}
    assert all(after[n].artifact_id != before[n].artifact_id for n in after)
    assert after["shard"].version == before["shard"].version  # shard's own code did not change

    # an old manifest without a code block
    aid = before["ingest"].artifact_id
    mpath = tmp_path / "artifacts/ingest" / aid / "manifest.json"
    m = json.loads(mpath.read_text())
    del m["code"]
    mpath.write_text(json.dumps(m))
    assert make_plan(cfg, kinds).stages["ingest"].reason == \
        "code changed: the previous artifact predates code fingerprints"


def test_library_version_change_is_explained(tmp_path, monkeypatch, kinds):
    cfg = parse_config(basic_config(tmp_path), kinds, root=tmp_path)
    run_stages(cfg, kinds)
    installed = fake_library_version(monkeypatch, "webdataset", "9.9.9")
    stages = make_plan(cfg, kinds).stages
    assert {n: (s.action, s.reason) for n, s in stages.items()} == {
        "ingest": ("cached", "cached: manifest exists"), "ingest_pairs": ("cached", "cached: manifest exists"),
        "shard": ("run", f"webdataset {installed} -> 9.9.9"), "shard_pairs": ("run", f"webdataset {installed} -> 9.9.9")}


def test_trl_version_change_is_explained_for_training_stages(monkeypatch, kinds):
    """The issue's example, through the explanation the plan gives (no training run needed)."""
    from lmforge.plan import code_changes

    sft_before = fingerprint.for_stage(kinds["sft"]).to_json()
    trl = fake_library_version(monkeypatch, "trl", "1.13.0")
    assert code_changes({"code": sft_before}, fingerprint.for_stage(kinds["sft"])) == f"trl {trl} -> 1.13.0"


def test_manifest_and_mlflow_carry_code_and_environment(tmp_path, kinds):
    path = write_config(tmp_path, basic_config(tmp_path))
    assert main(["run", str(path), "--json", str(tmp_path / "run.json")]) == 0
    summary = json.loads((tmp_path / "run.json").read_text())
    code = fingerprint.for_stage(kinds["shard"])
    m = json.loads((tmp_path / "artifacts/shard" / summary["stages"]["shard"]["artifact_id"] /
                    "manifest.json").read_text())
    assert m["code"] == {"fingerprint": code.fingerprint, "modules": code.modules,
                         "libraries": {"webdataset": metadata.version("webdataset")}}
    assert m["code_version"] == code.fingerprint and m["code"]["modules"]["tasks/shard.py"] == code.modules[
        "tasks/shard.py"] and len(code.modules["tasks/shard.py"]) == 12
    env = provenance.environment()
    assert m["environment"] == env
    assert set(env) >= {"python", "torch", "cuda", "gpu", "gpu_count", "machine", "cpu", "host"}
    assert env["torch"] == metadata.version("torch") and env["machine"] and env["host"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    shard_run = client.get_run(summary["stages"]["shard"]["mlflow_run_id"])
    parent = client.get_run(summary["mlflow_run_id"])
    for run in (shard_run, parent):
        assert {k: run.data.tags[f"lmforge.env.{k}"] for k in env} == env
    assert shard_run.data.tags["lmforge.code_version"] == code.fingerprint


def test_accept_code_change_through_the_cli(tmp_path, monkeypatch, kinds, capsys, caplog):
    path = write_config(tmp_path, basic_config(tmp_path))
    assert main(["run", str(path), "--json", str(tmp_path / "first.json")]) == 0
    first = json.loads((tmp_path / "first.json").read_text())
    ids = {n: s["artifact_id"] for n, s in first["stages"].items()}
    old_code = fingerprint.for_stage(kinds["ingest"])
    edit_module(monkeypatch, "tasks/ingest.py")
    new_code = fingerprint.for_stage(kinds["ingest"])
    new_id = make_plan(load_config(path, kinds), kinds).stages["ingest"].artifact_id

    capsys.readouterr()
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{'run':<6} {'ingest':<18} ingest/{new_id}" in out and "(code changed: tasks/ingest.py)" in out

    caplog.set_level(logging.WARNING, logger="lmforge.executor")
    assert main(["run", str(path), "--accept-code-change", "ingest", "--json", str(tmp_path / "second.json")]) == 0
    second = json.loads((tmp_path / "second.json").read_text())
    # ingest keeps its old id; shard, reading it, stays cached; ingest_pairs (same kind, not named) reruns
    assert {n: s["status"] for n, s in second["stages"].items()} == \
        {"ingest": "cached", "shard": "cached", "ingest_pairs": "ran", "shard_pairs": "ran"}
    assert second["stages"]["ingest"]["artifact_id"] == ids["ingest"]
    assert second["stages"]["shard"]["artifact_id"] == ids["shard"]
    # one record (a second run in this process leaves caplog's handler reached twice by the same record; a second
    # warning would be a second record, with its own creation time)
    warnings = sorted({(r.created, r.getMessage()) for r in caplog.records if "code change accepted" in r.getMessage()})
    warnings = [m for _, m in warnings]
    assert len(warnings) == 1 and f"ingest/{ids['ingest']}" in warnings[0] and "tasks/ingest.py" in warnings[0]

    # recorded: in the store's _accepted, in the old artifact's manifest and on the MLflow run
    record = json.loads((tmp_path / f"artifacts/_accepted/ingest/{new_id}.json").read_text())
    assert {k: record[k] for k in ("artifact_id", "new_artifact_id", "stage", "pipeline", "changes")} == \
        {"artifact_id": ids["ingest"], "new_artifact_id": new_id, "stage": "ingest", "pipeline": "t",
         "changes": "code changed: tasks/ingest.py"}
    assert record["code_before"] == old_code.to_json() and record["code_after"] == new_code.to_json()
    assert record["accepted_at"] and record["mlflow_run_id"] == second["stages"]["ingest"]["mlflow_run_id"]
    manifest = ArtifactStore(str(tmp_path / "artifacts")).require("ingest", ids["ingest"]).manifest
    assert [(a["new_artifact_id"], a["changes"]) for a in manifest["code_change_accepted"]] == \
        [(new_id, "code changed: tasks/ingest.py")]
    assert manifest["code"] == old_code.to_json()  # the artifact still says which code made it
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    tags = client.get_run(second["stages"]["ingest"]["mlflow_run_id"]).data.tags
    assert tags["lmforge.code_change_accepted"].startswith(f"ingest/{ids['ingest']} kept instead of {new_id}")
    assert tags["lmforge.code_change_accepted"].endswith(": code changed: tasks/ingest.py")
    assert client.get_run(second["mlflow_run_id"]).data.tags["lmforge.accept_code_change"] == "ingest"

    # later plain runs keep using it, and say so
    capsys.readouterr()
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{'cached':<6} {'ingest':<18} ingest/{ids['ingest']}" in out
    assert f"code change accepted (--accept-code-change ingest, {record['accepted_at']})" in out
    caplog.clear()
    assert main(["run", str(path), "--json", str(tmp_path / "third.json")]) == 0
    third = json.loads((tmp_path / "third.json").read_text())
    assert {n: s["status"] for n, s in third["stages"].items()} == dict.fromkeys(second["stages"], "cached")
    assert third["stages"]["ingest"]["artifact_id"] == ids["ingest"]
    assert any("code change accepted" in r.getMessage() for r in caplog.records)
    assert len(ArtifactStore(str(tmp_path / "artifacts")).require("ingest", ids["ingest"]).manifest[
        "code_change_accepted"]) == 1

    # refused when the config changed too: named stage, and what else changed
    capsys.readouterr()
    assert main(["run", str(path), "-o", "stages.ingest.part_records=7", "--accept-code-change", "ingest"]) == 2
    err = capsys.readouterr().err
    assert "--accept-code-change ingest: refused" in err and "config changed: part_records 100000 -> 7" in err
    # a name that is no stage
    assert main(["plan", str(path), "--accept-code-change", "nope"]) == 2
    assert "--accept-code-change nope: no stage named 'nope'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# paths and resume


def sft_config(root: Path, base_path: str) -> dict:
    write_jsonl(root / "data" / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "hello"}]}])
    return {"name": "ids", "store": "artifacts",
            "datasets": {"chat": {"path": "data/chat.jsonl", "kind": "chat"}},
            "stages": {"ingest": {"kind": "ingest", "inputs": ["chat"]},
                       "shard": {"kind": "shard", "inputs": ["ingest"]},
                       "sft": {"kind": "sft", "inputs": ["shard"], "base_model": {"path": base_path}},
                       "eval": {"kind": "eval", "inputs": ["sft"], "task_dirs": ["tasks_extra"],
                                "models": [{"name": "base", "base": base_path}, {"name": "sft", "input": "sft"}]}}}


def fake_model(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(weights)
    return folder


def test_ids_do_not_depend_on_the_working_directory(tmp_path, monkeypatch, kinds):
    root = tmp_path / "project"
    model = fake_model(root / "models" / "tiny", b"\x00" * 64)
    (root / "tasks_extra").mkdir()
    (root / "tasks_extra" / "t.yaml").write_text("task: t\n")
    path = write_config(root, sft_config(root, "models/tiny"))
    (root / "pyproject.toml").write_text("")
    # a folder of the same relative name under another working directory, with other weights
    decoy = tmp_path / "elsewhere"
    fake_model(decoy / "models" / "tiny", b"\x01" * 64)
    plans = []
    for cwd in (root, decoy, tmp_path):
        monkeypatch.chdir(cwd)
        plans.append(make_plan(load_config(path, kinds), kinds).stages)
    ids = [{n: s.artifact_id for n, s in p.items()} for p in plans]
    assert ids[0] == ids[1] == ids[2]
    sft = plans[1]["sft"].settings
    assert sft["base_model"]["path"] == folder_fingerprint(model)  # the root's folder, not the decoy
    ev = plans[1]["eval"].settings
    assert ev["models"][0]["base"] == folder_fingerprint(model)
    assert ev["task_dirs"] == [folder_fingerprint(root / "tasks_extra")]
    assert load_config(path, kinds).stages["eval"].local_path("tasks_extra") == root / "tasks_extra"


def test_checkpoint_records_its_environment_and_resume_elsewhere_warns(tmp_path, caplog):
    from trainer import checkpoint

    local = tmp_path / "local"
    local.mkdir()
    (local / "weights.bin").write_bytes(b"w")
    uri = str(tmp_path / "ckpts")
    checkpoint.upload(local, uri, 200)
    done = json.loads((tmp_path / "ckpts/checkpoint-200/DONE").read_text())
    assert done["environment"] == provenance.environment()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert checkpoint.warn_if_environment_changed(uri, 200, "sft") == []  # same machine: nothing to say
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    now = provenance.environment()
    other = {**now, "torch": "2.0.0", "machine": "aarch64", "host": "host-a"}
    done["environment"] = other
    (tmp_path / "ckpts/checkpoint-200/DONE").write_text(json.dumps(done))
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        changes = checkpoint.warn_if_environment_changed(uri, 200, "sft")
    assert changes == [f"torch 2.0.0 -> {now['torch']}", f"machine aarch64 -> {now['machine']}",
                       f"host host-a -> {now['host']}"]
    msg = caplog.records[-1].getMessage()
    assert msg.startswith(f"resuming sft from step 200 made on torch 2.0.0/aarch64 host host-a, now "
                          f"torch {now['torch']}/{now['machine']}")
    assert "torch 2.0.0 -> " in msg


def test_a_parse_broken_by_another_threads_parse_is_retried(monkeypatch):
    """CPython 3.11 shares ast's recursion counter between threads; a Dask cluster's thread broke a plan's parse
    in CI ("AST constructor recursion depth mismatch"). A parse is pure: lmforge parses again."""
    import ast

    from lmforge import fingerprint

    real, calls = ast.parse, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=165, after=76)")
        return real(*args, **kwargs)

    monkeypatch.setattr(fingerprint.ast, "parse", flaky)
    assert fingerprint.normalized_source("x = 1\n") == fingerprint.normalized_source("x = 1  # same\n")
    assert len(calls) == 3
    monkeypatch.setattr(fingerprint.ast, "parse", lambda *a, **k: (_ for _ in ()).throw(SystemError("other")))
    with pytest.raises(SystemError, match="other"):
        fingerprint.normalized_source("x = 1\n")
