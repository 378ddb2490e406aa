"""Dedup benchmark: hashing throughput, quality against exact Jaccard, memory, vs naive datasketch.

    python bench/dedup.py [--docs 100000] [--sizes 25000,50000,100000] [--workers 2] [--seed 0]

The corpus is generated with ground truth: documents of 1-2 KB (sentences of pseudo-words and English
stop words); about 25% are near copies of an earlier document (word substitutions, deletions and
insertions aimed at a Jaccard similarity drawn uniformly from 0.5..1.0, some copies of copies) and
about 5% exact copies up to case, punctuation and spacing. Truth: every pair of documents of one
family (an original and all copies of it) whose exact Jaccard similarity of 5-word shingle sets
(`tasks.minhash.normalize_text`, computed here with Python sets) is >= 0.8. Documents of different
families share no 5-gram by construction (checked on a sample).

Measured:
- hashing docs/s per core: text -> MinHash signature (and band keys), in this process; the baseline
  is datasketch used naively: Python shingle strings, `MinHash.bulk(num_perm=128)`.
- quality: pairs each method calls duplicates vs the truth. Baseline: all pairs returned by
  `MinHashLSH(threshold=0.8, num_perm=128)` queries. Stage: its verified pairs, plus the pairs an
  exact duplicate inherits from the document it duplicates (documents with equal normalized text).
- the stage end to end (run(): plan, map, shuffle, reduce, write), at each corpus size, in a child
  process: wall time, docs/s per core, and peak memory (proportional set size summed over the process
  and its workers, sampled every 20 ms; "floor" is that sum after imports, before the stage starts).
- filter throughput (tasks/filter.py with default rules, 1 process), when that stage exists.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from lmforge.records import RecordWriter  # noqa: E402
from lmforge.store import ArtifactStore, artifact_id  # noqa: E402
from tasks import minhash  # noqa: E402

log = logging.getLogger("bench.dedup")
STOP = ["the", "of", "and", "to", "with", "that", "a", "in", "is", "was", "for", "on", "by", "it", "from"]
NGRAM, THRESHOLD, NUM_PERM = 5, 0.8, 128


# ---------------------------------------------------------------------------------------------
# corpus with ground truth


def make_corpus(n: int, seed: int) -> tuple[list[str], list[int]]:
    """(texts, family of each text)."""
    rng = random.Random(seed)
    syll = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
    vocab = sorted({"".join(rng.choices(syll, k=rng.randint(1, 4))) for _ in range(40_000)})
    texts: list[str] = []
    tokens: list[list[str]] = []
    family: list[int] = []
    for i in range(n):
        r = rng.random()
        if i >= 100 and r < 0.25:  # near copy of an earlier document (possibly itself a copy)
            src = rng.randrange(i)
            toks = near_copy(rng, vocab, tokens[src], rng.uniform(0.5, 1.0))
            family.append(family[src])
        elif i >= 100 and r < 0.30:  # exact copy up to case, punctuation and spacing
            src = rng.randrange(i)
            toks = [t.strip(".,;") for t in tokens[src]]
            toks = [t.upper() if rng.random() < 0.3 else t for t in toks]
            family.append(family[src])
        else:
            toks = []
            size = rng.randint(1000, 2000)
            chars = 0
            while chars < size:
                sent = [rng.choice(STOP) if rng.random() < 0.35 else rng.choice(vocab) for _ in range(rng.randint(6, 18))]
                sent[0] = sent[0].capitalize()
                sent[-1] += rng.choice("....,;")
                toks += sent
                chars += sum(len(t) + 1 for t in sent)
            family.append(i)
        tokens.append(toks)
        texts.append(" ".join(toks) if rng.random() < 0.8 else "\n".join(" ".join(toks[k:k + 12])
                                                                          for k in range(0, len(toks), 12)))
    return texts, family


def near_copy(rng: random.Random, vocab: list[str], toks: list[str], target: float) -> list[str]:
    """Scattered edits; each touches about NGRAM shingles, so k edits give J ~ (S - 5k) / (S + 5k)."""
    s = max(len(toks) - NGRAM + 1, 1)
    k = max(1, round(s * (1 - target) / (NGRAM * (1 + target))))
    out = list(toks)
    for _ in range(k):
        pos = rng.randrange(len(out))
        op = rng.random()
        if op < 0.6:
            out[pos] = rng.choice(vocab)
        elif op < 0.8 and len(out) > NGRAM + 1:
            del out[pos]
        else:
            out.insert(pos, rng.choice(vocab))
    return out


def shingles(text: str) -> set[str]:
    w = minhash.normalize_text(text).split()
    return {" ".join(w[i:i + NGRAM]) for i in range(len(w) - NGRAM + 1)} if len(w) >= NGRAM else ({" ".join(w)} if w else set())


def truth_pairs(texts: list[str], family: list[int]) -> tuple[set[tuple[int, int]], dict[str, int]]:
    members: dict[int, list[int]] = {}
    for i, f in enumerate(family):
        members.setdefault(f, []).append(i)
    sets: dict[int, set[str]] = {}
    truth: set[tuple[int, int]] = set()
    hist = {"0.5-0.8": 0, "0.8-0.9": 0, "0.9-1.0": 0, "1.0": 0}
    for group in members.values():
        if len(group) < 2:
            continue
        for i in group:
            sets[i] = shingles(texts[i])
        for a in range(len(group)):
            for b in range(a + 1, len(group)):
                x, y = sets[group[a]], sets[group[b]]
                j = len(x & y) / len(x | y)
                if j >= 0.5:
                    hist["1.0" if j == 1 else "0.9-1.0" if j >= 0.9 else "0.8-0.9" if j >= 0.8 else "0.5-0.8"] += 1
                if j >= THRESHOLD:
                    truth.add((group[a], group[b]))
        for i in group:
            del sets[i]
    return truth, hist


def check_families_disjoint(texts: list[str], family: list[int], rng: random.Random, k: int = 3000) -> float:
    """Largest Jaccard over k random cross-family pairs (should be ~0)."""
    best = 0.0
    for _ in range(k):
        a, b = rng.randrange(len(texts)), rng.randrange(len(texts))
        if family[a] != family[b]:
            x, y = shingles(texts[a]), shingles(texts[b])
            best = max(best, len(x & y) / max(len(x | y), 1))
    return best


def publish(store: ArtifactStore, texts: list[str], name: str):
    with store.staging("ingest", name) as staged:
        with RecordWriter(staged) as w:
            for i, t in enumerate(texts):
                w.write({"text": t, "id": f"d{i}"})
        return store.publish("ingest", name, staged, {"result": {"records": len(texts), "data_kind": "text"}})


def score(pred: set[tuple[int, int]], truth: set[tuple[int, int]]) -> tuple[float, float]:
    tp = len(pred & truth)
    return tp / max(len(pred), 1), tp / max(len(truth), 1)


# ---------------------------------------------------------------------------------------------
# measurements


def hashing_rate(texts: list[str], bands: int, rows: int) -> float:
    minhash.shingle(texts[:200], NGRAM)  # warm up
    t0 = time.process_time()
    sh = minhash.shingle(texts, NGRAM)
    sig = minhash.signatures((sh.hashes >> np.uint64(32)).astype(np.uint32), sh.offsets, NUM_PERM, 1)
    minhash.band_keys(sig, bands, rows)
    return len(texts) / (time.process_time() - t0)


def baseline_child(args) -> None:
    """datasketch used naively, in a fresh process: shingle strings, MinHash.bulk, MinHashLSH insert + query."""
    from datasketch import MinHash, MinHashLSH

    from lmforge.records import iter_records

    mem = PeakMemory()
    texts = [r["text"] for r in iter_records(ArtifactStore(args.store).require("ingest", args.input))]
    t0 = time.process_time()
    MinHash.bulk([[s.encode() for s in shingles(t)] for t in texts[:args.rate_docs]], num_perm=NUM_PERM)
    rate = args.rate_docs / (time.process_time() - t0)
    t0 = time.perf_counter()
    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    sigs = MinHash.bulk(([s.encode() for s in shingles(t)] for t in texts), num_perm=NUM_PERM)
    for i, m in enumerate(sigs):
        lsh.insert(i, m)
    pred = sorted({(min(i, j), max(i, j)) for i, m in enumerate(sigs) for j in lsh.query(m) if j != i})
    seconds = time.perf_counter() - t0
    mem.stop()
    np.save(args.pairs_out, np.array(pred, dtype=np.int64).reshape(-1, 2))
    print(json.dumps({"rate": rate, "bands": lsh.b, "rows": lsh.r, "seconds": seconds, "floor_mb": mem.floor_mb,
                      "peak_mb": mem.peak_mb}))


def stage_pairs(art, texts: list[str]) -> set[tuple[int, int]]:
    """The stage's verified pairs, with what exact duplicates inherit from their first twin."""
    pairs = set()
    for p in sorted(f for f in art.files if f.startswith("pairs/")):
        with art.open(p) as f:
            for line in f:
                row = json.loads(line)
                pairs.add((int(row["a"][1:]), int(row["b"][1:])))
    classes: dict[str, list[int]] = {}
    for i, t in enumerate(texts):
        classes.setdefault(minhash.normalize_text(t), []).append(i)
    first = {i: m[0] for m in classes.values() for i in m}
    members = {m[0]: m for m in classes.values()}
    pred = set()
    for m in classes.values():
        pred |= {(m[a], m[b]) for a in range(len(m)) for b in range(a + 1, len(m))}
    for a, b in pairs:
        pred |= {(min(x, y), max(x, y)) for x in members[first[a]] for y in members[first[b]]}
    return pred


