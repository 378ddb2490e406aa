"""What the training stages (pretrain, sft, reward, dpo, ppo, grpo) share: the config base, the result fields
they all report, the input checks, a base model's content identity, and the launcher that trains in a child
process.

- `TrainingConfig`: a stage's config is `StageConfig` plus its method's settings (trainer/settings.py), inherited
  second (`class SftConfig(TrainingConfig, SftSettings)`). The settings' `RUN_ONLY` fields stay out of the id, a
  local base model enters it by its content, and `trainer_settings` is what the training process gets.
- `TrainingResult`, `PreferenceResult`, `RLResult`: the result fields every training stage, every preference
  stage (reward, dpo) and every RL stage (ppo, grpo) reports; each stage adds its own.
- `launch_training`: the job spec, the checks that need only the config and the model's config (before any
  process starts), then the training child (`trainer.launch`); with nnodes > 1, as node 0 of the stage.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lmforge.config import StageConfig
from lmforge.errors import ConfigError
from lmforge.port import Port
from lmforge.shards import shard_refs
from lmforge.stage import StageRuntime, TrainedResult
from lmforge.store import Artifact, file_fingerprint, folder_fingerprint

log = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"  # a tokenize stage's chat template, next to its token shards


# ----------------------------------------------------------------------------------------------
# config and results


class TrainingConfig(StageConfig):
    """A training stage's config: the stage's own fields, then its method's settings, inherited second."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        #: how often to checkpoint and log and how to launch (the settings' RUN_ONLY) do not change the model:
        #: kept out of the id
        cls.ORCHESTRATION_FIELDS = StageConfig.ORCHESTRATION_FIELDS | getattr(cls, "RUN_ONLY", frozenset())

    def settings(self) -> dict:
        """Ids depend on content, not paths (as in the eval stage): a local `base_model.path` folder enters as the
        sha256 of its files' names and contents, a package GGUF as the package's version and the file's sha256.
        A relative path resolves against the project root, as the run resolves it; a path or package that cannot
        be found enters as written, and `run` reports it."""
        return model_source_identity(super().settings(), self.base_model, self.project_root)

    def trainer_settings(self) -> dict:
        """Every training setting, including the orchestration ones the training process needs."""
        return self.model_dump(mode="json", exclude=set(StageConfig.model_fields))


class TrainingResult(TrainedResult):
    """What every training stage reports."""

    base_model: str
    steps: int
    train_seconds: float
    peak_memory_mb: float
    resumed_from_step: int
    checkpoints_uploaded: list[int]


class PreferenceResult(TrainingResult):
    """What a stage that trains on preference pairs (reward, dpo) reports."""

    method: str
    train_records: int
    validation_records: int
    skipped_identical_pairs: int
    train_pairs: int
    validation_pairs: int
    token_shards: str | None = None  # kind/id of the tokenize stage's token shards this stage streamed
    epochs: float
    train_loss_first: float | None
    train_loss_last: float | None
    train_reward_accuracy_last: float | None
    train_margin_last: float | None
    eval_loss: float | None
    eval_reward_accuracy: float | None
    eval_margin: float | None
    trainable_parameters: int


class RLResult(TrainingResult):
    """What a stage that trains a policy on its own samples (ppo, grpo) reports."""

    method: str
    format: str
    train_records: int
    validation_records: int
    dropped_prompt_too_long: int
    train_prompts: int
    validation_prompts: int  # distinct validation prompts of the held-out check
    epochs: float
    train_reward_first: float | None
    train_reward_last: float | None
    train_kl_last: float | None
    eval_reward_start: float | None  # the starting policy, greedy, on the validation prompts
    eval_reward_trained: float | None
    trainable_parameters: int  # of the policy


# ----------------------------------------------------------------------------------------------
# inputs


def wrong_shards(inputs: list[Port], data_kinds: tuple[str, ...]) -> str | None:
    """None when `inputs` hold exactly one shards input of `data_kinds`; else the shards given, for the error."""
    shards = [p for p in inputs if p.type == "shards"]
    if len(shards) == 1 and shards[0].data_kind in data_kinds:
        return None
    return ", ".join(p.describe() for p in shards) or "none"


def check_input_types(inputs: list[Port], stage: str, reads: str) -> None:
    """Only shards, tokenizer and model inputs, and at most one tokenizer and one model."""
    for i, p in enumerate(inputs):
        if p.type not in ("shards", "tokenizer", "model"):
            raise ValueError(f"input {i} is {p.describe()}; {stage} reads {reads}, a tokenizer and a model")
    for t in ("tokenizer", "model"):
        if sum(p.type == t for p in inputs) > 1:
            raise ValueError(f"{stage} takes at most one {t} input")


