"""mix: combine several records (or shards) inputs of one data kind, by sampling weights or epochs per source.

Each input is a source, named by its stage in `inputs`. Exactly one of two modes sets how many records
each source puts into the output (its `records_out`):

- `weights: {source: w}` are sampling ratios. The output holds `total` records; source i gets
  total * w_i / sum(w), rounded by largest remainder (ties to the earlier input), so the counts sum to
  `total` exactly. Without `total`, the output is the largest mix in which no record repeats: the
  limiting source (the one with the fewest records per unit of weight) is used whole, or all but a
  rounding remainder, and every other source is downsampled.
- `epochs: {source: e}` are passes over each source: records_out = round(records_in * e), halves up
  (2.0: every record twice; 0.5: a seeded half; 1.5: every record once plus a seeded half again).

A source gives k of its n records as whole passes plus a seeded pick: every record k // n times, and
the k % n records with the smallest seeded hash of their index once more (without replacement). So
downsampling takes a seeded subset, upsampling whole repeats plus a seeded subset of the remainder,
and `times_repeated` (the most copies of one record) is ceil(k / n). Copies keep their record's `id`,
so `shard` puts every copy of a record in the same split (no train/validation leakage).

The output order is a seeded shuffle of the union: records sorted by a seeded 64-bit hash of
(source, index in the source, copy number). Hashes (MurmurHash3's fmix64 over a per-source salt from
blake2b) depend on the seed and the source names only, never on a library's random stream, so the
same inputs and config give byte-identical files and the same artifact id on every machine.

Memory: per source, a few integers per record (its copy count and the hashes of its copies); records
themselves are streamed once into hash-range buckets under the staging folder (`bucket_records` each)
and only one bucket at a time is held and sorted. Nothing grows with the size of a record.

Inputs are all `records` (output: records, the lines byte for byte as they came in, in
`records/part-*.jsonl`) or all `shards` (output: shards of the same layout as `shard` writes). With
shards, the mix applies to the train split; every source's validation split is kept whole (each record
once), shuffled the same way, since repeating held-out records adds nothing to a validation loss.
`mix_report.json` holds the settings, each source's requested and realised share, and its counts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, ClassVar, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.errors import DataError
from lmforge.log import Progress
from lmforge.port import Port
from lmforge.records import PartWriter, part_names
from lmforge.shards import SPLITS, iter_samples, shard_name
from lmforge.stage import Result, StageDef
from lmforge.store import Artifact, sha256_file

log = logging.getLogger(__name__)

REPORT = "mix_report.json"
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class MixConfig(StageConfig):
    kind: Literal["mix"] = Field(description="Combines several records or shards inputs by weights or epochs.")
    weights: dict[str, Positive] | None = Field(
        None, description="Sampling ratio per input, {input name: weight > 0}, every input named once; the share "
        "of source i is w_i / sum(w). Set this or `epochs`.")
    total: int | None = Field(
        None, gt=0, description="Records in the output (weights only; with shards inputs: train records). Default: "
        "the largest mix in which no record repeats (the limiting source used whole, the others downsampled).")
    epochs: dict[str, Positive] | None = Field(
        None, description="Passes over each input, {input name: epochs > 0}: 2.0 repeats every record twice, 0.5 "
        "takes a seeded half. Set this or `weights`.")
    seed: int = Field(0, description="Seed of the subsets picked and of the output order.")
    part_records: int = Field(100_000, gt=0, description="Records per output part file (records inputs).")
    max_count: int = Field(10_000, gt=0, description="Most samples per output shard (shards inputs).")
    max_bytes: int = Field(256 * 2**20, gt=0, description="An output shard closes once its sample payload reaches "
                           "this many bytes (shards inputs).")
    bucket_records: int = Field(200_000, gt=0, description="Records per shuffle bucket held in memory at once; "
                                "changes memory use, never the output.")

    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | {"bucket_records"}

    @field_validator("inputs")
    @classmethod
    def _distinct_inputs(cls, v: list[str]) -> list[str]:
        dup = sorted({n for n in v if v.count(n) > 1})
        if dup:
            raise ValueError(f"{', '.join(dup)} listed more than once; a source is weighted once, name it once")
        return v

    @field_validator("weights", "epochs")
    @classmethod
    def _one_per_input(cls, v: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        if v is None or "inputs" not in info.data:
            return v
        inputs = info.data["inputs"]
        problems = [f"{n!r} is not an input of this stage (inputs: {', '.join(inputs) or 'none'})"
                    for n in v if n not in inputs]
        what = {"weights": "weight", "epochs": "epochs value"}[info.field_name]
        problems += [f"input {n!r} has no {what}; give every input one (or drop the input)"
                     for n in inputs if n not in v]
        if problems:
            raise ValueError("; ".join(problems))
        return {n: v[n] for n in inputs}  # in input order: the order sources are read and rounding ties go

    @model_validator(mode="after")
    def _one_mode(self) -> "MixConfig":
        if (self.weights is None) == (self.epochs is None):
            raise ValueError(f"set exactly one of `weights` (sampling ratios) or `epochs` (passes per input), got "
                             f"{'both' if self.weights is not None else 'neither'}")
        if self.total is not None and self.epochs is not None:
            raise ValueError("`total` applies to `weights` only; with `epochs` each input's count is its records x "
                             "epochs: drop `total`, or switch to `weights`")
        return self


class SourceReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str  # kind/id of the artifact read
    records_in: int
    records_out: int
    times_repeated: int  # most copies of one record in the output: 0 none taken, 1 no repeats, k up to k copies
    requested_proportion: float  # weights: w / sum(w); epochs: records_in * e / sum(records_in * e)
    realised_proportion: float  # records_out / total records out


class MixResult(Result):
    data_kind: str
    mode: Literal["weights", "epochs"]
    records: int  # records (train samples with shards inputs) in the mix
    limiting_source: str | None  # weights without `total`: the source used whole
    sources: dict[str, SourceReport]
    # shards inputs only (None with records): the same fields `shard` reports, so training stages read either
    validation: dict[str, int] | None = None  # validation records per source, each kept once
    train_samples: int | None = None
    validation_samples: int | None = None
    num_shards: dict[str, int] | None = None
    bytes: int | None = None
    shards: list[dict] | None = None


# ---------------------------------------------------------------------------------------------
# how many records each source gives, and which


def _round(x: Fraction) -> int:
    return math.floor(x + Fraction(1, 2))


def plan_counts(cfg: MixConfig, sizes: dict[str, int]) -> tuple[dict[str, int], dict[str, Fraction], str | None]:
    """({source: records out}, {source: requested share}, limiting source or None), exact in rationals."""
    if cfg.epochs is not None:
        want = {s: sizes[s] * Fraction(cfg.epochs[s]) for s in sizes}
        whole = sum(want.values())
        return {s: _round(w) for s, w in want.items()}, {s: w / whole for s, w in want.items()}, None
    assert cfg.weights is not None  # by MixConfig._one_mode
    w = {s: Fraction(cfg.weights[s]) for s in sizes}
    share = {s: x / sum(w.values()) for s, x in w.items()}
    limiting, total = None, cfg.total
    if total is None:  # the largest total at which every source's quota fits in its records
        fits = {s: math.floor(sizes[s] / share[s]) for s in sizes}
        total = min(fits.values())
        limiting = next(s for s in sizes if fits[s] == total)
    quota = {s: total * p for s, p in share.items()}
    counts = {s: math.floor(q) for s, q in quota.items()}
    order = sorted(sizes, key=lambda s: (-(quota[s] - counts[s]), list(sizes).index(s)))
    for s in order[:total - sum(counts.values())]:  # largest remainders first
        counts[s] += 1
    return counts, share, limiting


def fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, a bijection on uint64 (the same as tasks.minhash.fmix64, kept here so the
    mix's artifact id does not follow minhash's code or the datasketch version it imports)."""
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xFF51AFD7ED558CCD)
    h = h ^ (h >> np.uint64(33))
    h = h * np.uint64(0xC4CEB9FE1A85EC53)
    return h ^ (h >> np.uint64(33))


