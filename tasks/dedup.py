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

It runs as map -> shuffle -> reduce (`tasks/dedup_find.py`), each step a list of independent tasks
(`lmforge.parallel`: in-process, a local process pool, or a Dask cluster). Here: the plan (one pass over
the input notes where every partition of `partition_records` records starts), then the write (one ordered
pass over the input writes the kept records and the evidence). On a remote store (S3) the input is downloaded
once into the work folder, verified, and all three passes read that copy. Partition, bucket and worker counts change
how the work is cut, never what is found: the same input gives the same kept set, the same files and the
same artifact id.

Output: `records/part-*.jsonl` (kept records, byte for byte as they came in, input order),
`removed/part-*.jsonl` ({id, representative, reason, jaccard} per dropped record, input order),
`pairs/part-*.jsonl` ({a, b, similarity} per verified pair, a before b in the input) and
`report.json` (settings, counts, cluster-size histogram, removed documents next to their
representatives).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import uuid
from pathlib import Path
from typing import IO, Any, ClassVar, Iterator, Literal

import numpy as np
from pydantic import Field, model_validator

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.log import Progress
from lmforge.parallel import Mapper, make_mapper
from lmforge.port import Port
from lmforge.records import PartWriter, part_names
from lmforge.stage import Result, StageDef, expect_inputs
from lmforge.store import Artifact, is_local
from tasks import minhash
from tasks.dedup_find import Job, Partition, canonical_text, find_duplicates

log = logging.getLogger(__name__)

BUCKET_ROWS = 4_000_000  # target shuffle rows per reduce task when shuffle_buckets is automatic
SNIPPET_CHARS = 300


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
        None, description="Folder for intermediate files (about 3x the text size; 4x on a remote store, whose input "
        "is copied there once); every Dask worker must see it "
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
# the stage


def _input_copy(src: Artifact, work: Path) -> Path | None:
    """On a remote store, the input's parts downloaded once into the work folder, each verified against the manifest
    as it is copied; the plan, the map tasks and the write then read the copy. The three passes would otherwise each
    download the whole input. None on a local store, which is read in place."""
    if is_local(src.store.fs):
        return None
    folder = work / "input"
    for part in part_names(src):
        interrupt.check("dedup input copy")
        src.download(folder, [part])
    return folder


def _open_input(src: Artifact, copy: Path | None, part: str) -> IO[bytes]:
    """A part of the input: the verified local copy, or the store's file verified as it is read."""
    return open(copy / part, "rb", buffering=1 << 20) if copy else src.open(part)


def _plan_partitions(src: Artifact, size: int, copy: Path | None) -> list[Partition]:
    """One pass over the input (verified against its manifest): where every partition starts."""
    out: list[Partition] = []
    start = 0
    progress = Progress(log, f"dedup plan {src.kind}/{src.id}", total=int(src.result.get("records", 0)) or None)
    for part in part_names(src):
        with _open_input(src, copy, part) as f:
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


def _ascii_line(row: dict[str, Any]) -> bytes:
    """A row of removed/ or pairs/: JSON with every non-ASCII character escaped."""
    return json.dumps(row, ensure_ascii=True).encode()


def _find(cfg: DedupConfig, src: Artifact, data_kind: str, parts: list[Partition], n: int, bands: int, rows: int,
          mapper: Mapper, work: Path, copy: Path | None) -> dict[str, Any]:
    buckets = cfg.shuffle_buckets or max(2 * mapper.parallelism, math.ceil(n * (bands + 1) / BUCKET_ROWS))
    job = Job(store_url=src.store.url, input_kind=src.kind, input_id=src.id, data_kind=data_kind, work=str(work),
              partitions=len(parts), buckets=buckets, exact=cfg.exact, fuzzy=cfg.fuzzy, ngram=cfg.ngram_words,
              num_perm=cfg.num_perm, seed=cfg.seed, bands=bands, rows=rows, verify=cfg.verify,
              threshold=cfg.threshold, input_copy=str(copy) if copy else None)
    log.info("dedup: %d records in %d partitions, %d shuffle buckets, %s", n, len(parts), buckets, mapper)
    return find_duplicates(job, parts, mapper)


def run(cfg: DedupConfig, inputs: list[Artifact], out: Path) -> DedupResult:
    src = inputs[0]
    data_kind = str(src.result.get("data_kind") or src.manifest.get("output", {}).get("data_kind") or "text")
    bands, rows = cfg.lsh_shape()
    with _work_dir(cfg, out) as work:
        copy = _input_copy(src, work)
        parts = _plan_partitions(src, cfg.partition_records, copy)
        n = sum(p.count for p in parts)
        if n:
            preload = [find_duplicates.__module__]  # the module of the mapped tasks
            with make_mapper(cfg.workers, cfg.dask_address, preload=preload) as mapper:
                found = _find(cfg, src, data_kind, parts, n, bands, rows, mapper, work, copy)
        else:  # e.g. everything was filtered out upstream: pass the empty corpus on, shard will explain it
            log.warning("dedup: input %s/%s holds no records; writing an empty artifact", src.kind, src.id)
            ints = np.empty(0, np.int64)
            found = {"removed": ints, "representative": ints, "exact": np.empty(0, bool), "jaccard": np.empty(0),
                     "pairs": ints.reshape(0, 2), "pair_similarity": np.empty(0), "candidates": 0, "empty": 0,
                     "cluster_sizes": ints}
        kept = _write(cfg, src, data_kind, n, found, bands, rows, out, copy)
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
           out: Path, copy: Path | None) -> int:
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
    kept = PartWriter(out, cfg.part_records)
    g = 0
    for part in part_names(src):
        with _open_input(src, copy, part) as f:  # verified against the manifest as it is read (or was copied)
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
    rm = PartWriter(out, cfg.part_records, "removed")
    for d, r, why, j in zip(removed.tolist(), reps.tolist(), reasons.tolist(), found["jaccard"].tolist()):
        rm.write_line(_ascii_line({"id": ids[d], "representative": ids[r], "reason": why, "jaccard": round(j, 6)}))
    rm.close()
    pw = PartWriter(out, cfg.part_records, "pairs")
    for (a, b), s in zip(pairs.tolist(), found["pair_similarity"].tolist()):
        pw.write_line(_ascii_line({"a": ids[a], "b": ids[b], "similarity": round(s, 6)}))
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
