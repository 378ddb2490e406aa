"""The stage contract shared by every stage kind in `tasks/`.

A stage is one module with one entry point, `run(cfg, inputs, out) -> Result`:
- `cfg` is its validated config (a `StageConfig` subclass),
- `inputs` are what it reads, in the order of `cfg.inputs`: `DatasetInput` for raw datasets,
  `Artifact` for outputs of other stages,
- `out` is a local staging folder it writes into; the store publishes it with a manifest.
A `StageDef` bundles that function with its config model, code version and type check; the code
fingerprint in every artifact id covers its module and everything that module imports.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

from pydantic import BaseModel, ConfigDict

from lmforge.config import StageConfig
from lmforge.datasets import DatasetInput
from lmforge.port import Port
from lmforge.store import Artifact
from lmforge.store import ArtifactStore as Store

Input = Union[DatasetInput, Artifact]


class Result(BaseModel):
    """A stage's typed summary. Numbers become MLflow metrics; everything goes into the manifest."""

    model_config = ConfigDict(extra="forbid")

    def metrics(self) -> dict[str, float]:
        return numeric_leaves(self.model_dump(mode="json"))


class TrainedResult(Result):
    """What every training stage reports beside its own figures: how reproducible the run was
    (`trainer.determinism`). Goes into the manifest with the rest of the result."""

    deterministic: bool  # deterministic algorithms on, and no op without a deterministic version ran
    nondeterminism: list[str]  # why not, when not: the setting, or each op torch warned about
    cpu_threads: int  # math threads per training process (the sums' order on CPU)
    # trainer/batching.PaddingMeter, rank 0: the share of computed tokens that were padding, and real tokens/s;
    # None where the trainer has no training_step to measure (ppo's own loop)
    padding_fraction: float | None = None
    nonpad_tokens_per_s: float | None = None
    # CPU: the training process's non-model RSS when training begins (its RSS then, less the model's parameters
    # and buffers; trainer.metrics.nonmodel_rss_mb), what the preflight subtracts from the peak RSS
    baseline_rss_mb: float | None = None
    rss_after_imports_mb: float | None = None  # CPU: its RSS after importing torch/transformers/trl


def numeric_leaves(d: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """{"a": {"b": 2}, "c": "x"} -> {"a/b": 2.0}: the numbers in a nested summary, as metric names."""
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, (bool, int, float)):
            out[key] = float(v)
        elif isinstance(v, dict):
            out.update(numeric_leaves(v, key + "/"))
    return out


@dataclass(frozen=True)
class StageRuntime:
    """Where a stage runs, for stages that need more than `out` (checkpoints, live metrics).

    Passed as `run(cfg, inputs, out, runtime=...)` to stages whose StageDef sets `wants_runtime`.
    A training stage hands these to its child process: checkpoints go to `checkpoint_uri` right
    away (so a rerun resumes), metrics go to the stage's MLflow run `mlflow_run_id`.
    """

    pipeline: str
    stage: str
    kind: str
    artifact_id: str
    store: Store
    checkpoint_uri: str
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    root: Path = Path(".")  # project root: relative paths in settings resolve against it
    lease: Any = None  # lmforge.lease.Fence of the stage's lease: the child checks it before touching checkpoints
    monitoring: Any = None  # lmforge.monitoring.TrainingMonitoring: where the training process serves its metrics


@dataclass(frozen=True)
class StageDef:
    kind: str
    version: str  # a manual bump for what the source cannot show; the code fingerprint (lmforge.fingerprint) has it
    config: type[StageConfig]
    run: Callable[..., Result]  # run(cfg, inputs, out) -> Result, plus runtime= if wants_runtime
    output_port: Callable[[Any, list[Port]], Port]  # raises ValueError naming the bad input
    description: str = ""
    wants_runtime: bool = False
    #: modules that make the output besides `run`'s module and what it imports: the training child's entry
    #: point and the recipe it loads by name (`trainer.entry` imports `trainer.<method>` dynamically)
    code: tuple[str, ...] = ()
    #: parse_config's hook for kinds tied to another stage: link(name, cfg, stages) -> {name: replaced config}
    #: (tasks/preflight.py); raises ValueError("<field>: problem")
    link: Callable[[str, Any, dict[str, Any]], dict[str, Any]] | None = None
    #: the artifact type (Port.type) of every output of this kind, where it does not depend on the config or the
    #: inputs: what link hooks can know of a stage before ports exist (a tokenize stage tells its tokenizer and
    #: model inputs from its data inputs by it). parse_config checks it against output_port's answer.
    output_type: str | None = None
    #: the stage loads models in the flow's own process (eval, export, a preflight's reload), not in a training
    #: child: the executor runs such stages one at a time per process (`executor.MODELS_HERE`), since transformers'
    #: loading is not thread-safe (an export loaded beside an eval came out with meta tensors)
    loads_models_here: bool = False


def expect_inputs(inputs: list[Port], stage: str, *, count: int | None = None, types: set[str],
                  same_kind: bool = True) -> str | None:
    """Shared input check for `output_port`: returns the common data kind or raises ValueError."""
    if count is not None and len(inputs) != count:
        raise ValueError(f"{stage} takes exactly {count} input(s), got {len(inputs)}")
    if not inputs:
        raise ValueError(f"{stage} needs at least one input ({' or '.join(sorted(types))})")
    for i, p in enumerate(inputs):
        if p.type not in types:
            raise ValueError(f"input {i} is {p.describe()}; {stage} reads {' or '.join(sorted(types))}")
    kinds = {p.data_kind for p in inputs}
    if same_kind and len(kinds) > 1:
        raise ValueError(f"inputs mix data kinds {sorted(k or '?' for k in kinds)}; {stage} needs one kind")
    return inputs[0].data_kind
