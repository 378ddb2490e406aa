"""decontaminate: remove (or flag) training records that overlap the evaluation sets the pipeline runs.

Records in, records out, same data kind (text, chat or preference records: after ingest, filter or dedup).

Evaluation items come from lm-eval's own task objects, loaded exactly as the eval stage loads them:
lmforge's tasks in `configs/eval_tasks/`, the folders in `task_dirs:`, or any lm-eval task or group name
(`tasks:`). A stage config cannot see the rest of the pipeline, so the task names are not taken from the
eval stages: list the same `tasks:` and `task_dirs:` as the eval stage(s) whose scores should stay clean.
Every document a task evaluates (`task.eval_docs`: its test split, else its validation split; all of them,
whatever an eval stage's `limit:`) becomes one item: `doc_to_text(doc)`, the target delimiter, then the
target (`doc_to_target`; for multiple choice, the text of the correct choice; the first one when a task
gives several answers). Few-shot examples are not evaluated and are not items.

A record's text: text: `text`; chat: its message contents, joined by newlines; preference: the prompt (the
contents of `prompt_messages` when it has them), chosen and rejected, joined by newlines. Joined, a question
in a user turn and its answer in the assistant turn form one run of words, as in the eval item.

Matching (`tasks/overlap.py`, on words normalized as dedup does: NFKC, lowercase, runs of letters and digits):
- `method: ngram` (default): a record is contaminated by a task when it contains any word `ngram`-gram
  (default 13) of one of the task's items. An item shorter than `ngram` words counts as one gram, its whole
  word sequence, if it has at least `min_words` words (default 8); shorter items are never matched.
- `method: minhash`: near matches of whole texts: the record's and the item's word `shingle_words`-gram sets
  (default 5) have Jaccard similarity >= `threshold` (default 0.8), found with MinHash LSH and verified exactly.
  Items under `min_words` words are left out here too.
- `method: both`: either.

`action: remove` (default) drops contaminated records; `action: flag` keeps every record and adds
`"contaminated": [task, ...]` to the contaminated ones. Every other record is copied byte for byte.

Artifact: `records/part-*.jsonl`; `contamination.jsonl`, one row per contaminated record and task:
{record (input index), id, task, method, doc (the eval document index in the task's eval_docs), docs_matched,
and ngram + shared_ngrams (ngram) or jaccard (minhash)}; `report.json` (settings, per-task counts);
`tasks/` (the task YAMLs as lm-eval read them).
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Literal

from pydantic import Field, model_validator

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.errors import ConfigError, DataError
from lmforge.log import Progress
from lmforge.port import Port
from lmforge.records import PartWriter, encode_record, part_names
from lmforge.stage import Result, StageDef, StageRuntime, expect_inputs
from lmforge.store import Artifact, folder_fingerprint
from tasks.overlap import MinHashIndex, NgramIndex
from tasks.evaluation import lmeval_tasks as ev
from tasks.evaluation.lmeval_tasks import SHIPPED_TASKS

if TYPE_CHECKING:  # pragma: no cover
    from lm_eval.api.task import Task

log = logging.getLogger(__name__)

BATCH_RECORDS = 2048  # records matched at once
REPORT_DOCS = 20  # eval document indices listed per contamination row
FLAG_FIELD = "contaminated"


class DecontaminateConfig(StageConfig):
    kind: Literal["decontaminate"] = Field(description="Removes or flags training records that overlap the "
                                           "evaluation tasks' documents (word n-grams, or MinHash near matches).")
    tasks: list[str] = Field(default_factory=list, description="lm-eval task or group names whose documents must "
                             "not be in the training data, e.g. lmforge_arith_mc; with eval_stage, added to that "
                             "stage's tasks.")
    eval_stage: str | None = Field(None, description="An eval stage of this pipeline whose tasks and task_dirs to "
                                   "check against (filled in when the config is read: the id covers the tasks, "
                                   "not the name).")
    task_dirs: list[str] = Field(default_factory=list, description="Extra folders of lm-eval task YAMLs (after "
                                 "lmforge's configs/eval_tasks), relative to the project root, as in the eval stage.")
    action: Literal["remove", "flag"] = Field("remove", description="Drop contaminated records, or keep them with "
                                              f"`{FLAG_FIELD}: [task, ...]` added.")
    method: Literal["ngram", "minhash", "both"] = Field(
        "ngram", description="ngram: the record contains a word n-gram of an eval item; minhash: the record as a "
        "whole nearly equals an eval item (Jaccard of word shingles); both: either.")
    ngram: int = Field(13, ge=1, description="Words per n-gram (method ngram).")
    min_words: int = Field(8, ge=1, description="Eval items with fewer words are never matched; items with "
                           "min_words to ngram - 1 words match as one gram, their whole word sequence.")
    threshold: float = Field(0.8, gt=0, le=1, description="Jaccard similarity at which a record nearly equals an "
                             "eval item (method minhash).")
    shingle_words: int = Field(5, ge=1, description="Words per shingle (method minhash).")
    num_perm: int = Field(128, ge=2, le=4096, description="MinHash permutations (method minhash).")
    seed: int = Field(1, ge=0, description="MinHash seed (method minhash).")
    part_records: int = Field(100_000, gt=0, description="Records per output part file.")

    ORCHESTRATION_FIELDS: ClassVar[frozenset[str]] = StageConfig.ORCHESTRATION_FIELDS | {"eval_stage"}

    @model_validator(mode="after")
    def _some_tasks(self) -> "DecontaminateConfig":
        if not self.tasks and not self.eval_stage:
            raise ValueError("name the eval tasks to check against: eval_stage (an eval stage of this pipeline) "
                             "and/or tasks (lm-eval task names)")
        return self

    @model_validator(mode="after")
    def _short_items(self) -> "DecontaminateConfig":
        if self.min_words > self.ngram:
            raise ValueError(f"min_words ({self.min_words}) is above ngram ({self.ngram}): items of ngram words or "
                             "more match by their n-grams anyway; set min_words to at most ngram")
        return self

    def settings(self) -> dict[str, Any]:
        """Task folders enter as content hashes (as in the eval stage): new eval data gives a new id."""
        s = super().settings()
        s["task_dirs"] = [folder_fingerprint(self.local_path(d)) or d for d in s["task_dirs"]]
        s["shipped_tasks"] = folder_fingerprint(SHIPPED_TASKS) or str(SHIPPED_TASKS)
        return s


class DecontaminateResult(Result):
    data_kind: str
    input_records: int
    records: int  # records written
    dropped: dict[str, int]  # {"contaminated": n} when removing (read by lmforge.records.require_records)
    records_flagged: int  # contaminated records kept with the flag (action flag)
    matches_per_task: dict[str, int]  # task -> contaminated records (a record can count for several tasks)
    eval_docs: dict[str, int]  # task -> documents read
    eval_docs_too_short: dict[str, int]  # task -> documents under min_words words, never matched


# ----------------------------------------------------------------------------------------------
# evaluation items


@dataclass
class EvalItems:
    tasks: list[str]  # leaf task names, sorted
    texts: list[str]  # every item, task after task, in each task's eval_docs order
    task_of: list[int]  # item -> index into tasks
    doc_of: list[int]  # item -> document index within its task


def _leaf_tasks(tree: dict[Any, Any], out: dict[str, "Task"]) -> dict[str, "Task"]:
    """The tasks of get_task_dict's answer, groups flattened."""
    for key, value in tree.items():
        if isinstance(value, dict):
            _leaf_tasks(value, out)
        else:
            out.setdefault(getattr(getattr(value, "config", None), "task", None) or str(key), value)
    return out


