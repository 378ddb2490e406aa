"""dedup: vectorized MinHash == datasketch, exact kept sets, quality bars, invariance, Dask, bad input."""
from __future__ import annotations

import hashlib
import json
import random
import uuid
from pathlib import Path

import numpy as np
import pytest
from datasketch import MinHash
from datasketch.hashfunc import sha1_hash32

from lmforge import fingerprint
from lmforge.config import parse_config
from lmforge.errors import ArtifactError, ConfigError
from lmforge.port import Port
from lmforge.records import RecordWriter, iter_records
from lmforge.store import Artifact, ArtifactStore, artifact_id
from tasks import REGISTRY, minhash
from tasks.dedup import STAGE, DedupConfig, run

# ---------------------------------------------------------------------------------------------
# helpers


def publish_records(store: ArtifactStore, records: list[dict], kind: str = "text", name: str = "corpus"):
    """A records artifact as ingest would leave it, with ids r0, r1, ... unless given."""
    aid = hashlib.sha256(json.dumps([name, records], sort_keys=True).encode()).hexdigest()[:16]
    with store.staging("ingest", aid) as staged:
        with RecordWriter(staged, part_records=max(1, len(records) // 3 + 1)) as w:
            for i, r in enumerate(records):
                w.write({"id": f"r{i}", **r})
        return store.publish("ingest", aid, staged, {"result": {"records": len(records), "data_kind": kind}})


def dedup(store: ArtifactStore, src, **settings):
    """Run the stage into a fresh staging folder and publish it; returns (artifact, result)."""
    cfg = DedupConfig(kind="dedup", inputs=["corpus"], **settings)
    aid = artifact_id("dedup", fingerprint.for_stage(STAGE).fingerprint, cfg.settings(), [src.id])
    with store.staging("dedup", aid) as out:
        result = run(cfg, [src], out)
        art = store.publish("dedup", aid, out, {"result": result.model_dump(mode="json")}, replace=True)
    return art, result


def lines(art, prefix: str) -> list[dict]:
    rows = []
    for p in sorted(f for f in art.files if f.startswith(prefix + "/")):
        with art.open(p) as f:
            rows += [json.loads(x) for x in f]
    return rows


def words(rng: random.Random, vocab: list[str], n: int) -> list[str]:
    return [rng.choice(vocab) for _ in range(n)]


def shingle_set(text: str, n: int = 5) -> set[str]:
    w = minhash.normalize_text(text).split()
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)} if len(w) >= n else ({" ".join(w)} if w else set())


def true_jaccard(a: str, b: str) -> float:
    x, y = shingle_set(a), shingle_set(b)
    return len(x & y) / len(x | y) if x | y else 1.0


def near_copy(rng: random.Random, vocab: list[str], ws: list[str], target: float, n: int = 5) -> list[str]:
    """`ws` with scattered word substitutions, about `target` Jaccard away (each touches <= n shingles)."""
    s = max(len(ws) - n + 1, 1)
    k = max(1, round(s * (1 - target) / (n * (1 + target))))
    out = list(ws)
    for i in rng.sample(range(len(ws)), k):
        out[i] = rng.choice(vocab)
    return out


