"""MinHash signatures and LSH band keys for a whole batch of documents at once, in numpy.

This is datasketch's MinHash, vectorized: the permutation parameters come from
`datasketch.MinHash(num_perm, seed)` and the permutation is its default "affine32" scheme, so a
signature here equals `datasketch.MinHash(num_perm, seed, hashfunc=...)` fed the same shingle hashes
(tests/test_dedup.py checks it). What differs is the loop: the shingle hashes of all documents of a
batch are concatenated, permuted with one broadcast `a * fmix32(h) + b (mod 2^32)`, and reduced per
document with `np.minimum.reduceat`.

Normalization, exactly (`normalize_text` is the reference; the batch code is a faster equivalent):
  1. NFKC, then `str.lower()`. (ASCII text is its own NFKC form, so it only gets lowercased.)
  2. Words are the maximal runs of alphanumeric characters (`str.isalnum`: Unicode letters and
     digits). Everything else separates words: whitespace, punctuation, symbols, `_`, control
     characters, lone surrogates.
  3. The normalized text is the words joined by single spaces ("" when there are none).
Shingles are the `ngram` consecutive-word windows of the normalized text. A document with at least
one but fewer than `ngram` words has one shingle, all its words; one with no words has none.

Hashes. A word's 64-bit hash: its UTF-8 bytes as zero-padded 8-byte little-endian chunks c_0..c_m,
h = c_0 ^ (length * K), h = fmix64(h) ^ c_r for each further chunk, then fmix64(h) (MurmurHash3's
64-bit finalizer); a word over 32 bytes: its blake2b-64 instead. A shingle's hash:
fmix64(sum_k M_k * hash(word_k)) mod 2^64, with fixed odd multipliers M_k. Exact Jaccard compares
sets of these 64-bit hashes (distinct shingles collide with probability about 2^-64); MinHash takes
their top 32 bits as its `hashfunc` values. The exact-duplicate key is blake2b-128 of the normalized
text. All of it is computed for a batch of documents at once, on one byte buffer.
"""
from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from dataclasses import dataclass

import numpy as np
from datasketch import MinHash
from datasketch.lsh import _optimal_param

U32_MAX = np.uint32(0xFFFFFFFF)  # datasketch's empty-MinHash value for affine32
_ALNUM_RUN = re.compile(r"[^\W_]+")  # \w minus "_" is exactly str.isalnum()
_ASCII_TABLE = bytes(c if chr(c).isalnum() else 32 for c in range(128)).lower() + bytes(range(128, 256))
_BYTE_MASKS = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], dtype=np.uint64)

_BAND_MULT = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                       0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9],
                      dtype=np.uint64)
SIG_BLOCK = 4096  # shingles per permutation block: 128 perms x 4096 x 4 bytes = 2 MiB, about the L2 cache


def normalize_text(text: str) -> str:
    """The normalized text a document is compared on (reference implementation, see module doc)."""
    return " ".join(_ALNUM_RUN.findall(unicodedata.normalize("NFKC", text).lower()))


# ---------------------------------------------------------------------------------------------
# mixing functions (uint arrays; numpy wraps on overflow, which is the intended arithmetic)


def _fmix(h: np.ndarray, word: type, shifts: tuple[int, int, int], mults: tuple[int, int]) -> np.ndarray:
    """MurmurHash3's finalizer in `word` arithmetic: xor-shift, multiply, xor-shift, multiply, xor-shift."""
    first, second, third = (word(k) for k in shifts)
    h = h ^ (h >> first)
    h = h * word(mults[0])
    h = h ^ (h >> second)
    h = h * word(mults[1])
    return h ^ (h >> third)


def fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer."""
    return _fmix(h, np.uint64, (33, 33, 33), (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53))


def fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer, as datasketch applies it to every input hash (affine32)."""
    return _fmix(h, np.uint32, (16, 13, 16), (0x85EBCA6B, 0xC2B2AE35))


