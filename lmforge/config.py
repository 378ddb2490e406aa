"""The pipeline config: a YAML file declaring datasets and stages, validated by pydantic.

Validation reports every problem at once, each with its dotted path, e.g.
`stages.shard.max_count: must be > 0, got 0`. Stage kinds are not known here; the caller passes
the registry (`{kind: StageDef}`) so this module stays below `tasks/` in the import graph.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from lmforge.errors import ConfigError
from lmforge.port import Port

DataKind = Literal["text", "chat", "preference"]
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class StageConfig(BaseModel):
    """Fields every stage has. Each stage kind subclasses this with its own settings."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(description="Stage kind, e.g. ingest or shard.")
    inputs: list[str] = Field(
        default_factory=list, description="Names of the datasets or stages this stage reads, in order."
    )
    retries: int = Field(1, ge=0, description="How often Prefect retries a failed run of this stage.")
    retry_delay_seconds: float = Field(5.0, ge=0, description="Wait between retries, in seconds.")
    timeout_seconds: float | None = Field(
        None, gt=0, description="Fail the stage if one attempt runs longer than this, in seconds."
    )
    after: list[str] = Field(
        default_factory=list, description="Stages that must finish before this one starts, besides its inputs "
        "(e.g. a preflight: its training stage gets it here when the config is read). Not part of the id."
    )

    #: fields that steer orchestration but do not change what a stage produces (kept out of the id)
    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = frozenset({"kind", "inputs", "retries", "retry_delay_seconds",
                                                                "timeout_seconds", "after"})

    def upstream(self) -> list[str]:
        """What this stage waits for: its inputs, then the stages in `after`."""
        return [*self.inputs, *(a for a in self.after if a not in self.inputs)]

    #: the project root, set by parse_config (kept by model_copy): relative paths in settings resolve against it
    _root: Path | None = PrivateAttr(None)

    def settings(self) -> dict[str, Any]:
        """The normalized settings that define the output: defaults filled in, orchestration left out."""
        return self.model_dump(mode="json", exclude=set(self.ORCHESTRATION_FIELDS))

    @property
    def project_root(self) -> Path:
        """What relative paths in this stage's settings resolve against: the pipeline's root. Only a stage config
        built by hand, outside parse_config, falls back to the working directory."""
        return self._root if self._root is not None else Path.cwd()

    def local_path(self, p: str) -> Path:
        """A local path written in this stage's settings, absolute: `~` expanded, relative to the project root."""
        path = Path(p).expanduser()
        return path if path.is_absolute() else (self.project_root / path).resolve()


class DatasetConfig(BaseModel):
    """A named raw data source: local paths, globs or fsspec URLs."""

    model_config = ConfigDict(extra="forbid")

    path: str | list[str] = Field(
        description="File, directory, glob or URL (s3://...), or a list of them. Relative paths resolve "
        "against the project root (the nearest folder above the config with pyproject.toml or .git)."
    )
    kind: DataKind = Field(description="Record schema: text {text}, chat {messages}, preference {prompt, chosen, rejected}.")
    format: Literal["auto", "json", "jsonl", "jsonl.gz", "parquet", "txt", "hf_disk"] = Field(
        "auto", description="File format; auto picks it from the file name (.json: a JSON array of rows, or JSON "
        "Lines), and a folder written by datasets' save_to_disk (it holds state.json) is hf_disk."
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Map schema field -> source column when the source uses other names, e.g. {text: body}.",
    )
    txt_unit: Literal["file", "line"] = Field(
        "file", description="For .txt files: one document per file, or one per non-empty line."
    )

    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


class MonitoringConfig(BaseModel):
    """Prometheus metrics of a run (lmforge.monitoring): an HTTP endpoint per process, and/or pushes to a Pushgateway.
    Off unless a port or a Pushgateway is set. Never changes an artifact id."""

    model_config = ConfigDict(extra="forbid")

    port: int = Field(0, ge=0, le=65535, description="Serve the stage process's metrics (stage states and durations, "
                      "failures, retries, data stages' results, host CPU and RAM) at http://address:port/metrics; 0: off.")
    training_port: int | None = Field(None, ge=0, le=65535, description="Port of each training process's endpoint "
                                      "(tokens/s, loss, step time, data wait, checkpoint uploads, GPU); unset: port + 1, "
                                      "0: off. A port in use (several trainings at once) moves to the next free one of "
                                      "the 8 after it.")
    address: str = Field("127.0.0.1", description="Interface the endpoints listen on; 0.0.0.0 serves every interface.")
    pushgateway: str | None = Field(None, description="Prometheus Pushgateway URL, e.g. http://127.0.0.1:9091: each "
                                    "process also pushes its metrics every push_interval_seconds and when it ends.")
    push_interval_seconds: float = Field(15.0, gt=0, description="Seconds between pushes to the Pushgateway.")

    @property
    def training_port_resolved(self) -> int:
        if self.training_port is not None:
            return self.training_port
        return self.port + 1 if self.port else 0


