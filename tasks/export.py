"""export: a trained model -> the standalone model that leaves lmforge: registered, served, published.

Inputs: the `model` artifact of a training stage (first), then optionally the eval stage that scored it (its
figures go on the card; the export waits for it, so a run whose gates failed exports nothing).

Output: a `model` artifact that is three things at once (`trainer.export`):
- a plain Hugging Face folder: adapters merged with peft's `merge_and_unload` (the merge eval uses), safetensors
  in `dtype`, the tokenizer with its chat template, a greedy `generation_config.json`;
- an MLflow `transformers` model: `MLmodel` (the `llm/v1/chat` task for a chat model, `text-classification`
  with the raw reward for a reward model), `components/tokenizer/`, the pinned serving requirements;
- `README.md`, a model card in the Hub's format written from the store's artifacts (`tasks/card.py`): front
  matter, intended use, the eval input's table of this model beside its base and the stage before it (value ±
  stderr), gates and bands, the training settings, the lineage to the raw files by hash, commit and MLflow run.

No file names a path of the machine that made it; the stage fails when one would (`trainer.export.ExportError`).

The executor registers it as MLflow model `<pipeline>-<registered_model>` (default: the exported stage's name, so
`models:/demo-dpo@champion` is the dpo stage's standalone model). Training stages are not registered themselves:
what the registry holds is what an export stage made. At the end of a run whose gates passed, the flow moves
`@champion` and copies the folder to `publish_to` (a folder or `s3://bucket/prefix`; `lmforge.publish`).
"""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from lmforge.config import StageConfig
from lmforge.port import Port
from lmforge.stage import Input, Result, StageDef, StageRuntime
from lmforge.store import Artifact

