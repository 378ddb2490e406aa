"""Plan a pipeline run: each stage's artifact id, and whether it runs or is cached, and why.

Ids come from configs, input ids and code fingerprints alone, so the whole plan is known before any stage
runs: a stage is cached exactly when a manifest exists at `{store}/{kind}/{id}`, or when the user accepted
an earlier artifact across a code change (`--accept-code-change STAGE`, kept in `{store}/_accepted/`).
Why a stage runs comes from comparing it with what this pipeline's stage made last time (its ref).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from lmforge import fingerprint
from lmforge.config import PipelineConfig
from lmforge.datasets import DatasetInput, resolve_dataset
from lmforge.errors import ConfigError
from lmforge.fingerprint import CodeFingerprint
from lmforge.port import Port
from lmforge.stage import StageDef
from lmforge.store import Artifact, ArtifactStore, _now, artifact_id


@dataclass
class StagePlan:
    name: str
    kind: str
    version: str  # the code fingerprint (manifest code_version, MLflow tag lmforge.code_version)
    artifact_id: str  # the id the stage runs into or reads: an accepted earlier artifact's id when `accepted`
    settings: dict[str, Any]
    inputs: list[str]
    input_ids: list[str]
    action: str = "run"  # run | cached
    reason: str = "no manifest"
    forced: bool = False
    uri: str = ""
    port: Port | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    code: CodeFingerprint | None = None
    #: an earlier artifact used across a code change: the `_accepted` record (see `accept_code_change`)
    accepted: dict[str, Any] | None = None
    accepted_now: bool = False  # accepted by this run's --accept-code-change (the executor records it)


@dataclass
class Plan:
    cfg: PipelineConfig
    store: ArtifactStore
    datasets: dict[str, DatasetInput]
    stages: dict[str, StagePlan]  # in topological order

    @property
    def to_run(self) -> list[str]:
        return [n for n, s in self.stages.items() if s.action == "run"]

    def format(self) -> str:
        lines = [f"pipeline {self.cfg.name}: store {self.store.url}, tracking {self.cfg.tracking_uri}"]
        for n, d in self.datasets.items():
            lines.append(f"  dataset {n:<18} {d.id:<20} {len(d.files)} file(s), {d.config.kind}")
        for s in self.stages.values():
            src = ", ".join(s.inputs) or "-"
            lines.append(f"  {s.action:<6} {s.name:<18} {s.kind}/{s.artifact_id}  <- {src}  ({s.reason})")
        return "\n".join(lines)


def make_plan(cfg: PipelineConfig, kinds: Mapping[str, StageDef], force: list[str] | None = None,
              store: ArtifactStore | None = None, accept_code_change: list[str] | None = None) -> Plan:
    force, accept = list(force or []), list(accept_code_change or [])
    problems = [f"--{flag} {u}: no stage named {u!r}; stages: {', '.join(cfg.stages)}"
                for flag, names in (("force", force), ("accept-code-change", accept)) for u in names
                if u not in cfg.stages]
    problems += [f"--accept-code-change {n} and --force {n}: a forced stage reruns, so there is nothing to accept; "
                 "keep one of them" for n in accept if n in force]
    if problems:
        raise ConfigError(problems)
    store = store or ArtifactStore(cfg.store_url)
    used = {i for s in cfg.stages.values() for i in s.inputs if i in cfg.datasets}
    datasets = {n: resolve_dataset(cfg, n) for n in cfg.datasets if n in used}
    forced = cfg.dependants(set(force))
    stages: dict[str, StagePlan] = {}
    ports: dict[str, Port] = {n: Port("dataset", d.kind) for n, d in cfg.datasets.items()}
    for name in cfg.topo_order():
        sc = cfg.stages[name]
        sdef = kinds[sc.kind]
        input_ids = [datasets[i].id if i in datasets else stages[i].artifact_id for i in sc.inputs]
        settings = sc.settings()
        code = fingerprint.for_stage(sdef)
        aid = artifact_id(sc.kind, code.fingerprint, settings, input_ids)
        sp = StagePlan(name=name, kind=sc.kind, version=code.fingerprint, artifact_id=aid, settings=settings,
                       inputs=list(sc.inputs), input_ids=input_ids, uri=store.artifact_uri(sc.kind, aid),
                       port=sdef.output_port(sc, [ports[i] for i in sc.inputs]), code=code)
        ports[name] = sp.port
        exists = store.get(sc.kind, aid) is not None
        if name in forced:
            sp.forced = True
            sp.reason = f"forced (--force {name})" if name in force else \
                f"forced: depends on {', '.join(i for i in sc.inputs if i in forced)}"
        elif exists:
            sp.action, sp.reason = "cached", "cached: manifest exists"
        elif (record := _accepted_before(store, sp)) is not None:
            _use_accepted(store, sp, record)
        elif name in accept:
            _use_accepted(store, sp, accept_code_change_for(store, cfg.name, sp, stages))
            sp.accepted_now = True
        else:
            sp.reason = _why_new(store, cfg.name, sp, stages)
        stages[name] = sp
    return Plan(cfg=cfg, store=store, datasets=datasets, stages=stages)


def _previous(store: ArtifactStore, pipeline: str, stage: str) -> Artifact | None:
    """The artifact this pipeline's stage produced (or reused) last time, through its ref."""
    ref = store.get_ref(pipeline, stage)
    return store.get(ref["kind"], ref["artifact_id"]) if ref else None


