"""The filter stage's rewriting rules: the C4 line pass, which removes lines (and may drop the document), and PII
masking, which only rewrites. Their config models and the sources of their thresholds are in
`tasks/filter_rules.py`; `tasks/filter.py` runs them in the order documented there.
"""
from __future__ import annotations

import ipaddress
import re

from tasks.filter_rules import C4Rule, PiiConfig

# ----------------------------------------------------------------------------------------------
# C4 line pass: removes lines from `text` documents, may drop the document

_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_END_MARKS = (".", "?", "!", '"')
_POLICY = re.compile("terms of use|privacy policy|cookie policy|uses cookies|use of cookies|use cookies")
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s|$)")
LINE_RULES = ("c4_long_word", "c4_terminal_punct", "c4_min_words_per_line", "c4_javascript", "c4_policy")


class C4Outcome:
    __slots__ = ("reason", "text", "removed", "citations")

    def __init__(self, reason: str | None, text: str, removed: dict[str, int], citations: int):
        self.reason, self.text, self.removed, self.citations = reason, text, removed, citations


def c4_lines(s: str, c: C4Rule, lower: str | None = None) -> C4Outcome:
    """C4's `clean_page`: line removal, then `lorem_ipsum`, `curly_bracket`, `c4_min_sentences`.

    Per line, in TFDS order: a word over `max_word_chars` removes it; citations are cut; no terminal
    punctuation (or a trailing `...`) removes it; too few words remove it; 'lorem ipsum' marks the
    document; 'javascript' removes the line; `{` marks the document; a policy phrase removes the line.
    A document with lorem ipsum (first) or a curly bracket in a line that survived up to that check is
    dropped, as is one left with fewer than `min_sentences` sentences or with no line at all
    (`c4_no_lines_left`). Sentences are runs of . ! ? followed by whitespace or the line end (C4 used
    nltk's punkt). Unlike C4, kept lines stay verbatim (not stripped) and blank lines survive as
    paragraph breaks; an untouched document comes back as the same string.
    """
    lower = s.lower() if lower is None else lower
    # phrases absent from the whole document need no per-line look
    lorem_on = c.lorem_ipsum and "lorem ipsum" in lower
    js_on = c.javascript and "javascript" in lower
    policy_on = c.policy and _POLICY.search(lower) is not None
    curly_on = c.curly_bracket and "{" in s
    need = c.min_sentences or 0
    removed = dict.fromkeys(LINE_RULES, 0)
    kept: list[str] = []
    citations = sentences = 0
    lorem = curly = False
    last_blank = True  # leading blank lines go, runs of blank lines collapse (only in a rebuilt text)
    limit = c.max_word_chars
    for raw in s.split("\n"):
        line = raw.strip()
        if not line:
            if not last_blank:
                kept.append(raw)
                last_blank = True
            continue
        if limit is not None and len(line) > limit and any(len(w) > limit for w in line.split()):
            removed["c4_long_word"] += 1
            continue
        if c.remove_citations and "[" in line:
            cut, n = _CITATION.subn("", line)
            if n:
                citations += n
                raw = line = cut.strip()
        if c.terminal_punctuation and (not line.endswith(_END_MARKS) or line.endswith("...")):
            removed["c4_terminal_punct"] += 1
            continue
        if c.min_words_per_line and len(line.split()) < c.min_words_per_line:
            removed["c4_min_words_per_line"] += 1
            continue
        if lorem_on or js_on or policy_on:
            low = line.lower()
            if lorem_on and "lorem ipsum" in low:
                lorem = True
            if js_on and "javascript" in low:
                removed["c4_javascript"] += 1
                continue
            if curly_on and "{" in line:
                curly = True
            if policy_on and _POLICY.search(low):
                removed["c4_policy"] += 1
                continue
        elif curly_on and "{" in line:
            curly = True
        if sentences < need:  # counted only up to what the rule needs
            sentences += len(_SENTENCE_END.findall(line)) or 1
        kept.append(raw)
        last_blank = False
    if lorem:
        return C4Outcome("lorem_ipsum", s, removed, citations)
    if curly:
        return C4Outcome("curly_bracket", s, removed, citations)
    if sentences < need:
        return C4Outcome("c4_min_sentences", s, removed, citations)
    if last_blank and kept:
        kept.pop()
    if not kept:
        return C4Outcome("c4_no_lines_left", s, removed, citations)
    if citations or any(removed.values()):
        s = "\n".join(kept)
    return C4Outcome(None, s, removed, citations)


# ----------------------------------------------------------------------------------------------
# PII masking

_EMAIL_CHARS = r"[\w!#$%&'*+/=?^`{|}~-]"
_EMAIL = re.compile(
    rf"(?<![\w.!#$%&'*+/=?^`{{|}}~-]){_EMAIL_CHARS}{{1,64}}(?:\.{_EMAIL_CHARS}{{1,64}}){{0,8}}"
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.){1,8}[A-Za-z]{2,63}(?![\w-])")
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\w|\.[0-9])")
# a candidate run of hex digits, colons and dots with two colons near its start; ipaddress decides
_IPV6 = re.compile(r"(?<![\w:.])(?=[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{0,4}:)[0-9A-Fa-f:.]{2,45}(?![\w:])")


class PiiMasker:
    """Replaces e-mail and IP addresses with placeholders and counts them."""

    def __init__(self, c: PiiConfig):
        self.c = c

    def _ip(self, cls: type, text: str) -> str | None:
        try:
            ip = cls(text)
        except ValueError:
            return None
        return None if self.c.only_public_ips and not ip.is_global else self.c.ip_placeholder

    def __call__(self, s: str) -> tuple[str, int, int]:
        """(masked text, e-mails masked, IPs masked)."""
        emails = ips = 0
        if self.c.email and "@" in s:
            s, emails = _EMAIL.subn(self.c.email_placeholder, s)
        if self.c.ip:
            found = [0]

            def v6(m: re.Match[str]) -> str:
                cand = m.group(0)
                tail = len(cand) - len(cand.rstrip("."))
                out = self._ip(ipaddress.IPv6Address, cand[:len(cand) - tail])
                if out is None:
                    return cand
                found[0] += 1
                return out + "." * tail

            def v4(m: re.Match[str]) -> str:
                out = self._ip(ipaddress.IPv4Address, m.group(0))
                if out is None:
                    return m.group(0)
                found[0] += 1
                return out

            if "::" in s or s.count(":") >= 2:
                s = _IPV6.sub(v6, s)
            if "." in s:
                s = _IPV4.sub(v4, s)
            ips = found[0]
        return s, emails, ips
