"""decontaminate: planted eval documents are found in chat, text and preference records, through real lm-eval
task objects (a local task folder and the shipped configs/eval_tasks), and removed or flagged; clean records
pass byte for byte; the report names each match; bad task names and folders fail naming the config field.

One pipeline (ingest x3, decontaminate x6) runs once for the module; each test reads its stage's artifact.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lmforge.config import parse_config
from lmforge.errors import ConfigError
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from tasks import decontaminate as dc
from tasks import eval as eval_stage
from tests.helpers import text_rows, write_jsonl

# the local task: questions long enough for 13-grams
QUIZ = [
    ("Which river flows through the ancient city of Florence before reaching the Ligurian Sea near Pisa?", "The Arno"),
    ("What is the name of the longest bone in the human body, found in the upper leg?", "The femur"),
    ("Which scientist proposed the three laws of motion and the law of universal gravitation in the Principia?",
     "Isaac Newton"),
    ("In which year did the first human landing on the Moon take place during the Apollo program?", "1969"),
]
ARITH = Path(__file__).resolve().parent.parent / "configs" / "eval_tasks" / "data" / "arith_test.jsonl"


def chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


CHAT = [
    chat("Tell me a joke about cats.", "Why did the cat sit on the computer? To keep an eye on the mouse."),
    chat(QUIZ[2][0], "Isaac Newton, in 1687."),  # quiz doc 2 verbatim: shares its 13-grams 1..5
    chat("Tell me: which scientist proposed the three laws of motion and the law of thermodynamics?",
         "Nobody did."),  # 12 words in a row from quiz doc 2, never 13: clean
    chat("What is 44 plus 1?", "Answer: 45"),  # lmforge_arith_mc with its correct choice: 7 words
    chat("What is 44 plus 1?", "Answer: 55"),  # a wrong choice: clean
    chat("Write a haiku about autumn leaves.", "Red leaves drift and fall / the wind carries them away / "
         "winter waits nearby"),
]
PREFERENCE = [
    # a near duplicate of quiz doc 0's item ("Question: ...?\nAnswer: The Arno"): Jaccard 15/18 of word 5-grams
    {"prompt": f"{QUIZ[0][0]} Answer:", "chosen": "The Arno.", "rejected": "The Po."},
    {"prompt": "Name a primary colour.", "chosen": "Blue.", "rejected": "Purple, I think."},
    # quiz doc 1 inside a long record: contained (n-grams), not near equal (Jaccard)
    {"prompt": "Here is a long exam with many questions about anatomy, history and geography for first-year "
               f"students who prepare for the finals. The first one: {QUIZ[1][0]}",
     "chosen": "It is the femur, which is also the strongest bone; the tibia and fibula are in the lower leg.",
     "rejected": "The humerus."},
]


def words(s: str) -> list[str]:
    return re.findall(r"[^\W_]+", s.lower())


def jaccard5(a: str, b: str) -> float:
    """Word 5-gram Jaccard, computed here without tasks/minhash.py."""
    def grams(s: str) -> set[tuple[str, ...]]:
        w = words(s)
        return {tuple(w[i:i + 5]) for i in range(len(w) - 4)}
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def write_quiz_dir(d: Path, rows=QUIZ) -> Path:
    write_jsonl(d / "data" / "quiz.jsonl", [{"question": q, "answer": a} for q, a in rows])
    (d / "quiz_gen.yaml").write_text(
        "task: quiz_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data/quiz.jsonl\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
        "metric_list:\n  - metric: exact_match\nmetadata:\n  version: 1.0\n")
    return d


def pipeline(tmp: Path) -> dict:
    write_quiz_dir(tmp / "quiz")
    write_jsonl(tmp / "data" / "chat.jsonl", CHAT)
    write_jsonl(tmp / "data" / "text.jsonl", text_rows(30))
    write_jsonl(tmp / "data" / "pairs.jsonl", PREFERENCE)
    quiz = {"tasks": ["quiz_gen"], "task_dirs": ["quiz"], "retries": 0}
    return {
        "name": "decon", "store": str(tmp / "artifacts"), "tracking": f"sqlite:///{tmp / 'mlflow.db'}",
        "datasets": {"chat": {"path": "data/chat.jsonl", "kind": "chat"},
                     "text": {"path": "data/text.jsonl", "kind": "text"},
                     "pairs": {"path": "data/pairs.jsonl", "kind": "preference"}},
        "stages": {
            "ingest_chat": {"kind": "ingest", "inputs": ["chat"], "retries": 0},
            "ingest_text": {"kind": "ingest", "inputs": ["text"], "retries": 0},
            "ingest_pairs": {"kind": "ingest", "inputs": ["pairs"], "retries": 0},
            "remove": {"kind": "decontaminate", "inputs": ["ingest_chat"], **quiz,
                       "tasks": ["quiz_gen", "lmforge_arith_mc"], "min_words": 7},
            "flag": {"kind": "decontaminate", "inputs": ["ingest_chat"], **quiz,
                     "tasks": ["quiz_gen", "lmforge_arith_mc"], "min_words": 7, "action": "flag"},
            "defaults": {"kind": "decontaminate", "inputs": ["ingest_chat"], "tasks": ["lmforge_arith_mc"],
                         "retries": 0},
            "clean": {"kind": "decontaminate", "inputs": ["ingest_text"], **quiz},
            "near": {"kind": "decontaminate", "inputs": ["ingest_pairs"], **quiz, "method": "minhash"},
            "both": {"kind": "decontaminate", "inputs": ["ingest_pairs"], **quiz, "method": "both"},
        },
    }


def run_stages(tmp: Path, raw: dict, kinds, names: list[str] | None = None):
    plan = make_plan(parse_config(raw, kinds, root=tmp), kinds)
    ctx = RunContext(plan=plan, kinds=kinds, tracker=None, parent_run_id=None)
    for n in names or list(plan.stages):
        execute_stage(ctx, n)
    return plan


@pytest.fixture(scope="module")
def ran(tmp_path_factory, kinds_module):
    tmp = tmp_path_factory.mktemp("decon")
    plan = run_stages(tmp, pipeline(tmp), kinds_module)
    return tmp, plan


def artifact(plan, name: str):
    sp = plan.stages[name]
    return plan.store.get(sp.kind, sp.artifact_id)


def lines(art) -> list[bytes]:
    return b"".join((Path(art.path) / p).read_bytes() for p in sorted(art.files) if p.startswith("records/")) \
        .splitlines(keepends=True)


def report(art) -> list[dict]:
    return [json.loads(x) for x in (Path(art.path) / "contamination.jsonl").read_text().splitlines()]


def arith_docs(question: str) -> list[int]:
    rows = [json.loads(x) for x in ARITH.read_text().splitlines()]
    return [i for i, r in enumerate(rows) if r["question"] == question]


# ----------------------------------------------------------------------------------------------


def test_removes_planted_eval_documents(ran):
    _, plan = ran
    src, art = artifact(plan, "ingest_chat"), artifact(plan, "remove")
    before = lines(src)
    ids = [json.loads(x)["id"] for x in before]
    held_out = arith_docs("What is 44 plus 1?")
    assert held_out  # the shipped data has it
    assert lines(art) == [before[i] for i in (0, 2, 4, 5)]  # the rest byte for byte, in order
    assert art.result == {
        "data_kind": "chat", "input_records": 6, "records": 4, "dropped": {"contaminated": 2}, "records_flagged": 0,
        "matches_per_task": {"lmforge_arith_mc": 1, "quiz_gen": 1},
        "eval_docs": {"lmforge_arith_mc": 144, "quiz_gen": 4},
        "eval_docs_too_short": {"lmforge_arith_mc": 0, "quiz_gen": 0}}
    assert art.manifest["output"] == {"type": "records", "data_kind": "chat"}
    assert report(art) == [
        {"record": 1, "id": ids[1], "task": "quiz_gen", "method": "ngram", "doc": 2,
         "ngram": "which scientist proposed the three laws of motion and the law of universal",
         "shared_ngrams": 5, "docs_matched": 1, "docs": [2]},
        {"record": 3, "id": ids[3], "task": "lmforge_arith_mc", "method": "ngram", "doc": held_out[0],
         "ngram": "what is 44 plus 1 answer 45", "shared_ngrams": 1, "docs_matched": len(held_out),
         "docs": held_out}]
    rep = json.loads((Path(art.path) / "report.json").read_text())
    assert rep["gram_lengths"] == [7, 13] and rep["counts"] == art.result


def test_flag_keeps_every_record_and_marks_the_contaminated(ran):
    _, plan = ran
    before, after = lines(artifact(plan, "ingest_chat")), lines(artifact(plan, "flag"))
    art = artifact(plan, "flag")
    assert len(after) == 6
    for i in (0, 2, 4, 5):
        assert after[i] == before[i]
    assert json.loads(after[1]) == {**json.loads(before[1]), "contaminated": ["quiz_gen"]}
    assert json.loads(after[3]) == {**json.loads(before[3]), "contaminated": ["lmforge_arith_mc"]}
    assert art.result["records"] == 6 and art.result["records_flagged"] == 2 and art.result["dropped"] == {}
    assert [(r["record"], r["task"]) for r in report(art)] == [(1, "quiz_gen"), (3, "lmforge_arith_mc")]
    # the same matches as removing: only the action differs
    assert report(art) == report(artifact(plan, "remove"))
    assert plan.stages["flag"].artifact_id != plan.stages["remove"].artifact_id


def test_shipped_arith_items_are_under_the_default_min_words(ran):
    """'What is 44 plus 1?\\nAnswer: 45' is 7 words: with min_words 8 (the default) no arith item is matched."""
    _, plan = ran
    art = artifact(plan, "defaults")
    assert lines(art) == lines(artifact(plan, "ingest_chat"))
    assert art.result["eval_docs_too_short"] == {"lmforge_arith_mc": 144}
    assert art.result["matches_per_task"] == {"lmforge_arith_mc": 0} and art.result["dropped"] == {"contaminated": 0}
    assert report(art) == []


def test_clean_data_passes_untouched(ran):
    _, plan = ran
    src, art = artifact(plan, "ingest_text"), artifact(plan, "clean")
    assert [p for p in art.files if p.startswith("records/")] == ["records/part-00000.jsonl"]
    assert lines(art) == lines(src) and len(lines(src)) == 30
    assert art.files["records/part-00000.jsonl"]["sha256"] == src.files["records/part-00000.jsonl"]["sha256"]
    assert art.result["dropped"] == {"contaminated": 0} and art.result["matches_per_task"] == {"quiz_gen": 0}
    assert report(art) == []


def test_minhash_finds_the_near_duplicate_only(ran):
    _, plan = ran
    src, art = artifact(plan, "ingest_pairs"), artifact(plan, "near")
    before = lines(src)
    item = f"Question: {QUIZ[0][0]}\nAnswer: {QUIZ[0][1]}"
    expected = jaccard5(item, "\n".join(PREFERENCE[0][k] for k in ("prompt", "chosen", "rejected")))
    assert expected == pytest.approx(15 / 18)
    rows = report(art)
    assert rows == [{"record": 0, "id": json.loads(before[0])["id"], "task": "quiz_gen", "method": "minhash",
                     "doc": 0, "jaccard": round(expected, 6), "docs_matched": 1, "docs": [0]}]
    assert lines(art) == before[1:]  # the long record that contains doc 1 is no near duplicate of it
    assert art.result["matches_per_task"] == {"quiz_gen": 1}
    rep = json.loads((Path(art.path) / "report.json").read_text())
    assert rep["lsh"]["bands"] * rep["lsh"]["rows"] <= 128


def test_both_methods_report_each(ran):
    _, plan = ran
    art = artifact(plan, "both")
    assert [(r["record"], r["method"], r["doc"]) for r in report(art)] == [
        (0, "minhash", 0), (0, "ngram", 0), (2, "ngram", 1)]
    assert lines(art) == lines(artifact(plan, "ingest_pairs"))[1:2]
    assert art.result["matches_per_task"] == {"quiz_gen": 2} and art.result["dropped"] == {"contaminated": 2}
    metrics = dc.DecontaminateResult.model_validate(art.result).metrics()
    assert metrics["matches_per_task/quiz_gen"] == 2.0 and metrics["dropped/contaminated"] == 2.0


def test_ids_follow_the_eval_data(ran, kinds):
    """A changed task file gives a new id (its folder enters as a content hash); the same config the same id."""
    tmp, plan = ran
    raw = pipeline(tmp)
    again = make_plan(parse_config(raw, kinds, root=tmp), kinds)
    assert again.stages["clean"].artifact_id == plan.stages["clean"].artifact_id
    assert again.stages["clean"].action == "cached"
    write_quiz_dir(tmp / "quiz", QUIZ[:3])
    try:
        changed = make_plan(parse_config(raw, kinds, root=tmp), kinds)
        assert changed.stages["clean"].artifact_id != plan.stages["clean"].artifact_id
        assert changed.stages["defaults"].artifact_id == plan.stages["defaults"].artifact_id  # reads no quiz
    finally:
        write_quiz_dir(tmp / "quiz")
    assert dc.SHIPPED_TASKS == eval_stage.SHIPPED_TASKS


def test_bad_task_names_and_folders_name_the_field(ran, kinds):
    tmp, _ = ran
    raw = pipeline(tmp)
    raw["stages"] = {"ingest_text": raw["stages"]["ingest_text"],
                     "decon": {"kind": "decontaminate", "inputs": ["ingest_text"], "retries": 0,
                               "tasks": ["quiz_gen", "quiz_gem"], "task_dirs": ["quiz"]}}
    with pytest.raises(ConfigError, match=r"stages\.decon\.tasks\[1\]: lm-eval does not know task 'quiz_gem' "
                                          r"\(did you mean 'quiz_gen'\?\)"):
        run_stages(tmp, raw, kinds, ["decon"])
    raw["stages"]["decon"].update(tasks=["quiz_gen"], task_dirs=["quiz", "no_such_dir"])
    with pytest.raises(ConfigError, match=r"stages\.decon\.task_dirs\[1\]: .*no_such_dir is not a folder"):
        run_stages(tmp, raw, kinds, ["decon"])
    raw["stages"]["decon"].update(task_dirs=["quiz"], min_words=20)
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds, root=tmp)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("stages.decon: ")
    assert "min_words (20) is above ngram (13)" in e.value.problems[0]
    raw["stages"]["decon"].update(min_words=8, tasks=[])
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds, root=tmp)
    assert [p.split(":")[0] for p in e.value.problems] == ["stages.decon"]
    assert "name the eval tasks to check against: eval_stage" in e.value.problems[0]
    raw["stages"]["decon"].update(eval_stage="decon")
    with pytest.raises(ConfigError, match=r"stages\.decon\.eval_stage: 'decon' is not an eval stage of this "
                                          r"pipeline \(eval stages: none\)"):
        parse_config(raw, kinds, root=tmp)


def test_eval_stage_supplies_the_tasks_and_the_id_covers_them(ran, kinds):
    """`eval_stage:` takes the eval stage's tasks and task_dirs (the pipeline's own eval suite); the id is that of
    the same tasks listed by hand."""
    tmp, plan = ran
    raw = pipeline(tmp)
    by_hand = dict(raw["stages"]["clean"])
    raw["stages"]["ev"] = {"kind": "eval", "models": [{"name": "m", "base": "models/none"}],
                           "tasks": by_hand["tasks"], "task_dirs": by_hand["task_dirs"]}
    raw["stages"]["clean"] = {k: v for k, v in by_hand.items() if k not in ("tasks", "task_dirs")} | {"eval_stage": "ev"}
    cfg = parse_config(raw, kinds, root=tmp)
    assert (cfg.stages["clean"].tasks, cfg.stages["clean"].task_dirs) == (by_hand["tasks"], by_hand["task_dirs"])
    again = make_plan(cfg, kinds)
    assert again.stages["clean"].artifact_id == plan.stages["clean"].artifact_id
    assert again.stages["clean"].action == "cached"
