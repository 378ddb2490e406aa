"""Garbage: what killed runs leave behind, and what finished artifacts no longer need.

Every staging folder (`{store}/_staging/` on a local store, `$LMFORGE_WORK_DIR|$TMPDIR/lmforge-staging/` for an
object store) and every training scratch folder (`.../lmforge-train/`) carries `owner.json` (`lmforge.owner`): the
host, pid and process start time of the run that made it, and the artifact it builds. A folder is a leftover when its
owner is gone: on this host, the process no longer exists (or the pid was reused by another process); on another host
(a local store shared over NFS), the artifact's lease is absent or expired. A folder without `owner.json` (killed
between its mkdir and the record) is a leftover once it is older than the lease expiry. A live run's folders are
never touched.

`sweep_leftovers` runs at the start of every `lmforge run`. `collect` is `lmforge gc`: leftovers, plus
- the checkpoints of finished artifacts (default: none kept after success; `keep_checkpoints=N` keeps the newest
  N complete ones), also those kept under `_history/` by forced reruns. An artifact whose lease is held (a forced
  rerun training now) is skipped;
- with `unreferenced`, whole artifacts that no pipeline's ref (`_refs/`) reaches, directly or as an input of one
  that is. The manifest goes first, so an artifact is never half visible;
- with `caches`, the local model cache (`lmforge-models/`: downloaded and merged models that eval rebuilds).
Each reports the bytes it frees; `dry_run` only reports.
"""
from __future__ import annotations

import json
import logging
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.lease import TTL_SECONDS
from lmforge.owner import OWNER, process_gone, work_base
from lmforge.store import CHECKPOINTS, HISTORY, LEASE, MANIFEST, ArtifactStore

log = logging.getLogger(__name__)

def _lease_live(store: ArtifactStore | None, kind: str, aid: str) -> bool:
    if store is None:
        return False
    try:
        store.fs.invalidate_cache()
        held = json.loads(store.fs.cat_file(f"{store.artifact_path(kind, aid)}/{LEASE}"))
    except (FileNotFoundError, ValueError):
        return False
    return time.time() <= float(held.get("expires", 0))


def orphaned(folder: Path, store: ArtifactStore | None = None) -> str | None:
    """Why `folder` is a leftover of a run that is gone, or None while its run may still be using it."""
    try:
        owner = json.loads((folder / OWNER).read_text())
    except FileNotFoundError:
        age = time.time() - folder.stat().st_mtime
        return f"no owner record, {age:.0f} s old" if age > TTL_SECONDS else None
    except ValueError:
        return "unreadable owner record"
    if owner.get("host") == platform.node():
        pid = owner.get("pid")
        if not isinstance(pid, int) or process_gone(pid, owner.get("pid_started")):
            return f"its process {pid} is gone"
        return None
    if _lease_live(store, owner.get("kind", ""), owner.get("artifact_id", "")):
        return None
    return f"made on host {owner.get('host')}, whose lease on {owner.get('kind')}/{owner.get('artifact_id')} expired"


@dataclass
class Removal:
    what: str  # leftover | checkpoints | unreferenced | cache
    path: str
    bytes: int
    why: str


@dataclass
class Report:
    dry_run: bool
    removals: list[Removal] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.removals)

    def to_json(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "bytes": self.bytes, "removals": [r.__dict__ for r in self.removals]}


def _local_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _store_bytes(store: ArtifactStore, path: str) -> int:
    try:
        return int(store.fs.du(path, total=True))
    except FileNotFoundError:
        return 0


def _scratch_areas(store: ArtifactStore) -> list[Path]:
    areas = [work_base("lmforge-train"), work_base("lmforge-staging")]
    if store.local:
        areas.insert(0, Path(store.root) / "_staging")
    return areas


def sweep_leftovers(store: ArtifactStore, dry_run: bool = False, report: Report | None = None) -> Report:
    """Remove the staging and training-scratch folders of runs that are gone (see the module doc)."""
    report = report or Report(dry_run)
    for area in _scratch_areas(store):
        if not area.is_dir():
            continue
        for folder in sorted(area.iterdir()):
            if not folder.is_dir():
                continue
            why = orphaned(folder, store)
            if why is None:
                continue
            size = _local_bytes(folder)
            report.removals.append(Removal("leftover", str(folder), size, why))
            if not dry_run:
                shutil.rmtree(folder, ignore_errors=True)
    return report


