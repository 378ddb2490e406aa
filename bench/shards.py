"""Shard write and read throughput, local disk vs a real S3 server (SeaweedFS on 127.0.0.1).

    python bench/shards.py [--records 100000]

Write = the shard stage's run() into staging plus publishing to the store (upload for S3).
Read = `webdataset.WebDataset` over the published shards, one process, JSON decoded per sample.
Targets (issue 2): read >= 20k samples/s per core locally; S3 read >= 70% of local.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lmforge.records import RecordWriter  # noqa: E402
from lmforge.shards import iter_samples  # noqa: E402
from lmforge.store import ArtifactStore  # noqa: E402
from tasks.shard import ShardConfig, run as shard_run  # noqa: E402


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_records(store: ArtifactStore, tmp: Path, n: int):
    staged = tmp / "records-staged"
    staged.mkdir()
    with RecordWriter(staged) as w:
        for i in range(n):
            w.write({"text": f"record {i}: a short line of text about sample number {i * 7919 % 100003}.",
                     "id": f"bench:{i}"})
    return store.publish("ingest", "bench-records", staged, {"result": {"records": n, "data_kind": "text"},
                                                             "inputs": []})


def bench(store: ArtifactStore, tmp: Path, n: int, label: str) -> dict[str, float]:
    (tmp / label).mkdir()
    records = make_records(store, tmp / label, n)
    cfg = ShardConfig(kind="shard", max_count=10_000, validation_fraction=0.0)
    with store.staging("shard", "bench") as out:
        t0, c0 = time.perf_counter(), cpu_seconds()
        result = shard_run(cfg, [records], out)
        art = store.publish("shard", f"bench-{label}", out, {"result": result.model_dump(mode="json"), "inputs": []},
                            replace=True)
        write_s = time.perf_counter() - t0
    nbytes = result.bytes
    t0, c0 = time.perf_counter(), cpu_seconds()
    count = sum(1 for _ in iter_samples(art, "train"))
    read_s, read_cpu = time.perf_counter() - t0, cpu_seconds() - c0
    assert count == n, (count, n)
    return {"write_samples_s": n / write_s, "write_mb_s": nbytes / write_s / 1e6, "read_samples_s": n / read_s,
            "read_mb_s": nbytes / read_s / 1e6, "read_samples_per_cpu_s": n / read_cpu, "mb": nbytes / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=100_000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmforge-bench-shards-"))
    rows = {"local": bench(ArtifactStore(str(tmp / "store")), tmp, args.records, "local")}
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from s3server import S3Server

    with S3Server(tmp / "s3server") as s3:
        os.environ.update(s3.env())
        s3.make_bucket("bench")
        rows["s3"] = bench(ArtifactStore("s3://bench/store"), tmp, args.records, "s3")
    print(f"\nshards: {args.records} short text records, {rows['local']['mb']:.1f} MB of tar shards, 1 process\n")
    print(f"{'store':<6} {'write samples/s':>16} {'write MB/s':>11} {'read samples/s':>15} {'read MB/s':>10} "
          f"{'read samples/CPU-s':>19}")
    for k, r in rows.items():
        print(f"{k:<6} {r['write_samples_s']:>16,.0f} {r['write_mb_s']:>11.1f} {r['read_samples_s']:>15,.0f} "
              f"{r['read_mb_s']:>10.1f} {r['read_samples_per_cpu_s']:>19,.0f}")
    ratio = rows["s3"]["read_samples_s"] / rows["local"]["read_samples_s"]
    print(f"\nlocal read per core: {rows['local']['read_samples_per_cpu_s']:,.0f} samples/s (target >= 20,000)")
    print(f"S3 read / local read: {ratio:.2f} (target >= 0.70)")
    print(json.dumps({"records": args.records, **{f"{k}_{m}": round(v, 1) for k, r in rows.items()
                                                   for m, v in r.items()}, "s3_over_local": round(ratio, 3)}))


if __name__ == "__main__":
    main()
