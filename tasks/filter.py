"""filter: heuristic quality filtering of records (Gopher, C4), optional language ID and PII masking.

Records in, records out, same data kind. A record is dropped by the first rule it fails, in this
fixed order (names are the keys of `dropped` and the `rule` of each rejected line):

  1. schema            a checked field is missing or not a string (never switched off)
  2. bad_chars         replacement/control characters
  3. min_chars, max_chars, min_words, max_words                        length
  4. language          optional fastText language ID
  5. mean_word_length, hash_ratio, ellipsis_ratio, bullet_lines,       Gopher quality (text only)
     ellipsis_lines, alpha_words, stop_words
  6. dup_para_frac, dup_para_char_frac, dup_line_frac,                 Gopher repetition
     dup_line_char_frac, top_2gram..top_4gram, dup_5gram..dup_10gram
  7. lorem_ipsum, curly_bracket, c4_min_sentences, c4_no_lines_left    C4 (curly and after: text only)

Rules 2-7 drop whole records. The C4 line rules (c4_long_word, c4_terminal_punct,
c4_min_words_per_line, c4_javascript, c4_policy) remove lines from `text` documents and are
counted in `lines_removed`; a document only loses lines if it is kept. PII masking runs last, on
kept records only. Thresholds and their sources are in `tasks/filter_rules.py`.

Per data kind:
- text:       every rule on `text`; C4 line removal rewrites it.
- chat:       each message content whose role is in `chat_roles` (default user, assistant) is a
              checked field; length uses `rules.length.fields` (default: not empty); Gopher quality,
              curly bracket, min sentences and line removal do not apply (short turns, code
              answers); repetition checks only fields of at least `min_words` words; lorem ipsum and
              language apply per field. PII masking covers every message, all roles.
- preference: prompt, chosen and rejected are the checked fields, as for chat.
A record is dropped when any checked field fails; the rules run in order over all fields, so the
reported rule is the earliest one any field fails, and `field` names the first such field.

Dropped records go to `rejected/part-NNNNN.jsonl`: the original record plus `rule` and `field`.
Lone surrogates (not writable as UTF-8) are replaced with U+FFFD in kept records.
With `workers` > 1, chunks of records are filtered in worker processes; the output is identical
for every worker count, in input order.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import signal
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.errors import DataError
from lmforge.log import Progress
from lmforge.port import Port
from lmforge.records import ROLES, PartWriter, RecordWriter, encode_record, iter_part, part_names
from lmforge.stage import Result, StageDef, expect_inputs
from lmforge.store import Artifact
from tasks import filter_rules as fr
from tasks.filter_rewrite import LINE_RULES, PiiMasker, c4_lines

log = logging.getLogger(__name__)

REJECTED_DIR = "rejected"
CHUNK_RECORDS = 500  # records per task handed to a worker process
RULE_ORDER = (
    "schema", "bad_chars", "min_chars", "max_chars", "min_words", "max_words", "language",
    "mean_word_length", "hash_ratio", "ellipsis_ratio", "bullet_lines", "ellipsis_lines", "alpha_words",
    "stop_words", "dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac",
    "top_2gram", "top_3gram", "top_4gram", "dup_5gram", "dup_6gram", "dup_7gram", "dup_8gram", "dup_9gram",
    "dup_10gram", "lorem_ipsum", "curly_bracket", "c4_min_sentences", "c4_no_lines_left",
)


class Rules(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bad_chars: fr.BadCharsRule = Field(default_factory=fr.BadCharsRule, description="Drop mojibake/binary leftovers.")
    length: fr.LengthRule = Field(default_factory=fr.LengthRule, description="Character and word limits per kind.")
    language: fr.LanguageRule = Field(default_factory=fr.LanguageRule, description="Optional language ID.")
    gopher_quality: fr.GopherQualityRule = Field(default_factory=fr.GopherQualityRule,
                                                 description="Gopher quality heuristics (text only).")
    gopher_repetition: fr.GopherRepetitionRule = Field(default_factory=fr.GopherRepetitionRule,
                                                       description="Gopher repetition removal.")
    c4: fr.C4Rule = Field(default_factory=fr.C4Rule, description="C4 line removal and page rules.")


class FilterConfig(StageConfig):
    kind: Literal["filter"] = Field(description="Drops low-quality records by heuristic rules; masks PII.")
    rules: Rules = Field(default_factory=Rules, description="The rule groups; each has `enabled` and thresholds "
                         "(null switches one threshold off).")
    chat_roles: list[Literal["system", "user", "assistant", "tool"]] = Field(
        ["user", "assistant"], min_length=1,
        description="For chat records: the roles whose message contents the rules check.")
    pii: fr.PiiConfig = Field(default_factory=fr.PiiConfig, description="Masking of e-mail and IP addresses.")
    workers: int = Field(1, ge=1, description="Worker processes; does not change the output (not part of the id).")
    part_records: int = Field(100_000, gt=0, description="Records per output part file (kept and rejected).")

    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | {"workers"}


class FilterResult(Result):
    data_kind: str
    input_records: int
    records: int
    dropped: dict[str, int]  # rule -> records it dropped (only rules that dropped some), in rule order
    lines_removed: dict[str, int]
    pii_masked: dict[str, int]
    citations_removed: int
    surrogates_replaced: int


# ----------------------------------------------------------------------------------------------
# the per-record engine (built once per process)

Check = Callable[[fr.Text], "str | None"]


@dataclass
class ChunkResult:
    kept: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)
    lines_removed: Counter = field(default_factory=Counter)
    pii: Counter = field(default_factory=Counter)
    citations: int = 0
    surrogates: int = 0

    def add(self, other: "ChunkResult") -> None:
        self.dropped.update(other.dropped)
        self.lines_removed.update(other.lines_removed)
        self.pii.update(other.pii)
        self.citations += other.citations
        self.surrogates += other.surrogates


class Engine:
    """The rules of one config, composed for one data kind."""

    def __init__(self, cfg: FilterConfig, kind: str):
        if kind not in ("text", "chat", "preference"):
            raise DataError("filter input", f"unknown data kind {kind!r}",
                            "filter reads text, chat or preference records")
        r = cfg.rules
        self.kind = kind
        self.roles = set(cfg.chat_roles)
        checks: list[Check] = []
        if r.bad_chars.enabled:
            checks.append(partial(fr.bad_chars, c=r.bad_chars))
        if r.length.enabled:
            checks.append(partial(fr.length, lim=r.length.text if kind == "text" else r.length.fields))
        if r.language.enabled:
            checks.append(fr.LanguageId(r.language))
        if kind == "text" and r.gopher_quality.enabled:
            checks.append(partial(fr.gopher_quality, c=r.gopher_quality,
                                  stop_re=fr.stop_words_pattern(r.gopher_quality.stop_words)))
        if r.gopher_repetition.enabled:
            checks.append(partial(fr.gopher_repetition, c=r.gopher_repetition))
        if kind != "text" and r.c4.enabled and r.c4.lorem_ipsum:
            checks.append(fr.lorem_ipsum)
        self.checks = checks
        self.c4 = r.c4 if kind == "text" and r.c4.enabled else None
        self.pii = PiiMasker(cfg.pii) if cfg.pii.email or cfg.pii.ip else None

    def _fields(self, rec: dict[str, Any]) -> list[tuple[str, str]] | tuple[str, None]:
        """[(field name, value)] of the checked fields, or (bad field name, None) when the schema is off."""
        if self.kind == "text":
            v = rec.get("text")
            return [("text", v)] if isinstance(v, str) else ("text", None)
        if self.kind == "preference":
            out = []
            for k in ("prompt", "chosen", "rejected"):
                if not isinstance(rec.get(k), str):
                    return k, None
                out.append((k, rec[k]))
            return out
        msgs = rec.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return "messages", None
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                return f"messages[{i}]", None
            if m["role"] in self.roles:
                out.append((f"messages[{i}].content", m["content"]))
        return out

    def process(self, records: list[dict[str, Any]]) -> ChunkResult:
        res = ChunkResult()
        for rec in records:
            fields = self._fields(rec)
            if isinstance(fields, tuple):
                res.dropped["schema"] += 1
                res.rejected.append({**rec, "rule": "schema", "field": fields[0]})
                continue
            texts: list[tuple[str, fr.Text]] = []
            surrogates = 0
            for name, value in fields:
                value, n = fr.replace_surrogates(value)
                surrogates += n
                texts.append((name, fr.Text(value)))
            reject = self._first_failure(texts)
            clean = {name: t.s for name, t in texts}
            if reject is None and self.c4 is not None:
                c4 = c4_lines(clean["text"], self.c4, texts[0][1].lower)
                if c4.reason:
                    reject = (c4.reason, "text")
                else:
                    clean["text"] = c4.text
                    res.lines_removed.update({k: v for k, v in c4.removed.items() if v})
                    res.citations += c4.citations
            if reject is not None:
                res.dropped[reject[0]] += 1
                res.rejected.append({**rec, "rule": reject[0], "field": reject[1]})
                continue
            res.surrogates += surrogates
            res.kept.append(self._output(rec, clean, res))
        return res

    def _first_failure(self, texts: list[tuple[str, fr.Text]]) -> tuple[str, str] | None:
        for check in self.checks:
            for name, t in texts:
                reason = check(t)
                if reason is not None:
                    return reason, name
        return None

    def _mask(self, s: str, res: ChunkResult) -> str:
        if self.pii is None:
            return s
        s, emails, ips = self.pii(s)
        res.pii["email"] += emails
        res.pii["ip"] += ips
        return s

    def _writable(self, s: str, res: ChunkResult) -> str:
        s, n = fr.replace_surrogates(s)
        res.surrogates += n
        return s

    def _output(self, rec: dict[str, Any], clean: dict[str, str], res: ChunkResult) -> dict[str, Any]:
        """The kept record: checked fields as checked (and C4-cleaned), every string field PII-masked."""
        if self.kind != "chat":
            out = {**rec, **{k: self._mask(v, res) for k, v in clean.items()}}
            if isinstance(rec.get("prompt_messages"), list):  # a multi-turn preference prompt's turns (checked as
                out["prompt_messages"] = [{**m, "content": self._mask(self._writable(m["content"], res), res)}
                                          for m in rec["prompt_messages"]]  # `prompt`, their joined text)
            return out
        msgs = []
        for i, m in enumerate(rec["messages"]):
            s = clean.get(f"messages[{i}].content")
            if s is None:  # a role the rules skip: still make it writable
                s = self._writable(m["content"], res)
            msgs.append({**m, "content": self._mask(s, res)})
        return {**rec, "messages": msgs}


_WORKER_ENGINE: Engine | None = None


def _init_worker(cfg: FilterConfig, kind: str) -> None:
    global _WORKER_ENGINE
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the main process decides
    _WORKER_ENGINE = Engine(cfg, kind)


def _work(records: list[dict[str, Any]]) -> ChunkResult:
    assert _WORKER_ENGINE is not None  # set by the pool initializer
    return _WORKER_ENGINE.process(records)


# ----------------------------------------------------------------------------------------------
# the stage


class _RejectWriter:
    """`rejected/part-NNNNN.jsonl`, its folder made with the first rejected record. Escapes what UTF-8 cannot hold,
    so the original record survives as is."""

    def __init__(self, out: Path, part_records: int):
        self.out, self.part_records = out, part_records
        self._parts: PartWriter | None = None

    def write(self, rec: dict[str, Any]) -> None:
        if self._parts is None:
            self._parts = PartWriter(self.out, self.part_records, REJECTED_DIR)
        self._parts.write_line(encode_record(rec))

    def close(self) -> None:
        if self._parts is not None:
            self._parts.close()


def _chunks(src: Artifact) -> Iterator[list[dict[str, Any]]]:
    """The input's records in lists of CHUNK_RECORDS (the last one shorter), each part verified before use."""
    records = (rec for part in part_names(src) for rec in iter_part(src, part))
    while chunk := list(itertools.islice(records, CHUNK_RECORDS)):
        yield chunk