@functools.lru_cache(maxsize=8)
def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """datasketch's own (a, b) for `MinHash(num_perm, seed)`, affine32 scheme, as uint32 arrays."""
    m = MinHash(num_perm=num_perm, seed=seed)
    if m.scheme != "affine32":  # pragma: no cover - guards a datasketch default change
        raise RuntimeError(f"datasketch's default MinHash scheme is {m.scheme!r}; this code implements affine32")
    a, b = m.permutations
    return np.ascontiguousarray(a, dtype=np.uint32), np.ascontiguousarray(b, dtype=np.uint32)


# ---------------------------------------------------------------------------------------------
# documents -> normalized bytes, exact keys and shingle hashes


@dataclass
class Shingled:
    """One batch of documents: exact keys, and shingle hashes per document (text order, repeats kept)."""

    exact: np.ndarray    # (n, 2) uint64: the first 16 bytes of blake2b(normalized text)
    words: np.ndarray    # (n,) int64: words per document
    offsets: np.ndarray  # (n + 1,) int64: document d's shingles are hashes[offsets[d]:offsets[d+1]]
    hashes: np.ndarray   # (total,) uint64

    @property
    def n(self) -> int:
        return self.words.size

    @staticmethod
    def concat(parts: list["Shingled"]) -> "Shingled":
        if len(parts) == 1:
            return parts[0]
        offs, base = [np.zeros(1, np.int64)], 0
        for p in parts:
            offs.append(p.offsets[1:] + base)
            base += p.hashes.size
        return Shingled(exact=np.concatenate([p.exact for p in parts]).reshape(-1, 2),
                        words=np.concatenate([p.words for p in parts]),
                        offsets=np.concatenate(offs), hashes=np.concatenate([p.hashes for p in parts]))


def shingle(texts: list[str], ngram: int, batch_bytes: int = 1 << 20) -> Shingled:
    """Normalize, key and shingle `texts`, in sub-batches of about `batch_bytes` of text."""
    parts, start, size = [], 0, 0
    for i, t in enumerate(texts):
        size += len(t) + 1
        if size >= batch_bytes:
            parts.append(_shingle_batch(texts[start:i + 1], ngram))
            start, size = i + 1, 0
    if start < len(texts) or not parts:
        parts.append(_shingle_batch(texts[start:], ngram))
    return Shingled.concat(parts)


def _prepare(text: str) -> bytes:
    """Bytes in which words are the runs of non-space bytes (separators may repeat)."""
    if text.isascii():  # lowercase, and every ASCII byte that is not [0-9a-z] becomes a space
        return text.encode("ascii").translate(_ASCII_TABLE)
    return normalize_text(text).encode("utf-8")


