"""Registered model versions hold an export stage's standalone model only: `models:/<pipeline>-<stage>@champion`
downloads the final weights, config, tokenizer, chat template, model card and MLflow model files, never the training
stage's checkpoints or a manifest, and the download loads with transformers and with MLflow. Training stages are
not registered themselves. On a local store with a local MLflow artifact folder the weights are hard links, not a second copy;
on S3 the version is made from the upload's staging folder, or, for an artifact that has no such version yet (a
cached stage in a new tracking store), from a verified download."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from mlflow.artifacts import download_artifacts
from mlflow.tracking import MlflowClient

from lmforge.runview import promote_champions
from lmforge.tracking import Tracker
from tests.helpers import TRAIN_DATA, artifact, chat_rows, run_config, run_stages, sft, train_pipeline, \
    write_jsonl, write_task_dir

#: an exported sft model: weights, config, tokenizer, chat template, model card, MLflow model
MODEL = ["MLmodel", "README.md", "chat_template.jinja", "components/tokenizer/chat_template.jinja",
         "components/tokenizer/tokenizer.json", "components/tokenizer/tokenizer_config.json", "conda.yaml",
         "config.json", "generation_config.json", "lmforge_model.json", "model.safetensors", "python_env.yaml",
         "requirements.txt", "tokenizer.json", "tokenizer_config.json"]
SFT = sft(method="full", max_steps=4, evaluate=False, checkpoint_every_steps=2)
#: what MLflow downloads of a registered MLflow model: its files and MLflow's registered_model_meta (name, version)
DOWNLOAD = sorted([*MODEL, "registered_model_meta"])
EXPORT = {"kind": "export", "inputs": ["sft"], "retries": 0}


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _download(uri: str, tracking: str, dest: Path, monkeypatch) -> Path:
    """As a user downloads a registered model: MLflow resolves `models:/` against the registry of the environment
    (MLFLOW_TRACKING_URI; its registry_uri argument does not reach that lookup in MLflow 3.17)."""
    with monkeypatch.context() as m:  # only for the download: a Tracker made later would take its registry too
        m.setenv("MLFLOW_TRACKING_URI", tracking)
        m.setenv("MLFLOW_REGISTRY_URI", tracking)
        return Path(download_artifacts(artifact_uri=uri, dst_path=str(dest)))


def _loads(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True,
                                   tokenize=False)
    ids = torch.tensor([tok(text)["input_ids"]])
    assert model.config.hidden_size == 64
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] > ids.shape[1]


def test_champion_download_is_the_model_only_and_loads(tmp_path, kinds, monkeypatch):
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(60))
    stages = {"sft": SFT,
              "eval": {"kind": "eval", "inputs": ["sft"], "retries": 0, "models": [{"name": "sft", "input": "sft"}],
                       "tasks": ["t_mc"], "task_dirs": [str(write_task_dir(tmp_path / "tasks"))],
                       "gates": [{"metric": "sft/t_mc/acc", "against": "sft", "max_regression": 0.0}]},
              "export": {**EXPORT, "inputs": ["sft", "eval"]}}
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(tracking, "train")
    plan, out = run_stages(tmp_path, kinds, stages, TRAIN_DATA + ["sft", "eval", "export"], tracker)
    assert promote_champions(tracker, plan, out) == {"train-sft": "1"}
    trained, art = artifact(plan, "sft"), artifact(plan, "export")
    store_files = _files(Path(trained.path))
    assert any(f.startswith("_checkpoints/checkpoint-") for f in store_files) and "manifest.json" in store_files

    client = MlflowClient(tracking)
    # the registry holds the export only: the training stage made no version of its own
    assert [m.name for m in client.search_registered_models()] == ["train-sft"]
    assert "lmforge.registered_model" not in client.get_run(out["sft"]["mlflow_run_id"]).data.tags
    version = client.get_model_version_by_alias("train-sft", "champion")
    run_id = out["export"]["mlflow_run_id"]
    assert (version.source, version.run_id) == (f"runs:/{run_id}/model", run_id)
    assert version.tags["lmforge.artifact_id"] == art.id and version.tags["lmforge.contents"] == "model"
    assert (version.tags["lmforge.stage"], version.tags["lmforge.export_stage"]) == ("sft", "export")
    assert version.tags["lmforge.source_artifact"] == f"sft/{trained.id}"
    dl = _download("models:/train-sft@champion", tracking, tmp_path / "dl", monkeypatch)
    assert _files(dl) == DOWNLOAD  # no _checkpoints/, no manifest.json
    art.verify_local(dl)  # the same bytes as the artifact's files
    _loads(dl)
    # the run's copy is hard links to the store's files: the weights are on disk once
    run_dir = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://")) / "model"
    assert os.path.samefile(run_dir / "model.safetensors", Path(art.path) / "model.safetensors")

    # a cached rerun reuses the version: no new one, no second upload
    plan2, out2 = run_stages(tmp_path, kinds, stages, TRAIN_DATA + ["sft", "eval", "export"], tracker)
    assert out2["export"]["status"] == "cached"
    assert [str(v.version) for v in client.search_model_versions("name='train-sft'")] == ["1"]
    assert "model" not in [f.path for f in client.list_artifacts(out2["export"]["mlflow_run_id"])]


@pytest.mark.s3
def test_s3_store_registers_the_model_only(s3, tmp_path, kinds, monkeypatch):
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(60))
    raw = train_pipeline(tmp_path, {"sft": SFT, "export": EXPORT})
    raw["store"] = f"s3://lmforge-test/registry-{uuid.uuid4().hex[:8]}"
    names = TRAIN_DATA + ["sft", "export"]
    for db, status in (("made.db", "ran"), ("later.db", "cached")):  # later: a new tracking store, the stage cached
        tracking = f"sqlite:///{tmp_path / db}"
        plan, out = run_config(raw, kinds, tmp_path, names, Tracker(tracking, "train"))
        assert out["sft"]["status"] == out["export"]["status"] == status
        version = MlflowClient(tracking).get_model_version_by_alias("train-sft", "candidate")
        assert version.source == f"runs:/{out['export']['mlflow_run_id']}/model"
        dl = _download("models:/train-sft@candidate", tracking, tmp_path / f"dl-{status}", monkeypatch)
        assert _files(dl) == DOWNLOAD
        artifact(plan, "export").verify_local(dl)
    assert plan.store.fs.find(plan.store.checkpoint_path("sft", plan.stages["sft"].artifact_id))  # in the store only
    _loads(dl)


# slow (three sft runs): the default test covers the model-only version and its
# reuse by a cached rerun; this one covers `--force`, which replaces an artifact under the same id
@pytest.mark.slow
def test_a_forced_rerun_keeps_the_version_of_identical_weights_and_adds_one_for_new_weights(tmp_path, kinds,
                                                                                          monkeypatch):
    from lmforge.config import parse_config
    from lmforge.executor import RunContext, execute_stage
    from lmforge.plan import make_plan

    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(60))
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(tracking, "train")
    client = MlflowClient(tracking)

    def run(stage: dict, force: list[str]):
        plan = make_plan(parse_config(train_pipeline(tmp_path, {"sft": stage, "export": EXPORT}), kinds,
                                      root=tmp_path), kinds, force=force)
        ctx = RunContext(plan=plan, kinds=kinds, tracker=tracker)
        ctx.parent_run_id = tracker.start_run("pipeline", {})
        return plan, {n: execute_stage(ctx, n) for n in TRAIN_DATA + ["sft", "export"]}

    def versions() -> dict[str, str]:
        found = client.search_model_versions("name='train-sft'")
        return {str(v.version): v.tags["lmforge.model_digest"] for v in found}

    plan, out = run(SFT, [])
    first = artifact(plan, "export")
    assert list(versions()) == ["1"]
    # forced, the same weights (CPU training is bit-reproducible here) exported again to the same bytes (the MLflow
    # files do not depend on the clock): the version of those bytes is kept
    plan, out = run(SFT, ["sft", "export"])
    assert out["sft"]["status"] == out["export"]["status"] == "ran" and artifact(plan, "export").id == first.id
    assert list(versions()) == ["1"]
    # other weights under the same id (a forced rerun on a GPU, or on another machine): the model from another
    # seed, registered as this artifact's, gets a version of its own; the same bytes again reuse it
    plan2, out2 = run({**SFT, "seed": 7}, [])
    other = artifact(plan2, "export")
    assert other.id != first.id and sorted(versions()) == ["1", "2"]  # its own artifact: its own version
    files = [f for f in MODEL if f in other.files]
    digest = "other-weights-0001"
    tags = {"lmforge.artifact_id": first.id, "lmforge.model_digest": digest}
    assert tracker.register_model("train-sft", Path(other.path), files, out["export"]["mlflow_run_id"], tags) == "3"
    assert tracker.register_model("train-sft", Path(other.path), files, out["export"]["mlflow_run_id"], tags) == "3"
    assert tracker.model_version("train-sft", first.id, digest=versions()["1"]) == "1"
    old = _download("models:/train-sft/1", tracking, tmp_path / "v1", monkeypatch)
    new = _download("models:/train-sft/3", tracking, tmp_path / "v2", monkeypatch)
    first.verify_local(old)  # version 1 still serves the bytes it registered
    other.verify_local(new)


# slow (a minute: `mlflow models serve` starts its own Python and loads the model): the default suite loads the same
# registered folder with mlflow.pyfunc and compares its chat answers with lmforge's greedy ones
# (tests/test_export.py::test_the_export_stage_is_a_plain_folder_an_mlflow_model_and_a_true_card)
@pytest.mark.slow
def test_mlflow_models_serve_answers_the_champion_like_lmforge_generate(tmp_path, kinds, monkeypatch):
    import json
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from trainer.generations import generate
    from trainer.models import load_trained

    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(60))
    stages = {"sft": {**SFT, "max_steps": 12},
              "eval": {"kind": "eval", "inputs": ["sft"], "retries": 0, "models": [{"name": "sft", "input": "sft"}],
                       "tasks": ["t_mc"], "task_dirs": [str(write_task_dir(tmp_path / "tasks"))],
                       "gates": [{"metric": "sft/t_mc/acc", "against": "sft", "max_regression": 0.0}]},
              "export": {**EXPORT, "inputs": ["sft", "eval"], "max_new_tokens": 8}}
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(tracking, "train")
    plan, out = run_stages(tmp_path, kinds, stages, TRAIN_DATA + ["sft", "eval", "export"], tracker)
    assert promote_champions(tracker, plan, out) == {"train-sft": "1"}
    model, tok = load_trained(Path(artifact(plan, "export").path))
    questions = ["What is 2 plus 3?", "What is 7 plus 1?"]
    expected = generate(model, tok, questions, 8)  # lmforge's own greedy answers, through the chat template

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mlflow_cli = Path(sys.executable).with_name("mlflow")
    # as a user runs it, in the environment: MLflow starts `uvicorn` from PATH
    env = {**os.environ, "MLFLOW_TRACKING_URI": tracking, "MLFLOW_REGISTRY_URI": tracking,
           "PATH": f"{mlflow_cli.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([str(mlflow_cli), "models", "serve", "-m", "models:/train-sft@champion", "--env-manager",
                             "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        for q, want in zip(questions, expected):
            body = json.dumps({"messages": [{"role": "user", "content": q}]}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                answer = json.load(r)
            choices = answer["predictions"][0]["choices"] if "predictions" in answer else answer[0]["choices"]
            assert choices[0]["message"]["content"].strip() == want, (q, answer)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