def render(task: "Task", doc: dict[str, Any]) -> str:
    """One eval item: the prompt, the target delimiter and the correct answer, as lm-eval builds them."""
    text = task.doc_to_text(doc)
    target = task.doc_to_target(doc)
    if task.OUTPUT_TYPE == "multiple_choice":
        choices = task.doc_to_choice(doc)
        if isinstance(text, int):  # several contexts, one continuation (e.g. winogrande): the correct context
            text = choices[text]
        else:
            if isinstance(target, list):
                target = target[0] if target else ""
            if isinstance(target, int):
                target = choices[target]
    elif isinstance(target, list):
        target = target[0] if target else ""
    return f"{text}{task.config.target_delimiter or ''}{target}"


def load_eval_items(cfg: DecontaminateConfig, work: Path, where: str) -> EvalItems:
    from lm_eval.tasks import get_task_dict

    problems = [f"{where}task_dirs[{i}]: {cfg.local_path(d)} is not a folder. Give a folder of lm-eval task YAML "
                "files, relative to the project root" for i, d in enumerate(cfg.task_dirs)
                if not cfg.local_path(d).is_dir()]
    if problems:
        raise ConfigError(problems)
    sources = [SHIPPED_TASKS, *(cfg.local_path(d) for d in cfg.task_dirs)]
    include = ev.prepare_task_dirs(sources, work)
    tm = ev.task_manager(include, cfg.tasks, where=f"{where}tasks")  # names every unknown task: tasks[i]
    ev.check_tasks(tm, cfg.tasks, include, sources)
    leaves = _leaf_tasks(get_task_dict(list(cfg.tasks), tm), {})
    items = EvalItems(tasks=sorted(leaves), texts=[], task_of=[], doc_of=[])
    for t, name in enumerate(items.tasks):
        task = leaves[name]
        for d, doc in enumerate(task.eval_docs):
            try:
                items.texts.append(render(task, doc))
            except Exception as e:  # a template that does not fit the row
                raise DataError(f"task {name}, document {d}", f"cannot render it ({type(e).__name__}: {e})",
                                "Fix the task's doc_to_text / doc_to_target / doc_to_choice or its data") from None
            items.task_of.append(t)
            items.doc_of.append(d)
    return items