def make_corpus(n_docs: int, seed: int = 0):
    """Random documents, a share of them near copies of earlier ones at Jaccard 0.5..1.0, some exact copies
    with other casing and punctuation. Returns (texts, true duplicate pairs (i, j, jaccard >= 0.8))."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    texts: list[str] = []
    family: list[int] = []
    for i in range(n_docs):
        r = rng.random()
        if i > 10 and r < 0.25:  # near copy of an earlier document
            src = rng.randrange(i)
            ws = near_copy(rng, vocab, minhash.normalize_text(texts[src]).split(), rng.uniform(0.5, 1.0))
            texts.append(" ".join(ws))
            family.append(family[src])
        elif i > 10 and r < 0.30:  # exact copy up to case and punctuation
            src = rng.randrange(i)
            texts.append(texts[src].upper().replace(" ", " , "))
            family.append(family[src])
        else:
            texts.append(" ".join(words(rng, vocab, rng.randint(60, 140))).capitalize() + ".")
            family.append(i)
    members: dict[int, list[int]] = {}
    for i, f in enumerate(family):
        members.setdefault(f, []).append(i)
    truth = set()
    for group in members.values():  # documents of different families share (almost) no 5-gram
        for a in range(len(group)):
            for b in range(a + 1, len(group)):
                if true_jaccard(texts[group[a]], texts[group[b]]) >= 0.8:
                    truth.add((group[a], group[b]))
    return texts, truth


@pytest.fixture()
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(str(tmp_path / "store"))


@pytest.fixture(scope="module")
def corpus():
    return make_corpus(1500, seed=7)


# ---------------------------------------------------------------------------------------------
# the numpy MinHash core


TRICKY = ["", "   ", "!!! ???", "Hello,  World!\n", "one two three four", "Ünïcödé “quotes” café_x ｆｕｌｌ ﬁne",
          "tab\tsep\x00nul\x01ctl\x7fdel", "lone \ud800 surrogate \udcff bytes", "x" * 70 + " long word",
          "A.B.C. d-e f'g", "数据 去重 测试 一 二 三", "İstanbul ΣΟΦΙΑ straße"]


def test_normalization_is_documented_rule():
    assert minhash.normalize_text("Hello,  World!\n") == "hello world"
    assert minhash.normalize_text("snake_case x\ty") == "snake case x y"
    assert minhash.normalize_text("ｆｕｌｌ ﬁne") == "full fine"  # NFKC
    assert minhash.normalize_text("a\x00b\ud800c") == "a b c"
    sh = minhash.shingle(TRICKY, 5)
    for i, t in enumerate(TRICKY):  # the vectorized path keys exactly the reference normalization
        assert sh.exact[i].tobytes() == hashlib.blake2b(minhash.normalize_text(t).encode(), digest_size=16).digest(), t
        n_words = len(minhash.normalize_text(t).split())
        assert sh.offsets[i + 1] - sh.offsets[i] == (max(n_words - 4, 1) if n_words else 0), t  # windows, repeats kept
    assert sh.words.tolist() == [len(minhash.normalize_text(t).split()) for t in TRICKY]


def test_signatures_equal_datasketch():
    rng = random.Random(1)
    vocab = [f"w{i}" for i in range(300)]
    texts = TRICKY + [" ".join(words(rng, vocab, rng.randint(1, 400))) for _ in range(40)]
    sh = minhash.shingle(texts, 5)
    for num_perm, seed in ((128, 1), (64, 42)):
        sig = minhash.signatures((sh.hashes >> np.uint64(32)).astype(np.uint32), sh.offsets, num_perm, seed, block=256)
        for i in range(len(texts)):
            m = MinHash(num_perm=num_perm, seed=seed, hashfunc=lambda h: h)
            m.update_batch([int(h) >> 32 for h in sh.hashes[sh.offsets[i]:sh.offsets[i + 1]]])
            assert np.array_equal(sig[i], m.hashvalues), (num_perm, seed, i)
    # and with datasketch's own shingle hash (sha1_hash32 of the bytes) the signature is datasketch's default MinHash
    sets = [sorted(shingle_set(t)) for t in texts[-10:]]
    offsets = np.cumsum([0] + [len(s) for s in sets])
    hashes = np.array([sha1_hash32(s.encode()) for ss in sets for s in ss], dtype=np.uint32)
    sig = minhash.signatures(hashes, offsets, 128, 1)
    for i, ss in enumerate(sets):
        m = MinHash(num_perm=128)
        m.update_batch([s.encode() for s in ss])
        assert np.array_equal(sig[i], m.hashvalues)


def test_lsh_shape_is_datasketch_optimum():
    from datasketch.lsh import _optimal_param

    assert DedupConfig(kind="dedup").lsh_shape() == _optimal_param(0.8, 128, 0.02, 0.98) == (17, 7)
    assert DedupConfig(kind="dedup", bands=32, rows=4).lsh_shape() == (32, 4)
    sig = np.array([[1, 2, 3, 4], [1, 2, 9, 4], [5, 2, 3, 4]], dtype=np.uint32)
    keys = minhash.band_keys(sig, 2, 2)  # equal bands <=> equal keys; bands of a row differ
    assert keys[0, 0] == keys[1, 0] and keys[0, 1] != keys[1, 1] and keys[0, 1] == keys[2, 1] and keys[0, 0] != keys[2, 0]


# ---------------------------------------------------------------------------------------------
# the stage


def test_small_corpus_exact_kept_set(store):
    rng = random.Random(3)
    vocab = ["".join(rng.choice("abcdefghij") for _ in range(6)) for _ in range(2000)]
    a, b, c = (words(rng, vocab, 60) for _ in range(3))
    a_near = list(a)
    a_near[30] = "changed"  # one word: 5 of 56 shingles differ -> J = 51/61
    c_far = near_copy(rng, vocab, c, 0.4)
    docs = [
        {"text": " ".join(a)},                       # r0 kept
        {"text": " ".join(b)},                       # r1 kept
        {"text": " ".join(a).upper() + "!!"},        # r2 exact duplicate of r0
        {"text": " ".join(a_near)},                  # r3 near duplicate of r0
        {"text": ""},                                # r4 kept (first empty)
        {"text": " ".join(c)},                       # r5 kept
        {"text": " ".join(c_far)},                   # r6 kept: J < 0.8
        {"text": "  \n\t "},                         # r7 exact duplicate of r4 (no words either)
        {"text": ", ".join(a_near)},                 # r8 exact duplicate of r3 -> cluster of r0
    ]
    assert true_jaccard(docs[0]["text"], docs[3]["text"]) == pytest.approx(51 / 61)
    assert true_jaccard(docs[5]["text"], docs[6]["text"]) < 0.6
    src = publish_records(store, docs)
    art, res = dedup(store, src, workers=1)
    assert [r["id"] for r in iter_records(art)] == ["r0", "r1", "r4", "r5", "r6"]
    assert [r["text"] for r in iter_records(art)] == [docs[i]["text"] for i in (0, 1, 4, 5, 6)]
    assert res.records == 5 and res.input_records == 9
    assert res.dropped == {"exact_duplicate": 3, "near_duplicate": 1}
    assert (res.clusters, res.largest_cluster, res.verified_pairs, res.empty_documents) == (2, 4, 1, 2)
    assert res.candidate_pairs >= 1
    removed = lines(art, "removed")
    assert [(r["id"], r["representative"], r["reason"]) for r in removed] == [
        ("r2", "r0", "exact_duplicate"), ("r3", "r0", "near_duplicate"),
        ("r7", "r4", "exact_duplicate"), ("r8", "r0", "exact_duplicate")]
    assert [r["jaccard"] for r in removed] == [1.0, pytest.approx(51 / 61, abs=1e-6), 1.0, pytest.approx(51 / 61, abs=1e-6)]
    assert lines(art, "pairs") == [{"a": "r0", "b": "r3", "similarity": pytest.approx(51 / 61, abs=1e-6)}]
    report = json.loads((Path(art.path) / "report.json").read_text())
    assert report["cluster_sizes"] == {"2": 1, "4": 1}
    assert report["lsh"]["bands"] == 17 and report["lsh"]["rows"] == 7
    assert {s["removed"]["id"] for s in report["removed_sample"]} == {"r2", "r3", "r7", "r8"}
    assert report["removed_sample"][1]["representative"]["text"].startswith(" ".join(a[:3]))
    assert res.metrics()["dropped/near_duplicate"] == 1.0


def test_quality_and_partition_invariance(store, corpus):
    texts, truth = corpus
    assert len(truth) > 150
    src = publish_records(store, [{"text": t} for t in texts])
    art1, res1 = dedup(store, src, workers=1, partition_records=100_000)
    pairs = {(int(p["a"][1:]), int(p["b"][1:])) for p in lines(art1, "pairs")}
    # exact duplicates skip the LSH: a pair counts as found through the first document with its normalized text
    first: dict[str, int] = {}
    c = [first.setdefault(minhash.normalize_text(t), i) for i, t in enumerate(texts)]
    found = {(i, j) for i, j in truth if c[i] == c[j] or (min(c[i], c[j]), max(c[i], c[j])) in pairs}
    precision = len(pairs & truth) / len(pairs)
    recall = len(found) / len(truth)
    assert precision >= 0.99 and recall >= 0.97, (precision, recall)

    # other partition, bucket and worker counts: the same files and the same artifact id
    cfg1 = DedupConfig(kind="dedup", workers=1, partition_records=100_000)
    cfg2 = DedupConfig(kind="dedup", workers=2, partition_records=97, shuffle_buckets=3)
    assert cfg1.settings() == cfg2.settings()
    art2, res2 = dedup(store, src, workers=2, partition_records=97, shuffle_buckets=3)
    assert art2.id == art1.id
    assert res2 == res1
    assert {f: e["sha256"] for f, e in art2.files.items()} == {f: e["sha256"] for f, e in art1.files.items()}


def test_dask_local_cluster_gives_the_same_result(store, corpus):
    from distributed import LocalCluster

    texts, _ = corpus
    src = publish_records(store, [{"text": t} for t in texts[:600]])
    local, res_local = dedup(store, src, workers=1)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        art, res = dedup(store, src, dask_address=cluster.scheduler_address, partition_records=150)
        # the stage itself running as a task on the cluster (as under Prefect's DaskTaskRunner) fans out
        # through the worker's client, its own thread seceded: no deadlock with one thread per worker
        from distributed import Client

        with Client(cluster.scheduler_address, set_as_default=False) as client, \
                store.staging("dedup", "in-worker") as out:
            cfg = DedupConfig(kind="dedup", inputs=["corpus"], partition_records=150)
            in_worker = client.submit(run, cfg, [src], out, pure=False).result(timeout=120)
            assert sorted(p.name for p in (out / "records").iterdir()) == ["part-00000.jsonl"]
            assert client.get_events("worker-client")  # it went through distributed.worker_client()
    assert res == res_local == in_worker and res.dropped["near_duplicate"] > 20
    assert art.id == local.id
    assert [r["id"] for r in iter_records(art)] == [r["id"] for r in iter_records(local)]


def test_s3_store_reads_its_input_once_and_gives_the_local_bytes(s3, store, corpus, monkeypatch):
    """On S3 the input is downloaded once (verified) for the plan, the map tasks and the write: every part opened
    once from the store, not three times; the output equals the local store's byte for byte. A byte flipped in the
    stored input is caught while it is copied."""
    texts, _ = corpus
    records = [{"text": t} for t in texts[:400]]
    local, _ = dedup(store, publish_records(store, records), workers=2, partition_records=100)
    remote_store = ArtifactStore(f"s3://lmforge-test/dedup-{uuid.uuid4().hex[:8]}")
    src = publish_records(remote_store, records)
    opened = []
    real_open = Artifact.open
    monkeypatch.setattr(Artifact, "open", lambda self, rel: opened.append((self.kind, rel)) or real_open(self, rel))
    remote, _ = dedup(remote_store, src, workers=2, partition_records=100)
    parts = sorted(p for p in src.files if p.startswith("records/"))
    assert len(parts) == 3 and sorted(rel for kind, rel in opened if kind == "ingest") == parts
    assert remote.id == local.id and remote.files == local.files  # same names, sizes and sha256
    with remote_store.fs.open(f"{src.path}/{parts[1]}", "rb") as f:
        data = bytearray(f.read())
    data[10] ^= 1
    remote_store.fs.pipe_file(f"{src.path}/{parts[1]}", bytes(data))
    with pytest.raises(ArtifactError, match=parts[1]):
        dedup(remote_store, src, workers=1)


def test_estimate_verification(store, corpus):
    texts, truth = corpus
    src = publish_records(store, [{"text": t} for t in texts[:400]])
    art, res = dedup(store, src, workers=1, verify="estimate")
    art_exact, exact = dedup(store, src, workers=1)
    assert art.id != art_exact.id
    assert abs(res.verified_pairs - exact.verified_pairs) <= 0.1 * exact.verified_pairs + 2
    assert all(p["similarity"] >= 0.8 for p in lines(art, "pairs"))


def test_bad_input_does_not_crash(store, tmp_path):
    big = " ".join(f"w{i % 5000}" for i in range(700_000))  # about 4 MB, one document
    docs = [{"text": ""}, {"text": big}, {"text": "ctl\x00\x01\x1b[31m text \x7f"}, {"text": big + " tail"},
            {"text": "\ufffd\ufffd replacement chars"}, {"text": ""}, {"text": "x" * 3_000_000}]
    src = publish_records(store, docs)
    art, res = dedup(store, src, workers=1)
    assert [r["id"] for r in iter_records(art)] == ["r0", "r1", "r2", "r4", "r6"]
    assert res.dropped == {"exact_duplicate": 1, "near_duplicate": 1}

    # lone surrogates (what non-UTF-8 bytes become when decoded with surrogateescape), written as
    # valid JSON escapes: the records pass through unchanged
    aid = "surrogates000000"
    with store.staging("ingest", aid) as staged:
        (staged / "records").mkdir()
        rows = [{"id": "s0", "text": "bad \udcff\udcfe bytes here"}, {"id": "s1", "text": "BAD \udcff bytes, here!"},
                {"id": "s2", "text": "\ud800"}]
        (staged / "records" / "part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        src2 = store.publish("ingest", aid, staged, {"result": {"records": 3, "data_kind": "text"}})
    art2, res2 = dedup(store, src2, workers=1)
    assert [r["id"] for r in iter_records(art2)] == ["s0", "s2"]
    assert next(iter_records(art2))["text"] == rows[0]["text"]


def test_everything_dropped_and_empty_input(store):
    src = publish_records(store, [{"text": "Same words here."}] * 5 + [{"text": "same WORDS, here"}])
    art, res = dedup(store, src, workers=1)
    assert (res.records, res.dropped) == (1, {"exact_duplicate": 5, "near_duplicate": 0})
    empty = publish_records(store, [], name="empty")
    art, res = dedup(store, empty, workers=1)
    assert (res.records, res.input_records, res.clusters) == (0, 0, 0)
    assert list(iter_records(art)) == []


@pytest.mark.parametrize("kind,rows", [
    ("chat", [{"messages": [{"role": "user", "content": "Hi there, how are you today my friend"},
                            {"role": "assistant", "content": "Fine."}]},
              {"messages": [{"role": "user", "content": "hi there how are you today, my friend"},
                            {"role": "assistant", "content": "fine"}]},
              {"messages": [{"role": "user", "content": "Something else entirely, is it not"},
                            {"role": "assistant", "content": "Yes."}]}]),
    ("preference", [{"prompt": "Say hi", "chosen": "Hi!", "rejected": "No."},
                    {"prompt": "say HI", "chosen": "hi", "rejected": "no"},
                    {"prompt": "Say hi", "chosen": "Hello!", "rejected": "No."}]),
])
def test_chat_and_preference_use_canonical_text(store, kind, rows):
    src = publish_records(store, rows, kind=kind, name=kind)
    art, res = dedup(store, src, workers=1)
    assert [r["id"] for r in iter_records(art)] == ["r0", "r2"]
    assert res.data_kind == kind and res.dropped["exact_duplicate"] == 1


def test_config_checks_and_artifact_id():
    base = DedupConfig(kind="dedup")
    same = DedupConfig(kind="dedup", workers=7, partition_records=5, shuffle_buckets=2,
                       dask_address="tcp://127.0.0.1:8786", work_dir="/tmp/x")
    assert base.settings() == same.settings()
    assert "workers" not in base.settings() and "threshold" in base.settings()
    assert DedupConfig(kind="dedup", threshold=0.7).settings() != base.settings()
    with pytest.raises(ConfigError) as e:
        parse_config({"name": "p", "datasets": {"raw": {"path": "x.jsonl", "kind": "text"}},
                      "stages": {"ing": {"kind": "ingest", "inputs": ["raw"]},
                                 "d1": {"kind": "dedup", "inputs": ["ing"], "bands": 4},
                                 "d2": {"kind": "dedup", "inputs": ["ing"], "bands": 40, "rows": 4},
                                 "d3": {"kind": "dedup", "inputs": ["raw"]}}}, REGISTRY)
    text = str(e.value)
    assert "stages.d1: value error, set both bands and rows, or neither (got bands=4, rows=None)" in text
    assert "bands x rows = 40 x 4 = 160 exceeds num_perm = 128" in text
    assert "stages.d3.inputs: input 0 is text dataset; dedup reads records" in text
    assert STAGE.output_port(base, [Port("records", "chat")]) == Port("records", "chat")
