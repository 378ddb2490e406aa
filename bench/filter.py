"""Filter throughput: docs/s per core on synthetic 1-2 KB documents, and how many each rule dropped.

    python bench/filter.py [--docs 20000] [--workers 1] [--prose synthetic|stdlib] [--seed 0]

About 60% of the documents are good prose: sentences of pseudo-words and English stop words with
lines ending in a period (`--prose synthetic`), or paragraphs of Python standard library docstrings
(`--prose stdlib`, real English, slower: its n-grams repeat, so the repetition rules cannot stop
early). The rest each trip one rule. Two timings: the rules alone in this process
(`engine`), and the whole stage (`run`: read the records artifact, filter, write kept and rejected
parts) with `--workers` processes. docs/s per core = documents / seconds / processes.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmforge.log import setup_logging  # noqa: E402
from lmforge.store import ArtifactStore  # noqa: E402
from tasks import filter as filt  # noqa: E402

log = logging.getLogger("bench.filter")

STOP = ["the", "of", "and", "to", "with", "that", "a", "in", "is", "was", "for", "on", "by", "it", "from"]


def vocab(rng: random.Random, n: int) -> list[str]:
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 4))))
    return sorted(out)


class Gen:
    def __init__(self, seed: int, n_vocab: int, stdlib: bool = False):
        self.rng = random.Random(seed)
        self.words = vocab(self.rng, n_vocab)
        self.paragraphs = stdlib_paragraphs() if stdlib else []

    def sentence(self, stop: bool = True) -> str:
        r = self.rng
        toks = [r.choice(STOP) if stop and r.random() < 0.35 else r.choice(self.words) for _ in range(r.randint(8, 16))]
        return " ".join([toks[0].capitalize(), *toks[1:]]) + r.choice(".....?!")

    def lines(self, chars: int, stop: bool = True) -> list[str]:
        out: list[str] = []
        n = 0
        while n < chars:
            line = " ".join(self.sentence(stop) for _ in range(self.rng.randint(1, 3)))
            out.append(line)
            n += len(line) + 1
        return out

    def prose(self, chars: int) -> str:
        if self.paragraphs:  # real English: paragraphs of Python standard library docstrings
            picked = self.rng.sample(self.paragraphs, 12)
            out = []
            while sum(map(len, out)) < chars and picked:
                out.append(picked.pop())
            return "\n\n".join(out)
        lines = self.lines(chars)
        for i in range(self.rng.randint(1, 3), len(lines), 4):  # some paragraph breaks
            lines[i] = "\n" + lines[i]
        return "\n".join(lines)


def stdlib_paragraphs() -> list[str]:
    """Docstring paragraphs of some standard library modules: real English that ships with Python."""
    import importlib
    import inspect

    paras: list[str] = []
    for name in ("argparse", "logging", "collections", "subprocess", "threading", "asyncio", "email", "json",
                 "http.client", "unittest", "typing", "pathlib", "decimal", "datetime", "inspect", "os", "socket",
                 "tarfile", "zipfile", "shutil", "csv", "sqlite3", "urllib.request", "multiprocessing",
                 "functools", "itertools", "io", "textwrap", "difflib", "pickle", "random", "statistics"):
        for _, obj in inspect.getmembers(importlib.import_module(name)):
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if doc and len(doc) > 200:
                paras += [" ".join(p.split()) for p in doc.split("\n\n") if len(p) > 80]  # unwrap lines
    return sorted(set(paras))


def _each_line(g: Gen, n: int, fn: Callable[[int, str], str]) -> str:
    return "\n".join(fn(i, s) for i, s in enumerate(g.lines(n)))


# rule the document is made to trip -> generator(gen, target characters)
BAD: dict[str, Callable[[Gen, int], str]] = {
    "bad_chars": lambda g, n: g.prose(n).replace(" ", " \ufffd", n // 40),
    "min_words": lambda g, n: g.sentence() + " " + g.sentence(),
    "mean_word_length": lambda g, n: "\n".join(["It is to be so. We go up to it as we do. Be it so on an ox."]
                                                * (n // 60)),
    "hash_ratio": lambda g, n: _each_line(g, n, lambda i, s: s.replace(" ", " #tag ", 4)),
    "ellipsis_ratio": lambda g, n: _each_line(g, n, lambda i, s: s.replace(" ", "... ", 6)),
    "bullet_lines": lambda g, n: _each_line(g, n, lambda i, s: f"• {s}"),
    "ellipsis_lines": lambda g, n: _each_line(g, n, lambda i, s: s[:-1] + "..." if i % 2 else s),
    "alpha_words": lambda g, n: _each_line(g, n, lambda i, s: s.replace(" ", " 1234 ", 14)),
    "stop_words": lambda g, n: "\n".join(g.lines(n, stop=False)),
    "dup_para_frac": lambda g, n: "\n\n".join([g.prose(n // 4)] * 3 + [g.prose(n // 4)]),
    "dup_line_frac": lambda g, n: "\n".join(g.lines(n // 2) + ["Thank you for reading the post."] * 12),
    "top_2gram": lambda g, n: _each_line(g, n, lambda i, s: s.replace(" ", " kiwi melon ", 5)),
    "dup_5gram": lambda g, n: (lambda shared: _each_line(g, n, lambda i, s: f"{s} {shared}" if i % 2 else s))(
        g.sentence() + " " + g.sentence()),
    "lorem_ipsum": lambda g, n: g.prose(n) + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.",
    "curly_bracket": lambda g, n: g.prose(n) + "\nThe settings are { debug on } for this whole page.",
    "c4_min_sentences": lambda g, n: _each_line(g, n, lambda i, s: s[:-1]),
}


def corpus(n_docs: int, seed: int, n_vocab: int, stdlib: bool = False, bad_share: float = 0.4) -> list[dict[str, str]]:
    g = Gen(seed, n_vocab, stdlib)
    rules = list(BAD)
    docs = []
    for i in range(n_docs):
        chars = g.rng.randint(1000, 2000)
        if g.rng.random() < bad_share:
            docs.append({"id": f"b{i}", "text": BAD[rules[i % len(rules)]](g, chars)})
        else:
            docs.append({"id": f"g{i}", "text": g.prose(chars)})
    return docs


def publish(store: ArtifactStore, docs: list[dict[str, str]], tmp: Path):
    staged = tmp / "staged"
    (staged / "records").mkdir(parents=True)
    with open(staged / "records" / "part-00000.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    return store.publish("ingest", "bench0000000000", staged,
                         {"result": {"records": len(docs), "data_kind": "text"}, "inputs": []})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=20_000, help="number of documents")
    ap.add_argument("--workers", type=int, default=1, help="worker processes for the stage timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prose", choices=("synthetic", "stdlib"), default="synthetic",
                    help="the good documents: pseudo-word prose, or real English from Python's standard library "
                    "docstrings (some of which the rules drop: code, repeats)")
    ap.add_argument("--vocab", type=int, default=2000, help="content words; smaller means more repeated n-grams, "
                    "so the repetition rules cannot stop early (slower)")
    args = ap.parse_args()
    setup_logging(logging.WARNING)
    logging.getLogger("bench").setLevel(logging.INFO)

    docs = corpus(args.docs, args.seed, args.vocab, args.prose == "stdlib")
    mb = sum(len(d["text"].encode()) for d in docs) / 2**20
    log.info("%d documents, %.1f MB", len(docs), mb)
    cfg = filt.FilterConfig(kind="filter", workers=args.workers)

    engine = filt.Engine(cfg, "text")
    t0 = time.perf_counter()
    res = engine.process(docs)
    engine_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory(prefix="lmforge-bench-") as tmp:
        src = publish(ArtifactStore(str(Path(tmp) / "store")), docs, Path(tmp))
        out = Path(tmp) / "out"
        out.mkdir()
        t0 = time.perf_counter()
        result = filt.run(cfg, [src], out)
        run_s = time.perf_counter() - t0

    assert dict(res.dropped) == result.dropped, "engine and stage disagree"
    n = len(docs)
    rows = [("engine (rules only)", 1, engine_s), ("run (read+filter+write)", args.workers, run_s)]
    w = sys.stdout.write
    w(f"\nfilter benchmark: {n} docs, {mb:.1f} MB, mean {mb * 2**20 / n:.0f} B/doc, {args.prose} prose\n\n")
    w(f"{'timing':<26}{'procs':>6}{'seconds':>10}{'docs/s':>10}{'docs/s/core':>13}{'MB/s/core':>11}\n")
    for name, procs, s in rows:
        w(f"{name:<26}{procs:>6}{s:>10.2f}{n / s:>10.0f}{n / s / procs:>13.0f}{mb / s / procs:>11.2f}\n")
    made = Counter(d["id"][0] for d in docs)
    w(f"\n{'rule':<22}{'dropped':>8}\n")
    for rule, k in result.dropped.items():
        w(f"{rule:<22}{k:>8}\n")
    w(f"{'kept':<22}{result.records:>8}   (good documents generated: {made['g']})\n")
    if result.lines_removed:
        w(f"lines removed: {result.lines_removed}\n")


if __name__ == "__main__":
    main()