def check_model_source(cfg, inputs: list[Port], needs: str) -> None:
    """Exactly one model source: `base_model` or a model input (`needs` says what to do when there is none), and a
    tokenizer input for a base model built from config. Raises ValueError naming the problem."""
    has_model = any(p.type == "model" for p in inputs)
    if cfg.base_model is None and not has_model:
        raise ValueError(needs)
    if cfg.base_model is not None and has_model:
        raise ValueError("both base_model and a model input are given; keep one of them")
    has_tokenizer = any(p.type == "tokenizer" for p in inputs)
    if cfg.base_model is not None and cfg.base_model.config is not None and not has_tokenizer:
        raise ValueError("a base_model built from config has no tokenizer; add a tokenizer stage to inputs")


def check_model_inputs(cfg, inputs: list[Port], stage: str, data_kinds: tuple[str, ...], reads: str) -> None:
    """The inputs of a stage that loads a model's tokenizer (sft, tokenize): one shards input of `data_kinds`, at
    most one tokenizer and one model, and exactly one model source. Raises ValueError naming the problem."""
    got = wrong_shards(inputs, data_kinds)
    if got is not None:
        raise ValueError(f"{stage} reads exactly one {reads} input (got {got})")
    check_input_types(inputs, stage, "chat shards")
    check_model_source(cfg, inputs, f"{stage} needs a base model: set base_model (config, path, package+file or "
                       "hub) or add a model stage to inputs")


def check_preference_inputs(stage: str, inputs: list[Port]) -> None:
    """Exactly one preference shards input, at most one tokenizer and one (non-reward) model."""
    got = wrong_shards(inputs, ("preference", f"{stage}_tokens"))
    if got is not None:
        also = f" (or a tokenize stage's {stage}_tokens shards)" if stage in ("dpo", "reward") else ""
        raise ValueError(f"{stage} reads exactly one preference shards input{also} (got {got})")
    for i, p in enumerate(inputs):
        if p.type not in ("shards", "tokenizer", "model"):
            raise ValueError(f"input {i} is {p.describe()}; {stage} reads preference shards, a tokenizer and a model")
        if p.type == "model" and p.data_kind == "reward":
            raise ValueError(f"input {i} is a reward model; {stage} starts from a policy model (e.g. an sft stage)")
    for t in ("tokenizer", "model"):
        if sum(p.type == t for p in inputs) > 1:
            raise ValueError(f"{stage} takes at most one {t} input")


def check_prompt_shards(stage: str, inputs: list[Port]) -> None:
    """An RL stage's prompts: exactly one preference or chat shards input."""
    got = wrong_shards(inputs, ("preference", "chat"))
    if got is not None:
        raise ValueError(f"{stage} reads exactly one preference or chat shards input, for its prompts (got {got})")


def split_models(inputs: list[Port]) -> tuple[list[Port], list[Port]]:
    """(policy models, reward models) among an RL stage's inputs."""
    models = [p for p in inputs if p.type == "model"]
    return [p for p in models if p.data_kind != "reward"], [p for p in models if p.data_kind == "reward"]


def split_reward_model(inputs: list[Artifact]) -> tuple[list[Artifact], Artifact | None]:
    """(the inputs but the reward model, the reward model or None): an RL stage's reward model is no policy."""
    def is_reward_model(a: Artifact) -> bool:
        return a.manifest.get("output", {}).get("data_kind") == "reward"

    reward_models = [a for a in inputs if is_reward_model(a)]
    return [a for a in inputs if not is_reward_model(a)], reward_models[0] if reward_models else None


# ----------------------------------------------------------------------------------------------
# a base model's content identity


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


# ----------------------------------------------------------------------------------------------
# the launcher


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
    from trainer.job import ArtifactRef, JobSpec, join_uri

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
            # launcher, processes, deepspeed/fsdp: from the settings; with nnodes > 1 this is node 0, and the other
            # nodes (`lmforge join`) find its job spec at the join key
            return launch.run(spec, root=runtime.root,
                              join=join_uri(runtime.store.url, runtime.pipeline, runtime.stage))
    except SettingError as e:
        raise ConfigError([f"stages.{runtime.stage}.{e.field}: {e.problem}"]) from None


def token_data(shards: Artifact) -> dict | None:
    """What the training process needs to stream a `tokenize` stage's rows (None for record shards): rows per
    shard of each split, the chat template they were made with (read verified), the tokenizer's fingerprint and
    the row settings."""
    r = shards.result
    if not str(r.get("data_kind", "")).endswith("_tokens"):
        return None
    with shards.open_verified(TEMPLATE_FILE) as f:
        template = f.read().decode()
    return {"artifact": f"{shards.kind}/{shards.id}", "stage": shards.producer,
            "rows_per_shard": {s: [x["samples"] for x in r["shards"] if x["split"] == s]
                               for s in ("train", "validation")},
            "chat_template": template, "tokenizer_fingerprint": r["tokenizer_fingerprint"],
            "max_length_tokens": r["max_length_tokens"], "assistant_only_loss": r.get("assistant_only_loss"),
            "rows": r.get("rows", "sft"), "records": r.get("records"), "skipped_identical": r.get("skipped_identical"),
            "dropped_no_label": r["dropped_no_label"]}
