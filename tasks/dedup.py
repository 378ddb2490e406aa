"""dedup: drop exact and near-duplicate documents; each cluster of duplicates keeps one document.

Documents are compared on a canonical text (text: `text`; chat: the message contents joined by
newlines; preference: prompt, chosen and rejected joined by newlines), normalized as described in
`tasks/minhash.py` (NFKC, lowercase, words = runs of letters and digits, joined by one space).

- Exact: documents with the same normalized text (128-bit blake2b key) are exact duplicates.
- Near: MinHash LSH on word n-gram shingles. Two documents become a candidate pair when they share
  a band; a candidate pair is a duplicate pair when the exact Jaccard similarity of its shingle sets
  reaches `threshold` (`verify: estimate` checks the MinHash estimate instead). Exact and near
  duplicate pairs are joined into clusters with union-find; each cluster keeps its document with the
  smallest global index (its position in the input), so earlier documents win.

It runs as map -> shuffle -> reduce, each step a list of independent tasks (`lmforge.parallel`:
in-process, a local process pool, or a Dask cluster):
  0. plan (here): one pass over the input notes the byte offset of every `partition_records`-th
     record; a partition is (part file, byte offset, first global index, count).
  1. map, per partition: keys, shingle hashes, signatures and band keys. Shingle hashes and band keys
     stay in the work folder for random access; (exact key, doc) and (band key, doc, band) rows go
     to shuffle files sorted by bucket (key mod `shuffle_buckets`), one file per partition.
  2. exact reduce, per bucket: equal keys -> (duplicate, first) pairs.
  3. band reduce, per bucket: equal band keys -> candidate pairs, exact duplicates left out. A pair is
     kept only by the first band it shares, so each pair is verified exactly once, in one bucket.
  4. resolve, here: union-find over the pairs; then, per block of removed documents, the Jaccard
     similarity to the representative (for the report).
  5. write, here: one ordered pass over the input writes the kept records and the evidence.
Partition, bucket and worker counts change how the work is cut, never what is found: the same
input gives the same kept set, the same files and the same artifact id.

Output: `records/part-*.jsonl` (kept records, byte for byte as they came in, input order),
`removed/part-*.jsonl` ({id, representative, reason, jaccard} per dropped record, input order),
`pairs/part-*.jsonl` ({a, b, similarity} per verified pair, a before b in the input) and
`report.json` (settings, counts, cluster-size histogram, removed documents next to their
representatives).
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal

import numpy as np
from pydantic import Field, model_validator

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.errors import DataError
from lmforge.log import Progress
from lmforge.parallel import Mapper, make_mapper
from lmforge.records import PART_DIR, part_names
from lmforge.stage import Port, Result, StageDef, expect_inputs
from lmforge.store import Artifact, ArtifactStore
from tasks import minhash

log = logging.getLogger(__name__)

EXACT_ROW = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("doc", "<i8")])
BAND_ROW = np.dtype([("key", "<u8"), ("doc", "<i8"), ("band", "<u2")])
BUCKET_ROWS = 4_000_000  # target shuffle rows per reduce task when shuffle_buckets is automatic
BIG_GROUP = 64  # band groups larger than this get their pairs from np.triu_indices, one by one
SNIPPET_CHARS = 300
PAIR_BLOCK = 20_000  # removed documents per similarity task


class DedupConfig(StageConfig):
    kind: Literal["dedup"] = Field(description="Drops exact and near-duplicate documents (MinHash LSH).")
    exact: bool = Field(True, description="Drop documents whose normalized text equals an earlier document's.")
    fuzzy: bool = Field(True, description="Drop near duplicates found with MinHash LSH and verified.")
    ngram_words: int = Field(5, ge=1, description="Words per shingle (word n-gram size).")
    num_perm: int = Field(128, ge=2, le=4096, description="MinHash permutations (signature length).")
    threshold: float = Field(0.8, gt=0, le=1, description="Jaccard similarity at which two documents are duplicates.")
    bands: int | None = Field(None, ge=1, description="LSH bands; with rows, or both derived from the threshold.")
    rows: int | None = Field(None, ge=1, description="Signature values per LSH band; with bands, or both derived.")
    false_positive_weight: float = Field(
        0.02, ge=0, le=1, description="Weight of false candidates when bands/rows are derived (datasketch "
        "_optimal_param). Low, because every candidate is verified: a false one only costs a check.")
    false_negative_weight: float = Field(
        0.98, ge=0, le=1, description="Weight of missed pairs when bands/rows are derived.")
    verify: Literal["jaccard", "estimate"] = Field(
        "jaccard", description="Check candidates by exact Jaccard of their shingle sets, or by the MinHash estimate.")
    seed: int = Field(1, ge=0, description="MinHash seed (datasketch's permutation generator).")
    report_samples: int = Field(50, ge=0, description="Removed documents shown with their representative in report.json.")
    part_records: int = Field(100_000, gt=0, description="Records per output part file.")
    # orchestration: how the work is cut, never what it produces (left out of the artifact id)
    workers: int | None = Field(None, ge=1, description="Local worker processes; default: one per CPU core.")
    partition_records: int = Field(10_000, gt=0, description="Records per map task.")
    shuffle_buckets: int | None = Field(None, ge=1, description="Reduce tasks per shuffle; default: from the corpus size.")
    dask_address: str | None = Field(
        None, description="Dask scheduler (tcp://host:8786) to run the tasks on, instead of local processes.")
    work_dir: str | None = Field(
        None, description="Folder for intermediate files (about 3x the text size); every Dask worker must see it "
        "(a shared filesystem) when the cluster spans machines. Default: next to the staging folder.")

    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | {
        "workers", "partition_records", "shuffle_buckets", "dask_address", "work_dir"}

    @model_validator(mode="after")
    def _lsh_shape(self) -> "DedupConfig":
        if (self.bands is None) != (self.rows is None):
            raise ValueError(f"set both bands and rows, or neither (got bands={self.bands}, rows={self.rows}); "
                             "when neither is set they are derived from threshold and num_perm")
        if self.bands is not None and self.bands * self.rows > self.num_perm:
            raise ValueError(f"bands x rows = {self.bands} x {self.rows} = {self.bands * self.rows} exceeds "
                             f"num_perm = {self.num_perm}; lower them or raise num_perm")
        if not (self.exact or self.fuzzy):
            raise ValueError("exact and fuzzy are both off, so nothing would be deduplicated; switch one on")
        return self

    def lsh_shape(self) -> tuple[int, int]:
        if self.bands is not None and self.rows is not None:
            return self.bands, self.rows
        return minhash.lsh_params(self.threshold, self.num_perm, self.false_positive_weight, self.false_negative_weight)


class DedupResult(Result):
    data_kind: str
    input_records: int
    records: int
    dropped: dict[str, int]  # exact_duplicate, near_duplicate (read by lmforge.records.require_records)
    clusters: int  # clusters of two or more documents
    largest_cluster: int
    candidate_pairs: int  # distinct pairs sharing at least one band
    verified_pairs: int  # candidate pairs at or above the threshold
    empty_documents: int  # documents without a word: only exact dedup applies to them
    bands: int
    rows: int


# ---------------------------------------------------------------------------------------------
# what every task gets


@dataclass(frozen=True)
class Partition:
    index: int
    part: str
    offset: int  # byte offset of its first record in the part file
    start: int  # global index of its first record
    count: int


@dataclass(frozen=True)
class Job:
    """Settings shared by every task of one run (small; pickled with each task)."""

    store_url: str
    input_kind: str
    input_id: str
    data_kind: str
    work: str
    partitions: int
    buckets: int
    exact: bool
    fuzzy: bool
    ngram: int
    num_perm: int
    seed: int
    bands: int
    rows: int
    verify: str
    threshold: float

    def path(self, index: int, name: str, ext: str = "npy") -> Path:
        """A map output of partition `index` in the work folder."""
        return Path(self.work) / f"p{index:06d}.{name}.{ext}"


def canonical_text(kind: str, rec: dict[str, Any]) -> str:
    if kind == "chat":
        return "\n".join(m["content"] for m in rec["messages"])
    if kind == "preference":
        return "\n".join((rec["prompt"], rec["chosen"], rec["rejected"]))
    return rec["text"]


def _save(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)  # a retried task never leaves half a file


def _save_raw(path: Path, arr: np.ndarray) -> None:
    """Raw bytes without a header, for reads at computed offsets."""
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    arr.tofile(tmp)
    os.replace(tmp, path)


def _save_by_bucket(job: Job, index: int, name: str, rows: np.ndarray, bucket: np.ndarray) -> None:
    order = np.argsort(bucket, kind="stable")
    bounds = np.zeros(job.buckets + 1, np.int64)
    np.cumsum(np.bincount(bucket, minlength=job.buckets), out=bounds[1:])
    _save(job.path(index, name), rows[order])
    _save(job.path(index, f"{name}-bounds"), bounds)


def _load_bucket(job: Job, name: str, bucket: int) -> np.ndarray:
    parts = []
    for i in range(job.partitions):
        bounds = np.load(job.path(i, f"{name}-bounds"))
        rows = np.load(job.path(i, name), mmap_mode="r")
        parts.append(np.asarray(rows[bounds[bucket]:bounds[bucket + 1]]))
    return np.concatenate(parts)


# ---------------------------------------------------------------------------------------------
# 1. map


def _read_texts(job: Job, p: Partition) -> list[str]:
    store = ArtifactStore(job.store_url)
    path = f"{store.artifact_path(job.input_kind, job.input_id)}/{p.part}"
    texts = []
    with store.fs.open(path, "rb") as f:
        f.seek(p.offset)
        for k in range(p.count):
            line = f.readline()
            try:
                texts.append(canonical_text(job.data_kind, json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"{store.artifact_uri(job.input_kind, job.input_id)}/{p.part}: record {p.start + k}",
                                f"not a {job.data_kind} record ({type(e).__name__}: {e})",
                                "rerun the stage that produced it (with --force)") from None
    return texts


def _map_partition(task: tuple[Job, Partition]) -> dict[str, int]:
    job, p = task
    sh = minhash.shingle(_read_texts(job, p), job.ngram)
    docs = np.arange(p.start, p.start + p.count, dtype=np.int64)
    if job.exact:
        rows = np.empty(p.count, EXACT_ROW)
        rows["hi"], rows["lo"], rows["doc"] = sh.exact[:, 0], sh.exact[:, 1], docs
        _save_by_bucket(job, p.index, "exact", rows, (sh.exact[:, 0] % np.uint64(job.buckets)).astype(np.int64))
    if job.fuzzy:
        _save(job.path(p.index, "offsets"), sh.offsets)
        _save_raw(job.path(p.index, "hashes", "u64"), sh.hashes.astype("<u8", copy=False))
        sig = minhash.signatures((sh.hashes >> np.uint64(32)).astype(np.uint32), sh.offsets, job.num_perm, job.seed)
        keys = minhash.band_keys(sig, job.bands, job.rows)
        _save(job.path(p.index, "bandkeys"), keys)
        if job.verify == "estimate":
            _save(job.path(p.index, "sig"), sig)
        has = np.flatnonzero(np.diff(sh.offsets) > 0)  # documents without shingles never collide
        rows = np.empty(has.size * job.bands, BAND_ROW)
        rows["key"] = keys[has].ravel()
        rows["doc"] = np.repeat(docs[has], job.bands)
        rows["band"] = np.tile(np.arange(job.bands, dtype=np.uint16), has.size)
        _save_by_bucket(job, p.index, "bands", rows, (rows["key"] % np.uint64(job.buckets)).astype(np.int64))
    return {"records": p.count, "empty": int((sh.words == 0).sum()), "shingles": int(sh.hashes.size)}


# ---------------------------------------------------------------------------------------------
# 2. exact reduce


def _reduce_exact(task: tuple[Job, int]) -> np.ndarray:
    """(k, 2) int64 [duplicate, first]: every member of an equal-key group but its smallest index."""
    job, bucket = task
    rows = _load_bucket(job, "exact", bucket)
    rows = rows[np.lexsort((rows["doc"], rows["lo"], rows["hi"]))]
    same = (rows["hi"][1:] == rows["hi"][:-1]) & (rows["lo"][1:] == rows["lo"][:-1])
    first = np.maximum.accumulate(np.where(np.r_[False, same], 0, np.arange(rows.size)))
    dup = np.flatnonzero(np.r_[False, same])
    return np.stack([rows["doc"][dup], rows["doc"][first[dup]]], axis=1)


# ---------------------------------------------------------------------------------------------
# random access to per-partition arrays (band keys, shingle sets, signatures) by global index


@functools.lru_cache(maxsize=4)
def _partition_starts(work: str) -> np.ndarray:
    return np.load(Path(work) / "starts.npy")


class _Lookup:
    """Per-document arrays of the map outputs, by global index. 2-D arrays (band keys, signatures)
    and offsets are memory-mapped; shingle hashes, the bulk, are read with pread, so a reduce task
    holds only the documents it checks (a bounded cache of their sorted shingle sets)."""

    CACHE = 8192  # shingle sets kept, about 16 MB for 1-2 KB documents

    def __init__(self, job: Job):
        self.job = job
        self.starts = _partition_starts(job.work)
        self._open: dict[tuple[int, str], np.ndarray] = {}
        self._fds: dict[int, int] = {}
        self._sets: dict[int, np.ndarray] = {}

    def __enter__(self) -> "_Lookup":
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds.values():
            os.close(fd)

    def _arr(self, index: int, name: str) -> np.ndarray:
        key = (index, name)
        if key not in self._open:
            # a plain ndarray view of the mapping: slicing a np.memmap object is much slower
            self._open[key] = np.load(self.job.path(index, name), mmap_mode="r").view(np.ndarray)
        return self._open[key]

    def rows(self, name: str, docs: np.ndarray) -> np.ndarray:
        """Rows of a per-partition 2-D array (bandkeys, sig) for global document indices."""
        part = np.searchsorted(self.starts, docs, side="right") - 1
        proto = self._arr(0, name)
        out = np.empty((docs.size, proto.shape[1]), proto.dtype)
        for i in np.unique(part).tolist():
            sel = part == i
            out[sel] = self._arr(i, name)[docs[sel] - self.starts[i]]
        return out

    def shingle_set(self, doc: int) -> np.ndarray:
        s = self._sets.get(doc)
        if s is None:
            i = int(np.searchsorted(self.starts, doc, side="right") - 1)
            local = doc - int(self.starts[i])
            lo, hi = self._arr(i, "offsets")[local:local + 2].tolist()
            if i not in self._fds:
                self._fds[i] = os.open(self.job.path(i, "hashes", "u64"), os.O_RDONLY)
            raw = os.pread(self._fds[i], (hi - lo) * 8, lo * 8)
            s = minhash.sorted_set(np.frombuffer(raw, dtype="<u8"))
            if len(self._sets) >= self.CACHE:
                del self._sets[next(iter(self._sets))]  # oldest first
            self._sets[doc] = s
        return s

    def jaccard(self, pairs: np.ndarray) -> np.ndarray:
        return np.array([minhash.jaccard(self.shingle_set(a), self.shingle_set(b)) for a, b in pairs.tolist()],
                        dtype=np.float64)

    def estimate(self, pairs: np.ndarray) -> np.ndarray:
        return (self.rows("sig", pairs[:, 0]) == self.rows("sig", pairs[:, 1])).mean(axis=1)


# ---------------------------------------------------------------------------------------------
# 3. band reduce


def _group_pairs(gstart: np.ndarray, gsize: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (p, q), p < q, of positions inside the same group; groups are [gstart, gstart + gsize)."""
    ps, qs = [], []
    small = gsize <= BIG_GROUP
    if small.any():
        member = np.repeat(gstart[small], gsize[small]) + _ranges(gsize[small])
        after = np.repeat(gstart[small] + gsize[small], gsize[small]) - member - 1  # members after it
        for d in range(1, int(gsize[small].max())):
            sel = member[after >= d]
            ps.append(sel)
            qs.append(sel + d)
    for start, size in zip(gstart[~small].tolist(), gsize[~small].tolist()):
        if size > 2000:
            log.warning("dedup: %d documents share one LSH band (%d pairs to check); templated text?",
                        size, size * (size - 1) // 2)
        p, q = np.triu_indices(size, 1)
        ps.append(p + start)
        qs.append(q + start)
    if not ps:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(ps).astype(np.int64), np.concatenate(qs).astype(np.int64)


def _ranges(sizes: np.ndarray) -> np.ndarray:
    """[0..s0), [0..s1), ... concatenated."""
    ends = np.cumsum(sizes)
    return np.arange(int(ends[-1]) if sizes.size else 0) - np.repeat(ends - sizes, sizes)


def _reduce_bands(task: tuple[Job, int]) -> dict[str, Any]:
    job, bucket = task
    rows = _load_bucket(job, "bands", bucket)
    removed_path = Path(job.work) / "exact_removed.npy"
    if removed_path.exists():  # exact duplicates are represented by the document they duplicate
        removed = np.load(removed_path)
        if removed.size:
            at = np.minimum(np.searchsorted(removed, rows["doc"]), removed.size - 1)
            rows = rows[removed[at] != rows["doc"]]
    rows = rows[np.lexsort((rows["doc"], rows["key"]))]
    empty = {"pairs": np.empty((0, 2), np.int64), "similarity": np.empty(0), "candidates": 0}
    if rows.size < 2:
        return empty
    new = np.r_[True, rows["key"][1:] != rows["key"][:-1]]
    gstart = np.flatnonzero(new)
    gsize = np.diff(np.r_[gstart, rows.size])
    multi = gsize > 1
    p, q = _group_pairs(gstart[multi], gsize[multi])
    if not p.size:
        return empty
    pairs = np.stack([rows["doc"][p], rows["doc"][q]], axis=1)
    band = rows["band"][p].astype(np.int64)
    with _Lookup(job) as look:
        # keep a pair only in the first band it shares, so it is checked once, in one bucket
        same = look.rows("bandkeys", pairs[:, 0]) == look.rows("bandkeys", pairs[:, 1])
        pairs = pairs[np.argmax(same, axis=1) == band]
        sim = look.estimate(pairs) if job.verify == "estimate" else look.jaccard(pairs)
    ok = sim >= job.threshold - 1e-12
    return {"pairs": pairs[ok], "similarity": sim[ok], "candidates": int(pairs.shape[0])}


# ---------------------------------------------------------------------------------------------
# 4. resolve


def _union_find(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, representative of each node): connected components, each represented by its smallest node."""
    if not pairs.size:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    nodes, inv = np.unique(pairs, return_inverse=True)
    parent = list(range(nodes.size))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, (a, b) in enumerate(inv.reshape(-1, 2).tolist()):
        if i % (100 * interrupt.EVERY_RECORDS) == 0:  # a pair costs about a microsecond
            interrupt.check("dedup resolve")
        ra, rb = find(a), find(b)
        if ra != rb:  # the smaller root wins: nodes are sorted, so the root is the smallest member
            if ra < rb:
                parent[rb] = ra
            else:
                parent[ra] = rb
    roots = np.fromiter((find(x) for x in range(nodes.size)), np.int64, count=nodes.size)
    return nodes, nodes[roots]


def _pair_jaccard(task: tuple[Job, np.ndarray]) -> np.ndarray:
    job, pairs = task
    with _Lookup(job) as look:
        return look.jaccard(pairs)


# ---------------------------------------------------------------------------------------------
# the stage


def _plan_partitions(src: Artifact, size: int) -> list[Partition]:
    """One pass over the input (verified against its manifest): where every partition starts."""
    out: list[Partition] = []
    start = 0
    progress = Progress(log, f"dedup plan {src.kind}/{src.id}", total=int(src.result.get("records", 0)) or None)
    for part in part_names(src):
        with src.open(part) as f:
            offset = first = n = 0
            for line in f:
                if n == 0:
                    first = offset
                n += 1
                offset += len(line)
                if n == size:
                    interrupt.check("dedup plan")
                    out.append(Partition(len(out), part, first, start, n))
                    start += n
                    n = 0
                    progress.update(size)
            if n:
                out.append(Partition(len(out), part, first, start, n))
                start += n
                progress.update(n)
    progress.done()
    return out


@contextlib.contextmanager
def _work_dir(cfg: DedupConfig, out: Path) -> Iterator[Path]:
    base = Path(cfg.work_dir).expanduser() if cfg.work_dir else out.parent
    path = base / f"{out.name}.dedup-work-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _sample(docs: np.ndarray, k: int, seed: int) -> np.ndarray:
    """k of `docs`, picked by a seeded hash of the index (so independent of partitioning), sorted."""
    if docs.size <= k:
        return docs
    score = minhash.fmix64(docs.astype(np.uint64) ^ np.uint64(seed * 0x9E3779B97F4A7C15 % (1 << 64)))
    return np.sort(docs[np.argsort(score, kind="stable")[:k]])


class _JsonlParts:
    """`{dir}/part-NNNNN.jsonl`, `part_records` lines per part: the layout of RecordWriter, which
    kept records bypass only to be copied byte for byte, without a decode/encode round trip."""

    def __init__(self, out: Path, name: str, part_records: int):
        self.dir, self.part_records, self.count, self._f = out / name, part_records, 0, None
        self.dir.mkdir(parents=True, exist_ok=True)

    def write_line(self, line: bytes) -> None:
        if self.count % self.part_records == 0:
            self.close()
            self._f = open(self.dir / f"part-{self.count // self.part_records:05d}.jsonl", "wb")
        self._f.write(line if line.endswith(b"\n") else line + b"\n")
        self.count += 1

    def write(self, row: dict[str, Any]) -> None:
        self.write_line(json.dumps(row, ensure_ascii=True).encode())

    def close(self) -> None:
        if self._f:
            self._f.close()
            self._f = None


def _find(cfg: DedupConfig, src: Artifact, data_kind: str, parts: list[Partition], n: int, bands: int, rows: int,
          mapper: Mapper, work: Path) -> dict[str, Any]:
    buckets = cfg.shuffle_buckets or max(2 * mapper.parallelism, math.ceil(n * (bands + 1) / BUCKET_ROWS))
    job = Job(store_url=src.store.url, input_kind=src.kind, input_id=src.id, data_kind=data_kind, work=str(work),
              partitions=len(parts), buckets=buckets, exact=cfg.exact, fuzzy=cfg.fuzzy, ngram=cfg.ngram_words,
              num_perm=cfg.num_perm, seed=cfg.seed, bands=bands, rows=rows, verify=cfg.verify,
              threshold=cfg.threshold)
    _save(work / "starts.npy", np.array([p.start for p in parts], np.int64))
    log.info("dedup: %d records in %d partitions, %d shuffle buckets, %s", n, len(parts), buckets, mapper)
    stats = mapper.map(_map_partition, [(job, p) for p in parts], what="dedup map")
    empty = sum(s["empty"] for s in stats)

    exact_pairs = np.empty((0, 2), np.int64)
    if cfg.exact:
        exact_pairs = np.concatenate(mapper.map(_reduce_exact, [(job, b) for b in range(buckets)],
                                                what="dedup exact reduce")).reshape(-1, 2)
        exact_pairs = exact_pairs[np.argsort(exact_pairs[:, 0])]
        _save(work / "exact_removed.npy", exact_pairs[:, 0].copy())

    near_pairs, near_sim, candidates = np.empty((0, 2), np.int64), np.empty(0), 0
    if cfg.fuzzy:
        found = mapper.map(_reduce_bands, [(job, b) for b in range(buckets)], what="dedup band reduce")
        candidates = sum(f["candidates"] for f in found)
        near_pairs = np.concatenate([f["pairs"] for f in found]).reshape(-1, 2)
        near_sim = np.concatenate([f["similarity"] for f in found])
        order = np.lexsort((near_pairs[:, 1], near_pairs[:, 0]))
        near_pairs, near_sim = near_pairs[order], near_sim[order]

    nodes, reps = _union_find(np.concatenate([exact_pairs, near_pairs]))
    gone = nodes != reps
    removed, removed_rep = nodes[gone], reps[gone]
    is_exact = np.isin(removed, exact_pairs[:, 0])
    twin = exact_pairs[np.minimum(np.searchsorted(exact_pairs[:, 0], removed), max(len(exact_pairs) - 1, 0)), 1] \
        if len(exact_pairs) else np.full(removed.size, -1)
    similarity = np.ones(removed.size)
    todo = np.flatnonzero(~is_exact | (twin != removed_rep))  # an exact duplicate kept with its twin: 1.0
    if todo.size and cfg.fuzzy:
        todo_pairs = np.stack([removed[todo], removed_rep[todo]], axis=1)
        blocks = [(job, todo_pairs[i:i + PAIR_BLOCK]) for i in range(0, todo.size, PAIR_BLOCK)]
        similarity[todo] = np.concatenate(mapper.map(_pair_jaccard, blocks, what="dedup similarity to representatives"))
    sizes = np.bincount(np.unique(reps, return_inverse=True)[1]) if reps.size else np.empty(0, np.int64)
    return {"removed": removed, "representative": removed_rep, "exact": is_exact, "jaccard": similarity,
            "pairs": near_pairs, "pair_similarity": near_sim, "candidates": candidates, "empty": empty,
            "cluster_sizes": sizes}


def run(cfg: DedupConfig, inputs: list[Artifact], out: Path) -> DedupResult:
    src = inputs[0]
    data_kind = str(src.result.get("data_kind") or src.manifest.get("output", {}).get("data_kind") or "text")
    bands, rows = cfg.lsh_shape()
    parts = _plan_partitions(src, cfg.partition_records)
    n = sum(p.count for p in parts)
    if n:
        with make_mapper(cfg.workers, cfg.dask_address, preload=[__name__]) as mapper, _work_dir(cfg, out) as work:
            found = _find(cfg, src, data_kind, parts, n, bands, rows, mapper, work)
    else:  # e.g. everything was filtered out upstream: pass the empty corpus on, shard will explain it
        log.warning("dedup: input %s/%s holds no records; writing an empty artifact", src.kind, src.id)
        ints = np.empty(0, np.int64)
        found = {"removed": ints, "representative": ints, "exact": np.empty(0, bool), "jaccard": np.empty(0),
                 "pairs": ints.reshape(0, 2), "pair_similarity": np.empty(0), "candidates": 0, "empty": 0,
                 "cluster_sizes": ints}
    kept = _write(cfg, src, data_kind, n, found, bands, rows, out)
    sizes = found["cluster_sizes"]
    n_exact = int(found["exact"].sum())
    result = DedupResult(
        data_kind=data_kind, input_records=n, records=kept,
        dropped={"exact_duplicate": n_exact, "near_duplicate": int(found["removed"].size) - n_exact},
        clusters=int(sizes.size), largest_cluster=int(sizes.max()) if sizes.size else 0,
        candidate_pairs=int(found["candidates"]), verified_pairs=int(found["pairs"].shape[0]),
        empty_documents=int(found["empty"]), bands=bands, rows=rows)
    log.info("dedup: kept %d of %d records (exact duplicates %d, near duplicates %d) in %d clusters; "
             "%d candidate pairs, %d verified", kept, n, result.dropped["exact_duplicate"],
             result.dropped["near_duplicate"], result.clusters, result.candidate_pairs, result.verified_pairs)
    return result


def _write(cfg: DedupConfig, src: Artifact, data_kind: str, n: int, found: dict[str, Any], bands: int, rows: int,
           out: Path) -> int:
    """One ordered pass over the input: kept records, then removed rows, pairs and the report."""
    removed, reps = found["removed"], found["representative"]
    pairs = found["pairs"]
    sample = _sample(removed, cfg.report_samples, cfg.seed)
    need_id = np.unique(np.concatenate([removed, reps, pairs.ravel()]))
    need_text = set(sample.tolist()) | set(reps[np.isin(removed, sample)].tolist())
    ids: dict[int, str] = {}
    texts: dict[int, str] = {}
    k = m = 0  # cursors into removed and need_id (both sorted)
    progress = Progress(log, "dedup write", total=n)
    kept = _JsonlParts(out, PART_DIR, cfg.part_records)
    g = 0
    for part in part_names(src):
        with src.open(part) as f:  # verified against the manifest as it is read
            for raw in interrupt.checked(f, "dedup write"):
                if (m < need_id.size and need_id[m] == g) or g in need_text:
                    rec = json.loads(raw)
                    if m < need_id.size and need_id[m] == g:
                        ids[g] = str(rec["id"])
                        m += 1
                    if g in need_text:
                        texts[g] = canonical_text(data_kind, rec)[:SNIPPET_CHARS]
                if k < removed.size and removed[k] == g:
                    k += 1
                else:
                    kept.write_line(raw)  # the record exactly as it came in
                g += 1
                progress.update()
    kept.close()
    progress.done()

    reasons = np.where(found["exact"], "exact_duplicate", "near_duplicate")
    rm = _JsonlParts(out, "removed", cfg.part_records)
    for d, r, why, j in zip(removed.tolist(), reps.tolist(), reasons.tolist(), found["jaccard"].tolist()):
        rm.write({"id": ids[d], "representative": ids[r], "reason": why, "jaccard": round(j, 6)})
    rm.close()
    pw = _JsonlParts(out, "pairs", cfg.part_records)
    for (a, b), s in zip(pairs.tolist(), found["pair_similarity"].tolist()):
        pw.write({"a": ids[a], "b": ids[b], "similarity": round(s, 6)})
    pw.close()

    sizes = found["cluster_sizes"]
    hist = {str(s): int(c) for s, c in enumerate(np.bincount(sizes)) if c} if sizes.size else {}
    where = {d: i for i, d in enumerate(removed.tolist())}
    samples = []
    for d in sample.tolist():
        i = where[d]
        samples.append({"removed": {"id": ids[d], "text": texts.get(d, "")},
                        "representative": {"id": ids[int(reps[i])], "text": texts.get(int(reps[i]), "")},
                        "reason": str(reasons[i]), "jaccard": round(float(found["jaccard"][i]), 6)})
    report = {
        "normalization": "NFKC, lowercase, words = runs of letters and digits (str.isalnum), joined by one space",
        "shingles": {"unit": "words", "ngram": cfg.ngram_words},
        "minhash": {"num_perm": cfg.num_perm, "seed": cfg.seed, "scheme": "datasketch affine32"},
        "lsh": {"bands": bands, "rows": rows, "derived": cfg.bands is None,
                "candidate_probability": {f"{s:.2f}": round(minhash.candidate_probability(s, bands, rows), 4)
                                          for s in (0.5, 0.6, 0.7, cfg.threshold, 0.9, 0.95)}},
        "verify": cfg.verify, "threshold": cfg.threshold,
        "counts": {"input_records": n, "records": kept.count, "exact_duplicate": int(found["exact"].sum()),
                   "near_duplicate": int((~found["exact"]).sum()), "empty_documents": int(found["empty"]),
                   "candidate_pairs": int(found["candidates"]), "verified_pairs": int(pairs.shape[0]),
                   "clusters": int(sizes.size)},
        "cluster_sizes": hist,
        "removed_sample": samples,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=True) + "\n", encoding="utf-8")
    return kept.count


def output_port(cfg: DedupConfig, inputs: list[Port]) -> Port:
    return Port("records", expect_inputs(inputs, "dedup", count=1, types={"records"}))


STAGE = StageDef(kind="dedup", version="1", config=DedupConfig, run=run, output_port=output_port,
                 description="records -> records without exact and near duplicates (MinHash LSH)",
                 output_type="records")
