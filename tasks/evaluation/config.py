"""The eval stage's config: which models, which measurements, which gates and expected bands.

Every field has a description: the config reference is generated from them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from lmforge.config import StageConfig
from lmforge.store import folder_fingerprint
from tasks.evaluation.lmeval_tasks import SHIPPED_TASKS

MODEL_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # also a metric path segment: no '/'


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
    loglik: bool = Field(True, description="Score every model entry by its own loglik_accuracy. false: only the "
                         "reference and the policies get log-probs (for their implicit reward), and with neither "
                         "set only the reward models score the pairs; each model entry scored costs two "
                         "log-likelihood passes over the pairs.")
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
        """As a reader says it: `in [0.35, 0.75]`, `>= 0.9`, `<= 0.05`."""
        if self.min is None:
            return f"<= {self.max:g}"
        if self.max is None:
            return f">= {self.min:g}"
        return f"in [{self.min:g}, {self.max:g}]"


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