# ----------------------------------------------------------------------------------------------
# records


def record_text(kind: str, rec: dict[str, Any]) -> str:
    if kind == "chat":
        return "\n".join(m["content"] for m in rec["messages"])
    if kind == "preference":
        turns = rec.get("prompt_messages")
        prompt = "\n".join(m["content"] for m in turns) if isinstance(turns, list) and turns else rec["prompt"]
        if prompt != rec["prompt"]:  # both, when an upstream stage made them differ
            prompt = f"{prompt}\n{rec['prompt']}"
        return "\n".join((prompt, rec["chosen"], rec["rejected"]))
    return rec["text"]


def _batches(src: Artifact, kind: str) -> Iterator[tuple[list[bytes], list[dict[str, Any]], list[str]]]:
    """(raw lines, records, texts), BATCH_RECORDS at a time, in input order; each part is checked against the
    manifest as it is read (to its end, before this stage's artifact can be published)."""
    lines: list[bytes] = []
    recs: list[dict[str, Any]] = []
    texts: list[str] = []
    n = 0
    for part in part_names(src):
        with src.open(part) as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                    texts.append(record_text(kind, rec))
                except (ValueError, KeyError, TypeError) as e:
                    raise DataError(f"{src.uri}/{part}: record {n}", f"not a {kind} record ({type(e).__name__}: {e})",
                                    "rerun the stage that produced it (with --force)") from None
                lines.append(raw)
                recs.append(rec)
                n += 1
                if len(lines) == BATCH_RECORDS:
                    yield lines, recs, texts
                    lines, recs, texts = [], [], []
    if lines:
        yield lines, recs, texts


def _rows(g: int, rec: dict[str, Any], items: EvalItems, ngram_hits: list, near_hits: list) -> list[dict[str, Any]]:
    """contamination.jsonl rows of one record: one per task and method, naming the closest document."""
    by_task: dict[tuple[int, str], list] = {}
    for h in ngram_hits:
        by_task.setdefault((items.task_of[h.item], "ngram"), []).append(h)
    for h in near_hits:
        by_task.setdefault((items.task_of[h.item], "minhash"), []).append(h)
    rows = []
    for (t, method), hits in sorted(by_task.items()):
        docs = sorted(items.doc_of[h.item] for h in hits)
        row: dict[str, Any] = {"record": g, "id": rec.get("id"), "task": items.tasks[t], "method": method}
        if method == "ngram":
            best = max(hits, key=lambda h: (h.shared, -h.item))
            row.update(doc=items.doc_of[best.item], ngram=best.gram, shared_ngrams=best.shared)
        else:
            best = max(hits, key=lambda h: (h.jaccard, -h.item))
            row.update(doc=items.doc_of[best.item], jaccard=round(best.jaccard, 6))
        row.update(docs_matched=len(docs), docs=docs[:REPORT_DOCS])
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# the stage