class TrainingMonitoring(BaseModel):
    """What the stage hands the training process (JobSpec.monitoring): its labels and where its metrics go."""

    model_config = ConfigDict(extra="forbid")

    pipeline: str
    stage: str
    kind: str
    port: int  # 0: no endpoint
    address: str
    pushgateway: str | None = None
    push_interval_seconds: float = 15.0


class PipelineConfig(BaseModel):
    """A whole pipeline. `stages` holds each kind's own config model."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    name: str = Field(pattern=NAME_RE, description="Pipeline name; also the MLflow experiment name.")
    store: str = Field("./artifacts", description="Artifact store: a local folder or an fsspec URL (s3://bucket/prefix).")
    tracking: str = Field("sqlite:///mlflow.db", description="MLflow tracking URI; relative sqlite paths resolve against the project root. MLFLOW_TRACKING_URI in the environment takes precedence.")
    dask_address: str | None = Field(
        None, description="Run the stages as tasks on this Dask cluster through prefect-dask's DaskTaskRunner "
        "(e.g. tcp://127.0.0.1:8786); data stages then fan their partitions out over its workers. Unset: stages "
        "run in threads of this process. Never changes an artifact id.")
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig, description="Prometheus metrics endpoints "
                                         "and Pushgateway (off by default); never changes an artifact id.")
    headline: list[str] = Field(default_factory=list, description="Metrics of the pipeline run shown first: logged "
                                "on its MLflow run as `0_headline/<key>` and listed first by `lmforge compare`. Each "
                                "is an eval metric `<model>/<task>/<metric>` (`<eval stage>/<model>/<task>/<metric>` "
                                "with several eval stages) or another `summary/` key, e.g. `tokens_trained/sft`. "
                                "Default: the metrics of the eval stages' gates. Never changes an artifact id.")
    datasets: dict[str, DatasetConfig] = Field(default_factory=dict, description="Named raw data sources.")
    stages: dict[str, StageConfig] = Field(description="Named stages; the DAG comes from their inputs.")
    root: Path = Field(Path("."), exclude=True, description="Project root that relative paths resolve against.")
    source: str | None = Field(None, exclude=True, description="Where this config was read from.")

    @field_validator("stages")
    @classmethod
    def _names(cls, v: dict[str, StageConfig]) -> dict[str, StageConfig]:
        for name in v:
            if not re.match(NAME_RE, name):
                raise ValueError(f"stage name {name!r} must match {NAME_RE}")
        return v

    def resolve_path(self, p: str) -> str:
        """Absolute path or URL for a path written in this config."""
        if "://" in p and not p.startswith("file://"):
            return p
        p = p.removeprefix("file://")
        path = Path(p).expanduser()
        return str(path if path.is_absolute() else (self.root / path).resolve())

    @property
    def store_url(self) -> str:
        return self.resolve_path(self.store)

    @property
    def tracking_uri(self) -> str:
        """MLFLOW_TRACKING_URI when set (a deployment's or `lmforge stack env`'s choice: the same config then logs
        to the team's server), else `tracking:`."""
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        m = re.match(r"^sqlite:///(?!/)(.+)$", self.tracking)
        if m:  # sqlite:///rel/path.db -> absolute under the project root
            return f"sqlite:///{(self.root / m.group(1)).resolve()}"
        return self.tracking

    def topo_order(self) -> list[str]:
        """Stage names, each after the stages it reads. Assumes validate() passed (no cycles)."""
        order: list[str] = []
        seen: set[str] = set()

        def visit(n: str) -> None:
            if n in seen:
                return
            seen.add(n)
            for i in self.stages[n].upstream():
                if i in self.stages:
                    visit(i)
            order.append(n)

        for n in self.stages:
            visit(n)
        return order

    def dependants(self, names: set[str]) -> set[str]:
        """The given stages and every stage downstream of them."""
        out = set(names)
        for n in self.topo_order():
            if any(i in out for i in self.stages[n].inputs):
                out.add(n)
        return out

    def config_hash(self) -> str:
        body = {
            "name": self.name,
            "datasets": {k: v.model_dump(mode="json") for k, v in self.datasets.items()},
            "stages": {k: v.model_dump(mode="json") for k, v in self.stages.items()},
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# loading


def find_project_root(config_path: Path) -> Path:
    start = config_path.resolve().parent
    for d in [start, *start.parents]:
        if (d / "pyproject.toml").exists() or (d / ".git").exists():
            return d
    return start


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"config file not found: {path}. Pass the path of a pipeline YAML file."]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"{path}: not UTF-8 text ({e.reason} at byte {e.start})"]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{where}: invalid YAML: {problem}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: expected a mapping with name, datasets and stages, got {type(raw).__name__}"])
    return raw


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `-o a.b.c=value` overrides; the value is parsed as a YAML scalar/flow value."""
    problems = []
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if not sep or not key:
            problems.append(f"override {ov!r}: expected KEY=VALUE, e.g. stages.shard.max_count=500")
            continue
        parts = key.strip().split(".")
        node: Any = raw
        for p in parts[:-1]:
            if not isinstance(node, dict):
                break
            node = node.setdefault(p, {})
        if not isinstance(node, dict):
            problems.append(f"override {ov!r}: {'.'.join(parts[:-1])} is not a mapping")
            continue
        try:
            node[parts[-1]] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            node[parts[-1]] = value
    if problems:
        raise ConfigError(problems)
    return raw


def load_config(
    path: str | Path, kinds: Mapping[str, Any], overrides: list[str] | None = None
) -> PipelineConfig:
    path = Path(path)
    raw = apply_overrides(read_yaml(path), overrides or [])
    return parse_config(raw, kinds, root=find_project_root(path), source=str(path))


def parse_config(
    raw: dict[str, Any], kinds: Mapping[str, Any], root: Path = Path("."), source: str | None = None
) -> PipelineConfig:
    """Validate a raw config dict against `kinds` ({kind: lmforge.stage.StageDef}). Raises ConfigError listing
    every problem with its path."""
    problems: list[str] = []
    raw = dict(raw)
    raw_stages = raw.pop("stages", None)
    stages: dict[str, StageConfig] = {}
    if raw_stages is None:
        problems.append("stages: required; declare at least one stage")
    elif not isinstance(raw_stages, dict) or not raw_stages:
        problems.append(f"stages: expected a non-empty mapping of stage name -> settings, got {raw_stages!r}")
    else:
        for name, body in raw_stages.items():
            where = f"stages.{name}"
            if not isinstance(name, str) or not re.match(NAME_RE, name):  # names become paths and MLflow run names
                problems.append(f"stages: stage name {name!r} must match {NAME_RE} (letters, digits, _ . -; no "
                                "slashes), e.g. sft_lora")
                continue
            if not isinstance(body, dict):
                problems.append(f"{where}: expected a mapping with kind, inputs and settings, got {body!r}")
                continue
            kind = body.get("kind")
            if kind is None:
                problems.append(f"{where}.kind: required; one of {', '.join(sorted(kinds))}")
                continue
            if kind not in kinds:
                problems.append(f"{where}.kind: unknown stage kind {kind!r}{_did_you_mean(kind, kinds)}; "
                                f"known kinds: {', '.join(sorted(kinds))}")
                continue
            model = kinds[kind].config
            try:
                stages[name] = model.model_validate(body)
            except ValidationError as e:
                problems += _format_errors(e, where, model)
            else:
                stages[name]._root = Path(root).resolve()
    for name in list(stages):  # kinds that tie themselves to other stages (a preflight to its training stage)
        link = getattr(kinds[stages[name].kind], "link", None)
        if link is not None:
            try:
                stages.update(link(name, stages[name], stages))
            except ValueError as e:
                problems.append(f"stages.{name}.{e}")
    try:
        top = PipelineConfig.model_validate({**raw, "stages": {}, "root": root, "source": source})
    except ValidationError as e:
        problems += _format_errors(e, "", PipelineConfig)
        top = None
    if top is not None and isinstance(raw_stages, dict):
        problems += _check_graph(top.datasets, raw_stages, stages, kinds)
    if problems:
        raise ConfigError(problems, source)
    assert top is not None  # no problems means the top level parsed
    return top.model_copy(update={"stages": stages})


def _check_graph(datasets, raw_stages, stages, kinds) -> list[str]:
    problems: list[str] = []
    for name in set(datasets) & set(raw_stages):
        problems.append(f"stages.{name}: name also used by datasets.{name}; give them different names")
    known = set(datasets) | set(raw_stages)
    for name, body in raw_stages.items():  # also stages whose own settings failed to parse
        refs = body.get("inputs") if isinstance(body, dict) else None
        afters = body.get("after") if isinstance(body, dict) else None
        for i, ref in enumerate(afters if isinstance(afters, list) else []):
            if ref == name or ref not in raw_stages:
                problems.append(f"stages.{name}.after[{i}]: {ref!r} is not another stage{_did_you_mean(ref, set(raw_stages))}")
        for i, ref in enumerate(refs if isinstance(refs, list) else []):
            if ref == name:
                problems.append(f"stages.{name}.inputs[{i}]: a stage cannot read its own output")
            elif ref not in known:
                problems.append(f"stages.{name}.inputs[{i}]: {ref!r} is not a dataset or a stage"
                                f"{_did_you_mean(ref, known)}")
    # cycles (depth-first search over stage -> stage edges)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def dfs(n: str, path: list[str]) -> None:
        state[n] = 1
        for ref in stages[n].upstream() if n in stages else []:
            if ref not in stages or ref == n:
                continue
            if state.get(ref) == 1:
                cycles.append(path[path.index(ref):] + [ref] if ref in path else [n, ref])
            elif ref not in state:
                dfs(ref, path + [ref])
        state[n] = 2

    for n in stages:
        if n not in state:
            dfs(n, [n])
    for c in cycles:
        problems.append(f"stages: cycle {' -> '.join(reversed(c))}; a stage cannot depend on itself")
    if cycles or problems:
        return problems
    # what flows along each edge: each kind checks its inputs and says what it produces
    ports: dict[str, Port] = {n: Port("dataset", d.kind) for n, d in datasets.items()}
    pending = [n for n in stages]
    while pending:
        progressed = False
        for n in list(pending):
            if all(ref in ports for ref in stages[n].inputs):
                pending.remove(n)
                progressed = True
                in_ports = [ports[r] for r in stages[n].inputs]
                if any(p.type == "invalid" for p in in_ports):  # reported upstream already
                    ports[n] = Port("invalid")
                    continue
                kind = kinds[stages[n].kind]
                try:
                    ports[n] = kind.output_port(stages[n], in_ports)
                except ValueError as e:
                    problems.append(f"stages.{n}.inputs: {e}")
                    ports[n] = Port("invalid")
                    continue
                if kind.output_type is not None and ports[n].type != kind.output_type:
                    raise RuntimeError(f"stage kind {kind.kind} declares output_type {kind.output_type!r} but its "
                                       f"output_port gave {ports[n].type!r} for stage {n}")
        if not progressed:  # inputs of an invalid stage that failed to parse
            break
    return problems


def _did_you_mean(word: str, options) -> str:
    m = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean {m[0]!r}?)" if m else ""


_OPS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_OP_KEY = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}


def _format_errors(e: ValidationError, prefix: str, model: type[BaseModel]) -> list[str]:
    out = []
    for err in e.errors():
        loc = [p for p in err["loc"] if p not in ("function-after",)]
        path = prefix
        for p in loc:
            path += f"[{p}]" if isinstance(p, int) else (f".{p}" if path else str(p))
        t, given = err["type"], err.get("input")
        ctx = err.get("ctx") or {}
        if t in _OPS:
            bound = ctx[_OP_KEY[t]]
            bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
            msg = f"must be {_OPS[t]} {bound}, got {given!r}"
        elif t == "extra_forbidden":
            fields = model.model_fields if len(loc) == 1 else {}
            known = [f for f in fields if f not in ("root", "source")]
            msg = f"unknown field{_did_you_mean(loc[-1], known)}"
            if known:
                msg += f"; expected one of: {', '.join(known)}"
        elif t == "missing":
            field = model.model_fields.get(str(loc[-1])) if len(loc) == 1 else None
            desc = f" ({field.description})" if field is not None and field.description else ""
            msg = f"required field is missing{desc}"
        elif t == "literal_error":
            msg = f"must be one of {ctx.get('expected')}, got {given!r}"
        elif t == "string_pattern_mismatch":
            msg = f"must match {ctx.get('pattern')}, got {given!r}"
        else:
            msg = f"{err['msg'][0].lower()}{err['msg'][1:]}, got {given!r}"
        out.append(f"{path or '(top level)'}: {msg}")
    return out
