"""What the stage (parent process) hands to the training process (child): one JSON file.

`JobSpec` carries the method, the stage's settings, the input shards and artifact references, where
to write the output, where checkpoints go and which MLflow run gets the metrics. Shards travel as
`ShardRef`s (URL plus the manifest's size and sha256, checked before a shard is used); other artifacts
by reference (store URL, kind, id), read through their manifest in the child: `materialize` gives a
local folder whose files were checked against the manifest's sizes and sha256.

A stage trained on several nodes: node 0 (the `lmforge run` holding the stage's lease) publishes a `JoinRecord`,
its job spec plus the rendezvous, at `join_uri(store, pipeline, stage)`; every other node's `lmforge join` reads it
(trainer.launch.join_node).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from lmforge.config import TrainingMonitoring
from lmforge.errors import ArtifactError
from lmforge.lease import Fence
from lmforge.shards import ShardRef
from lmforge.store import Artifact, ArtifactStore

log = logging.getLogger(__name__)


class ArtifactRef(BaseModel):
    """A finished artifact in a store, by address."""

    model_config = ConfigDict(extra="forbid")

    store: str
    kind: str
    id: str

    @classmethod
    def of(cls, artifact: Artifact) -> "ArtifactRef":
        return cls(store=artifact.store.url, kind=artifact.kind, id=artifact.id)

    def open(self) -> Artifact:
        return ArtifactStore(self.store).require(self.kind, self.id)

    def describe(self) -> str:
        return f"{self.kind} artifact {self.id}"


class JobSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: str  # sft | ... : which recipe in trainer/ runs
    stage: str  # the pipeline's stage name, for logs and errors
    settings: dict[str, Any]  # the stage config's settings(); the recipe validates them into its own model
    train_shards: list[ShardRef]  # each checked against its manifest digest before its records are used
    validation_shards: list[ShardRef] = []
    tokenizer: ArtifactRef | None = None
    model: ArtifactRef | None = None
    reward_model: ArtifactRef | None = None  # a `reward` stage's model (RL stages: grpo, rloo, ppo)
    output_dir: str  # local folder the final artifact files go into (the stage's staging folder)
    work_dir: str  # local scratch: local checkpoints, downloaded inputs, spec and result files
    checkpoint_uri: str  # fsspec URL; each checkpoint is uploaded here as soon as it is saved
    lease: Fence | None = None  # the stage's lease: checked before every checkpoint upload and prune (fencing)
    resume_from: str | None = None  # local copy of the newest complete checkpoint, downloaded by the parent
    resume_step: int | None = None
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    monitoring: TrainingMonitoring | None = None  # Prometheus endpoint / Pushgateway of rank 0 (trainer.monitoring)
    #: the shards are a `tokenize` stage's token rows (tasks/tokenize.py): their rows per shard, chat template,
    #: tokenizer fingerprint and row settings; None: the shards hold records the recipe tokenizes itself
    token_data: dict[str, Any] | None = None
    #: a multi-node attempt's id (node 0's JoinRecord): every rank checks that all ranks run the same attempt
    attempt: str | None = None

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2))

    @classmethod
    def read(cls, path: Path) -> "JobSpec":
        return cls.model_validate_json(path.read_text())


JOIN_FOLDER = "_join"  # under the store's root; `_`-prefixed folders are no artifact kind


def join_uri(store_url: str, pipeline: str, stage: str) -> str:
    """Where node 0 of `stage` publishes its JoinRecord: a key the other nodes know from the config alone (store,
    pipeline name, stage name), before they know the artifact id (that needs the data, which they need not have)."""
    return f"{store_url.rstrip('/')}/{JOIN_FOLDER}/{pipeline}/{stage}.json"


class JoinRecord(BaseModel):
    """What a joining node needs: node 0's job spec (its work and output folders are node 0's; a joining node uses
    its own), the rendezvous, and the state of node 0's attempt (training, then trained or failed)."""

    model_config = ConfigDict(extra="forbid")

    attempt: str  # new for every attempt of node 0: a joining node never follows an older one
    state: Literal["training", "trained", "failed"]
    stage: str
    artifact_uri: str  # the artifact node 0 builds: its manifest appears there when node 0 publishes
    nnodes: int
    nproc_per_node: int
    rdzv_endpoint: str
    host: str
    pid: int
    published_at: float
    error: str | None = None  # why node 0's attempt failed
    spec: JobSpec

    def write(self, uri: str) -> None:
        from lmforge.store import filesystem, is_local

        fs, path = filesystem(uri)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        data = self.model_dump_json(indent=2).encode()
        if is_local(fs):  # never seen half-written
            tmp = f"{path}.tmp-{os.getpid()}"
            fs.pipe_file(tmp, data)
            os.replace(tmp, path)
        else:
            fs.pipe_file(path, data)

    @classmethod
    def read(cls, uri: str) -> "JoinRecord | None":
        from lmforge.store import filesystem

        fs, path = filesystem(uri)
        try:
            fs.invalidate_cache(path)
            return cls.model_validate_json(fs.cat_file(path))
        except FileNotFoundError:
            return None

    def mark(self, uri: str, state: str, error: str | None = None) -> None:
        """Record the end of node 0's attempt, unless a newer attempt has replaced this record meanwhile."""
        now = JoinRecord.read(uri)
        if now is None or now.attempt == self.attempt:
            self.model_copy(update={"state": state, "error": error, "published_at": time.time()}).write(uri)


CONFIG_BYTES = 1 << 20  # what a config-only check (`verify=False`) reads and checks: config and tokenizer files


def materialize(ref: ArtifactRef, work_dir: Path, verify: bool = True) -> Path:
    """A local folder with the artifact's files, each checked against the manifest (size and sha256) before
    the folder is returned, so nothing loads bytes the manifest does not vouch for.

    A local store is read in place and every file hashed there. An object store is downloaded into
    `work_dir/inputs/`, hashed as it streams; a copy downloaded before (`.complete`) is hashed again against
    the manifest (the copy may have changed, or the artifact been replaced) and downloaded anew if it differs.
    `verify=False` is for the parent's config-only checks: only the files up to CONFIG_BYTES (configs,
    tokenizer files) are checked, or downloaded; the training process checks everything before it loads.
    """
    art = ref.open()
    limit = None if verify else CONFIG_BYTES
    if art.store.local:
        art.verify_local(Path(art.path), max_bytes=limit)
        return Path(art.path)
    dest = work_dir / "inputs" / f"{ref.kind}-{ref.id}"
    if (dest / ".complete").exists():
        try:
            art.verify_local(dest, max_bytes=limit)
            return dest
        except ArtifactError as e:
            log.warning("the downloaded copy of %s in %s no longer matches its manifest (%s); downloading it again",
                        art.uri, dest, str(e).split(". ", 1)[0])
    shutil.rmtree(dest, ignore_errors=True)
    wanted = [rel for rel, e in art.files.items() if limit is None or e["bytes"] <= limit]
    art.download(dest, wanted)  # hashed as it streams; a mismatch raises at EOF
    if verify:
        (dest / ".complete").touch()  # every file is here and matched
    log.info("downloaded %s (%d of %d files) to %s, verified", art.uri, len(wanted), len(art.files), dest)
    return dest


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