class PeakMemory:
    """Peak proportional set size (PSS) of this process and its workers, sampled every 20 ms from now on.
    PSS counts pages shared between processes once in total; ru_maxrss would not do here either, as
    a child started from a big parent inherits the parent's high-water mark."""

    def __init__(self):
        import psutil

        self._psutil, self._me = psutil, psutil.Process()
        self.floor_mb = self.peak_mb = self._pss() / 2**20
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _pss(self) -> int:
        total = 0
        for p in [self._me, *self._me.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
            except self._psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mb = max(self.peak_mb, self._pss() / 2**20)
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def child(args) -> None:
    """Run the stage once (in a fresh process) and print one JSON line of figures."""
    from lmforge import fingerprint
    from tasks.dedup import STAGE, DedupConfig, run

    store = ArtifactStore(args.store)
    src = store.require("ingest", args.input)
    cfg = DedupConfig(kind="dedup", inputs=["corpus"], workers=args.workers)
    aid = artifact_id("dedup", fingerprint.for_stage(STAGE).fingerprint, cfg.settings(), [src.id])
    mem = PeakMemory()
    t0 = time.perf_counter()
    with store.staging("dedup", aid) as out:
        result = run(cfg, [src], out)
        store.publish("dedup", aid, out, {"result": result.model_dump(mode="json")}, replace=True)
    wall = time.perf_counter() - t0
    mem.stop()
    print(json.dumps({"wall": wall, "peak_mb": mem.peak_mb, "floor_mb": mem.floor_mb, "artifact": aid,
                      "result": result.model_dump(mode="json")}))


def run_child(store_url: str, input_id: str, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--store", store_url, "--input", input_id, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"stage run failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def filter_rate(store: ArtifactStore, src) -> float | None:
    if not (ROOT / "tasks" / "filter.py").exists():
        return None
    try:
        from tasks import filter as filt

        cfg = filt.FilterConfig(kind="filter", inputs=["corpus"])
        with store.staging("filter", "bench") as out:
            t0 = time.perf_counter()
            filt.run(cfg, [src], out)
            return src.result["records"] / (time.perf_counter() - t0)
    except Exception as e:  # another engineer's stage: report, do not fail the dedup figures
        log.warning("filter benchmark skipped: %s: %s", type(e).__name__, e)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--sizes", default="25000,50000,100000", help="corpus sizes for the memory/throughput runs")
    ap.add_argument("--workers", type=int, default=2, help="worker processes for the stage runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate-docs", type=int, default=10_000, help="documents for the single-core hashing timings")
    ap.add_argument("--filter-docs", type=int, default=20_000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pairs-out", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--input", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child or args.baseline:
        logging.basicConfig(level=logging.WARNING)
        return child(args) if args.child else baseline_child(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-bench-dedup-"))
    try:
        bench(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench(args, tmp: Path) -> None:
    sizes = sorted({int(s) for s in args.sizes.split(",")} | {args.docs})
    store = ArtifactStore(str(tmp / "store"))

    t0 = time.perf_counter()
    texts, family = make_corpus(args.docs, args.seed)
    truth, hist = truth_pairs(texts, family)
    cross = check_families_disjoint(texts, family, random.Random(1))
    sizes_b = [len(t.encode()) for t in texts]
    log.info("corpus: %d docs, %.0f-%.0f bytes (mean %.0f), %d true pairs (J >= %.1f), pair histogram %s, "
             "max cross-family J on a sample %.3f, %.0fs", len(texts), min(sizes_b), max(sizes_b),
             np.mean(sizes_b), len(truth), THRESHOLD, hist, cross, time.perf_counter() - t0)
    inputs = {n: publish(store, texts[:n], f"corpus{n}").id for n in sizes}

    bands, rows = minhash.lsh_params(THRESHOLD, NUM_PERM, 0.02, 0.98)
    ours_rate = hashing_rate(texts[:args.rate_docs], bands, rows)
    log.info("hashing (lmforge, numpy): %.0f docs/s per core", ours_rate)

    runs = {}
    for n in sizes:
        for w in sorted({1, args.workers}) if n == args.docs else [1]:
            runs[(n, w)] = r = run_child(store.url, inputs[n], "--child", "--workers", str(w))
            log.info("stage %d docs, %d worker(s): %.1fs, peak %.0f MB", n, w, r["wall"], r["peak_mb"])
    full = store.require("dedup", runs[(args.docs, 1)]["artifact"])
    same_id = len({runs[(args.docs, w)]["artifact"] for w in sorted({1, args.workers})}) == 1
    p_ours, r_ours = score(stage_pairs(full, texts), truth)
    log.info("stage quality: precision %.4f recall %.4f", p_ours, r_ours)

    pairs_file = tmp / "baseline-pairs.npy"
    base = run_child(store.url, inputs[args.docs], "--baseline", "--pairs-out", str(pairs_file),
                     "--rate-docs", str(min(args.rate_docs, 5000)))
    base["pred"] = {(int(a), int(b)) for a, b in np.load(pairs_file)}
    p_base, r_base = score(base["pred"], truth)
    log.info("baseline: %.0f docs/s, precision %.4f recall %.4f, %.0fs", base["rate"], p_base, r_base, base["seconds"])

    frate = filter_rate(store, store.require("ingest", inputs[min(sizes, key=lambda s: abs(s - args.filter_docs))]))

    res = runs[(args.docs, 1)]["result"]
    load = os.getloadavg()
    print(f"\ndedup benchmark: {args.docs:,} documents of 1-2 KB, {len(truth):,} true duplicate pairs "
          f"(exact Jaccard >= {THRESHOLD}), {os.cpu_count()} cores, load average {load[0]:.1f}/{load[1]:.1f} "
          f"(other users of the CPU make these figures noisy)\n")
    w = args.workers
    rows_ = [
        ("hashing, docs/s per core", f"{base['rate']:,.0f}", f"{ours_rate:,.0f}", "≥ 15,000"),
        ("permutations", f"{NUM_PERM}", f"{NUM_PERM}", "same"),
        ("LSH bands x rows", f"{base['bands']} x {base['rows']}", f"{bands} x {rows}", ""),
        ("precision vs exact J ≥ 0.8", f"{p_base:.4f}", f"{p_ours:.4f}", "≥ 0.99"),
        ("recall vs exact J ≥ 0.8", f"{r_base:.4f}", f"{r_ours:.4f}", "≥ 0.97"),
        ("pairs reported", f"{len(base['pred']):,}", f"{res['verified_pairs']:,} verified "
         f"(+ exact)", ""),
        ("end to end, seconds (1 process)", f"{base['seconds']:.1f}", f"{runs[(args.docs, 1)]['wall']:.1f}", ""),
        ("end to end, docs/s per core", f"{args.docs / base['seconds']:,.0f}",
         f"{args.docs / runs[(args.docs, 1)]['wall']:,.0f}", ""),
        (f"end to end, seconds ({w} processes)", "-", f"{runs[(args.docs, w)]['wall']:.1f}", ""),
        ("peak memory, MB (1 process)", f"{base['peak_mb']:,.0f}", f"{runs[(args.docs, 1)]['peak_mb']:,.0f}", "linear"),
        ("  of which imports (floor)", f"{base['floor_mb']:,.0f}", f"{runs[(args.docs, 1)]['floor_mb']:,.0f}", ""),
    ]
    print(f"{'':34} {'datasketch naive':>18} {'lmforge dedup':>22} {'target':>10}")
    for name, a, b, target in rows_:
        print(f"{name:34} {a:>18} {b:>22} {target:>10}")
    print("\nstage at each size (1 process; memory = PSS of the process and its workers; floor = after imports)")
    print(f"{'docs':>8} {'seconds':>8} {'docs/s':>8} {'floor MB':>9} {'peak MB':>8} {'peak-floor':>11} "
          f"{'dropped (exact / near)':>23}")
    for n in sizes:
        r = runs[(n, 1)]
        d = r["result"]["dropped"]
        print(f"{n:>8,} {r['wall']:>8.1f} {n / r['wall']:>8,.0f} {r['floor_mb']:>9.0f} {r['peak_mb']:>8.0f} "
              f"{r['peak_mb'] - r['floor_mb']:>11.0f} {d['exact_duplicate']:>11,} / {d['near_duplicate']:<9,}")
    r = runs[(args.docs, w)]
    print(f"{args.docs:,} docs with {w} worker processes: {r['wall']:.1f}s, floor {r['floor_mb']:.0f} MB, "
          f"peak {r['peak_mb']:.0f} MB (the pool's fork server and workers each import the task modules)")
    if len(sizes) >= 2:
        x = np.array(sizes, float)
        y = np.array([runs[(n, 1)]["peak_mb"] - runs[(n, 1)]["floor_mb"] for n in sizes])
        slope, icpt = np.polyfit(x, y, 1)
        print(f"linear fit of peak-floor: {icpt:.0f} MB + {slope * 1000:.2f} MB per 1k docs "
              f"(max residual {np.max(np.abs(y - (icpt + slope * x))):.1f} MB)")
    print(f"artifact id the same with 1 and {w} workers: {same_id}")
    print(f"filter (tasks/filter.py, default rules, 1 process): "
          + (f"{frate:,.0f} docs/s per core" if frate else "skipped (no tasks/filter.py, or it failed: see log)"))


if __name__ == "__main__":
    main()
