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

FORMATS = {".json": "json", ".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz",
           ".parquet": "parquet", ".txt": "txt"}
HF_DISK_MARKER = "state.json"  # what `datasets.Dataset.save_to_disk` writes beside dataset_info.json and the .arrow files


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
                    "set format: to one of json, jsonl, jsonl.gz, parquet, txt, or point path at a folder "
                    "written by datasets' save_to_disk")


def saved_dataset_files(fs, path: str) -> list[str]:
    """The files of a `save_to_disk` folder, relative and sorted (hidden files left out): what its hash covers."""
    root = path.rstrip("/")
    rel = (p[len(root) + 1:] for p in fs.find(root))
    return sorted(r for r in rel if not any(part.startswith(".") for part in r.split("/")))


def combined_sha256(file_hashes: list[tuple[str, str]]) -> str:
    """One sha256 over (relative name, sha256) pairs: a saved dataset folder's content hash."""
    h = hashlib.sha256()
    for rel, sha in file_hashes:
        h.update(f"{rel}\0{sha}\n".encode())
    return h.hexdigest()


def _saved_dataset(fs, path: str, uri: str, where: str) -> SourceFile:
    """A `save_to_disk` folder as one source: hashed over every file's name and content."""
    if fs.exists(f"{path.rstrip('/')}/dataset_dict.json"):
        raise DataError(where, f"{uri!r} is a saved DatasetDict (it holds dataset_dict.json), not one split",
                        f"point path at one split's folder, e.g. {uri.rstrip('/')}/train")
    if not fs.exists(f"{path.rstrip('/')}/{HF_DISK_MARKER}"):
        raise DataError(where, f"{uri!r} is not a folder written by datasets' save_to_disk (no {HF_DISK_MARKER})",
                        "point path at the folder save_to_disk wrote, or set format: to the files' format")
    hashes, size = [], 0
    for rel in saved_dataset_files(fs, path):
        sha, n = fingerprint(fs, f"{path.rstrip('/')}/{rel}")
        hashes.append((rel, sha))
        size += n
    return SourceFile(uri=uri, format="hf_disk", sha256=combined_sha256(hashes), bytes=size)


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
        elif fs.isdir(path) and (cfg.format == "hf_disk" or
                                 (cfg.format == "auto" and fs.exists(f"{path.rstrip('/')}/{HF_DISK_MARKER}"))):
            folder = path.rstrip("/")
            files.append(_saved_dataset(fs, folder, protocol + folder if protocol else folder, where))
            continue
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
            if fmt == "hf_disk":
                raise DataError(where, f"format: hf_disk needs a folder written by save_to_disk, got the file {uri!r}",
                                "point path at the dataset's folder, or set format: to the file's format")
            sha256, size = fingerprint(fs, m)
            files.append(SourceFile(uri=uri, format=fmt, sha256=sha256, bytes=size))
    return DatasetInput(name=name, config=cfg, files=tuple(files))
