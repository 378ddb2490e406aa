"""`lmforge run --force STAGE` starts that stage over and keeps what it replaces.

Through the CLI, as a user runs it: the forced stage trains from step 0 (its old checkpoints are history, not a
resume point), the old result stays readable while the new one trains, and once the new manifest is published the
old artifact (manifest, weights, checkpoints) is whole under `_history/<stamp>/`. Its dependants start over too.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import yaml

from flows.cli import main
from lmforge.store import ArtifactStore, sha256_file
from tests.helpers import chat_rows, sft, train_pipeline, write_jsonl


def test_force_trains_from_step_zero_and_keeps_the_replaced_artifact_whole(tmp_path, capsys):
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(120))
    stages = {"sft": sft(method="full", max_steps=30, checkpoint_every_steps=10, keep_checkpoints=3, evaluate=False),
              "again": sft(inputs=["shard", "sft"], base_model=None, method="lora", max_steps=4, evaluate=False)}
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(yaml.safe_dump(train_pipeline(tmp_path, stages), sort_keys=False))
    assert main(["run", str(cfg)]) == 0
    store = ArtifactStore(str(tmp_path / "artifacts"))
    old = store.list("sft")
    assert len(old) == 2
    first = next(a for a in old if a.result["method"] == "full")
    dependant = next(a for a in old if a.result["method"] == "lora")
    assert first.result["resumed_from_step"] == 0 and first.result["checkpoints_uploaded"] == [10, 20]
    old_weights = first.files["model.safetensors"]["sha256"]
    old_finished = first.manifest["timings"]["finished_at"]

    # while the forced run trains, the old result is still the artifact, whole and verified
    seen: dict[str, object] = {}

    def watch() -> None:
        ckpts = f"{first.path}/_checkpoints"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "old_during_training" not in seen:
            store.fs.invalidate_cache()
            retired = store.fs.glob(f"{first.path}/_history/*/_checkpoints")
            done = store.fs.glob(f"{ckpts}/checkpoint-*/DONE") if retired and store.fs.exists(ckpts) else []
            if done:  # the old checkpoints are history and the forced run uploaded one: training is under way
                during = store.get("sft", first.id)
                during.verify()
                seen["old_during_training"] = during.manifest["timings"]["finished_at"]
                seen["checkpoints"] = sorted(done)
            time.sleep(0.01)

    assert main(["plan", str(cfg), "--force", "sft"]) == 0  # what the forced run will do, and why
    plan = capsys.readouterr().out
    assert "forced (--force sft)" in plan and "forced: depends on sft" in plan
    watcher = threading.Thread(target=watch)
    watcher.start()
    assert main(["run", str(cfg), "--force", "sft"]) == 0
    watcher.join()
    assert seen.get("old_during_training") == old_finished, seen
    assert seen["checkpoints"][0] == f"{first.path}/_checkpoints/checkpoint-10/DONE", seen  # the new run's first

    new = store.require("sft", first.id)  # same config, same id
    assert new.result["resumed_from_step"] == 0 and new.result["steps"] == 30
    assert new.result["checkpoints_uploaded"] == [10, 20]
    assert new.manifest["timings"]["finished_at"] != old_finished
    new.verify()
    # the replaced artifact, whole: manifest, weights and the checkpoints it trained with
    history = store.fs.ls(f"{first.path}/_history", detail=False)
    assert len(history) == 1, history
    kept = history[0]
    assert sha256_file(Path(kept) / "model.safetensors") == old_weights
    assert yaml.safe_load(open(f"{kept}/manifest.json"))["timings"]["finished_at"] == old_finished
    kept_ckpts = sorted(int(p.rsplit("/", 2)[-2].split("-")[1])
                        for p in store.fs.glob(f"{kept}/_checkpoints/checkpoint-*/DONE"))
    assert kept_ckpts == [10, 20]
    # the dependant started over as well, with its old result kept the same way
    again = store.require("sft", dependant.id)
    assert again.result["resumed_from_step"] == 0
    assert again.manifest["timings"]["finished_at"] != dependant.manifest["timings"]["finished_at"]
    assert len(store.fs.ls(f"{dependant.path}/_history", detail=False)) == 1