def run(cfg: DecontaminateConfig, inputs: list[Artifact], out: Path,
        runtime: StageRuntime | None = None) -> DecontaminateResult:
    where = f"stages.{runtime.stage}." if runtime else ""
    src = inputs[0]
    kind = str(src.result.get("data_kind") or src.manifest.get("output", {}).get("data_kind") or "")
    if kind not in ("text", "chat", "preference"):
        raise DataError(f"{src.kind} artifact {src.id}", f"holds {kind or 'no'} records",
                        "decontaminate reads text, chat or preference records (the output of ingest, filter or dedup)")
    items = load_eval_items(cfg, out / "tasks", where)
    ngram = NgramIndex(items.texts, cfg.ngram, cfg.min_words) if cfg.method in ("ngram", "both") else None
    near = MinHashIndex(items.texts, cfg.shingle_words, cfg.threshold, cfg.num_perm, cfg.seed, cfg.min_words) \
        if cfg.method in ("minhash", "both") else None
    usable = (ngram or near).usable
    docs = Counter(items.tasks[t] for t in items.task_of)
    short = Counter(items.tasks[t] for t, ok in zip(items.task_of, usable.tolist()) if not ok)
    log.info("decontaminate: %d eval documents from %d task(s) (%s); %d under min_words=%d are not matched%s",
             len(items.texts), len(items.tasks), ", ".join(f"{k}: {v}" for k, v in docs.items()), sum(short.values()),
             cfg.min_words, f"; {ngram.grams} distinct grams of {ngram.lengths} words" if ngram else "")
    for t in items.tasks:
        if docs[t] and short[t] == docs[t]:
            log.warning("decontaminate: every document of task %s is under min_words=%d words, so none can be "
                        "matched; lower min_words to check them", t, cfg.min_words)

    n = contaminated = 0
    per_task: Counter = Counter()
    kept = PartWriter(out, cfg.part_records)
    progress = Progress(log, f"decontaminate {src.kind}/{src.id}", total=int(src.result.get("records", 0)) or None)
    with open(out / "contamination.jsonl", "w", encoding="utf-8") as report:
        for lines, recs, texts in _batches(src, kind):
            interrupt.check("decontaminate")
            ng = ngram.match(texts) if ngram else [[] for _ in texts]
            nh = near.match(texts) if near else [[] for _ in texts]
            for line, rec, a, b in zip(lines, recs, ng, nh):
                rows = _rows(n, rec, items, a, b) if a or b else []
                n += 1
                if not rows:
                    kept.write_line(line)
                    continue
                contaminated += 1
                tasks = sorted({r["task"] for r in rows})
                per_task.update(tasks)
                for r in rows:
                    report.write(json.dumps(r, ensure_ascii=True) + "\n")
                if cfg.action == "flag":
                    kept.write_line(encode_record({**rec, FLAG_FIELD: tasks}))
            progress.update(len(lines))
    kept.close()
    progress.done()
    if not n:
        log.warning("decontaminate: input %s/%s holds no records; writing an empty artifact", src.kind, src.id)

    removing = cfg.action == "remove"
    result = DecontaminateResult(
        data_kind=kind, input_records=n, records=kept.count,
        dropped={"contaminated": contaminated} if removing else {},
        records_flagged=0 if removing else contaminated,
        matches_per_task={t: per_task[t] for t in items.tasks}, eval_docs={t: docs[t] for t in items.tasks},
        eval_docs_too_short={t: short[t] for t in items.tasks})
    report_json = {
        "normalization": "NFKC, lowercase, words = runs of letters and digits (str.isalnum), joined by one space",
        "item": "doc_to_text + target_delimiter + target (multiple choice: the correct choice's text)",
        "settings": cfg.settings(),
        "gram_lengths": ngram.lengths if ngram else None,
        "lsh": {"bands": near.bands, "rows": near.rows} if near else None,
        "counts": result.model_dump(mode="json"),
    }
    (out / "report.json").write_text(json.dumps(report_json, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    log.info("decontaminate: %d of %d records overlap the eval tasks (%s); %s", contaminated, n,
             ", ".join(f"{t}: {c}" for t, c in result.matches_per_task.items()),
             f"kept {kept.count}" if removing else f"flagged them with {FLAG_FIELD!r}")
    return result


def output_port(cfg: DecontaminateConfig, inputs: list[Port]) -> Port:
    return Port("records", expect_inputs(inputs, "decontaminate", count=1, types={"records"}))


def link(name: str, cfg: DecontaminateConfig, stages: dict[str, StageConfig]) -> dict[str, StageConfig]:
    """parse_config's hook: `eval_stage` fills tasks and task_dirs from that eval stage."""
    if cfg.eval_stage is None:
        return {}
    ev = stages.get(cfg.eval_stage)
    if ev is None or ev.kind != "eval":
        have = ", ".join(n for n, s in stages.items() if s.kind == "eval") or "none"
        raise ValueError(f"eval_stage: {cfg.eval_stage!r} is not an eval stage of this pipeline (eval stages: {have})")
    if not ev.tasks:
        raise ValueError(f"eval_stage: eval stage {cfg.eval_stage!r} runs no lm-eval tasks (tasks: []); list tasks "
                         "here instead")
    tasks = [*ev.tasks, *(t for t in cfg.tasks if t not in ev.tasks)]
    dirs = [*ev.task_dirs, *(d for d in cfg.task_dirs if d not in ev.task_dirs)]
    new = cfg.model_copy(update={"tasks": tasks, "task_dirs": dirs})
    new._root = cfg._root
    return {name: new}


STAGE = StageDef(kind="decontaminate", version="1", config=DecontaminateConfig, run=run, output_port=output_port,
                 wants_runtime=True, link=link,
                 description="records -> records without (or flagging) those that overlap the eval tasks' documents",
                 output_type="records")
