"""Run one planned stage: skip it when its manifest exists, else stage, run, publish, track.

No Prefect here: `flows/` wraps `execute_stage` in a Prefect task, and tests can call it directly.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from lmforge import gc, interrupt, provenance
from lmforge.datasets import DatasetInput
from lmforge.errors import ArtifactError, FailedAfterPublish
from lmforge.lease import Lease, LeaseLost
from lmforge.plan import Plan, StagePlan
from lmforge.stage import StageDef, StageRuntime, numeric_leaves
from lmforge.store import Artifact, _now
from lmforge.tracking import Tracker, model_files, registered_model_name

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """What every stage of one pipeline run shares."""

    plan: Plan
    kinds: Mapping[str, StageDef]
    tracker: Tracker | None = None
    parent_run_id: str | None = None
    flow_run: dict[str, str] = field(default_factory=dict)  # id, name of the Prefect flow run


#: held while a stage that loads models in this process runs (StageDef.loads_models_here)
MODELS_HERE = threading.Lock()


def _stage_tags(ctx: RunContext, sp: StagePlan) -> dict[str, str]:
    tags = {
        "lmforge.stage": sp.name,
        "lmforge.stage_kind": sp.kind,
        "lmforge.artifact_id": sp.artifact_id,
        "lmforge.artifact_uri": sp.uri,
        "lmforge.code_version": sp.version,
        "lmforge.inputs": ",".join(f"{n}={i}" for n, i in zip(sp.inputs, sp.input_ids)),
        "prefect.flow_run_id": ctx.flow_run.get("id", ""),
        **{f"lmforge.env.{k}": v for k, v in provenance.environment().items()},
    }
    if sp.accepted:  # an earlier artifact reused across a code change: never silent
        a = sp.accepted
        tags["lmforge.code_change_accepted"] = (f"{a['kind']}/{a['artifact_id']} kept instead of {a['new_artifact_id']} "
                                                f"(accepted {a['accepted_at']}): {a['changes']}")[:5000]
    return tags


def _use_accepted(ctx: RunContext, sp: StagePlan, run_id: str | None) -> None:
    """A stage that reuses an earlier artifact across a code change: record a new acceptance (manifest and
    `_accepted`), and say so every time."""
    a = dict(sp.accepted or {})
    if sp.accepted_now:
        ctx.plan.store.record_acceptance({**a, "mlflow_run_id": run_id, "flow_run_id": ctx.flow_run.get("id")})
        sp.accepted_now = False  # once, also when Prefect retries the task
    log.warning("stage %s: code change accepted (--accept-code-change %s, %s): using %s/%s, made by earlier code, "
                "instead of making %s/%s; %s", sp.name, a["stage"], a["accepted_at"], sp.kind, a["artifact_id"],
                sp.kind, a["new_artifact_id"], a["changes"])



def _input_entry(ctx: RunContext, name: str) -> dict[str, Any]:
    if name in ctx.plan.datasets:
        return {"name": name, "type": "dataset", **ctx.plan.datasets[name].lineage(),
                "artifact_id": ctx.plan.datasets[name].id}
    sp = ctx.plan.stages[name]
    return {"name": name, "type": "artifact", "kind": sp.kind, "artifact_id": sp.artifact_id, "uri": sp.uri}


def _register_model(ctx: RunContext, sp: StagePlan, artifact: Artifact, run_id: str | None, ran: bool,
                    staged: Path | None = None) -> None:
    """An export stage's artifact (`tasks/export.py`: the standalone model, an MLflow model itself) becomes a version
    of the registered model `<pipeline>-<registered_model>` (default: the exported stage's name), holding the model
    only (`tracking.model_files`: weights, config, tokenizer, chat template, card, MLmodel and its components; no
    manifest): the files go into the stage's MLflow run under `model/` (hard links when MLflow's artifacts are a
    local folder) and the version is registered from `runs:/<run_id>/model`, once per artifact and model digest.
    Training stages are not registered: an adapter is not a model anyone else can load. `staged`: the stage's
    staging folder, still holding the files just uploaded to an object store (no download). Alias `@candidate` points
    at it when the stage made it (`ran`); a cached stage sets it only where the model has none yet (or where it
    points at an earlier registration of the same artifact), so a rerun of an older config never moves it back.
    `@champion` is moved by the flow, at the end of a run whose eval gates passed (`runview.promote_champions`)."""
    if ctx.tracker is None or run_id is None:
        return
    if sp.kind != "export":
        cfg = ctx.plan.cfg
        if sp.port is not None and sp.port.type == "model" and ran and not any(
                s.kind == "export" and s.inputs[:1] == [sp.name] for s in cfg.stages.values()):
            log.info("stage %s: not registered in MLflow: the registry holds exports; add a stage `{kind: export, "
                     "inputs: [%s]}` to register its standalone model (docs/export.md)", sp.name, sp.name)
        return
    result = artifact.result or {}
    cfg = ctx.plan.cfg
    sc = cfg.stages[sp.name]
    source = ctx.plan.stages[sc.exported_stage()]
    name = registered_model_name(cfg.name, sc.model_name())
    tags = {"lmforge.artifact_id": sp.artifact_id, "lmforge.artifact_uri": artifact.uri,
            "lmforge.pipeline": cfg.name, "lmforge.stage": source.name, "lmforge.export_stage": sp.name,
            "lmforge.source_artifact": result.get("source", ""), "lmforge.method": result.get("source_method", ""),
            "lmforge.dtype": result.get("dtype", ""), "lmforge.evaluation": result.get("evaluation") or "",
            "lmforge.git_commit": artifact.manifest.get("git_commit", "") or "",
            "lmforge.source_run_id": artifact.manifest.get("produced_by", {}).get("mlflow_run_id", "") or ""}
    what = "reward model (a sequence classifier)" if source.port and source.port.data_kind == "reward" else "model"
    description = (f"Standalone {what} of the {source.kind} stage '{source.name}' of pipeline '{cfg.name}' "
                   f"(method {source.settings.get('method') or source.kind}, base "
                   f"{_describe_base(source, ctx.plan.store.get(source.kind, source.artifact_id))}), exported by "
                   f"stage '{sp.name}': merged {result.get('dtype', '')} weights, tokenizer, model card (README.md) "
                   "and MLflow transformers flavor; `mlflow models serve` serves it. Each version is one export "
                   "artifact in the store; @candidate is the newest one a run made, @champion the newest one whose "
                   "run passed its eval gates.")
    files = model_files(list(artifact.files))
    # the model's bytes: a forced rerun that trained other weights under the same artifact id gets its own version.
    # Not the card: it names the runs that made the model, so a forced rerun to identical weights rewrites it
    tags["lmforge.model_digest"] = hashlib.sha256(json.dumps(
        [[f, artifact.files[f]["sha256"]] for f in files if f != "README.md"]).encode()).hexdigest()[:16]
    tr = ctx.tracker
    try:
        version = tr.model_version(name, sp.artifact_id, digest=tags["lmforge.model_digest"])
        if version is None:
            with _model_folder(artifact, files, staged) as folder:
                version = tr.register_model(name, folder, files, run_id, tags, description=description)
        else:
            tr.ensure_registered_model(name, tags, description)
        candidate = tr.alias_version(name, "candidate")
        if ran or candidate is None or (candidate != version and  # this artifact, registered before as a whole
                                        tr.version_tags(name, candidate).get("lmforge.artifact_id") == sp.artifact_id):
            tr.set_alias(name, "candidate", version)
    except Exception as e:  # noqa: BLE001  the artifact is stored; the registry is a view of it
        log.warning("stage %s: could not register the model in MLflow: %s", sp.name, str(e).splitlines()[0])
        return
    tr.set_tags(run_id, {"lmforge.registered_model": f"{name}/{version}"})
    log.info("stage %s: registered as model %s version %s", sp.name, name, version)


@contextlib.contextmanager
def _model_folder(artifact: Artifact, files: list[str], staged: Path | None) -> Iterator[Path]:
    """A local folder holding the artifact's model `files`: the local store's own folder; the staging folder of an
    artifact just uploaded to an object store; else a temporary download, each file verified against the manifest."""
    if artifact.store.local:
        yield Path(artifact.path)
        return
    if staged is not None and all((staged / f).is_file() and (staged / f).stat().st_size == artifact.files[f]["bytes"]
                                  for f in files):
        yield staged
        return
    with tempfile.TemporaryDirectory(prefix="lmforge-register-") as tmp:
        yield artifact.download(Path(tmp), files)


def _describe_base(sp: StagePlan, artifact: Artifact | None) -> str:
    """The model a training stage starts from, in a few words: a hub id, a package GGUF, a folder, or a config."""
    result = (artifact.result if artifact is not None else None) or {}
    base = sp.settings.get("base_model")
    if isinstance(base, dict):
        if base.get("hub"):
            return base["hub"] + (f"@{base['revision']}" if base.get("revision") else "")
        if base.get("package"):
            return f"{base['package']}/{base.get('file') or ''}"
        if base.get("path"):
            return str(base["path"])
        if base.get("config"):
            return f"a new {base['config'].get('model_type', '')} model from a config".replace("  ", " ")
    return str(result.get("base_model") or base or "an earlier stage's model (see inputs)")


def _earlier_child(ctx: RunContext, name: str) -> Any | None:
    """This stage's child run from an earlier attempt in the same Prefect flow run (a task retry, `prefect flow-run
    retry`, which continues the flow run's parent), if any."""
    if ctx.tracker is None or not ctx.flow_run.get("id") or not ctx.parent_run_id:
        return None
    found = ctx.tracker.find_runs(f"tags.mlflow.parentRunId = '{ctx.parent_run_id}' and "
                                  f"tags.`lmforge.stage` = '{name}'", 1)
    return found[0] if found else None


def _start_stage_run(ctx: RunContext, name: str, tags: dict[str, str]) -> tuple[str, bool]:
    """The stage's child run: (run id, reused). Within one Prefect flow run a stage has one child, whatever the
    number of attempts: an earlier attempt's child is reopened."""
    earlier = _earlier_child(ctx, name)
    if earlier is None:
        return ctx.tracker.start_run(name, {**tags, "lmforge.attempt": "1"}, ctx.parent_run_id), False
    attempt = int(earlier.data.tags.get("lmforge.attempt", "1")) + 1
    ctx.tracker.reopen_run(earlier.info.run_id, {**tags, "lmforge.attempt": attempt},
                           drop_tags=("lmforge.error", "lmforge.source_run_id", "mlflow.note.content"))
    return earlier.info.run_id, True


def _load_inputs(ctx: RunContext, sp: StagePlan) -> list[DatasetInput | Artifact]:
    out: list[DatasetInput | Artifact] = []
    for name in sp.inputs:
        if name in ctx.plan.datasets:
            out.append(ctx.plan.datasets[name])
        else:
            up = ctx.plan.stages[name]
            out.append(ctx.plan.store.require(up.kind, up.artifact_id))
    return out


def _cached(ctx: RunContext, name: str, existing: Artifact) -> dict[str, Any]:
    """A stage whose artifact exists: a child run marked cached and linked to the run that made it."""
    plan, store, tr = ctx.plan, ctx.plan.store, ctx.tracker
    sp = plan.stages[name]
    run_id, kept = None, False
    if tr:
        source = existing.manifest.get("produced_by", {}).get("mlflow_run_id", "")
        earlier = _earlier_child(ctx, name)
        if earlier is not None and earlier.info.run_id == source:  # an earlier attempt of this flow run made it
            run_id, kept = source, True  # its child run stays as that attempt left it
        else:
            run_id, reused = _start_stage_run(ctx, name, {**_stage_tags(ctx, sp), "cached": "true",
                                                          "lmforge.source_run_id": source,
                                                          "mlflow.note.content": f"Cached: artifact made by run {source}"})
            tr.log_params(run_id, sp.settings, new_only=reused)
            tr.log_metrics(run_id, numeric_leaves(existing.result))
    if sp.accepted:
        _use_accepted(ctx, sp, run_id)
    if tr:
        if not existing.manifest.get("failure"):
            _register_model(ctx, sp, existing, run_id, ran=kept)
        if not kept:
            tr.end_run(run_id, "FAILED" if existing.manifest.get("failure") else "FINISHED")
    store.set_ref(plan.cfg.name, name, sp.kind, sp.artifact_id)
    if existing.manifest.get("failure"):
        raise FailedAfterPublish(f"{existing.manifest['failure']} (cached artifact {sp.uri})", existing.result)
    log.info("stage %s: cached %s", name, sp.uri)
    return {"stage": name, "status": "cached", "artifact_id": sp.artifact_id, "uri": sp.uri,
            "seconds": 0.0, "mlflow_run_id": run_id}


def execute_stage(ctx: RunContext, name: str) -> dict[str, Any]:
    """Returns {"stage", "status": ran|cached, "artifact_id", "uri", "seconds", "mlflow_run_id"}."""
    from lmforge import monitoring  # prometheus_client loads with the first stage, not with every import of lmforge
    with monitoring.stage(ctx.plan.cfg, name, ctx.plan.stages[name].kind, ctx.flow_run.get("id")) as watch:
        out = _execute_stage(ctx, name)
        watch.set("succeeded" if out["status"] == "ran" else "cached")
        return out


def _execute_stage(ctx: RunContext, name: str) -> dict[str, Any]:
    store, sp = ctx.plan.store, ctx.plan.stages[name]
    existing = store.get(sp.kind, sp.artifact_id)
    if existing is not None and not sp.forced:
        return _cached(ctx, name, existing)
    if sp.accepted:  # running here would write new code's output under the old code's id
        raise ArtifactError(f"stage {name}: the artifact accepted across a code change, {sp.uri}, is gone; rerun "
                            f"without --accept-code-change {name} to make {sp.kind}/{sp.accepted['new_artifact_id']}")
    interrupt.check(f"stage {name}")  # asked to stop: a stage that has not started does not start
    # one builder per artifact: another run building it now is waited for, and its result used
    while True:
        held = Lease(store, sp.kind, sp.artifact_id, run=ctx.flow_run.get("id") or f"{platform.node()}:{os.getpid()}")
        if not held.acquire(done=lambda: not sp.forced and store.get(sp.kind, sp.artifact_id) is not None):
            log.info("stage %s: %s was built meanwhile by another run; using it", name, sp.uri)
            return _cached(ctx, name, store.require(sp.kind, sp.artifact_id))
        if held.took_over:  # its holder died: remove what it left in staging and scratch
            gc.sweep_leftovers(store)
        try:
            return _build(ctx, name, held)
        except LeaseLost as e:  # this run stalled past its lease and another run took the stage over: wait for it
            if sp.forced:
                raise
            log.warning("stage %s: %s; waiting for that run's result", name, e)
        finally:
            held.release()


def _build(ctx: RunContext, name: str, held: Lease) -> dict[str, Any]:
    """Run the stage under `held` and publish its artifact (only while the lease is still ours)."""
    from lmforge import monitoring

    plan, store, tr = ctx.plan, ctx.plan.store, ctx.tracker
    sp = plan.stages[name]
    sc = plan.cfg.stages[name]
    existing = store.get(sp.kind, sp.artifact_id)
    if existing is not None and not sp.forced:  # published between the plan and the lease
        return _cached(ctx, name, existing)
    sdef = ctx.kinds[sp.kind]
    run_id, reused = _start_stage_run(ctx, name, {**_stage_tags(ctx, sp), "cached": "false"}) if tr else (None, False)
    try:
        if tr:
            tr.log_params(run_id, sp.settings, new_only=reused)
        log.info("stage %s: running %s (%s)", name, sp.uri, sp.reason)
        inputs = _load_inputs(ctx, sp)
        if sp.forced and "history_stamp" not in sp.extra:  # once per run: a Prefect retry resumes this attempt's work
            sp.extra["history_stamp"] = store.history_stamp()
            store.retire_checkpoints(sp.kind, sp.artifact_id, sp.extra["history_stamp"])
        started, t0 = _now(), time.monotonic()
        with store.staging(sp.kind, sp.artifact_id) as out:
            failure: FailedAfterPublish | None = None
            if sdef.wants_runtime:
                runtime = StageRuntime(pipeline=plan.cfg.name, stage=name, kind=sp.kind, artifact_id=sp.artifact_id,
                                       store=store, checkpoint_uri=store.checkpoint_uri(sp.kind, sp.artifact_id),
                                       tracking_uri=tr.uri if tr else None, mlflow_run_id=run_id,
                                       root=plan.cfg.root, lease=held.fence(),
                                       monitoring=monitoring.for_training(plan.cfg, name, sp.kind))
                run = functools.partial(sdef.run, runtime=runtime)
            else:
                run = sdef.run
            monitoring.stage_running(plan.cfg.name, name)
            try:
                with MODELS_HERE if sdef.loads_models_here else contextlib.nullcontext():
                    result = run(sc, inputs, out)
            except FailedAfterPublish as e:  # complete output that fails a check: publish, then fail
                failure, result = e, e.result
            seconds = time.monotonic() - t0
            manifest = {
                "manifest_version": 1,
                "artifact_id": sp.artifact_id,
                "kind": sp.kind,
                "code_version": sp.version,
                "code": sp.code.to_json() if sp.code else {},
                "config": sp.settings,
                "inputs": [_input_entry(ctx, i) for i in sp.inputs],
                "output": {"type": sp.port.type, "data_kind": sp.port.data_kind} if sp.port else {},
                "result": result.model_dump(mode="json"),
                "produced_by": {"pipeline": plan.cfg.name, "stage": name, "mlflow_run_id": run_id,
                                "flow_run_id": ctx.flow_run.get("id"), "flow_run_name": ctx.flow_run.get("name"),
                                "config_hash": plan.cfg.config_hash()},
                "git_commit": provenance.git_commit(),
                "library_versions": provenance.library_versions(),
                "environment": provenance.environment(),
                "timings": {"started_at": started, "finished_at": _now(), "seconds": round(seconds, 3)},
            }
            det = manifest["result"]
            manifest["deterministic"] = det.get("deterministic", True)  # data stages are seeded and single-ordered
            if det.get("nondeterminism"):
                manifest["nondeterminism"] = det["nondeterminism"]
            if failure is not None:
                manifest["failure"] = str(failure)
            held.check()  # fencing: a run whose lease was taken over does not publish
            artifact = store.publish(sp.kind, sp.artifact_id, out, manifest, replace=sp.forced,
                                     history_stamp=sp.extra.get("history_stamp"))
            store.set_ref(plan.cfg.name, name, sp.kind, sp.artifact_id)
            monitoring.StageWatch(plan.cfg.name, name, sp.kind).result(result.metrics())
            if tr:
                tr.log_metrics(run_id, {**result.metrics(), "stage_seconds": seconds})
                if failure is None:  # while `out` still holds what an object store was sent: no download
                    _register_model(ctx, sp, artifact, run_id, ran=True, staged=out)
                    tr.end_run(run_id)
        if failure is not None:
            raise failure
        log.info("stage %s: done in %.1fs -> %s", name, seconds, artifact.uri)
        return {"stage": name, "status": "ran", "artifact_id": sp.artifact_id, "uri": sp.uri,
                "seconds": round(seconds, 3), "mlflow_run_id": run_id}
    except BaseException as e:
        if tr and run_id:
            try:
                tr.set_tags(run_id, {"lmforge.error": f"{type(e).__name__}: {e}"[:5000]})
                tr.end_run(run_id, "FAILED" if isinstance(e, Exception) else "KILLED")
            except Exception:  # tracking must not hide the stage's own error
                log.exception("could not mark MLflow run %s failed", run_id)
        raise

