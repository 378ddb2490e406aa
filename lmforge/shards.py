"""Webdataset shards: names, URLs, and readers that verify each shard against its manifest before using it.

Every reader of shard bytes goes through `ShardRef`: the shard's URL (a plain path on a local store, an
fsspec URL on object storage) plus the size and sha256 the artifact's manifest lists for it. A shard is
read whole, once, hashed as it is copied, and only a copy that matches is parsed (shards are bounded by
the shard stage's max_bytes). The parent process builds the refs from the manifest (`shard_refs`); a
training process gets them in its job spec, so it checks the same digests without reading the manifest.
"""
from __future__ import annotations

import json
import re
import tarfile
from typing import IO, Any, Iterable, Iterator

import fsspec
from pydantic import BaseModel, ConfigDict

from lmforge.store import Artifact, filesystem
from lmforge.verified import mismatch_error, read_verified

SPLITS = ("train", "validation")
OBJECT_STORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs")


def _fsspec_gopen(url: str, mode: str = "rb", bufsize: int = 8192, **kw: Any):
    return fsspec.open(url, mode).open()


def register_webdataset_schemes() -> None:
    """webdataset 1.0 has no s3:// opener; route object-store URLs through fsspec (credentials and
    endpoint from the environment). Idempotent; call it in any process that opens shard URLs
    (a spawned DataLoader worker too). webdataset imports torch, so this is not done at import."""
    from webdataset.gopen import gopen_schemes

    for scheme in OBJECT_STORE_SCHEMES:
        gopen_schemes.setdefault(scheme, _fsspec_gopen)



def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def shard_files(artifact: Artifact, split: str) -> list[str]:
    """Shard file names of one split, from the manifest (never by listing the folder)."""
    return [s["name"] for s in artifact.result.get("shards", []) if s["split"] == split]


def _location(artifact: Artifact, name: str) -> str:
    return f"{artifact.path}/{name}" if artifact.store.local else artifact.file_uri(name)


def shard_urls(artifact: Artifact, split: str) -> list[str]:
    """URLs that `webdataset.WebDataset` opens: plain paths locally, fsspec URLs on object storage. Nothing
    checks what such a reader gets: lmforge's own readers take `shard_refs` and verify each shard."""
    register_webdataset_schemes()
    return [_location(artifact, n) for n in shard_files(artifact, split)]


class ShardRef(BaseModel):
    """One shard tar: where it is, and what its artifact's manifest says it holds."""

    model_config = ConfigDict(extra="forbid")

    url: str  # plain path (local store) or fsspec URL (object storage)
    artifact: str  # kind/id of the shards artifact
    file: str  # the shard's name in the artifact
    bytes: int
    sha256: str
    stage: str | None = None  # the pipeline stage that produced the artifact: the one to rerun with --force

    def open_verified(self) -> IO[bytes]:
        """The shard's bytes, checked against the manifest's size and sha256 before any is used (position 0)."""
        fs, path = filesystem(self.url)
        try:
            f = fs.open(path, "rb")
        except FileNotFoundError:
            raise self.mismatch(None) from None
        with f:
            return read_verified(f, self.bytes, self.sha256, lambda n, h: self.mismatch((n, h)))

    def mismatch(self, got: tuple[int, str] | None):
        return mismatch_error(self.artifact, self.file, self.url, got, (self.bytes, self.sha256), self.stage)


def shard_refs(artifact: Artifact, split: str) -> list[ShardRef]:
    """The shards of one split, each with the size and sha256 its manifest lists (for a training process)."""
    out = []
    for name in shard_files(artifact, split):
        e = artifact._entry(name)  # a shard the result lists but the manifest's files do not: an ArtifactError
        out.append(ShardRef(url=_location(artifact, name), artifact=f"{artifact.kind}/{artifact.id}", file=name,
                            bytes=e["bytes"], sha256=e["sha256"], stage=artifact.producer))
    return out


_MEMBER = re.compile(r"^(?:.*/|)[^./]+[.]([^/]*)$")  # webdataset's rule: the sample's key ends at the first dot


def tar_records(f: IO[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON record of every sample (its `.json` member) of a shard tar, in order."""
    with tarfile.open(fileobj=f, mode="r:") as tf:
        for m in tf:
            ext = _MEMBER.match(m.name) if m.isreg() else None
            if ext is not None and ext.group(1).lower() == "json":
                yield json.loads(tf.extractfile(m).read())  # type: ignore[union-attr]


def iter_shards(refs: Iterable[ShardRef]) -> Iterator[dict[str, Any]]:
    """The records of the given shards, in order; each shard is verified whole before its first record."""
    for ref in refs:
        with ref.open_verified() as f:
            yield from tar_records(f)


def iter_samples(artifact: Artifact, split: str = "train") -> Iterator[dict[str, Any]]:
    """Decoded records of one whole split, in shard order, each shard verified before it is used."""
    return iter_shards(shard_refs(artifact, split))