#: names MLflow takes for a registered model, and a publish target's scheme
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class ExportConfig(StageConfig):
    kind: Literal["export"] = Field(description="A trained model as a standalone, carded MLflow/Hugging Face model "
                                                "(adapters merged); what the registry holds and publish_to gets.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype of the exported weights.")
    intended_use: str = Field("", description="The model card's 'Intended use and limits': what the model is for.")
    limitations: str = Field("", description="The card's limits, after the intended use.")
    license: str = Field("unknown", description="The card's license (front matter): the base model's, or unknown.")
    max_new_tokens: int = Field(64, ge=1, description="Longest answer, in tokens, that the MLflow model serves "
                                                      "by default (a request's max_tokens overrides it).")
    registered_model: str | None = Field(None, description="Name in the MLflow registry after the pipeline's "
                                                           "(`<pipeline>-<name>`); default: the exported stage's name.")
    publish_to: str | None = Field(None, description="Where the folder goes at the end of a run whose gates "
                                                     "passed: a folder (relative to the project root) or "
                                                     "s3://bucket/prefix. Not part of the id.")

    #: where it is registered and published does not change the folder
    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | {"registered_model",
                                                                                         "publish_to"}

    @field_validator("registered_model")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.fullmatch(v):
            raise ValueError(f"{v!r} is not a registered model name; use letters, digits, '-', '_' and '.'")
        return v

    @field_validator("publish_to")
    @classmethod
    def _target(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip():
            raise ValueError("empty; give a folder or s3://bucket/prefix, or leave publish_to out")
        scheme = v.split("://", 1)[0] if "://" in v else ""
        if scheme == "hf" or v.startswith("hf:"):
            raise ValueError(f"{v!r}: a Hugging Face Hub repo is not a target lmforge can test (no Hub here); publish "
                             "to a folder or s3:// and upload it with `hf upload REPO FOLDER` (docs/export.md)")
        if scheme not in ("", "s3", "file"):
            raise ValueError(f"{v!r}: unknown scheme {scheme}://; give a folder or s3://bucket/prefix")
        if scheme == "s3" and not v[5:].strip("/"):
            raise ValueError(f"{v!r} names no bucket; give s3://bucket/prefix")
        return v

    def exported_stage(self) -> str:
        return self.inputs[0] if self.inputs else ""

    def model_name(self) -> str:
        return self.registered_model or self.exported_stage()


class ExportResult(Result):
    source: str  # kind/id of the trained artifact
    source_method: str  # full, lora, qlora
    architecture: str  # causal_lm | sequence_classification
    dtype: str
    parameters: int
    bytes: int  # of the whole folder
    files: int
    evaluation: str | None  # kind/id of the eval whose figures the card shows
    evaluated_as: str | None  # the name that eval gave the model


def run(cfg: ExportConfig, inputs: list[Input], out: Path, runtime: StageRuntime | None = None) -> ExportResult:
    from tasks.card import eval_of

    source, evals = inputs[0], inputs[1:]
    assert isinstance(source, Artifact)
    found = eval_of([e for e in evals if isinstance(e, Artifact)], source)
    got = make_export(source, out, dtype=cfg.dtype, max_new_tokens=cfg.max_new_tokens, evaluation=found,
                      uid=f"export/{runtime.artifact_id}" if runtime else "", intended_use=cfg.intended_use,
                      limitations=cfg.limitations, license=cfg.license)
    files = [p for p in out.rglob("*") if p.is_file()]
    return ExportResult(source=f"{source.kind}/{source.id}", source_method=got["source_method"],
                        architecture=got["architecture"], dtype=cfg.dtype, parameters=got["parameters"],
                        bytes=sum(p.stat().st_size for p in files), files=len(files),
                        evaluation=f"eval/{found[0].id}" if found else None, evaluated_as=found[1] if found else None)


def make_export(source: Artifact | Path, out: Path, *, dtype: str = "float32", max_new_tokens: int = 64,
                evaluation=None, uid: str = "", intended_use: str = "", limitations: str = "",
                license: str = "unknown") -> dict:
    """The standalone folder of a model artifact (or a model folder) in `out`: weights, tokenizer, MLflow model
    files, `lmforge_model.json` (a full model; a reward model's kind) and, for an artifact, the model card
    (`evaluation`: (eval artifact, name), None, or `tasks.card.NEWEST` for the newest in its store). What the export
    stage and `lmforge export` write. Returns trainer.export.export_model's account."""
    from tasks.card import model_card
    from trainer.export import ExportError, export_model, machine_paths
    from trainer.models import MODEL_INFO

    art = source if isinstance(source, Artifact) else None
    with tempfile.TemporaryDirectory(prefix="lmforge-export-") as tmp:
        if art is None:
            folder = Path(source)
        elif art.store.local:
            art.verify()  # read in place: its bytes as the manifest says
            folder = Path(art.path)
        else:
            folder = art.download(Path(tmp) / "source")
        got = export_model(folder, out, dtype=dtype, work_dir=Path(tmp) / "work", mlflow=True,
                           max_new_tokens=max_new_tokens, uid=uid or (f"{art.kind}/{art.id}/{dtype}" if art else ""))
        info = {"format": "full", "method": "full", "dtype": dtype, "exported_from": {"method": got["source_method"]}}
        if art is not None:
            info["exported_from"].update(kind=art.kind, artifact_id=art.id)
        if got["architecture"] == "sequence_classification":
            from trainer.preference import REWARD_MODEL_KIND
            info.update(kind=REWARD_MODEL_KIND, architecture="AutoModelForSequenceClassification", num_labels=1)
        (out / MODEL_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        if art is not None:
            (out / "README.md").write_text(model_card(art.store, art, evaluation=evaluation, intended_use=intended_use,
                                                      limitations=limitations, license=license,
                                                      exported={"dtype": dtype, "method": got["source_method"]}))
        roots = [folder, Path(tmp)] + ([Path(art.store.url)] if art is not None and art.store.local else [])
        leaks = machine_paths(out, roots)
        if leaks:
            raise ExportError("the exported folder names paths of this machine: " + "; ".join(leaks[:5]))
    got["files"] = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    return got


def link(name: str, cfg: ExportConfig, stages: dict[str, StageConfig]) -> dict[str, StageConfig]:
    """parse_config's hook, for what the ports cannot tell: an eval input scores the exported stage, and no two
    export stages register under one name. Changes nothing."""
    exported = cfg.exported_stage()
    for i, ev in enumerate(cfg.inputs[1:], 1):
        models = getattr(stages.get(ev), "models", None)
        preference = getattr(stages.get(ev), "preference", None)
        rewards = list(getattr(preference, "reward_models", None) or [])
        if models is not None and not any(getattr(m, "input", None) == exported for m in models) and \
                exported not in rewards:
            raise ValueError(f"inputs[{i}]: eval stage {ev!r} does not score {exported!r} (none of its models has "
                             f"input: {exported}, nor preference.reward_models); name an eval that does, or leave "
                             "it out")
    same = [n for n, s in stages.items() if n != name and isinstance(s, ExportConfig) and s.inputs
            and s.model_name() == cfg.model_name()]
    if same and cfg.inputs:
        raise ValueError(f"registered_model: stages {name} and {same[0]} would both register as "
                         f"'<pipeline>-{cfg.model_name()}'; give one of them another registered_model")
    return {}


def output_port(cfg: ExportConfig, inputs: list[Port]) -> Port:
    if not inputs or inputs[0].type != "model":
        got = inputs[0].describe() if inputs else "no input"
        raise ValueError(f"inputs[0] is {got}; export takes the model of a training stage first, then optionally "
                         "the eval stage that scored it")
    for i, p in enumerate(inputs[1:], 1):
        if p.type != "eval":
            raise ValueError(f"inputs[{i}] is {p.describe()}; after the model, export takes only eval stages "
                             "(their figures go on the model card)")
    return Port("model", inputs[0].data_kind)


STAGE = StageDef(kind="export", version="1", config=ExportConfig, run=run, output_port=output_port,
                 wants_runtime=True, link=link, loads_models_here=True, code=("trainer.export", "tasks.card"),
                 description="trained model (+ its eval) -> standalone carded model: merged weights, tokenizer, "
                             "MLflow transformers flavor, model card; registered and published",
                 output_type="model")
