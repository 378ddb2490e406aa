"""What the test modules share, as plain functions and constants (the fixtures are in tests/conftest.py).

No test module imports another: what two of them use lives here.
- files and configs: `write_jsonl`, `write_config`, `text_rows`, `basic_config`, `pipeline_config`, lm-eval task
  folders (`write_task_dir`);
- the tiny training setup: a 2-layer Llama built from a config, fast sft settings, the chat and preference sets
  the training tests learn from, and the pipelines of data stages they start from (`train_pipeline`,
  `align_pipeline`);
- running stages in this process, without Prefect: `run_config`, `run_stages`, `run_align`, `ingest`, `run_filter`;
- stopping training: `signal_after_first_checkpoint` runs a stage in a thread and signals its training
  process(es) once a checkpoint is uploaded; `start_training_run` / `assert_stopped_then_resumed` do the same
  through `lmforge run`, for a stop request to the CLI.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from lmforge.config import parse_config
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from lmforge.store import ArtifactStore

REPO = Path(__file__).resolve().parent.parent


def one_thread_per_test(stages: dict[str, dict[str, Any]]) -> dict[str, int]:
    """`{stage: 1}` for each stage of `stages` set to more than one math thread (`cpu_threads`), when the suite runs
    on more than one pytest-xdist worker, else `{}`: there each worker has a core, and a 2-thread training process
    beside the other worker's test waits at every parallel region for its preempted second thread (the demo's sft
    ran 12 minutes and did not finish, against about two alone; docs/results.md#suite). The demo's bands hold for 1
    and 2 threads (bench/demo_sweep.py sweeps both), so a parallel run checks them at 1 and `TEST_WORKERS=0` at the
    shipped settings."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= 1:
        return {}
    return {name: 1 for name, s in stages.items() if int(s.get("cpu_threads") or 1) > 1}


def outside_bands(bands: list[dict[str, Any]], scores: dict[str, Any]) -> list[str]:
    """One line per band of an eval stage's `expect:` that `scores` (the eval artifact's `eval`) misses or lies
    outside of, naming the metric, its value and the band."""
    from bench.demo_sweep import value

    got = {e["metric"]: value(scores, e["metric"]) for e in bands}
    return [f"{e['metric']} = {got[e['metric']]}, band {e.get('min')}..{e.get('max')}" for e in bands
            if got[e["metric"]] is None or not ((e.get("min") is None or got[e["metric"]] >= e["min"]) and
                                                (e.get("max") is None or got[e["metric"]] <= e["max"]))]


# ----------------------------------------------------------------------------------------------
# files and configs


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


# Empty databases, made once per test session and copied where a test starts from nothing: a new MLflow sqlite
# database spends about 2 s in its migrations and a new Prefect home about 8 s, times dozens of tests. The user's
# first run makes its own (the demo test does too), so that path stays covered.
_TEMPLATES: dict[str, Path] = {}


def _template(what: str) -> Path:
    if what not in _TEMPLATES:
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix=f"lmforge-template-{what}-"))
        if what == "mlflow":
            from mlflow.tracking import MlflowClient

            MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
            _TEMPLATES[what] = folder / "mlflow.db"
        else:
            code = ("import asyncio\nfrom prefect.server.database import provide_database_interface\n"
                    "asyncio.run(provide_database_interface().create_db())")
            subprocess.run([sys.executable, "-c", code], env={**os.environ, "PREFECT_HOME": str(folder)},
                           check=True, capture_output=True, timeout=600)
            assert (folder / "prefect.db").is_file(), sorted(folder.iterdir())
            _TEMPLATES[what] = folder / "prefect.db"
    return _TEMPLATES[what]


def mlflow_db(path: Path) -> str:
    """The sqlite URI of the MLflow database `path`, a copy of the session's empty one when it does not exist yet."""
    import shutil

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_template("mlflow"), path)
    return f"sqlite:///{path}"