def _shingle_batch(texts: list[str], ngram: int) -> Shingled:
    n = len(texts)
    enc = [_prepare(t) for t in texts]
    lens = np.fromiter(map(len, enc), dtype=np.int64, count=n)
    # one space before, between and after the documents, and 8 more so 8-byte reads stay in bounds
    raw = np.frombuffer(b" " + b" ".join(enc) + b" " * 9, dtype=np.uint8)
    doc_start = np.ones(n, np.int64)
    np.cumsum(lens[:-1] + 1, out=doc_start[1:])
    doc_start[1:] += 1

    # words: runs of non-space bytes; raw starts and ends with a space, so edges alternate start/end
    isw = raw != 32
    edges = np.flatnonzero(isw[:-1] != isw[1:]) + 1
    starts, ends = edges[0::2], edges[1::2]  # ends: the space after each word
    wlen = ends - starts
    wbound = np.zeros(n + 1, np.int64)  # document d's words are [wbound[d], wbound[d+1])
    wbound[1:n] = np.searchsorted(starts, doc_start[1:])
    wbound[n] = starts.size
    words = np.diff(wbound)
    wdoc = np.repeat(np.arange(n, dtype=np.int64), words)
    last = wbound[1:] - 1  # global index of each document's last word
    first = wbound[:-1]

    # exact keys: blake2b of each normalized text (its words, each followed by one space, minus the last)
    keep = isw.copy()
    keep[ends] = True
    compact = raw[keep]
    cbound = np.zeros(starts.size + 1, np.int64)
    np.cumsum(wlen + 1, out=cbound[1:])
    cstart = cbound[wbound[:-1]]
    cend = np.maximum(cstart, cbound[wbound[1:]] - 1)
    mv = memoryview(compact.tobytes())
    digest = b"".join(hashlib.blake2b(mv[s:e], digest_size=16).digest() for s, e in zip(cstart.tolist(), cend.tolist()))
    exact = np.frombuffer(digest, dtype=np.uint64).reshape(n, 2)

    wh = _word_hashes(raw, starts, wlen)

    # shingle j: sum_k wh[j + k] * M_k over its words, then fmix64. Window j covers words j..j+ngram-1
    # of its document; a document shorter than ngram has one window, from its first to its last word.
    nw = starts.size
    j = np.arange(nw, dtype=np.int64)
    dlast = last[wdoc]
    mult = _shingle_mults(ngram)
    whp = np.concatenate([wh, np.zeros(ngram, np.uint64)])
    acc = wh * mult[0]
    for k in range(1, ngram):
        acc += whp[k:k + nw] * mult[k]
    short_first = (words[wdoc] < ngram) & (j == first[wdoc])
    if short_first.any():
        js = np.flatnonzero(short_first)
        acc_s = wh[js] * mult[0]
        for k in range(1, ngram):
            inside = js + k <= dlast[js]
            acc_s += np.where(inside, whp[js + k], np.uint64(0)) * mult[k]
        acc[js] = acc_s
    valid = (j + ngram - 1 <= dlast) | short_first
    hashes = fmix64(acc[valid])
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(wdoc[valid], minlength=n), out=offsets[1:])
    return Shingled(exact=exact, words=words, offsets=offsets, hashes=hashes)


_LONG_WORD = 32  # bytes; longer words are hashed with blake2b