def _artifact_folders(store: ArtifactStore) -> list[tuple[str, str]]:
    out = []
    for kind in store.kinds():
        try:
            entries = store.fs.ls(f"{store.root}/{kind}", detail=True)
        except FileNotFoundError:
            continue
        out += [(kind, Path(e["name"]).name) for e in entries if e["type"] == "directory"]
    return out


def _checkpoints(store: ArtifactStore, where: str) -> list[tuple[int, str, bool]]:
    """(step, path, complete) of the `checkpoint-<step>` folders under `where`, oldest first (the layout of
    trainer/checkpoint.py: complete = has DONE)."""
    out = []
    for e in store.fs.ls(where, detail=False):
        name = Path(str(e).rstrip("/")).name
        if name.startswith("checkpoint-") and name[len("checkpoint-"):].isdigit():
            path = f"{where}/{name}"
            complete = store.fs.exists(f"{path}/DONE")
            # some S3 servers (SeaweedFS) keep an emptied prefix as a folder: not a checkpoint
            if complete or [f for f in store.fs.find(path) if f.rstrip("/") != path]:
                out.append((int(name[len("checkpoint-"):]), path, complete))
    return sorted(out)


def _prune_checkpoints(store: ArtifactStore, where: str, keep: int, why: str, report: Report) -> None:
    """Remove all but the newest `keep` complete checkpoints under `where` (a `_checkpoints/` folder); with
    keep 0 the whole folder."""
    store.fs.invalidate_cache(where)
    if keep == 0:
        doomed = [where]
    else:
        entries = _checkpoints(store, where)
        complete = [p for _, p, done in entries if done]
        doomed = [p for _, p, done in entries if not done] + complete[:-keep]
    for path in doomed:
        report.removals.append(Removal("checkpoints", path, _store_bytes(store, path), why))
        if report.dry_run:
            continue
        for done in store.fs.glob(f"{path}/DONE") + store.fs.glob(f"{path}/checkpoint-*/DONE"):
            store.fs.rm_file(done)  # first: a half-deleted checkpoint must not look complete
        store.fs.rm(path, recursive=True)


def _referenced(store: ArtifactStore) -> set[tuple[str, str]]:
    """Every artifact a ref points at, and everything those were made from."""
    try:
        refs = store.fs.glob(f"{store.root}/_refs/*/*.json")
    except FileNotFoundError:
        refs = []
    todo = []
    for r in refs:
        try:
            ref = json.loads(store.fs.cat_file(r))
            todo.append((ref["kind"], ref["artifact_id"]))
        except (ValueError, KeyError, FileNotFoundError):
            continue
    seen: set[tuple[str, str]] = set()
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        art = store.get(*key)
        for i in (art.manifest.get("inputs", []) if art else []):
            if i.get("type") == "artifact":
                todo.append((i["kind"], i["artifact_id"]))
    return seen


def collect(store: ArtifactStore, *, keep_checkpoints: int = 0, unreferenced: bool = False, caches: bool = False,
            dry_run: bool = False) -> Report:
    """`lmforge gc`: see the module doc."""
    report = sweep_leftovers(store, dry_run)
    referenced = _referenced(store) if unreferenced else set()
    for kind, aid in _artifact_folders(store):
        base = store.artifact_path(kind, aid)
        finished = store.fs.exists(f"{base}/{MANIFEST}")
        if _lease_live(store, kind, aid):
            continue  # a run is building it (a forced rerun): its checkpoints are in use
        if unreferenced and finished and (kind, aid) not in referenced:
            report.removals.append(Removal("unreferenced", base, _store_bytes(store, base),
                                           f"{kind}/{aid}: no pipeline ref reaches it"))
            if not dry_run:
                store.fs.rm_file(f"{base}/{MANIFEST}")  # first: from here on it does not exist for any reader
                store.fs.rm(base, recursive=True)
            continue
        if finished:
            ckpts = [f"{base}/{CHECKPOINTS}"]
            try:
                ckpts += [f"{h}/{CHECKPOINTS}" for h in store.fs.ls(f"{base}/{HISTORY}", detail=False)]
            except FileNotFoundError:
                pass
            for where in ckpts:
                if store.fs.exists(where):
                    _prune_checkpoints(store, where, keep_checkpoints, f"{kind}/{aid} is finished; keeping "
                                       f"{keep_checkpoints} checkpoint(s)", report)
    if caches:
        cache = work_base("lmforge-models")
        if cache.is_dir():
            report.removals.append(Removal("cache", str(cache), _local_bytes(cache),
                                           "downloaded and merged models; eval rebuilds them when needed"))
            if not dry_run:
                shutil.rmtree(cache, ignore_errors=True)
    return report