def prefect_home(path: Path) -> str:
    """`path` as a PREFECT_HOME whose API database is a copy of the session's empty one (when it has none yet)."""
    import shutil

    if not (path / "prefect.db").exists():
        path.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_template("prefect"), path / "prefect.db")
    return str(path)


def stack_port() -> int:
    """A free port of 127.0.0.1 in 33000-40000 for `lmforge stack`: SeaweedFS also takes port + 10000 (gRPC), which
    must stay below the ephemeral range the kernel hands out."""
    import random
    import socket

    while True:
        p = random.randrange(33000, 40000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue


def dask_data_config(tmp: Path, store: str, dask_address: str | None = None, *, name: str = "dask", n: int = 300,
                     partition_records: int = 50, shard_max_count: int | None = None) -> dict[str, Any]:
    """ingest -> filter -> dedup -> shard of `n` texts with exact and near duplicates, on the Dask cluster at
    `dask_address` (or in process): the Dask tests' pipeline."""
    rows = text_rows(n, prefix="alpha beta gamma delta")
    rows += rows[:40] + [{"text": r["text"] + " and one more clause at the end"} for r in rows[40:70]]
    write_jsonl(tmp / "data/text.jsonl", rows)
    shard = {"kind": "shard", "inputs": ["dedup"], "retries": 0}
    if shard_max_count is not None:
        shard["max_count"] = shard_max_count
    return {
        "name": name, "store": str(store), "tracking": mlflow_db(tmp / "mlflow.db"),
        **({"dask_address": dask_address} if dask_address else {}),
        "datasets": {"text": {"path": "data/text.jsonl", "kind": "text"}},
        "stages": {
            "ingest": {"kind": "ingest", "inputs": ["text"], "retries": 0},
            "filter": {"kind": "filter", "inputs": ["ingest"], "retries": 0, "workers": 2,
                       "rules": {"length": {"text": {"min_words": 5}}, "gopher_quality": {"enabled": False},
                                 "gopher_repetition": {"enabled": False}, "c4": {"enabled": False}}},
            "dedup": {"kind": "dedup", "inputs": ["filter"], "retries": 0, "partition_records": partition_records,
                      "workers": 2},
            "shard": shard,
        },
    }


def write_config(dir: Path, cfg: dict[str, Any], name: str = "pipeline.yaml") -> Path:
    path = dir / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def text_rows(n: int, prefix: str = "doc") -> list[dict[str, str]]:
    return [{"text": f"{prefix} number {i}: the quick brown fox jumps over the lazy dog {i * 7919 % 1000}."}
            for i in range(n)]


def pipeline_config(name: str, root: Path, datasets: dict[str, str], stages: dict[str, dict[str, Any]],
                    store: str | None = None) -> dict[str, Any]:
    """A pipeline with its store and MLflow database under `root`; `datasets` maps each name to its data kind, read
    from `root/data/<name>.jsonl`."""
    return {
        "name": name,
        "store": store or str(root / "artifacts"),
        "tracking": mlflow_db(root / "mlflow.db"),
        "datasets": {d: {"path": f"data/{d}.jsonl", "kind": kind} for d, kind in datasets.items()},
        "stages": stages,
    }


def basic_config(tmp: Path, n: int = 50, store: str | None = None, **shard: Any) -> dict[str, Any]:
    """A two-branch pipeline: text and preference data, each ingested then sharded."""
    write_jsonl(tmp / "data" / "text.jsonl", text_rows(n))
    write_jsonl(tmp / "data" / "pairs.jsonl",
                [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(20)])
    return pipeline_config("t", tmp, {"text": "text", "pairs": "preference"}, {
        "ingest": {"kind": "ingest", "inputs": ["text"], "retries": 0},
        "shard": {"kind": "shard", "inputs": ["ingest"], "max_count": 20, "validation_fraction": 0.1,
                  "retries": 0, **shard},
        "ingest_pairs": {"kind": "ingest", "inputs": ["pairs"], "retries": 0},
        "shard_pairs": {"kind": "shard", "inputs": ["ingest_pairs"], "retries": 0},
    }, store=store)


@contextlib.contextmanager
def aws_environment(env: dict[str, str]):
    """`env`'s AWS_* variables set in this process while inside (s3fs takes endpoint and keys from them), and
    s3fs's cached filesystems dropped on the way in and out (a cached one keeps another server's endpoint)."""
    import s3fs

    keys = [k for k in env if k.startswith("AWS_")]
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: env[k] for k in keys})
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()


