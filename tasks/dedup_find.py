"""dedup's search for duplicates, as map -> shuffle -> reduce over a records artifact.

Each step is a list of independent tasks (`lmforge.parallel`: in-process, a local process pool, or a Dask cluster);
a task gets the run's `Job` and its partition or bucket, and reads and writes the work folder:
  0. plan (tasks/dedup.py): one pass over the input notes the byte offset of every `partition_records`-th
     record; a partition is (part file, byte offset, first global index, count).
  1. map, per partition: keys, shingle hashes, signatures and band keys. Shingle hashes and band keys
     stay in the work folder for random access; (exact key, doc) and (band key, doc, band) rows go
     to shuffle files sorted by bucket (key mod `shuffle_buckets`), one file per partition.
  2. exact reduce, per bucket: equal keys -> (duplicate, first) pairs.
  3. band reduce, per bucket: equal band keys -> candidate pairs, exact duplicates left out. A pair is
     kept only by the first band it shares, so each pair is verified exactly once, in one bucket.
  4. resolve, here: union-find over the pairs; then, per block of removed documents, the Jaccard
     similarity to the representative (for the report).
Partition, bucket and worker counts change how the work is cut, never what is found.
"""
from __future__ import annotations

import functools
import io
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from lmforge import interrupt
from lmforge.errors import DataError
from lmforge.parallel import Mapper
from lmforge.store import ArtifactStore
from tasks import minhash

log = logging.getLogger(__name__)

EXACT_ROW = np.dtype([("hi", "<u8"), ("lo", "<u8"), ("doc", "<i8")])
BAND_ROW = np.dtype([("key", "<u8"), ("doc", "<i8"), ("band", "<u2")])
BIG_GROUP = 64  # band groups larger than this get their pairs from np.triu_indices, one by one
PAIR_BLOCK = 20_000  # removed documents per similarity task


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
    input_copy: str | None = None  # a folder with verified copies of the input's parts, read instead of the store

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


def _open_part(job: Job, store: ArtifactStore, part: str) -> IO[bytes]:
    if job.input_copy:  # the stage's verified local copy of a remote input (tasks/dedup.py)
        return open(Path(job.input_copy) / part, "rb", buffering=1 << 20)
    # a buffered reader over the store's file: fsspec's own readline costs more than the read on object storage; a
    # small fsspec block, since its default read-ahead on S3 fetches far past the end of a partition
    path = f"{store.artifact_path(job.input_kind, job.input_id)}/{part}"
    return io.BufferedReader(store.fs.open(path, "rb", block_size=1 << 22), 1 << 20)


def _read_texts(job: Job, p: Partition) -> list[str]:
    store = ArtifactStore(job.store_url)
    texts = []
    with _open_part(job, store, p.part) as f:
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
# all steps


def find_duplicates(job: Job, parts: list[Partition], mapper: Mapper) -> dict[str, Any]:
    """Map, both reduces and the resolve over `parts`: the removed documents (global indices, sorted), each one's
    representative, whether it is an exact duplicate, its Jaccard similarity to the representative, the verified
    near-duplicate pairs with their similarity, and the counts the report needs."""
    work = Path(job.work)
    _save(work / "starts.npy", np.array([p.start for p in parts], np.int64))
    stats = mapper.map(_map_partition, [(job, p) for p in parts], what="dedup map")
    empty = sum(s["empty"] for s in stats)

    exact_pairs = np.empty((0, 2), np.int64)
    if job.exact:
        exact_pairs = np.concatenate(mapper.map(_reduce_exact, [(job, b) for b in range(job.buckets)],
                                                what="dedup exact reduce")).reshape(-1, 2)
        exact_pairs = exact_pairs[np.argsort(exact_pairs[:, 0])]
        _save(work / "exact_removed.npy", exact_pairs[:, 0].copy())

    near_pairs, near_sim, candidates = np.empty((0, 2), np.int64), np.empty(0), 0
    if job.fuzzy:
        found = mapper.map(_reduce_bands, [(job, b) for b in range(job.buckets)], what="dedup band reduce")
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
    if todo.size and job.fuzzy:
        todo_pairs = np.stack([removed[todo], removed_rep[todo]], axis=1)
        blocks = [(job, todo_pairs[i:i + PAIR_BLOCK]) for i in range(0, todo.size, PAIR_BLOCK)]
        similarity[todo] = np.concatenate(mapper.map(_pair_jaccard, blocks, what="dedup similarity to representatives"))
    sizes = np.bincount(np.unique(reps, return_inverse=True)[1]) if reps.size else np.empty(0, np.int64)
    return {"removed": removed, "representative": removed_rep, "exact": is_exact, "jaccard": similarity,
            "pairs": near_pairs, "pair_similarity": near_sim, "candidates": candidates, "empty": empty,
            "cluster_sizes": sizes}