def _results(cfg: FilterConfig, kind: str, src: Artifact) -> Iterator[ChunkResult]:
    """Chunk results in input order; in worker processes when `workers` > 1. A stop request is checked per chunk,
    here, so leaving the `with` ends the pool's workers at once (`Pool.__exit__` terminates them)."""
    workers = cfg.workers
    if workers > 1 and multiprocessing.current_process().daemon:  # e.g. inside a Dask worker
        log.warning("filter runs in a daemonic process, which cannot start a pool: using 1 worker, not %d", workers)
        workers = 1
    if workers == 1:
        engine = Engine(cfg, kind)
        for chunk in _chunks(src):
            interrupt.check("filter")
            yield engine.process(chunk)
        return
    # spawn: forking a process that runs threads (Prefect, MLflow) can deadlock
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(cfg, kind)) as pool:
        pending: deque = deque()
        for chunk in _chunks(src):
            interrupt.check("filter")
            pending.append(pool.apply_async(_work, (chunk,)))
            if len(pending) >= 2 * workers:  # bounded read-ahead keeps memory flat
                yield pending.popleft().get()
        while pending:
            interrupt.check("filter")
            yield pending.popleft().get()


def run(cfg: FilterConfig, inputs: list[Artifact], out: Path) -> FilterResult:
    src = inputs[0]
    kind = src.result.get("data_kind") or src.manifest.get("output", {}).get("data_kind")
    if kind is None:
        raise DataError(f"{src.kind} artifact {src.id}", "its manifest names no data kind",
                        "filter reads records made by ingest (or another records stage)")
    n_in = 0
    totals = ChunkResult()
    progress = Progress(log, f"filter {src.kind}/{src.id}", total=int(src.result.get("records", 0)) or None)
    rejected = _RejectWriter(out, cfg.part_records)
    try:
        with RecordWriter(out, cfg.part_records) as writer:
            for res in _results(cfg, kind, src):
                for rec in res.kept:
                    writer.write(rec)
                for rec in res.rejected:
                    rejected.write(rec)
                totals.add(res)
                n_in += len(res.kept) + len(res.rejected)
                progress.update(len(res.kept) + len(res.rejected))
    finally:
        rejected.close()
    progress.done()
    order = {name: i for i, name in enumerate(RULE_ORDER)}
    dropped = dict(sorted(totals.dropped.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
    kept = n_in - sum(dropped.values())
    if dropped:
        log.info("filter kept %d of %d records; dropped %s", kept, n_in, dropped)
    if n_in and not kept:
        log.warning("filter dropped every record (%s); the next stage will have no data", dropped)
    return FilterResult(
        data_kind=kind, input_records=n_in, records=kept, dropped=dropped,
        lines_removed={k: totals.lines_removed[k] for k in LINE_RULES if totals.lines_removed[k]},
        pii_masked={"email": totals.pii["email"], "ip": totals.pii["ip"]},
        citations_removed=totals.citations, surrogates_replaced=totals.surrogates)


def output_port(cfg: FilterConfig, inputs: list[Port]) -> Port:
    return Port("records", expect_inputs(inputs, "filter", count=1, types={"records"}))


STAGE = StageDef(kind="filter", version="1", config=FilterConfig, run=run, output_port=output_port,
                 description="records -> records: Gopher/C4 quality rules, optional language ID and PII masking",
                 output_type="records")
