"""Versioned artifacts on any fsspec filesystem.

Layout: `{store}/{kind}/{artifact_id}/` holds the stage's files and `manifest.json`, written last.
A folder without a manifest does not exist. `{store}/_refs/{pipeline}/{stage}.json` points at the
artifact a pipeline's stage produced last; it only explains reruns (`lmforge plan`), it is never the
source of truth. S3 credentials and endpoint come from the environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...), never from a config.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

import fsspec

from lmforge.errors import ArtifactError
from lmforge.owner import claim, work_base
from lmforge.verified import VerifyingReader, mismatch_error, read_verified

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CHECKPOINTS = "_checkpoints"
HISTORY = "_history"
ACCEPTED = "_accepted"  # {store}/_accepted/{kind}/{new_id}.json: an earlier artifact reused across a code change
LEASE = "_lease.json"  # lmforge.lease: which run builds this artifact now
RESERVED = {MANIFEST, CHECKPOINTS, HISTORY, LEASE}
ID_LEN = 16


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def artifact_id(kind: str, code: str, settings: dict[str, Any], input_ids: list[str]) -> str:
    """Stable id: depends on what defines the output (the stage kind, its code fingerprint from
    `lmforge.fingerprint`, its normalized settings and its inputs' ids), never on paths, names or machines."""
    body = {"kind": kind, "code": code, "config": settings, "inputs": input_ids}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()[:ID_LEN]


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path) for a store URL or local path; S3 endpoint from the environment."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    kwargs: dict[str, Any] = {}
    if protocol in ("s3", "s3a"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            kwargs["client_kwargs"] = {"endpoint_url": endpoint}
    fs, root = fsspec.core.url_to_fs(url, **kwargs)
    return fs, root.rstrip("/")


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


@functools.lru_cache(maxsize=256)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(Path(path))


def file_fingerprint(path: Path) -> str:
    """sha256 of a local file, computed once per process for the same (path, size, mtime)."""
    st = path.stat()
    return _sha256_cached(str(path.resolve()), st.st_size, st.st_mtime_ns)


def _sha256_stream(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while b := f.read(1 << 20):
            h.update(b)
            n += len(b)
    return h.hexdigest(), n


@functools.lru_cache(maxsize=1024)
def _object_sha256(fs: fsspec.AbstractFileSystem, path: str, etag: str, size: int) -> tuple[str, int]:
    return _sha256_stream(fs, path)


def fingerprint(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, int]:
    """(sha256, bytes) of a file on any filesystem, hashed once per process while it is unchanged: a local file
    is known by (path, size, mtime), an object by its ETag (S3 changes it with every write). An object store
    without ETags is hashed every time."""
    if is_local(fs):
        p = Path(path)
        return file_fingerprint(p), p.stat().st_size
    info = fs.info(path)
    etag = info.get("ETag") or info.get("etag")
    if not etag:
        return _sha256_stream(fs, path)
    return _object_sha256(fs, path, str(etag), int(info.get("size") or 0))


def folder_fingerprint(folder: Path) -> str | None:
    """`sha256:<32 hex>` over a folder's file names and contents (hidden files and __pycache__ left
    out): what an artifact id hashes instead of a local model or task folder's path. None if no folder."""
    if not folder.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.relative_to(folder)
        if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            continue
        h.update(f"{rel.as_posix()}\0{file_fingerprint(f)}\n".encode())
    return "sha256:" + h.hexdigest()[:32]


def contents_digest(manifest: dict[str, Any]) -> str:
    """sha256 over an artifact's files (path and sha256 of each): what its bytes were, in 16 hex digits."""
    files = sorted((f["path"], f["sha256"]) for f in manifest.get("files", []))
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]



class Artifact:
    """A finished artifact, read through its manifest."""

    def __init__(self, store: "ArtifactStore", kind: str, artifact_id: str, manifest: dict[str, Any]):
        self.store, self.kind, self.id, self.manifest = store, kind, artifact_id, manifest

    def __repr__(self) -> str:
        return f"Artifact({self.kind}/{self.id})"

    @property
    def path(self) -> str:
        return self.store.artifact_path(self.kind, self.id)

    @property
    def uri(self) -> str:
        return self.store.artifact_uri(self.kind, self.id)

    @property
    def result(self) -> dict[str, Any]:
        return self.manifest.get("result", {})

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return {f["path"]: f for f in self.manifest["files"]}

    def file_uri(self, rel: str) -> str:
        self._entry(rel)
        return f"{self.uri}/{rel}"

    def _entry(self, rel: str) -> dict[str, Any]:
        try:
            return self.files[rel]
        except KeyError:
            raise ArtifactError(f"{self.uri}: has no file {rel!r}; files: {', '.join(sorted(self.files))}") from None

    @property
    def producer(self) -> str | None:
        """The pipeline stage that produced this artifact (the one to rerun with --force when it is damaged)."""
        return self.manifest.get("produced_by", {}).get("stage")

    def mismatch(self, rel: str, got: tuple[int, str] | None, location: str | None = None) -> ArtifactError:
        """The error for file `rel` read as `got` (bytes, sha256), or missing (None)."""
        e = self._entry(rel)
        return mismatch_error(f"{self.kind}/{self.id}", rel, location or f"{self.uri}/{rel}", got,
                              (e["bytes"], e["sha256"]), self.producer)

    def _open_raw(self, rel: str) -> IO[bytes]:
        try:
            return self.store.fs.open(f"{self.path}/{rel}", "rb")
        except FileNotFoundError:
            raise self.mismatch(rel, None) from None

    def open(self, rel: str) -> io.BufferedReader:
        """Open a file for streaming; reading it to the end verifies it against the manifest. The bytes before
        the end are not checked yet: use it where nothing is kept or published before the end (a download, a
        first pass), and `open_verified` where records are used as they come."""
        e = self._entry(rel)
        f = self._open_raw(rel)
        return io.BufferedReader(VerifyingReader(f, e["bytes"], e["sha256"], lambda n, h: self.mismatch(rel, (n, h))),
                                 1 << 20)

    def open_verified(self, rel: str) -> IO[bytes]:
        """A copy of a file, already checked against the manifest (size and sha256) before its first byte is
        used: one read, hashed as it is copied (in memory up to lmforge.verified.SPOOL_BYTES, else a temporary file)."""
        e = self._entry(rel)
        with self._open_raw(rel) as f:
            return read_verified(f, e["bytes"], e["sha256"], lambda n, h: self.mismatch(rel, (n, h)))

    def download(self, dest: Path, files: Iterable[str] | None = None) -> Path:
        """Copy `files` (default: every file) to `dest`/<path>, one read each, hashed as it streams: a file that does
        not match the manifest raises at its end, leaving `dest` for the caller to discard."""
        for rel in self.files if files is None else files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.open(rel) as src, open(target, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 22)
        return dest

    def verify(self) -> None:
        """Check every file's size and sha256 (reads everything)."""
        for rel in self.files:
            with self.open(rel) as f:
                while f.read(1 << 20):
                    pass

    def verify_local(self, folder: Path, prefix: str = "", max_bytes: int | None = None) -> None:
        """Check local files against the manifest: file `prefix + name` is `folder / name` (the local store's own
        folder, or a downloaded copy). `max_bytes` limits the check to files up to that size (configs only)."""
        for rel, e in self.files.items():
            if not rel.startswith(prefix) or (max_bytes is not None and e["bytes"] > max_bytes):
                continue
            p = folder / rel[len(prefix):]
            if not p.is_file():
                raise self.mismatch(rel, None, str(p))
            got = (p.stat().st_size, sha256_file(p))
            if got != (e["bytes"], e["sha256"]):
                raise self.mismatch(rel, got, str(p))


class ArtifactStore:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url)
        self.local = is_local(self.fs)

    def __repr__(self) -> str:
        return f"ArtifactStore({self.url})"

    # ---- paths
    def artifact_path(self, kind: str, aid: str) -> str:
        return f"{self.root}/{kind}/{aid}"

    def artifact_uri(self, kind: str, aid: str) -> str:
        return f"{self.url}/{kind}/{aid}"

    def checkpoint_path(self, kind: str, aid: str) -> str:
        return f"{self.artifact_path(kind, aid)}/{CHECKPOINTS}"

    def checkpoint_uri(self, kind: str, aid: str) -> str:
        return f"{self.artifact_uri(kind, aid)}/{CHECKPOINTS}"

    # ---- reading
    def get(self, kind: str, aid: str) -> Artifact | None:
        """The finished artifact, or None when it has no manifest (absent or half-written)."""
        mpath = f"{self.artifact_path(kind, aid)}/{MANIFEST}"
        try:
            with self.fs.open(mpath, "rb") as f:
                manifest = json.loads(f.read())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{self.artifact_uri(kind, aid)}/{MANIFEST}: not valid JSON ({e}); "
                                "delete the folder and rerun the stage") from None
        return Artifact(self, kind, aid, manifest)

    def require(self, kind: str, aid: str) -> Artifact:
        a = self.get(kind, aid)
        if a is None:
            raise ArtifactError(f"{self.artifact_uri(kind, aid)}: no finished artifact (no {MANIFEST}); "
                                "run the stage that produces it first")
        return a

    def kinds(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(Path(e["name"]).name for e in entries
                      if e["type"] == "directory" and not Path(e["name"]).name.startswith("_"))

    def list(self, kind: str | None = None) -> list[Artifact]:
        out = []
        for k in [kind] if kind else self.kinds():
            try:
                entries = self.fs.ls(f"{self.root}/{k}", detail=True)
            except FileNotFoundError:
                continue
            for e in entries:
                if e["type"] == "directory":
                    a = self.get(k, Path(e["name"]).name)
                    if a is not None:
                        out.append(a)
        return sorted(out, key=lambda a: a.manifest.get("timings", {}).get("finished_at", ""))

    def find(self, id_prefix: str) -> Artifact:
        hits = [a for a in self.list() if a.id.startswith(id_prefix)]
        if not hits:
            raise ArtifactError(f"no artifact with id {id_prefix!r} in {self.url}; `lmforge artifacts ls` lists them")
        if len(hits) > 1:
            raise ArtifactError(f"id prefix {id_prefix!r} is ambiguous in {self.url}: "
                                + ", ".join(f"{a.kind}/{a.id}" for a in hits))
        return hits[0]

    # ---- writing
    @contextlib.contextmanager
    def staging(self, kind: str, aid: str) -> Iterator[Path]:
        """A fresh local folder to write an artifact into (`<staging>/<kind>-<id>-<random>/out/`, next to the
        `owner.json` of `lmforge.owner`); removed afterwards, whatever happens, and by the next run after a kill -9
        (`lmforge.gc`)."""
        # a local store stages on its own filesystem, so publish is a rename
        base = Path(self.root) / "_staging" if self.local else work_base("lmforge-staging")
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{kind}-{aid}-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        try:
            claim(path, kind, aid)  # whose it is: a rerun removes it if this process dies (kill -9)
            (path / "out").mkdir()
            yield path / "out"
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def history_stamp(self) -> str:
        """A fresh `_history/<stamp>` name: UTC time to the second, plus a short random tail (two forced runs in
        one second never share a folder)."""
        return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:6]

    def retire_checkpoints(self, kind: str, aid: str, stamp: str) -> str | None:
        """Move the artifact's `_checkpoints/` to `_history/<stamp>/_checkpoints/` (a forced stage starts over at
        step 0; the old checkpoints stay readable there). Returns the new path, or None when there were none."""
        src = self.checkpoint_path(kind, aid)
        if not self.fs.exists(src):
            return None
        dest = f"{self.artifact_path(kind, aid)}/{HISTORY}/{stamp}/{CHECKPOINTS}"
        self._move(src, dest)
        log.info("%s: moved its checkpoints to %s/%s/ (forced: training starts at step 0)",
                 self.artifact_uri(kind, aid), HISTORY, stamp)
        return dest

    def _move(self, src: str, dest: str) -> None:
        """Move a file or folder within the store: a rename locally, copy-then-delete on object storage."""
        self.fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
        if self.local:
            os.replace(src, dest)
        else:  # file by file: s3fs's recursive mv also copies the folder markers some servers list (SeaweedFS)
            self.fs.invalidate_cache(src)
            files = [f for f in self.fs.find(src) if f.rstrip("/") != src] or [src]
            for f in files:
                self.fs.copy(f, dest + f[len(src):])
            self.fs.rm(files)  # only once every copy landed
            with contextlib.suppress(FileNotFoundError):  # an emptied prefix some servers keep as a folder
                self.fs.rm(src, recursive=True)
            self.fs.invalidate_cache(src)
            self.fs.invalidate_cache(dest)

    def publish(self, kind: str, aid: str, staged: Path, manifest: dict[str, Any], replace: bool = False,
                history_stamp: str | None = None) -> Artifact:
        """Move staged files into place and write the manifest last.

        Until the manifest lands, the artifact does not exist for any reader. With `replace` (a forced rerun)
        the old artifact moves whole, manifest first and then its files, to `_history/<history_stamp>/` (where
        the forced run already moved its checkpoints), so the old result stays readable until this moment and
        nothing stored is lost.
        """
        files = []
        for p in sorted(staged.rglob("*")):
            if p.is_file():
                rel = p.relative_to(staged).as_posix()
                if rel.split("/")[0] in RESERVED:
                    raise ArtifactError(f"stage {kind} wrote reserved name {rel!r} into its output")
                files.append({"path": rel, "bytes": p.stat().st_size, "sha256": sha256_file(p)})
        manifest = {**manifest, "files": files}
        dest = self.artifact_path(kind, aid)
        mpath = f"{dest}/{MANIFEST}"
        if self.fs.exists(mpath):
            if not replace:
                log.warning("%s was published meanwhile by another run; keeping that one", self.artifact_uri(kind, aid))
                return self.require(kind, aid)
            old = f"{dest}/{HISTORY}/{history_stamp or self.history_stamp()}"
            self._move(mpath, f"{old}/{MANIFEST}")  # first: from here on the old artifact is history, not current
            for e in self.fs.ls(dest, detail=False):
                if Path(e).name not in RESERVED:
                    self._move(e, f"{old}/{Path(e).name}")
            log.info("%s: the replaced artifact is kept in %s/", self.artifact_uri(kind, aid), old)
        self.fs.makedirs(dest, exist_ok=True)
        self.fs.invalidate_cache(dest)
        # leftovers of a killed publish (files without a manifest): everything but checkpoints/history
        try:
            for e in self.fs.ls(dest, detail=False):
                if Path(e).name not in RESERVED:
                    self.fs.rm(e, recursive=True)
        except FileNotFoundError:
            pass
        if self.local:
            for entry in staged.iterdir():
                os.replace(entry, Path(dest) / entry.name)
        else:
            for f in files:
                self.fs.put_file(str(staged / f["path"]), f"{dest}/{f['path']}")
        self._write_json(mpath, manifest)
        return Artifact(self, kind, aid, manifest)

    def _write_json(self, path: str, obj: Any) -> None:
        data = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False).encode()
        if self.local:  # write-then-rename so a reader never sees half a file
            tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:  # an S3 PUT is atomic
            self.fs.pipe_file(path, data)

    # ---- refs: which artifact a pipeline's stage produced last (explains reruns)
    def ref_path(self, pipeline: str, stage: str) -> str:
        return f"{self.root}/_refs/{pipeline}/{stage}.json"

    def set_ref(self, pipeline: str, stage: str, kind: str, aid: str) -> None:
        self.fs.makedirs(f"{self.root}/_refs/{pipeline}", exist_ok=True)
        self._write_json(self.ref_path(pipeline, stage), {"kind": kind, "artifact_id": aid,
                                                          "updated_at": _now()})

    def get_ref(self, pipeline: str, stage: str) -> dict[str, Any] | None:
        try:
            with self.fs.open(self.ref_path(pipeline, stage), "rb") as f:
                return json.loads(f.read())
        except (FileNotFoundError, json.JSONDecodeError):
            return None


    # ---- code changes accepted by name (`lmforge run --accept-code-change STAGE`)
    def acceptance_path(self, kind: str, new_id: str) -> str:
        return f"{self.root}/{ACCEPTED}/{kind}/{new_id}.json"

    def get_acceptance(self, kind: str, new_id: str) -> dict[str, Any] | None:
        """The record saying that `kind/new_id` (the id of the current code) reuses an earlier artifact, or None."""
        try:
            with self.fs.open(self.acceptance_path(kind, new_id), "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as e:
            raise ArtifactError(f"{self.url}/{ACCEPTED}/{kind}/{new_id}.json: not valid JSON ({e}); delete it and "
                                "accept the code change again") from None

    def record_acceptance(self, record: dict[str, Any]) -> None:
        """Keep a code change accepted for good: append it to the reused artifact's manifest
        (`code_change_accepted`, rewritten atomically), then write `_accepted/{kind}/{new_id}.json`, which later
        plans read. The artifact's files do not change."""
        kind, old_id, new_id = record["kind"], record["artifact_id"], record["new_artifact_id"]
        art = self.require(kind, old_id)
        manifest = dict(art.manifest)
        entries = [e for e in manifest.get("code_change_accepted", []) if e.get("new_artifact_id") != new_id]
        manifest["code_change_accepted"] = [*entries, {k: v for k, v in record.items() if k != "code_before"}]
        self._write_json(f"{self.artifact_path(kind, old_id)}/{MANIFEST}", manifest)
        self.fs.makedirs(f"{self.root}/{ACCEPTED}/{kind}", exist_ok=True)
        self._write_json(self.acceptance_path(kind, new_id), record)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
