"""Raw datasets: resolve a `datasets:` entry to concrete files and fingerprint their contents.

The fingerprint feeds the id of every artifact made from the dataset. It hashes each file's bytes
(and format), in a stable order, but never the path: the same data in another folder or bucket
gives the same ids.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from lmforge.config import DatasetConfig, PipelineConfig
from lmforge.errors import DataError
from lmforge.store import canonical_json, filesystem, fingerprint

FORMATS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz",
           ".parquet": "parquet", ".txt": "txt"}


@dataclass(frozen=True)
class SourceFile:
    uri: str
    format: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class DatasetInput:
    """A raw dataset as a stage input: its config and the files it resolved to."""

    name: str
    config: DatasetConfig
    files: tuple[SourceFile, ...] = field(default_factory=tuple)

    @property
    def id(self) -> str:
        body = {
            "kind": self.config.kind,
            "columns": self.config.columns,
            "txt_unit": self.config.txt_unit,
            "files": [[f.format, f.sha256] for f in self.files],
        }
        return "ds-" + hashlib.sha256(canonical_json(body).encode()).hexdigest()[:16]

    def lineage(self) -> dict[str, Any]:
        return {"dataset": self.name, "id": self.id, "kind": self.config.kind,
                "files": [f.__dict__ for f in self.files]}


def detect_format(uri: str, declared: str, where: str) -> str:
    if declared != "auto":
        return declared
    lower = uri.lower()
    for ext in sorted(FORMATS, key=len, reverse=True):
        if lower.endswith(ext):
            return FORMATS[ext]
    raise DataError(where, f"cannot tell the format of {uri!r} from its name",
                    "set format: to one of jsonl, jsonl.gz, parquet, txt")


def resolve_dataset(pipeline: PipelineConfig, name: str) -> DatasetInput:
    """Expand paths/globs/folders, hash every file. Raises DataError naming the missing path.

    A file is hashed once per process while it is unchanged (`lmforge.store.fingerprint`: local files by path,
    size and mtime, objects by ETag), so planning twice in one run (the CLI, then the flow) reads it once."""
    cfg = pipeline.datasets[name]
    where = f"datasets.{name}.path"
    files: list[SourceFile] = []
    for raw in cfg.paths():
        url = pipeline.resolve_path(raw)
        fs, path = filesystem(url)
        protocol = url.split("://", 1)[0] + "://" if "://" in url else ""
        if any(c in path for c in "*?["):
            matches = sorted(fs.glob(path))
        elif fs.isdir(path):
            matches = sorted(p for p in fs.find(path) if not p.rsplit("/", 1)[-1].startswith("."))
        elif fs.exists(path):
            matches = [path]
        else:
            raise DataError(where, f"{raw!r} does not exist (looked for {url})",
                            "fix the path, or create the file; relative paths resolve against "
                            f"{pipeline.root}")
        if not matches:
            raise DataError(where, f"{raw!r} matched no files (looked for {url})", "fix the glob or the folder")
        for m in matches:
            uri = protocol + m if protocol else m
            fmt = detect_format(uri, cfg.format, where)
            sha256, size = fingerprint(fs, m)
            files.append(SourceFile(uri=uri, format=fmt, sha256=sha256, bytes=size))
    return DatasetInput(name=name, config=cfg, files=tuple(files))