#: the lm-eval test tasks' rows: every row offers 5 and 7, so a model that always says 7 is right on rows 1-3, one
#: that always says 5 on row 4
TASK_ROWS = [("What is 3 plus 4?", "7", ["5", "7", "9"]), ("What is 2 plus 5?", "7", ["7", "5", "9"]),
             ("What is 6 plus 1?", "7", ["9", "5", "7"]), ("What is 1 plus 4?", "5", ["5", "7", "9"]),
             ("What is 4 plus 5?", "9", ["7", "9", "5"]), ("What is 1 plus 2?", "3", ["3", "5", "7"])]


def write_task_dir(dir: Path, rows=TASK_ROWS, missing_column: str | None = None) -> Path:
    """Three lm-eval tasks (t_mc, t_ll, t_gen) over one jsonl, with data_files relative to the YAML's folder."""
    data = [{"question": q, "answer": a, "choices": c, "label": c.index(a)} for q, a, c in rows]
    if missing_column:
        for r in data:
            r.pop(missing_column)
    write_jsonl(dir / "data" / "rows.jsonl", data)
    common = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data/rows.jsonl\ntest_split: test\n"
              "doc_to_text: \"{{question}}\\nAnswer:\"\nmetadata:\n  version: 2.0\n")
    (dir / "t_mc.yaml").write_text("task: t_mc\n" + common + "output_type: multiple_choice\n"
                                   "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
                                   "metric_list:\n  - metric: acc\n")
    (dir / "t_ll.yaml").write_text("task: t_ll\n" + common + "output_type: loglikelihood\n"
                                   "doc_to_target: \" {{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (dir / "t_gen.yaml").write_text(
        "task: t_gen\n" + common + "output_type: generate_until\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  do_sample: false\n  max_gen_toks: 4\n"
        "metric_list:\n  - metric: exact_match\n    regexes_to_ignore: [\"^\\\\s+\"]\n")
    return dir


# ----------------------------------------------------------------------------------------------
# running stages in this process


def plan_of(raw: dict[str, Any], kinds, root: Path):
    return make_plan(parse_config(raw, kinds, root=root), kinds)


def run_config(raw: dict[str, Any], kinds, root: Path, names: list[str], tracker=None):
    """Plan `raw` and execute the named stages in order, under an MLflow parent run when a tracker is given:
    (plan, {name: what execute_stage returned})."""
    plan = plan_of(raw, kinds, root)
    ctx = RunContext(plan=plan, kinds=kinds, tracker=tracker)
    if tracker is not None:
        ctx.parent_run_id = tracker.start_run("pipeline", {})
    return plan, {n: execute_stage(ctx, n) for n in names}


def artifact(plan, name: str):
    sp = plan.stages[name]
    return plan.store.require(sp.kind, sp.artifact_id)


def ingest(tmp_path: Path, kinds, path, kind="text", stage=None, **dataset):
    """One ingest stage on one dataset: (result, records without their ids, the artifact)."""
    from lmforge.records import iter_records

    raw = {"name": "t", "store": str(tmp_path / "artifacts"),
           "datasets": {"src": {"path": path, "kind": kind, **dataset}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["src"], **(stage or {})}}}
    plan, _ = run_config(raw, kinds, tmp_path, ["ingest"])
    art = artifact(plan, "ingest")
    return art.result, [{k: v for k, v in r.items() if k != "id"} for r in iter_records(art)], art


