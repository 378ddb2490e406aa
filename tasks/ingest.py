"""ingest: read raw files (jsonl, jsonl.gz, parquet, txt; local or s3://) into normalized records.

Every problem names the file and line (or parquet row). With `on_bad_record: skip` bad rows are
counted by reason and skipped, up to `max_bad_fraction`; the default fails on the first one.

Each file must still hold the bytes the plan hashed (its sha256 is in the artifact's id and in every
record id): they are hashed again as they are read, in the same pass, and a file that changed since the
plan fails the stage, naming the file, before anything is published.
"""
from __future__ import annotations

import gzip
import io
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import Field

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.datasets import DatasetInput, SourceFile
from lmforge.errors import DataError
from lmforge.log import Progress
from lmforge.records import RecordWriter, SchemaError, normalize
from lmforge.stage import Port, Result, StageDef, expect_inputs
from lmforge.store import VerifyingReader, filesystem, read_verified

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


def _rows(src: SourceFile, txt_unit: str) -> Iterator[tuple[int, Any]]:
    """(line or row number, parsed row or BadRow) for one file, whose bytes are checked against the plan's sha256:
    hashed as they are read (the check is at the end, before the stage publishes), parquet's before it is parsed."""
    fs, path = filesystem(src.uri)
    with fs.open(path, "rb") as stream:
        if src.format == "parquet":  # random access: checked in a copy first
            with read_verified(stream, src.bytes, src.sha256, changed_since_plan(src)) as copy:
                yield from _parquet_rows(src, copy)
            return
        raw = VerifyingReader(stream, src.bytes, src.sha256, changed_since_plan(src))
        f = gzip.GzipFile(fileobj=raw) if src.format == "jsonl.gz" else io.BufferedReader(raw, 1 << 20)
        if src.format == "txt" and txt_unit == "file":
            data = f.read()
            raw.finish()
            try:
                yield 1, {"text": data.decode("utf-8")}
            except UnicodeDecodeError as e:
                line = data[: e.start].count(b"\n") + 1
                yield line, BadRow("not_utf8", f"{src.uri}:{line}", f"not valid UTF-8 (byte 0x{data[e.start]:02x})")
            return
        try:
            for n, line in enumerate(f, 1):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield n, BadRow("not_utf8", f"{src.uri}:{n}",
                                    f"not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})")
                    continue
                if not text.strip():
                    continue
                if src.format == "txt":
                    yield n, {"text": text.rstrip("\r\n")}
                    continue
                try:
                    yield n, json.loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    yield n, BadRow("invalid_json", f"{src.uri}:{n}", f"invalid JSON: {e.msg} at column {e.colno}")
        except (OSError, EOFError) as e:  # truncated or corrupt gzip
            raw.finish()  # a file that changed since the plan says so first
            raise DataError(src.uri, f"cannot read {src.format} file: {e}", "re-create or re-download the file") from None
        raw.finish()


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
                for n, row in interrupt.checked(_rows(src, ds.config.txt_unit), f"ingest {ds.name} {src.uri}"):
                    rows += 1
                    progress.update()
                    if not isinstance(row, BadRow):
                        try:
                            rec = normalize(kind, row, ds.config.columns)
                        except SchemaError as e:
                            row = BadRow("schema", f"{src.uri}:{n}" if src.format != "parquet" else f"{src.uri}: row {n}",
                                         f"does not fit the {kind} schema: {e}")
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
                 description="raw files -> normalized records")