def _salt(seed: int, source: str, purpose: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(f"{seed}:{source}:{purpose}".encode(), digest_size=8).digest(),
                                    "little"))


def copies(n: int, k: int, seed: int, source: str) -> np.ndarray:
    """Copies of each of n records when a source gives k: k // n each, one more for the k % n records with the
    smallest seeded hash of their index (fmix64 is a bijection: no ties)."""
    out = np.full(n, k // n, np.int64)
    extra = k % n
    if extra:
        keys = fmix64(np.arange(n, dtype=np.uint64) ^ _salt(seed, source, "pick"))
        out[np.argpartition(keys, extra - 1)[:extra]] += 1
    return out


def order_keys(mult: np.ndarray, seed: int, source: str, purpose: str = "order") -> np.ndarray:
    """The sort key of every output copy, grouped by record (record 0's copies first): a seeded hash of
    (index + copy * n), distinct within a source."""
    n = mult.size
    idx = np.repeat(np.arange(n, dtype=np.uint64), mult)
    first = np.repeat(np.cumsum(mult) - mult, mult)
    copy = (np.arange(idx.size, dtype=np.int64) - first).astype(np.uint64)
    return fmix64((idx + copy * np.uint64(n)) ^ _salt(seed, source, purpose))


# ---------------------------------------------------------------------------------------------
# reading, bucketing, writing


def _data_kind(art: Artifact) -> str | None:
    return art.result.get("data_kind") or art.manifest.get("output", {}).get("data_kind")


def _size(art: Artifact, split: str | None) -> int:
    return int(art.result.get("records" if split is None else f"{split}_samples") or 0)


def _lines(art: Artifact, split: str | None) -> Iterator[bytes]:
    """Each record as one JSON line: records parts byte for byte (verified as read), or shard samples re-encoded."""
    if split is None:
        for part in part_names(art):
            with art.open(part) as f:
                for line in f:
                    yield line if line.endswith(b"\n") else line + b"\n"
    else:
        for rec in iter_samples(art, split):
            yield json.dumps(rec, ensure_ascii=True).encode() + b"\n"  # decoded again before it is written


class _Buckets:
    """Lines keyed by a 64-bit hash, spread over files by key range; read back one bucket at a time, sorted, they
    come out in ascending key order (the bucket count changes memory, never the order). All bucket files stay open
    while sources are read: total / bucket_records of them, so raise bucket_records past the open-file limit."""

    def __init__(self, work: Path, total: int, bucket_records: int):
        self.work, self.n = work, max(1, math.ceil(total / bucket_records))
        work.mkdir(parents=True)
        self.files = [open(work / f"b{i:05d}", "wb") for i in range(self.n)]

    def bucket(self, keys: np.ndarray) -> np.ndarray:
        return ((keys >> np.uint64(32)) * np.uint64(self.n)) >> np.uint64(32)

    def add(self, keys: np.ndarray, source: int, line: bytes) -> None:
        for key, b in zip(keys.tolist(), self.bucket(keys).tolist()):
            self.files[b].write(b"%016x %04d %s" % (key, source, line))  # hex key first: bytes sort as numbers

    def sorted_lines(self) -> Iterator[bytes]:
        for f in self.files:
            f.close()
        for i in range(self.n):
            interrupt.check("mix write")
            with open(self.work / f"b{i:05d}", "rb") as f:
                rows = f.readlines()
            rows.sort()  # key, then input order, then the record: a total order whatever the hashes
            for row in rows:
                yield row[22:]


def _mix_split(cfg: MixConfig, arts: dict[str, Artifact], split: str | None, counts: dict[str, int] | None,
               work: Path) -> tuple[Iterator[bytes], dict[str, int], dict[str, int]]:
    """Stream every source into buckets; returns (output lines in order, {source: records in}, {source: max copies}).
    `counts` None keeps every record once (a shards input's validation split)."""
    sizes = {s: _size(a, split) for s, a in arts.items()}
    mults = {s: copies(n, counts[s] if counts else n, cfg.seed, s) if n else np.zeros(0, np.int64)
             for s, n in sizes.items()}
    buckets = _Buckets(work, sum(int(m.sum()) for m in mults.values()), cfg.bucket_records)
    what = "mix" if split is None else f"mix {split}"
    for j, (s, art) in enumerate(arts.items()):
        mult = mults[s]
        keys = order_keys(mult, cfg.seed, s, "order" if split != "validation" else "order-validation")
        mult, ends = mult.tolist(), np.cumsum(mult).tolist()
        progress = Progress(log, f"{what}: read {s} ({art.kind}/{art.id})", total=sizes[s])
        i = 0
        for i, line in enumerate(interrupt.checked(_lines(art, split), what), start=1):
            if i > len(mult):
                raise DataError(f"mix input {s!r} ({art.kind}/{art.id})", f"holds more records than the {len(mult)} "
                                "its manifest reports", f"rebuild it: lmforge run --force {art.producer or s}")
            if mult[i - 1]:
                buckets.add(keys[ends[i - 1] - mult[i - 1]:ends[i - 1]], j, line)
            progress.update()
        progress.done()
        if i != len(mult):
            raise DataError(f"mix input {s!r} ({art.kind}/{art.id})", f"holds {i} records, its manifest reports "
                            f"{len(mult)}", f"rebuild it: lmforge run --force {art.producer or s}")
    return buckets.sorted_lines(), sizes, {s: int(m.max(initial=0)) for s, m in mults.items()}


def _is_shards(art: Artifact) -> bool:
    return art.manifest.get("output", {}).get("type") == "shards" or bool(art.result.get("shards"))


def _write_shards(out: Path, split: str, lines: Iterator[bytes], cfg: MixConfig) -> list[dict[str, Any]]:
    """One split as webdataset tars named as `shard` names them, with mtime 0 (byte-identical reruns)."""
    import tarfile

    import webdataset as wds

    writer = wds.ShardWriter(str(out / f"{split}-%06d.tar"), maxcount=cfg.max_count, maxsize=cfg.max_bytes,
                             verbose=0, mtime=0)
    n = 0
    try:
        for line in lines:
            writer.write({"__key__": f"{n:09d}", "json": json.loads(line)})
            n += 1
    finally:
        writer.close()
    files = sorted(out.glob(f"{split}-*.tar"))
    if n == 0:  # ShardWriter leaves an empty tar when nothing was written
        for f in files:
            f.unlink()
        return []
    shards = []
    for i, f in enumerate(files):
        if f.name != shard_name(split, i):
            raise RuntimeError(f"unexpected shard name {f.name}")
        with tarfile.open(f) as tf:
            samples = sum(1 for m in tf if m.isfile())
        shards.append({"name": f.name, "split": split, "bytes": f.stat().st_size, "sha256": sha256_file(f),
                       "samples": samples})
    return shards


# ---------------------------------------------------------------------------------------------
# the stage


def run(cfg: MixConfig, inputs: list[Artifact], out: Path, runtime: Any = None) -> MixResult:
    arts = dict(zip(cfg.inputs, inputs))
    field = "weights" if cfg.weights is not None else "epochs"
    is_shards = all(_is_shards(a) for a in inputs)
    split = "train" if is_shards else None
    data_kind = str(_data_kind(inputs[0]))
    sizes = {s: _size(a, split) for s, a in arts.items()}
    for s, a in arts.items():
        if sizes[s] == 0:
            raise DataError(f"{field}.{s}", f"input {s!r} ({a.kind}/{a.id}) holds no "
                            f"{'train samples' if split else 'records'}, so it cannot give its share",
                            f"fix what emptied it upstream, or drop {s!r} from inputs and {field}")
    counts, share, limiting = plan_counts(cfg, sizes)
    for s in arts:
        if counts[s] == 0:
            log.warning("mix: source %s rounds to 0 records (%s %s of %d records in, %d out in all); raise its %s "
                        "or the total", s, field, getattr(cfg, field)[s], sizes[s], sum(counts.values()), field)
    total = sum(counts.values())
    if total == 0:
        asked = ", ".join(f"{s}: {sizes[s]} records x {getattr(cfg, field)[s]}" for s in arts)
        raise DataError(field, f"every input rounds to 0 records ({asked})", f"raise the {field}")
    work = out.parent / f"{out.name}.mix-work"
    try:
        lines, _, repeats = _mix_split(cfg, arts, split, counts, work / "mix")
        extra: dict[str, Any] = {}
        if is_shards:
            shards = _write_shards(out, "train", lines, cfg)
            vlines, vsizes, _ = _mix_split(cfg, arts, "validation", None, work / "validation")
            shards += _write_shards(out, "validation", vlines, cfg)
            extra = {"validation": vsizes, "train_samples": total, "validation_samples": sum(vsizes.values()),
                     "num_shards": {sp: sum(1 for x in shards if x["split"] == sp) for sp in SPLITS},
                     "bytes": sum(x["bytes"] for x in shards), "shards": shards}
        else:
            with PartWriter(out, cfg.part_records) as parts:
                for line in lines:
                    parts.write_line(line)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sources = {s: SourceReport(input=f"{a.kind}/{a.id}", records_in=sizes[s], records_out=counts[s],
                               times_repeated=repeats[s], requested_proportion=round(float(share[s]), 6),
                               realised_proportion=round(counts[s] / total, 6))
               for s, a in arts.items()}
    result = MixResult(data_kind=data_kind, mode=field, records=total, limiting_source=limiting, sources=sources,
                       **extra)
    report = {"mode": field, field: getattr(cfg, field), "seed": cfg.seed,
              "total": {"records": total, "from": "config" if cfg.total is not None else
                        (f"default: {limiting} used whole, no record repeated" if limiting else "epochs")},
              "sources": {s: r.model_dump() for s, r in sources.items()}}
    if is_shards:
        report.update(split="train; every source's validation split kept whole", validation=extra["validation"])
    (out / REPORT).write_text(json.dumps(report, indent=2, ensure_ascii=True) + "\n", encoding="utf-8")
    log.info("mix: %d records from %s", total, ", ".join(
        f"{s} {r.records_out}/{r.records_in} ({r.realised_proportion:.1%}, asked {r.requested_proportion:.1%})"
        for s, r in sources.items()))
    return result


def output_port(cfg: MixConfig, inputs: list[Port]) -> Port:
    names = cfg.inputs or [f"#{i}" for i in range(len(inputs))]
    if not inputs:
        raise ValueError("mix needs at least one input (records or shards of one data kind)")
    listed = ", ".join(f"{n} ({p.describe()})" for n, p in zip(names, inputs))
    bad = [n for n, p in zip(names, inputs) if p.type not in ("records", "shards")]
    if bad:
        raise ValueError(f"mix reads records (ingest, filter, dedup) or shards; {', '.join(bad)} is neither: "
                         f"{listed}. Put an ingest stage in front of a dataset")
    if len({p.type for p in inputs}) > 1:
        raise ValueError(f"inputs mix records and shards: {listed}; mix reads one type: mix the records "
                         "before a shard stage, or shard every source first")
    if len({p.data_kind for p in inputs}) > 1:
        raise ValueError(f"inputs mix data kinds: {listed}; mix combines one kind (text, chat or preference)")
    return Port(inputs[0].type, inputs[0].data_kind)


STAGE = StageDef(kind="mix", version="1", config=MixConfig, run=run, output_port=output_port,
                 description="records (or shards) of one kind -> one mix, by weights or epochs per source")
