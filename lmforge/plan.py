"""Plan a pipeline run: each stage's artifact id, and whether it runs or is cached, and why.

Ids come from configs and input ids alone, so the whole plan is known before any stage runs:
a stage is cached exactly when a manifest exists at `{store}/{kind}/{id}`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from lmforge.config import PipelineConfig
from lmforge.datasets import DatasetInput, resolve_dataset
from lmforge.errors import ConfigError
from lmforge.stage import Port, StageDef
from lmforge.store import ArtifactStore, artifact_id


@dataclass
class StagePlan:
    name: str
    kind: str
    version: str
    artifact_id: str
    settings: dict[str, Any]
    inputs: list[str]
    input_ids: list[str]
    action: str = "run"  # run | cached
    reason: str = "no manifest"
    forced: bool = False
    uri: str = ""
    port: Port | None = None
    extra: dict[str, Any] = field(default_factory=dict)


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
              store: ArtifactStore | None = None) -> Plan:
    force = list(force or [])
    unknown = [f for f in force if f not in cfg.stages]
    if unknown:
        raise ConfigError([f"--force {u}: no stage named {u!r}; stages: {', '.join(cfg.stages)}" for u in unknown])
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
        aid = artifact_id(sc.kind, sdef.version, settings, input_ids)
        sp = StagePlan(name=name, kind=sc.kind, version=sdef.version, artifact_id=aid, settings=settings,
                       inputs=list(sc.inputs), input_ids=input_ids, uri=store.artifact_uri(sc.kind, aid),
                       port=sdef.output_port(sc, [ports[i] for i in sc.inputs]))
        ports[name] = sp.port
        exists = store.get(sc.kind, aid) is not None
        if name in forced:
            sp.forced = True
            sp.reason = f"forced (--force {name})" if name in force else \
                f"forced: depends on {', '.join(i for i in sc.inputs if i in forced)}"
        elif exists:
            sp.action, sp.reason = "cached", "cached: manifest exists"
        else:
            sp.reason = _why_new(store, cfg.name, sp, stages)
        stages[name] = sp
    return Plan(cfg=cfg, store=store, datasets=datasets, stages=stages)


def _why_new(store: ArtifactStore, pipeline: str, sp: StagePlan, earlier: dict[str, StagePlan]) -> str:
    """Compare with the artifact this pipeline's stage produced last time (its ref)."""
    ref = store.get_ref(pipeline, sp.name)
    prev = store.get(ref["kind"], ref["artifact_id"]) if ref else None
    if prev is None:
        return "no manifest"
    m = prev.manifest
    if m.get("code_version") != sp.version:
        return f"code version changed: {m.get('code_version')} -> {sp.version}"
    old_ids = [i["artifact_id"] for i in m.get("inputs", [])]
    changed_inputs = [n for n, new, old in zip(sp.inputs, sp.input_ids, old_ids + [None] * len(sp.inputs))
                      if new != old]
    old_cfg = m.get("config", {})
    diffs = [f"{k} {old_cfg.get(k)!r} -> {v!r}" for k, v in sp.settings.items() if old_cfg.get(k) != v]
    diffs += [f"{k} removed" for k in old_cfg if k not in sp.settings]
    if diffs:
        return "config changed: " + "; ".join(diffs)
    if changed_inputs or len(old_ids) != len(sp.input_ids):
        what = ", ".join(f"{n} ({'will run' if n in earlier and earlier[n].action == 'run' else 'new data'})"
                         for n in changed_inputs)
        return f"input changed: {what or 'input list'}"
    return "no manifest (previous artifact was deleted or never finished)"
