"""reward: preference shards -> a reward model (sequence classification, one score), with TRL's RewardTrainer.

Inputs: one preference `shards` artifact ({prompt, chosen, rejected} records), plus optionally a `tokenizer`
artifact and/or a `model` artifact (e.g. the sft stage's model: its backbone gets a new score head;
otherwise `base_model` says where the model comes from). Pairs with chosen == rejected are skipped and
counted (`skipped_identical_pairs`); pairs longer than `max_length_tokens` are counted too (`dropped_too_long`).
The training runs in a child process (`trainer.launch`), with checkpoints in the store (a rerun resumes)
and metrics on the stage's MLflow run (`train/loss`, `train/reward_accuracy`, `train/margin`,
`eval/reward_accuracy`, `eval/margin`, ...). The result carries the held-out pairwise accuracy and mean
margin on the shards' validation split.

Output: a `model` artifact with data kind `reward`: a full `...ForSequenceClassification` model (LoRA merged),
the tokenizer, and `lmforge_model.json` with `"kind": "reward_model"`; reload it with
`trainer.reward.load_reward_model`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from lmforge.config import StageConfig
from lmforge.errors import ConfigError
from lmforge.shards import shard_urls
from lmforge.stage import Port, Result, StageDef, StageRuntime
from lmforge.store import Artifact
from tasks.sft import model_source_identity
from trainer.settings import RewardSettings

log = logging.getLogger(__name__)


class RewardStageConfig(StageConfig, RewardSettings):
    kind: Literal["reward"] = Field(description="Reward model on preference shards (TRL RewardTrainer).")

    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | RewardSettings.RUN_ONLY

    def settings(self) -> dict:
        """As in sft: a base model enters the id by its content, never by its path."""
        return model_source_identity(super().settings(), self.base_model)

    def trainer_settings(self) -> dict:
        return self.model_dump(mode="json", include=set(RewardSettings.model_fields))


class RewardResult(Result):
    method: str
    base_model: str
    train_records: int
    validation_records: int
    skipped_identical_pairs: int
    dropped_too_long: int
    train_pairs: int
    validation_pairs: int
    steps: int
    epochs: float
    train_loss_first: float | None
    train_loss_last: float | None
    train_reward_accuracy_last: float | None
    train_margin_last: float | None
    eval_loss: float | None
    eval_reward_accuracy: float | None
    eval_margin: float | None
    train_seconds: float
    peak_memory_mb: float
    trainable_parameters: int
    resumed_from_step: int
    checkpoints_uploaded: list[int]


def by_type(inputs: list[Artifact]) -> dict[str, list[Artifact]]:
    out: dict[str, list[Artifact]] = {}
    for a in inputs:
        out.setdefault(a.manifest.get("output", {}).get("type", a.kind), []).append(a)
    return out


def launch_training(method: str, cfg, settings_cls, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> dict:
    """Shared by reward and dpo: build the job spec, run the config-only checks, train in a child process."""
    from trainer import launch, models
    from trainer.errors import SettingError
    from trainer.job import ArtifactRef, JobSpec

    settings = cfg.model_dump(mode="json", include=set(settings_cls.model_fields))
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
                train_urls=shard_urls(shards, "train"), validation_urls=shard_urls(shards, "validation"),
                tokenizer=ArtifactRef.of(tokenizer) if tokenizer else None,
                model=ArtifactRef.of(model) if model else None,
                output_dir=str(out), work_dir=str(work), checkpoint_uri=runtime.checkpoint_uri,
                tracking_uri=runtime.tracking_uri, mlflow_run_id=runtime.mlflow_run_id)
            res = models.resolve(base_model, spec.model, work, verify=False)
            if method == "reward" and cfg.method == "qlora":
                raise SettingError("method", "the reward stage trains method full or lora; qlora is not supported "
                                   "for sequence-classification reward models yet; use lora")
            info = models.preflight(res, cfg.method, cfg.lora, cfg.max_length_tokens)
            log.info("stage %s: %s %s, %s", runtime.stage, cfg.method, res.describe, info)
            return launch.run(spec, launcher=cfg.launcher, nproc_per_node=cfg.nproc_per_node)
    except SettingError as e:
        raise ConfigError([f"stages.{runtime.stage}.{e.field}: {e.problem}"]) from None


def run(cfg: RewardStageConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> RewardResult:
    return RewardResult(**launch_training("reward", cfg, RewardSettings, inputs, out, runtime))


def check_inputs(stage: str, inputs: list[Port]) -> None:
    """Exactly one preference shards input, at most one tokenizer and one (non-reward) model."""
    shards = [p for p in inputs if p.type == "shards"]
    if len(shards) != 1 or shards[0].data_kind != "preference":
        got = ", ".join(p.describe() for p in shards) or "none"
        raise ValueError(f"{stage} reads exactly one preference shards input (got {got})")
    for i, p in enumerate(inputs):
        if p.type not in ("shards", "tokenizer", "model"):
            raise ValueError(f"input {i} is {p.describe()}; {stage} reads preference shards, a tokenizer and a model")
        if p.type == "model" and p.data_kind == "reward":
            raise ValueError(f"input {i} is a reward model; {stage} starts from a policy model (e.g. an sft stage)")
    for t in ("tokenizer", "model"):
        if sum(p.type == t for p in inputs) > 1:
            raise ValueError(f"{stage} takes at most one {t} input")


def output_port(cfg: RewardStageConfig, inputs: list[Port]) -> Port:
    check_inputs("reward", inputs)
    has_model = any(p.type == "model" for p in inputs)
    if cfg.base_model is None and not has_model:
        raise ValueError("reward needs a base model: set base_model (config, path, package+file or hub) or add a "
                         "model stage to inputs")
    if cfg.base_model is not None and has_model:
        raise ValueError("both base_model and a model input are given; keep one of them")
    has_tokenizer = any(p.type == "tokenizer" for p in inputs)
    if cfg.base_model is not None and cfg.base_model.config is not None and not has_tokenizer:
        raise ValueError("a base_model built from config has no tokenizer; add a tokenizer stage to inputs")
    return Port("model", "reward")


STAGE = StageDef(kind="reward", version="1", config=RewardStageConfig, run=run, output_port=output_port,
                 wants_runtime=True, description="preference shards -> reward model (TRL RewardTrainer, full/lora)")
