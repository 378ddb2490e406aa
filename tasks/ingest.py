"""ingest: read raw files (json arrays, jsonl, jsonl.gz, parquet, txt, datasets save_to_disk folders; local or
s3://) into normalized records (layouts per kind: lmforge.records).

A JSON array is streamed element by element (ijson), never loaded whole. Every problem names the file and the
line (jsonl, txt), array element or row (parquet, saved dataset), 1-based. With `on_bad_record: skip` bad rows are
counted by reason and skipped, up to `max_bad_fraction`; the default fails on the first one.

Each file must still hold the bytes the plan hashed (its sha256 is in the artifact's id and in every
record id): they are hashed again as they are read, in the same pass, and a file that changed since the
plan fails the stage, naming the file, before anything is published.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import Field

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.datasets import DatasetInput, SourceFile, combined_sha256, saved_dataset_files
from lmforge.errors import DataError
from lmforge.log import Progress
from lmforge.port import Port
from lmforge.records import RecordWriter, SchemaError, normalize
from lmforge.stage import Result, StageDef, expect_inputs
from lmforge.store import filesystem
from lmforge.verified import VerifyingReader, read_verified

log = logging.getLogger(__name__)
MAX_EXAMPLES = 20


class IngestConfig(StageConfig):
    kind: Literal["ingest"] = Field(description="Reads raw datasets into normalized records.")
    on_bad_record: Literal["fail", "skip"] = Field(
        "fail", description="fail: stop at the first bad row; skip: count it by reason and go on.")
    max_bad_fraction: float = Field(
        0.1, ge=0, le=1, description="With skip: fail anyway when more than this fraction of rows is bad.")
    part_records: int = Field(100_000, gt=0, description="Records per output part file.")


class IngestResult(Result):
    data_kind: str
    records: int
    rows_read: int
    bytes_read: int
    per_dataset: dict[str, int]
    bad_records: dict[str, int]
    bad_examples: list[str]


class BadRow(Exception):
    def __init__(self, reason: str, where: str, problem: str):
        self.reason, self.where, self.problem = reason, where, problem
        super().__init__(f"{where}: {problem}")


def changed_since_plan(src: SourceFile):
    """The error for a raw file whose bytes are no longer those the plan hashed: `(bytes, sha256)` as read now."""
    def error(n: int, sha256: str) -> DataError:
        return DataError(src.uri, f"changed since the plan hashed it (now {n} bytes, sha256 {sha256[:12]}…; the "
                         f"plan, and so this stage's artifact id, used {src.bytes} bytes, {src.sha256[:12]}…)",
                         "run the command again: a new plan hashes the file as it is now; do not change raw files "
                         "while a pipeline that reads them runs")
    return error


def _rows(src: SourceFile, txt_unit: str) -> Iterator[tuple[int, str, Any]]:
    """(row number, where, parsed row or BadRow) for one file, whose bytes are checked against the plan's sha256:
    hashed as they are read (the check is at the end, before the stage publishes), parquet's and a saved dataset's
    before they are parsed. `where` names the file and the line (jsonl, txt), array element or row, 1-based."""
    if src.format == "hf_disk":
        yield from _saved_dataset_rows(src)
        return
    fs, path = filesystem(src.uri)
    with fs.open(path, "rb") as stream:
        if src.format == "parquet":  # random access: checked in a copy first
            with read_verified(stream, src.bytes, src.sha256, changed_since_plan(src)) as copy:
                for n, row in _parquet_rows(src, copy):
                    yield n, f"{src.uri}: row {n}", row
            return
        raw = VerifyingReader(stream, src.bytes, src.sha256, changed_since_plan(src))
        f = gzip.GzipFile(fileobj=raw) if src.format == "jsonl.gz" else io.BufferedReader(raw, 1 << 20)
        if src.format == "txt" and txt_unit == "file":
            data = f.read()
            raw.finish()
            try:
                yield 1, f"{src.uri}:1", {"text": data.decode("utf-8")}
            except UnicodeDecodeError as e:
                line = data[: e.start].count(b"\n") + 1
                yield line, f"{src.uri}:{line}", BadRow("not_utf8", f"{src.uri}:{line}",
                                                         f"not valid UTF-8 (byte 0x{data[e.start]:02x})")
            return
        if src.format == "json" and f.peek(64).lstrip()[:1] != b"{":  # an array; '{' first: JSON Lines named .json
            yield from _json_array_rows(src, f, raw)
            return
        try:
            for n, line in enumerate(f, 1):
                where = f"{src.uri}:{n}"
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield n, where, BadRow("not_utf8", where,
                                           f"not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})")
                    continue
                if not text.strip():
                    continue
                if src.format == "txt":
                    yield n, where, {"text": text.rstrip("\r\n")}
                    continue
                try:
                    yield n, where, json.loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    yield n, where, BadRow("invalid_json", where, f"invalid JSON: {e.msg} at column {e.colno}"
                                           + _layout_hint(src, n, text))
        except (OSError, EOFError) as e:  # truncated or corrupt gzip
            raw.finish()  # a file that changed since the plan says so first
            raise DataError(src.uri, f"cannot read {src.format} file: {e}", "re-create or re-download the file") from None
        raw.finish()


def _layout_hint(src: SourceFile, n: int, text: str) -> str:
    """What a line-level JSON error means about the file's layout, when the first line shows it."""
    if n == 1 and text.lstrip().startswith("["):
        return (" (this file starts with '[': a JSON array, not JSON Lines; set format: json on the dataset, "
                "or name the file .json)")
    if src.format == "json":
        return " (a .json file must hold one JSON array of row objects, or one JSON object per line)"
    return ""