def _why_new(store: ArtifactStore, pipeline: str, sp: StagePlan, earlier: dict[str, StagePlan]) -> str:
    """Compare with the artifact this pipeline's stage produced last time (its ref): config, inputs, code."""
    prev = _previous(store, pipeline, sp.name)
    if prev is None:
        return "no manifest"
    reasons = _other_changes(prev.manifest, sp, earlier)
    code = code_changes(prev.manifest, sp.code)
    if code:
        reasons.append(code)
    return "; ".join(reasons) or "no manifest (previous artifact was deleted or never finished)"


def code_changes(manifest: dict[str, Any], code: CodeFingerprint | None) -> str:
    """`code changed: trainer/sft.py; trl 1.12.0 -> 1.13.0` between the code that made `manifest` and `code`;
    empty when they are the same."""
    before = manifest.get("code")
    if code is None:
        return ""
    if not before:
        return "code changed: the previous artifact predates code fingerprints"
    if before.get("fingerprint") == code.fingerprint:
        return ""
    modules, other = fingerprint.diff(before, code)
    return "; ".join(([f"code changed: {', '.join(modules)}"] if modules else []) + other)


def _other_changes(m: dict[str, Any], sp: StagePlan, earlier: dict[str, StagePlan]) -> list[str]:
    """What differs besides the code between a previous manifest and the plan: config, inputs."""
    out = []
    old_cfg = m.get("config", {})
    diffs = [f"{k} {old_cfg.get(k)!r} -> {v!r}" for k, v in sp.settings.items() if old_cfg.get(k) != v]
    diffs += [f"{k} removed" for k in old_cfg if k not in sp.settings]
    if diffs:
        out.append("config changed: " + "; ".join(diffs))
    old_ids = [i["artifact_id"] for i in m.get("inputs", [])]
    changed_inputs = [n for n, new, old in zip(sp.inputs, sp.input_ids, old_ids + [None] * len(sp.inputs))
                      if new != old]
    if changed_inputs or len(old_ids) != len(sp.input_ids):
        what = ", ".join(f"{n} ({'will run' if n in earlier and earlier[n].action == 'run' else 'new data'})"
                         for n in changed_inputs)
        out.append(f"input changed: {what or 'input list'}")
    return out


# ----------------------------------------------------------------------------------------------
# reusing an artifact across a code change, by name


def accept_code_change_for(store: ArtifactStore, pipeline: str, sp: StagePlan,
                           earlier: dict[str, StagePlan]) -> dict[str, Any]:
    """The `_accepted` record that lets `sp` (whose new id has no manifest) reuse the artifact this pipeline's
    stage made last time: allowed only when that artifact has the same config and input ids, so the code (or a
    library) is all that differs. Raises ConfigError naming the stage and what else changed."""
    flag = f"--accept-code-change {sp.name}"
    prev = _previous(store, pipeline, sp.name)
    if prev is None or prev.kind != sp.kind:
        raise ConfigError([f"{flag}: pipeline {pipeline} has no earlier {sp.kind} artifact of stage {sp.name} in "
                           f"{store.url} to keep; run without {flag} to make one"])
    other = _other_changes(prev.manifest, sp, earlier)
    if other:
        raise ConfigError([f"{flag}: refused: the earlier artifact {sp.kind}/{prev.id} differs by more than code: "
                           f"{'; '.join(other)}. Accepting keeps an artifact across a code change only; drop {flag} "
                           "to rerun the stage"])
    before = prev.manifest.get("code") or {"code_version": prev.manifest.get("code_version")}
    return {"artifact_id": prev.id, "kind": sp.kind, "stage": sp.name, "pipeline": pipeline,
            "new_artifact_id": sp.artifact_id, "accepted_at": _now(),
            "changes": code_changes(prev.manifest, sp.code) or "code changed",
            "code_before": before, "code_after": sp.code.to_json() if sp.code else {}}


def _accepted_before(store: ArtifactStore, sp: StagePlan) -> dict[str, Any] | None:
    """An acceptance recorded by an earlier run for this exact new id, whose artifact still exists."""
    record = store.get_acceptance(sp.kind, sp.artifact_id)
    if record is None or store.get(sp.kind, record["artifact_id"]) is None:
        return None
    return record


def _use_accepted(store: ArtifactStore, sp: StagePlan, record: dict[str, Any]) -> None:
    """Point the stage at the accepted artifact: cached, and its dependants keep their ids."""
    sp.accepted = record
    sp.artifact_id = record["artifact_id"]
    sp.uri = store.artifact_uri(sp.kind, sp.artifact_id)
    sp.action = "cached"
    sp.reason = (f"cached: code change accepted (--accept-code-change {record['stage']}, {record['accepted_at']}): "
                 f"{record['changes']}; keeps {sp.kind}/{record['artifact_id']} instead of making "
                 f"{sp.kind}/{record['new_artifact_id']}")