def publish_records(tmp_path: Path, records: list[dict[str, Any]], kind: str = "text", part_records: int = 100_000):
    """A finished records artifact in a store under tmp_path (JSON written ASCII-escaped, so records
    may hold lone surrogates as an upstream could)."""
    store = ArtifactStore(str(tmp_path / "store"))
    body = json.dumps(records, sort_keys=True).encode()
    aid = hashlib.sha256(body).hexdigest()[:16]
    if store.get("ingest", aid):
        return store.require("ingest", aid)
    staged = tmp_path / f"staged-{aid}"
    (staged / "records").mkdir(parents=True)
    for p in range(0, max(len(records), 1), part_records):
        with open(staged / "records" / f"part-{p // part_records:05d}.jsonl", "w", encoding="ascii") as f:
            for r in records[p:p + part_records]:
                f.write(json.dumps(r) + "\n")
    return store.publish(
        "ingest", aid, staged, {"result": {"records": len(records), "data_kind": kind}, "inputs": []})


def read_jsonl(paths: list[Path]) -> list[dict[str, Any]]:
    out = []
    for p in sorted(paths):
        with open(p, encoding="utf-8") as f:
            out += [json.loads(line) for line in f]
    return out


class FilterRun:
    """A filter stage's result, the records it kept and those it rejected."""

    def __init__(self, result, out: Path):
        self.result, self.out = result, out
        self.kept = read_jsonl(list((out / "records").glob("*.jsonl")))
        self.rejected = read_jsonl(list((out / "rejected").glob("*.jsonl")))

    @property
    def reasons(self) -> dict[str, str]:
        return {r["id"]: r["rule"] for r in self.rejected}


def run_filter(tmp_path: Path, records: list[dict[str, Any]], kind: str = "text", **cfg: Any) -> FilterRun:
    """The filter stage's `run` on `records`, into a fresh folder under tmp_path."""
    from tasks import filter as filt

    src = publish_records(tmp_path, records, kind)
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    out.mkdir()
    config = filt.FilterConfig.model_validate({"kind": "filter", **cfg})
    return FilterRun(filt.run(config, [src], out), out)


# ----------------------------------------------------------------------------------------------
# the tiny training setup: model, data, pipelines

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "tie_word_embeddings": True}
SFT_FAST = {"max_length_tokens": 64, "batch_size_per_device": 8, "learning_rate": 3e-3, "warmup_steps": 2,
            "logging_steps": 1, "retries": 0}
TRAIN_DATA = ["ingest", "shard", "tokenizer"]


def varied_chat(n: int) -> list[dict]:
    """Answers from a few words to a long paragraph, as in Alpaca-style data."""
    import random

    rng = random.Random(1)
    rows = []
    for i in range(n):
        a, b = i % 10, (i * 7 + 3) % 10
        words = " ".join(["and then"] * rng.choice([0, 0, 1, 2, 4, 8, 14]))
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"{a} plus {b} {words} equals {a + b}."}]})
    return rows


def chat_rows(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        a, b = i % 10, (i * 7 + 3) % 10
        rows.append({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                  {"role": "assistant", "content": f"{a} plus {b} equals {a + b}."}]})
    return rows