def _json_array_rows(src: SourceFile, f, raw: VerifyingReader) -> Iterator[tuple[int, str, Any]]:
    """The elements of a top-level JSON array, streamed by ijson (one element in memory at a time)."""
    import ijson

    n = 0
    try:
        if f.peek(64).lstrip()[:1] not in (b"[", b""):
            raise ijson.JSONError("the top-level value is not an array")
        for n, row in enumerate(ijson.items(f, "item", use_float=True), 1):
            yield n, f"{src.uri}: element {n}", row
    except (ijson.JSONError, UnicodeDecodeError) as e:
        raw.finish()  # a file that changed since the plan says so first
        raise DataError(f"{src.uri}: element {n + 1}",
                        f"invalid JSON ({e}); a .json file must hold one JSON array of row objects "
                        "([{...}, {...}]) or one JSON object per line",
                        "fix the file at that element (the elements before it parsed), or convert it to JSON Lines"
                        ) from None
    raw.finish()


def _saved_dataset_rows(src: SourceFile) -> Iterator[tuple[int, str, Any]]:
    """The rows of a `datasets` save_to_disk folder: its files are copied into a temporary folder while they are
    hashed, checked against the plan's hash, then read with `datasets.load_from_disk` (memory-mapped, offline)."""
    import datasets

    fs, path = filesystem(src.uri)
    with tempfile.TemporaryDirectory(prefix="lmforge-ingest-") as tmp:
        hashes, total = [], 0
        for rel in saved_dataset_files(fs, path):
            h = hashlib.sha256()
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            with fs.open(f"{path}/{rel}", "rb") as r, open(Path(tmp) / rel, "wb") as w:
                while b := r.read(1 << 20):
                    h.update(b)
                    total += len(b)
                    w.write(b)
            hashes.append((rel, h.hexdigest()))
        sha = combined_sha256(hashes)
        if total != src.bytes or sha != src.sha256:
            raise changed_since_plan(src)(total, sha)
        try:
            ds = datasets.load_from_disk(tmp)
        except (FileNotFoundError, ValueError, OSError) as e:
            raise DataError(src.uri, f"not a readable datasets save_to_disk folder: {e}",
                            "re-create it with Dataset.save_to_disk, or point path at the raw files") from None
        if not isinstance(ds, datasets.Dataset):
            raise DataError(src.uri, f"holds a {type(ds).__name__}, not one Dataset",
                            "point path at one split's folder, e.g. .../train")
        n = 0
        for batch in ds.iter(batch_size=4096):
            for values in zip(*batch.values()):
                n += 1
                yield n, f"{src.uri}: row {n}", dict(zip(batch, values))


def _parquet_rows(src: SourceFile, raw) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(raw)
    except (pa.ArrowException, OSError) as e:
        raise DataError(src.uri, f"not a readable parquet file: {e}", "re-create the file or fix format:") from None
    n = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            n += 1
            yield n, row


def run(cfg: IngestConfig, inputs: list[DatasetInput], out: Path) -> IngestResult:
    kind = inputs[0].config.kind
    bad: Counter[str] = Counter()
    examples: list[str] = []
    per_dataset: dict[str, int] = {}
    rows = nbytes = 0
    with RecordWriter(out, cfg.part_records) as writer:
        for ds in inputs:
            before = writer.count
            for src in ds.files:
                nbytes += src.bytes
                progress = Progress(log, f"ingest {ds.name} {Path(src.uri).name}")
                for n, where, row in interrupt.checked(_rows(src, ds.config.txt_unit), f"ingest {ds.name} {src.uri}"):
                    rows += 1
                    progress.update()
                    if not isinstance(row, BadRow):
                        try:
                            rec = normalize(kind, row, ds.config.columns)
                        except SchemaError as e:
                            row = BadRow("schema", where, f"does not fit the {kind} schema: {e}")
                    if isinstance(row, BadRow):
                        if cfg.on_bad_record == "fail":
                            raise DataError(row.where, row.problem,
                                            "fix the row, or set on_bad_record: skip on the ingest stage")
                        bad[row.reason] += 1
                        if len(examples) < MAX_EXAMPLES:
                            examples.append(str(row))
                        continue
                    rec["id"] = f"{src.sha256[:12]}:{n}"
                    writer.write(rec)
                progress.done()
            per_dataset[ds.name] = writer.count - before
            if per_dataset[ds.name] == 0:
                files = ", ".join(f.uri for f in ds.files)
                why = f" ({sum(bad.values())} bad rows skipped: {dict(bad)})" if bad else ""
                raise DataError(f"datasets.{ds.name}", f"no records in {files}{why}",
                                "point the dataset at files that hold data")
    nbad = sum(bad.values())
    if nbad:
        log.warning("ingest skipped %d bad rows of %d: %s; first: %s", nbad, rows, dict(bad), examples[0])
    if rows and nbad / rows > cfg.max_bad_fraction:
        raise DataError("max_bad_fraction",
                        f"{nbad} of {rows} rows are bad ({nbad / rows:.0%} > max_bad_fraction "
                        f"{cfg.max_bad_fraction}): {dict(bad)}; first: {examples[0]}",
                        "check the dataset's kind and columns, or raise max_bad_fraction")
    return IngestResult(data_kind=kind, records=writer.count, rows_read=rows, bytes_read=nbytes,
                        per_dataset=per_dataset, bad_records=dict(bad), bad_examples=examples)


def output_port(cfg: IngestConfig, inputs: list[Port]) -> Port:
    return Port("records", expect_inputs(inputs, "ingest", types={"dataset"}))


STAGE = StageDef(kind="ingest", version="1", config=IngestConfig, run=run, output_port=output_port,
                 description="raw files -> normalized records", output_type="records")