def _word_hashes(raw: np.ndarray, starts: np.ndarray, wlen: np.ndarray) -> np.ndarray:
    """64-bit word hashes. A word of up to 32 bytes, zero-padded to 8-byte little-endian chunks
    c_0..c_m: h = c_0 ^ (len * K); h = fmix64(h) ^ c_r for each further chunk; hash = fmix64(h).
    A longer word: the first 8 bytes (little-endian) of its blake2b-64."""
    # the 8 bytes starting at every position, as little-endian uint64 (unaligned strided view)
    at = np.ndarray(shape=(raw.size - 7,), dtype="<u8", buffer=raw, strides=(1,))

    def chunk(pos: np.ndarray, remaining: np.ndarray) -> np.ndarray:
        return at[pos] & _BYTE_MASKS[np.minimum(remaining, 8)]

    h = chunk(starts, wlen) ^ (wlen.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    for r in range(1, _LONG_WORD // 8):
        sel = np.flatnonzero(wlen > 8 * r)
        if not sel.size:
            break
        h[sel] = fmix64(h[sel]) ^ chunk(starts[sel] + 8 * r, wlen[sel] - 8 * r)
    h = fmix64(h)
    long = np.flatnonzero(wlen > _LONG_WORD)
    if long.size:
        mv = memoryview(raw)
        digest = b"".join(hashlib.blake2b(mv[s:s + w], digest_size=8).digest()
                          for s, w in zip(starts[long].tolist(), wlen[long].tolist()))
        h[long] = np.frombuffer(digest, dtype="<u8")
    return h


@functools.lru_cache(maxsize=8)
def _shingle_mults(ngram: int) -> np.ndarray:
    m = fmix64(np.arange(1, ngram + 1, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93))
    return m | np.uint64(1)


# ---------------------------------------------------------------------------------------------
# signatures and bands


def signatures(hashes32: np.ndarray, offsets: np.ndarray, num_perm: int, seed: int,
               block: int = SIG_BLOCK) -> np.ndarray:
    """(n, num_perm) uint32 MinHash signatures; document d hashed `hashes32[offsets[d]:offsets[d+1]]`.

    Equal to datasketch `MinHash(num_perm, seed, hashfunc=identity).update_batch(those hashes)`;
    a document without shingles gets the empty MinHash (all 2^32 - 1), as in datasketch.
    """
    a, b = permutations(num_perm, seed)
    n = offsets.size - 1
    sig = np.full((n, num_perm), U32_MAX, dtype=np.uint32)
    total = int(offsets[-1])
    if total == 0:
        return sig
    x = fmix32(hashes32.astype(np.uint32, copy=False))
    counts = np.diff(offsets)
    docs = np.flatnonzero(counts > 0)
    # segments: every document start and every block start; a document spanning blocks has several
    seg = np.union1d(offsets[docs], np.arange(0, total, block, dtype=np.int64))
    seg_doc = np.searchsorted(offsets, seg, side="right") - 1  # skips empty documents (same start)
    seg_min = np.empty((num_perm, seg.size), dtype=np.uint32)
    buf = np.empty((num_perm, block), dtype=np.uint32)
    a_col, b_col = a[:, None], b[:, None]
    lo_seg = 0
    for lo in range(0, total, block):
        hi = min(lo + block, total)
        hi_seg = np.searchsorted(seg, hi, side="left")
        view = buf[:, :hi - lo]
        np.multiply(a_col, x[None, lo:hi], out=view)
        np.add(view, b_col, out=view)
        seg_min[:, lo_seg:hi_seg] = np.minimum.reduceat(view, seg[lo_seg:hi_seg] - lo, axis=1)
        lo_seg = hi_seg
    firsts = np.flatnonzero(np.r_[True, seg_doc[1:] != seg_doc[:-1]])
    per_doc = np.minimum.reduceat(seg_min, firsts, axis=1) if firsts.size < seg.size else seg_min
    sig[seg_doc[firsts]] = per_doc.T
    return sig


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64: a hash of each band's `rows` signature values (datasketch's hash ranges,
    band i = values [i*rows, (i+1)*rows)); equal keys mean equal bands, barring 2^-64 collisions."""
    n = sig.shape[0]
    v = sig[:, :bands * rows].reshape(n, bands, rows).astype(np.uint64) + np.uint64(1)
    mult = _mults(rows)
    key = (v * mult).sum(axis=2, dtype=np.uint64)
    key += np.arange(bands, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return fmix64(key)


@functools.lru_cache(maxsize=8)
def _mults(rows: int) -> np.ndarray:
    reps = -(-rows // _BAND_MULT.size)
    m = np.tile(_BAND_MULT, reps)[:rows].copy()
    m ^= np.repeat(np.arange(reps, dtype=np.uint64) << np.uint64(1), _BAND_MULT.size)[:rows]  # stay odd, distinct
    return m


def lsh_params(threshold: float, num_perm: int, false_positive_weight: float,
               false_negative_weight: float) -> tuple[int, int]:
    """(bands, rows) minimizing datasketch's weighted false positive/negative probability."""
    return _optimal_param(threshold, num_perm, false_positive_weight, false_negative_weight)


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    """Chance that two documents with this Jaccard similarity share at least one band."""
    return 1.0 - (1.0 - similarity ** rows) ** bands


def sorted_set(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted."""
    s = np.sort(values)
    if s.size < 2:
        return s
    keep = np.empty(s.size, bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def jaccard(x: np.ndarray, y: np.ndarray) -> float:
    """Jaccard similarity of two sorted sets (`sorted_set`); 1.0 for two empty sets."""
    if x.size == 0 or y.size == 0:
        return 1.0 if x.size == y.size else 0.0
    if x.size < y.size:
        x, y = y, x
    inter = int(np.count_nonzero(x[np.minimum(np.searchsorted(x, y), x.size - 1)] == y))
    return inter / (x.size + y.size - inter)
