"""sft: chat shards -> a fine-tuned model (full) or LoRA adapter (lora, qlora), with TRL's SFTTrainer.

Inputs: one chat `shards` artifact, plus optionally a `tokenizer` artifact and/or a `model` artifact
(an earlier stage's model to continue from; otherwise `base_model` says where the model comes from).
The training runs in a child process (`trainer.launch`): checkpoints go to the stage's checkpoint URI as
they are saved, so a rerun after a failure or SIGTERM resumes; metrics go to the stage's MLflow run.
Before the child starts, the settings that need only the model's config are checked here (sequence
length, LoRA target modules, bitsandbytes for qlora), so a bad config fails in seconds.

Output: a `model` artifact: `config.json` + `model.safetensors` (full) or `adapter_config.json` +
`adapter_model.safetensors` (lora, qlora), the tokenizer, and `lmforge_model.json` (how to reload it).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from lmforge.config import StageConfig
from lmforge.errors import ConfigError
from lmforge.shards import shard_refs
from lmforge.stage import Port, StageDef, StageRuntime, TrainedResult
from lmforge.store import Artifact, file_fingerprint, folder_fingerprint
from trainer.settings import SftSettings

log = logging.getLogger(__name__)


class SftConfig(StageConfig, SftSettings):
    kind: Literal["sft"] = Field(description="Supervised fine-tuning on chat shards (TRL SFTTrainer).")

    #: how often to checkpoint and log, and how to launch, do not change the model: kept out of the id
    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | SftSettings.RUN_ONLY

    def settings(self) -> dict:
        """Ids depend on content, not paths (as in the eval stage): a local `base_model.path` folder enters as the
        sha256 of its files' names and contents, a package GGUF as the package's version and the file's sha256.
        A relative path resolves against the project root, as the run resolves it; a path or package that cannot
        be found enters as written, and `run` reports it."""
        return model_source_identity(super().settings(), self.base_model, self.project_root)

    def trainer_settings(self) -> dict:
        """Every training setting, including the orchestration ones the training process needs."""
        return self.model_dump(mode="json", include=set(SftSettings.model_fields))


def model_source_identity(settings: dict, src, root: Path) -> dict:
    """`settings` with `base_model` (a local folder, relative to the project `root`, or a package GGUF) replaced by
    its content identity."""
    if src is not None and src.path is not None:
        settings["base_model"]["path"] = folder_fingerprint(root / Path(src.path).expanduser()) or src.path
    elif src is not None and src.package is not None:
        settings["base_model"].update(_gguf_identity(src.package, src.file or ""))
    return settings


def _gguf_identity(package: str, file: str) -> dict[str, str]:
    """{package: name==version, file: sha256:...} of a GGUF shipped in an installed package; as written if absent."""
    from importlib import metadata

    from trainer.errors import SettingError
    from trainer.models import gguf_location

    try:
        path = gguf_location(package, file)
    except SettingError:
        return {"package": package, "file": file}
    dists = metadata.packages_distributions().get(package) or [package]
    try:
        version = metadata.version(dists[0])
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"package": f"{package}=={version}", "file": "sha256:" + file_fingerprint(path)}


class SftResult(TrainedResult):
    method: str
    base_model: str
    format: str
    train_records: int
    train_rows: int
    dropped_fully_masked: int
    validation_records: int
    token_shards: str | None = None  # kind/id of the tokenize stage's token shards this stage streamed
    steps: int
    epochs: float
    train_loss_first: float | None
    train_loss_last: float | None
    eval_loss: float | None
    tokens: int
    tokens_per_s: float
    train_seconds: float
    peak_memory_mb: float
    trainable_parameters: int
    quantized_linear_layers: int
    resumed_from_step: int
    checkpoints_uploaded: list[int]


def by_type(inputs: list[Artifact]) -> dict[str, list[Artifact]]:
    """Input artifacts grouped by their output type (shards, tokenizer, model)."""
    out: dict[str, list[Artifact]] = {}
    for a in inputs:
        out.setdefault(a.manifest.get("output", {}).get("type", a.kind), []).append(a)
    return out


def launch_training(method: str, cfg, inputs: list[Artifact], out: Path, runtime: StageRuntime,
                    reward_model: Artifact | None = None) -> dict:
    """Every training stage (sft, reward, dpo, RL): build the job spec, run the checks that need only the
    config and the model's config (before any process starts), then train in a child process.
    `reward_model` (RL stages) is a `reward` stage's artifact, kept out of `inputs` so that `inputs`' one
    model stays the policy. Returns the child's result dict."""
    from trainer import launch, models
    from trainer.errors import SettingError
    from trainer.job import ArtifactRef, JobSpec

    settings = cfg.trainer_settings()
    base_model = cfg.base_model
    if base_model is not None and base_model.path is not None:  # relative to the project root; the child runs elsewhere
        base_model = base_model.model_copy(
            update={"path": str((runtime.root / Path(base_model.path).expanduser()).resolve())})
        settings["base_model"]["path"] = base_model.path
    found = by_type(inputs)
    shards = found["shards"][0]
    tokenizer = found.get("tokenizer", [None])[0]
    model = found.get("model", [None])[0]
    try:
        with launch.work_dir(runtime.stage, runtime.artifact_id) as work:
            spec = JobSpec(
                method=method, stage=runtime.stage, settings=settings,
                # each shard with its manifest's size and sha256: the child checks them before using a record
                train_shards=shard_refs(shards, "train"), validation_shards=shard_refs(shards, "validation"),
                tokenizer=ArtifactRef.of(tokenizer) if tokenizer else None,
                model=ArtifactRef.of(model) if model else None,
                reward_model=ArtifactRef.of(reward_model) if reward_model else None,
                output_dir=str(out), work_dir=str(work), checkpoint_uri=runtime.checkpoint_uri, lease=runtime.lease,
                tracking_uri=runtime.tracking_uri, mlflow_run_id=runtime.mlflow_run_id, monitoring=runtime.monitoring,
                token_data=token_data(shards))
            res = models.resolve(base_model, spec.model, work, verify=False)
            info = models.preflight(res, cfg.method, cfg.lora, cfg.max_length_tokens)
            log.info("stage %s: %s %s, %s", runtime.stage, cfg.method, res.describe, info)
            return launch.run(spec, root=runtime.root)  # launcher, processes, deepspeed/fsdp: from the settings
    except SettingError as e:
        raise ConfigError([f"stages.{runtime.stage}.{e.field}: {e.problem}"]) from None


