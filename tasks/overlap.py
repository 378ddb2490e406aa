"""Overlap between training texts and a fixed set of items (evaluation documents): which items a text contains.

Texts and items are compared as words, normalized exactly as dedup does (`tasks/minhash.py`: NFKC, lowercase,
words = runs of letters and digits), and word sequences are compared by their 64-bit hashes from
`minhash.shingle`. The hash of a word sequence does not depend on the n-gram size it was cut for, so a gram of
an item can be looked up among the grams of a text of the same length.

- `NgramIndex`: containment. An item with at least `n` words is represented by all its word n-grams; an item
  with `min_words` to `n - 1` words by one gram, its whole word sequence; an item with fewer words than
  `min_words` by nothing (too short to tell contamination from chance). A text matches an item when it contains
  any of the item's grams, word for word. Texts are cut into grams of every length some item uses.
- `MinHashIndex`: near matches of whole texts. MinHash LSH on word shingles (the vectorized datasketch
  MinHash of `tasks/minhash.py`) proposes candidate pairs; a pair matches when the exact Jaccard similarity of
  the two shingle sets reaches `threshold`. Items under `min_words` words are left out here too. Jaccard
  compares whole texts, so a long training record that merely contains an item scores low: that is what the
  n-gram index is for.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks import minhash

#: LSH shape weights as dedup derives them by default: every candidate is verified, so a false one only costs a check
FALSE_POSITIVE_WEIGHT, FALSE_NEGATIVE_WEIGHT = 0.02, 0.98


@dataclass(frozen=True)
class NgramHit:
    item: int
    shared: int  # distinct grams of the item that the text contains
    gram: str  # one of them, normalized: the earliest in the item


@dataclass(frozen=True)
class NearHit:
    item: int
    jaccard: float


def _hits_in(sorted_hashes: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """Indices of `hashes` that occur in `sorted_hashes`."""
    if not sorted_hashes.size or not hashes.size:
        return np.empty(0, np.int64)
    at = np.minimum(np.searchsorted(sorted_hashes, hashes), sorted_hashes.size - 1)
    return np.flatnonzero(sorted_hashes[at] == hashes)


class NgramIndex:
    """The grams of `items` (see the module doc), for finding the items a text contains."""

    def __init__(self, items: list[str], n: int, min_words: int):
        self.items, self.n = items, n
        sh = minhash.shingle(items, n)
        self.words = sh.words
        self.usable = sh.words >= max(min_words, 1)
        counts = np.diff(sh.offsets)
        owner = np.repeat(np.arange(len(items), dtype=np.int64), counts)
        pos = np.arange(sh.hashes.size, dtype=np.int64) - np.repeat(sh.offsets[:-1], counts)
        keep = self.usable[owner]
        h, owner, pos = sh.hashes[keep], owner[keep], pos[keep]
        order = np.lexsort((pos, owner, h))  # by hash, then item, then position: the earliest position first
        self.hashes, self.owner, self.pos = h[order], owner[order], pos[order]
        self.unique = minhash.sorted_set(self.hashes)
        #: gram lengths in use: n, and the length of every usable item shorter than n
        self.lengths = sorted({n} | {int(w) for w in sh.words[self.usable] if w < n})

    @property
    def grams(self) -> int:
        return int(self.unique.size)

    def match(self, texts: list[str]) -> list[list[NgramHit]]:
        """Per text, the items it contains a gram of, by item index."""
        found: list[dict[int, dict[int, int]]] = [{} for _ in texts]  # text -> item -> {gram hash: position}
        for length in self.lengths:
            sh = minhash.shingle(texts, length)
            idx = _hits_in(self.unique, sh.hashes)
            if not idx.size:
                continue
            text_of = np.searchsorted(sh.offsets, idx, side="right") - 1
            hashes = sh.hashes[idx]
            lo = np.searchsorted(self.hashes, hashes, side="left")
            hi = np.searchsorted(self.hashes, hashes, side="right")
            for t, h, a, b in zip(text_of.tolist(), hashes.tolist(), lo.tolist(), hi.tolist()):
                for k in range(a, b):
                    grams = found[t].setdefault(int(self.owner[k]), {})
                    if h not in grams:  # rows of one item and hash come earliest position first
                        grams[h] = int(self.pos[k])
        out: list[list[NgramHit]] = []
        for per_item in found:
            hits = []
            for item in sorted(per_item):
                grams = per_item[item]
                first = min(grams.values())
                words = minhash.normalize_text(self.items[item]).split(" ")
                hits.append(NgramHit(item=item, shared=len(grams),
                                     gram=" ".join(words[first:first + min(self.n, len(words))])))
            out.append(hits)
        return out


class MinHashIndex:
    """MinHash LSH over the word shingles of `items`, for finding the items a text nearly equals."""

    def __init__(self, items: list[str], shingle_words: int, threshold: float, num_perm: int, seed: int,
                 min_words: int):
        self.shingle_words, self.threshold, self.num_perm, self.seed = shingle_words, threshold, num_perm, seed
        self.bands, self.rows = minhash.lsh_params(threshold, num_perm, FALSE_POSITIVE_WEIGHT, FALSE_NEGATIVE_WEIGHT)
        sh = minhash.shingle(items, shingle_words)
        self.usable = sh.words >= max(min_words, 1)
        docs = np.flatnonzero(self.usable)
        keys = self._band_keys(sh)[docs]
        flat, owner = keys.ravel(), np.repeat(docs, self.bands)
        order = np.lexsort((owner, flat))
        self.keys, self.owner = flat[order], owner[order]
        self.sets = {int(d): minhash.sorted_set(sh.hashes[sh.offsets[d]:sh.offsets[d + 1]]) for d in docs}

    def _band_keys(self, sh: minhash.Shingled) -> np.ndarray:
        sig = minhash.signatures((sh.hashes >> np.uint64(32)).astype(np.uint32), sh.offsets, self.num_perm, self.seed)
        return minhash.band_keys(sig, self.bands, self.rows)

    def match(self, texts: list[str]) -> list[list[NearHit]]:
        """Per text, the items whose shingle set has Jaccard similarity >= threshold with the text's, by item index."""
        out: list[list[NearHit]] = [[] for _ in texts]
        if not self.keys.size or not texts:
            return out
        sh = minhash.shingle(texts, self.shingle_words)
        keys = self._band_keys(sh)
        flat = keys.ravel()
        idx = _hits_in(self.keys, flat)
        candidates: dict[int, set[int]] = {}
        lo = np.searchsorted(self.keys, flat[idx], side="left")
        hi = np.searchsorted(self.keys, flat[idx], side="right")
        for i, a, b in zip(idx.tolist(), lo.tolist(), hi.tolist()):
            if sh.words[i // self.bands]:  # a text without words has the empty MinHash: no shingle in common
                candidates.setdefault(i // self.bands, set()).update(self.owner[a:b].tolist())
        for t, items in sorted(candidates.items()):
            mine = minhash.sorted_set(sh.hashes[sh.offsets[t]:sh.offsets[t + 1]])
            for item in sorted(items):
                j = minhash.jaccard(mine, self.sets[item])
                if j >= self.threshold - 1e-12:
                    out[t].append(NearHit(item=item, jaccard=j))
        return out