def train_pipeline(root: Path, stages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The chat set's data stages (ingest, shard, tokenizer), plus the given training stages."""
    return pipeline_config("train", root, {"chat": "chat"}, {
        "ingest": {"kind": "ingest", "inputs": ["chat"], "retries": 0},
        "shard": {"kind": "shard", "inputs": ["ingest"], "validation_fraction": 0.1, "retries": 0},
        "tokenizer": {"kind": "tokenizer", "inputs": ["shard"], "vocab_size": 300, "min_frequency": 1, "retries": 0},
        **stages,
    })


def run_stages(root: Path, kinds, stages: dict[str, dict[str, Any]], names: list[str], tracker=None):
    return run_config(train_pipeline(root, stages), kinds, root, names, tracker)


def chat_store(root: Path, kinds, chat: list[dict[str, Any]]) -> Path:
    """`root` with `chat` as its chat set and train_pipeline's data stages run on it."""
    write_jsonl(root / "data" / "chat.jsonl", chat)
    run_stages(root, kinds, {}, TRAIN_DATA)
    return root


def sft(**over) -> dict[str, Any]:
    return {"kind": "sft", "inputs": ["shard", "tokenizer"], "base_model": {"config": TINY_LLAMA}, **SFT_FAST, **over}


def fact_docs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Text documents of arithmetic facts ("3 plus 4 equals 7."): learnable in a few dozen steps."""
    import random

    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        facts = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(rng.randint(2, 8))]
        docs.append({"text": " ".join(f"{a} plus {b} equals {a + b}." for a, b in facts)})
    return docs


# the preference set: 120 learnable pairs, 6 with chosen == rejected, 5 whose prompt alone is too long
GOOD, IDENTICAL, LONG = 120, 6, 5
ALIGN_DATA = ["ingest", "shard", "tokenizer", "ingest_pairs", "shard_pairs", "sft"]
ALIGN_FAST = {"max_length_tokens": 64, "batch_size_per_device": 8, "warmup_steps": 1, "logging_steps": 1,
              "retries": 0}


def preference_rows() -> list[dict[str, str]]:
    """Chosen: the SFT format with the right sum ("3 plus 4 equals 7."); rejected: a differently worded wrong sum."""
    rows = []
    for i in range(GOOD):
        a, b = i % 10, (i // 10) % 10
        wrong = a + b + 1 + i % 3
        rows.append({"prompt": f"What is {a} plus {b}?", "chosen": f"{a} plus {b} equals {a + b}.",
                     "rejected": f"I think it is {wrong}."})
    for i in range(IDENTICAL):  # nothing to prefer
        rows.append({"prompt": f"What is {i} plus {i}?", "chosen": f"{i} plus {i} equals {2 * i}.",
                     "rejected": f"{i} plus {i} equals {2 * i}."})
    for i in range(LONG):  # the prompt alone is far beyond max_length_tokens
        rows.append({"prompt": " ".join([f"What is {i} plus {i}?"] * 30), "chosen": f"{i} plus {i} equals {2 * i}.",
                     "rejected": f"I think it is {2 * i + 1}."})
    return rows


def align_pipeline(root: Path, stages: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The chat and preference sets' data stages and one full SFT stage, plus the given stages (which may replace
    the SFT)."""
    return pipeline_config("align", root, {"chat": "chat", "pairs": "preference"}, {
        **train_pipeline(root, {})["stages"],
        "ingest_pairs": {"kind": "ingest", "inputs": ["pairs"], "retries": 0},
        "shard_pairs": {"kind": "shard", "inputs": ["ingest_pairs"], "validation_fraction": 0.15, "retries": 0},
        "sft": {"kind": "sft", "inputs": ["shard", "tokenizer"], "base_model": {"config": TINY_LLAMA},
                "method": "full", "max_steps": 12, "evaluate": False, **SFT_FAST},
        **stages,
    })


def run_align(root: Path, kinds, stages: dict[str, dict[str, Any]], names: list[str], tracker=None):
    return run_config(align_pipeline(root, stages), kinds, root, names, tracker)


def align_store(root: Path, kinds, chat: list[dict[str, Any]], pairs: list[dict[str, str]],
                stages: dict[str, dict[str, Any]] | None = None, extra: tuple[str, ...] = ()) -> Path:
    """`root` with its chat and preference sets, and align_pipeline's data stages, the SFT and `extra` run on them."""
    write_jsonl(root / "data" / "chat.jsonl", chat)
    write_jsonl(root / "data" / "pairs.jsonl", pairs)
    run_align(root, kinds, stages or {}, [*ALIGN_DATA, *extra])
    return root


def reward(**over) -> dict[str, Any]:
    return {"kind": "reward", "inputs": ["shard_pairs", "sft"], "learning_rate": 1e-3, **ALIGN_FAST, **over}


def dpo(**over) -> dict[str, Any]:
    return {"kind": "dpo", "inputs": ["shard_pairs", "sft"], "learning_rate": 5e-3, "beta": 0.1, **ALIGN_FAST,
            **over}


def assert_pair_counts(r: dict[str, Any], dropped_key: str) -> None:
    """Exact skip and drop counts of a stage on preference_rows: every record is either used, identical, or too
    long."""
    assert r["train_records"] + r["validation_records"] == GOOD + IDENTICAL + LONG
    assert r["skipped_identical_pairs"] == IDENTICAL
    assert r[dropped_key] == LONG
    assert r["train_pairs"] + r["validation_pairs"] == GOOD
    # the shard stage's split is a seeded hash of the record ids: 111 train and 20 validation records, of which
    # 101 and 19 pairs are used (the 6 identical and 5 too long pairs fall 5 + 5 in train, 1 + 0 in validation)
    assert (r["train_records"], r["validation_records"], r["train_pairs"], r["validation_pairs"]) == (111, 20, 101, 19)


def assert_tuned_model_reloads_and_generates(art, sft_art):
    """A model trained on top of an SFT model reloads (an adapter merged onto that model from the store), answers a
    prompt other than the SFT model does, and generates. Returns its tokenizer."""
    import torch

    from trainer import models

    model, tok = models.load_trained(Path(art.path))
    sft_model, _ = models.load_trained(Path(sft_art.path))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 5?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        assert not torch.allclose(model(**prompt).logits, sft_model(**prompt).logits)
    gen = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > prompt["input_ids"].shape[1]
    return tok


def metric_steps(client, run_id: str, key: str) -> list[tuple[int, float]]:
    """An MLflow metric's history, (step, value) in step order."""
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


# ----------------------------------------------------------------------------------------------
# stopping training: in this process, and through `lmforge run`


def training_processes() -> list[psutil.Process]:
    """Every training process this process started (the one child, or torchrun's agent and its ranks)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "trainer.entry" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def stage_in_thread(plan, kinds, name: str) -> tuple[threading.Thread, list[BaseException]]:
    """Stage `name` of `plan` executing in a started thread, and the list that gets what it raises."""
    errors: list[BaseException] = []

    def attempt():
        try:
            execute_stage(RunContext(plan=plan, kinds=kinds), name)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=attempt)
    t.start()
    return t, errors


def wait_for_checkpoint(plan, name: str, thread: threading.Thread, wait_s: float = 120) -> str:
    """Wait until stage `name` has a complete checkpoint in the store (or its thread ends, or `wait_s` pass);
    returns the stage's checkpoint URI."""
    from trainer import checkpoint

    uri = plan.store.checkpoint_uri(plan.stages[name].kind, plan.stages[name].artifact_id)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and checkpoint.latest_complete(uri) is None and thread.is_alive():
        time.sleep(0.005)
    return uri


def signal_after_first_checkpoint(plan, kinds, name: str, sig: int = signal.SIGKILL, *, processes: int = 1,
                                  wait_s: float = 120) -> tuple[int, list[BaseException]]:
    """Run stage `name` in a thread; once a checkpoint is uploaded, send `sig` to its training process, or with
    `processes` > 1 to all of them at once (torchrun and its ranks: a machine lost, nothing gets to clean up).
    Returns the newest complete checkpoint's step afterwards, and what the stage raised."""
    from trainer import checkpoint

    t, errors = stage_in_thread(plan, kinds, name)
    uri = wait_for_checkpoint(plan, name, t, wait_s)
    procs = training_processes()
    procs = procs if processes > 1 else procs[:1]
    assert len(procs) == processes and checkpoint.latest_complete(uri) is not None, "no checkpoint before the run ended"
    for p in procs:
        p.send_signal(sig)
    t.join(60)
    assert not t.is_alive()
    return checkpoint.latest_complete(uri)[0], errors


def start_cli(cfg: Path, log: Path, *extra: str) -> subprocess.Popen:
    """`lmforge run cfg` in its own session, its output appended to `log`."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(cfg), *extra], cwd=cfg.parent, env=env,
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def start_training_run(tmp_path: Path, max_steps: int = 150) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """`lmforge run` of a tiny sft stage (`max_steps` steps, a checkpoint every 5, retries 1) in `tmp_path`, returned
    once its first checkpoint is uploaded, with the processes it runs then (a training child among them). The stop
    request must come before the training ends."""
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(120))
    stages = {"sft": sft(method="full", max_steps=max_steps, checkpoint_every_steps=5, evaluate=False, retries=1)}
    cfg = write_config(tmp_path, train_pipeline(tmp_path, stages))
    log = tmp_path / "log.txt"
    store = ArtifactStore(str(tmp_path / "artifacts"))

    proc = start_cli(cfg, log)
    deadline = time.monotonic() + 240
    done: list[str] = []
    while time.monotonic() < deadline and not done and proc.poll() is None:
        store.fs.invalidate_cache()
        done = store.fs.glob(f"{store.root}/sft/*/_checkpoints/checkpoint-*/DONE")
        time.sleep(0.05)
    assert done, log.read_text()[-3000:]
    family = psutil.Process(proc.pid).children(recursive=True)
    assert any("trainer.entry" in " ".join(p.cmdline()) for p in family)  # a training child is running
    return proc, family


def assert_stopped_then_resumed(tmp_path: Path, proc: subprocess.Popen, family: list[psutil.Process],
                                cause: str, max_steps: int = 150) -> str:
    """After a stop request (`cause`: SIGTERM, SIGINT, a cancellation through Prefect) to the run that
    `start_training_run` started: it exits 3 leaving no process behind, nothing retried or published, the MLflow
    parent KILLED; then the same command resumes from the checkpoint and finishes. Returns the stopped run's log."""
    from mlflow.tracking import MlflowClient

    log = tmp_path / "log.txt"
    rc = proc.wait(timeout=180)
    out = log.read_text()
    assert rc == 3, out[-3000:]
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert alive == [], [(p.pid, p.cmdline()) for p in alive]  # no trainer, no Prefect server left behind
    assert f"{cause}: stopping. Training process(es)" in out
    assert f"stopped by {cause}" in out and "rerun the same command to resume" in out
    assert out.count("training in a child process") == 1  # not retried (retries: 1 would start a second one)
    store = ArtifactStore(str(tmp_path / "artifacts"))
    sft_dir = store.fs.glob(f"{store.root}/sft/*")[0]
    assert not store.fs.exists(f"{sft_dir}/manifest.json")  # not finished: nothing published
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    parent = [r for r in runs if "lmforge.pipeline" in r.data.tags]
    assert [r.info.status for r in parent] == ["KILLED"]
    assert all(r.info.status != "RUNNING" for r in runs)

    rerun = start_cli(tmp_path / "pipeline.yaml", log, "--json", str(tmp_path / "summary.json"))
    assert rerun.wait(timeout=300) == 0, log.read_text()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stages"]["sft"]["status"] == "ran"
    result = store.require("sft", summary["stages"]["sft"]["artifact_id"]).result
    assert result["resumed_from_step"] > 0  # the step it stopped at: saved on SIGTERM at the end of that step
    assert result["steps"] == max_steps
    return out


def card_cells(card: str, metric: str) -> dict[str, tuple[float, float]]:
    """{model: (value, stderr)} of one row of the card's eval table, read back as numbers."""
    table = [line for line in card.splitlines() if line.startswith("| metric |") or line.startswith(f"| `{metric}` |")]
    names = [c.strip().strip("*") for c in table[0].strip("|").split("|")][1:]
    cells = [c.strip() for c in table[1].strip("|").split("|")][1:]
    return {n: tuple(float(x) for x in c.split(" ± ")) for n, c in zip(names, cells) if c}