def token_data(shards: Artifact) -> dict | None:
    """What the training process needs to stream a `tokenize` stage's rows (None for record shards): rows per
    shard of each split, the chat template they were made with (read verified), the tokenizer's fingerprint and
    the row settings."""
    r = shards.result
    if not str(r.get("data_kind", "")).endswith("_tokens"):
        return None
    from tasks.tokenize import TEMPLATE_FILE

    with shards.open_verified(TEMPLATE_FILE) as f:
        template = f.read().decode()
    return {"artifact": f"{shards.kind}/{shards.id}", "stage": shards.producer,
            "rows_per_shard": {s: [x["samples"] for x in r["shards"] if x["split"] == s]
                               for s in ("train", "validation")},
            "chat_template": template, "tokenizer_fingerprint": r["tokenizer_fingerprint"],
            "max_length_tokens": r["max_length_tokens"], "assistant_only_loss": r.get("assistant_only_loss"),
            "rows": r.get("rows", "sft"), "records": r.get("records"), "skipped_identical": r.get("skipped_identical"),
            "dropped_no_label": r["dropped_no_label"]}


def run(cfg: SftConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> SftResult:
    return SftResult(**launch_training("sft", cfg, inputs, out, runtime))


def check_model_inputs(cfg, inputs: list[Port], stage: str, data_kinds: tuple[str, ...], reads: str) -> None:
    """The inputs of a stage that loads a model's tokenizer (sft, tokenize): one shards input of `data_kinds`, at
    most one tokenizer and one model, and exactly one model source. Raises ValueError naming the problem."""
    shards = [p for p in inputs if p.type == "shards"]
    if len(shards) != 1 or shards[0].data_kind not in data_kinds:
        got = ", ".join(p.describe() for p in shards) or "none"
        raise ValueError(f"{stage} reads exactly one {reads} input (got {got})")
    for i, p in enumerate(inputs):
        if p.type not in ("shards", "tokenizer", "model"):
            raise ValueError(f"input {i} is {p.describe()}; {stage} reads chat shards, a tokenizer and a model")
    for t in ("tokenizer", "model"):
        if sum(p.type == t for p in inputs) > 1:
            raise ValueError(f"{stage} takes at most one {t} input")
    has_model = any(p.type == "model" for p in inputs)
    if cfg.base_model is None and not has_model:
        raise ValueError(f"{stage} needs a base model: set base_model (config, path, package+file or hub) or add a "
                         "model stage to inputs")
    if cfg.base_model is not None and has_model:
        raise ValueError("both base_model and a model input are given; keep one of them")
    has_tokenizer = any(p.type == "tokenizer" for p in inputs)
    if cfg.base_model is not None and cfg.base_model.config is not None and not has_tokenizer:
        raise ValueError("a base_model built from config has no tokenizer; add a tokenizer stage to inputs")


def output_port(cfg: SftConfig, inputs: list[Port]) -> Port:
    check_model_inputs(cfg, inputs, "sft", ("chat", "sft_tokens"),
                       "chat shards (or a tokenize stage's sft_tokens shards)")
    return Port("model")


STAGE = StageDef(kind="sft", version="1", code=("trainer.entry", "trainer.sft", "trainer.tokens"),  # the child's code
                 config=SftConfig, run=run, output_port=output_port, wants_runtime=True,
                 description="chat shards -> fine-tuned model or LoRA adapter (TRL SFTTrainer, full/lora/qlora)",
                 output_type="model")
