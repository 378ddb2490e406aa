"""Publishing: an export stage's folder copied to its `publish_to` at the end of a run whose gates passed.

A target is a local folder (relative paths resolve against the project root) or `s3://bucket/prefix` (the same
endpoint and keys as an s3:// store: the AWS_* environment variables). What it gets is the export artifact's files,
each read verified against the store's manifest, and `lmforge_published.json` (which artifact, its contents digest,
pipeline, stage, when), written last:
- a folder is filled beside the target and renamed into place, so a reader sees the old model or the new one, never
  half of one; the old one is then removed (it stays in the store and the registry);
- an S3 prefix has no rename: its marker is removed first, the files are uploaded, files of the old model that the
  new one lacks are deleted, and the marker comes last. The prefix holds a finished model exactly when its marker
  names one.
Publishing the same artifact again changes nothing. A target holding files that lmforge did not publish (no marker)
is refused, and nothing is written to it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lmforge.errors import DataError
from lmforge.store import Artifact, contents_digest, filesystem

log = logging.getLogger(__name__)

MARKER = "lmforge_published.json"


def publish_exports(plan, stages: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Publish every export stage with `publish_to` that finished in this run, when the run's gates passed
    (`runview.gates_passed`). Returns {stage: "published <target>" | "unchanged <target>"}."""
    from lmforge.runview import gates_passed

    wanted = [n for n, sp in plan.stages.items() if sp.kind == "export" and plan.cfg.stages[n].publish_to]
    if not wanted or not gates_passed(plan, stages):
        return {}
    done = {}
    for name in wanted:
        sp = plan.stages[name]
        if stages.get(name, {}).get("status") not in ("ran", "cached"):
            continue
        target = resolve_target(plan.cfg.stages[name].publish_to, plan.cfg.root)
        record = {"pipeline": plan.cfg.name, "stage": name,
                  "exported_stage": plan.cfg.stages[name].exported_stage()}
        where = f"stages.{name}.publish_to"
        try:
            how = publish(plan.store.require(sp.kind, sp.artifact_id), target, record, where=where)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001  a target that cannot be written: say which, and that nothing is lost
            raise DataError(where, f"could not publish to {target}: {type(e).__name__}: {str(e).splitlines()[0]}",
                            "fix the target and rerun: every stage is cached, and the model is in the store and "
                            "the registry") from e
        done[name] = f"{how} {target}"
        log.info("stage %s: %s to %s", name, how, target)
    return done


def resolve_target(target: str, root: Path) -> str:
    if "://" in target and not target.startswith("file://"):
        return target.rstrip("/")
    path = Path(target[len("file://"):] if target.startswith("file://") else target).expanduser()
    return str(path if path.is_absolute() else (Path(root) / path).resolve())


def publish(art: Artifact, target: str, record: dict[str, Any], where: str = "publish_to") -> str:
    """Copy model artifact `art` to `target` (a folder or an fsspec URL). Returns "published" or "unchanged"."""
    record = {"artifact": f"{art.kind}/{art.id}", "contents": contents_digest(art.manifest), **record,
              "published_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if "://" in target:
        return _publish_fs(art, target, record, where)
    return _publish_folder(art, Path(target), record, where)


def _same(existing: dict[str, Any] | None, record: dict[str, Any]) -> bool:
    return bool(existing) and existing.get("artifact") == record["artifact"] and \
        existing.get("contents") == record["contents"]


def _foreign(target: str, where: str) -> DataError:
    return DataError(where, f"{target} holds files that lmforge did not publish (no {MARKER})",
                     "publish to a new or empty folder or prefix; nothing was written there")


def _publish_folder(art: Artifact, target: Path, record: dict[str, Any], where: str) -> str:
    marker = target / MARKER
    existing = json.loads(marker.read_text()) if marker.is_file() else None
    if _same(existing, record):
        return "unchanged"
    if existing is None and target.is_dir() and any(target.iterdir()):
        raise _foreign(str(target), where)
    if target.exists() and not target.is_dir():
        raise DataError(where, f"{target} is a file", "publish to a folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    new, old = target.parent / f".{target.name}.publishing-{tag}", target.parent / f".{target.name}.replaced-{tag}"
    try:
        art.download(new)  # each file hashed as it streams: a mismatch raises before anything is renamed
        (new / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        if target.exists():
            os.rename(target, old)
        os.rename(new, target)
    finally:
        shutil.rmtree(new, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return "published"


def _publish_fs(art: Artifact, target: str, record: dict[str, Any], where: str) -> str:
    fs, root = filesystem(target)
    marker = f"{root}/{MARKER}"
    existing = json.loads(fs.cat_file(marker)) if fs.exists(marker) else None
    if _same(existing, record):
        return "unchanged"
    before = set()
    if fs.exists(root):
        before = {p[len(root) + 1:] for p in fs.find(root)}
    if existing is None and before:
        raise _foreign(target, where)
    if existing is not None:
        fs.rm_file(marker)  # from here until the new marker, the prefix holds no finished model
    for rel in sorted(art.files):
        with art.open(rel) as src, fs.open(f"{root}/{rel}", "wb") as f:
            shutil.copyfileobj(src, f, 1 << 22)
    for rel in sorted(before - set(art.files) - {MARKER}):
        fs.rm_file(f"{root}/{rel}")
    fs.pipe_file(marker, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    fs.invalidate_cache(root)
    return "published"
