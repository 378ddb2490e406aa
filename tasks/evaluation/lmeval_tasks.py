"""lm-eval tasks for the eval stage (and decontaminate's view of the same tasks).

- `prepare_task_dirs`: copies of task folders with their relative data paths made absolute (lm-eval
  itself resolves them against the working directory, not the YAML's folder);
- `task_manager` / `check_tasks`: every task name known, and every local task's metrics and data columns
  checked, before any model loads;
- `run_tasks`: `lm_eval.simple_evaluate` on an already-loaded model, every seed pinned;
- `flatten_results` / `write_results_json`: lm-eval's results as `{task: {metric: value}}` and as a file.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import yaml

from lmforge.errors import ConfigError, DataError

if TYPE_CHECKING:  # pragma: no cover
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

SHIPPED_TASKS = Path(__file__).resolve().parent.parent.parent / "configs" / "eval_tasks"  # lmforge's own tasks
TASK_FILE_SUFFIXES = (".yaml", ".yml", ".py")  # copied into the work dir; data files stay where they are
TEMPLATE_FIELDS = ("doc_to_text", "doc_to_target", "doc_to_choice")
LOCAL_DATA_SUFFIXES = (".jsonl", ".json")  # data files whose rows check_tasks reads


# ----------------------------------------------------------------------------------------------
# lm-eval task folders


class _FunctionRef(str):
    """A `!function module.fn` value of an lm-eval YAML, kept as written when the YAML is rewritten."""


class _TaskLoader(yaml.SafeLoader):
    pass


class _TaskDumper(yaml.SafeDumper):
    pass


_TaskLoader.add_constructor("!function", lambda loader, node: _FunctionRef(loader.construct_scalar(node)))
_TaskDumper.add_representer(_FunctionRef, lambda dumper, v: dumper.represent_scalar("!function", str(v)))


def prepare_task_dirs(dirs: Sequence[Path], work: Path) -> list[Path]:
    """Copies each task folder's YAML and Python files to `work/<i>-<name>/`, with every relative path
    in `dataset_kwargs.data_files`, `dataset_kwargs.data_dir` and `dataset_path` made absolute against
    the folder of the YAML that wrote it (lm-eval itself resolves them against the working directory).
    Data files are not copied. Returns the copies, in order (later folders win on equal task names)."""
    out = []
    for i, src in enumerate(dirs):
        if not src.is_dir():
            raise DataError(str(src), "task folder does not exist",
                            "Give a folder of lm-eval task YAML files in task_dirs (absolute, or relative to "
                            "the working directory)")
        dst = work / f"{i}-{src.name}"
        for f in sorted(src.rglob("*")):
            rel = f.relative_to(src)
            if not f.is_file() or f.suffix not in TASK_FILE_SUFFIXES or any(
                    p.startswith(".") or p == "__pycache__" for p in rel.parts):
                continue
            target = dst / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if f.suffix == ".py":
                shutil.copyfile(f, target)
            else:
                _write_resolved_yaml(f, target)
        out.append(dst)
    return out


def _write_resolved_yaml(src: Path, dst: Path) -> None:
    text = src.read_text(encoding="utf-8")
    try:
        cfg = yaml.load(text, Loader=_TaskLoader)  # noqa: S506 - a SafeLoader plus the !function tag
    except yaml.YAMLError as e:
        raise DataError(str(src), f"not valid lm-eval task YAML: {e}", "Fix the file") from None
    changed = False
    if isinstance(cfg, dict):
        base = src.parent
        kwargs = cfg.get("dataset_kwargs")
        if isinstance(kwargs, dict):
            for key in ("data_files", "data_dir"):
                if key in kwargs:
                    resolved = _resolve_paths(kwargs[key], base, f"{src}: dataset_kwargs.{key}")
                    changed |= resolved != kwargs[key]
                    kwargs[key] = resolved
        dp = cfg.get("dataset_path")
        if isinstance(dp, str) and "://" not in dp and (dp.startswith(".") or (base / dp).exists()):
            cfg["dataset_path"] = _resolve_paths(dp, base, f"{src}: dataset_path")
            changed |= cfg["dataset_path"] != dp
    if changed:
        header = f"# resolved copy of {src}: relative data paths made absolute by lmforge\n"
        dst.write_text(header + yaml.dump(cfg, Dumper=_TaskDumper, sort_keys=False, allow_unicode=True),
                       encoding="utf-8")
    else:
        dst.write_text(text, encoding="utf-8")


def _resolve_paths(value: Any, base: Path, where: str) -> Any:
    if isinstance(value, dict):
        return {k: _resolve_paths(v, base, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_paths(v, base, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str) or "://" in value:
        return value
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base / path
    if any(c in value for c in "*?["):
        if not list(path.parent.glob(path.name)):
            raise DataError(where, f"{value!r} matches no file (looked for {path})",
                            "Fix the pattern; paths in a task YAML resolve against the YAML's folder")
        return str(path)
    if not path.exists():
        raise DataError(where, f"{value!r} does not exist (looked for {path.resolve()})",
                        "Fix the path; paths in a task YAML resolve against the YAML's folder")
    return str(path.resolve())


def task_manager(include: Sequence[Path], names: Sequence[str], where: str = "tasks") -> "TaskManager":
    """A TaskManager over `include` that knows every name in `names`. lm-eval's built-in index
    (thousands of YAML files, seconds to build) is only added when a name is not in `include`.
    Raises ConfigError naming each unknown task."""
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in include]
    tm = TaskManager(include_path=paths, include_defaults=False)
    if all(n in tm.all_tasks for n in names):
        return tm
    local = tm.all_tasks
    tm = TaskManager(include_path=paths, include_defaults=True)
    problems = []
    for i, n in enumerate(names):
        if n not in tm.all_tasks:
            close = difflib.get_close_matches(n, tm.all_tasks, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{where}[{i}]: lm-eval does not know task {n!r}{hint}. Tasks in the task folders: "
                            f"{', '.join(local) or 'none'}; others come from lm-eval (`lm-eval ls tasks`). Add the "
                            "folder with its YAML to task_dirs, or fix the name")
    if problems:
        raise ConfigError(problems)
    return tm


def check_tasks(tm: "TaskManager", names: Sequence[str], include: Sequence[Path], sources: Sequence[Path]) -> None:
    """Before any model loads: every task from the local folders uses only lm-eval's built-in
    (offline) metrics, and every row of its local JSON data has each column its templates use.
    `include` are the resolved copies of the folders `sources` (errors name the original YAML)."""
    from lm_eval.api import registry
    from lm_eval.tasks._yaml_loader import load_yaml

    if len(registry.metric_registry) == 0:
        import lm_eval.api.metrics  # noqa: F401  (fills the registry)
    roots = [(p.resolve(), src) for p, src in zip(include, sources, strict=True)]
    for name in names:
        entry = tm.task_index.get(name)
        path = getattr(entry, "yaml_path", None)
        origin = next((src / Path(path).resolve().relative_to(r) for r, src in roots
                       if path is not None and Path(path).resolve().is_relative_to(r)), None)
        if origin is None:
            continue  # a group, a Python task or one of lm-eval's own: lm-eval checks those
        cfg = load_yaml(Path(path), resolve_func=False, recursive=True)
        if not isinstance(cfg, dict) or "task" not in cfg:
            continue
        where = f"task {name} ({origin})"
        for m in cfg.get("metric_list") or []:
            metric = m.get("metric") if isinstance(m, dict) else None
            if isinstance(metric, str) and not metric.startswith("/") and metric not in registry.metric_registry:
                raise DataError(where, f"metric {metric!r} is not one of lm-eval's built-in metrics "
                                f"({', '.join(sorted(registry.metric_registry.keys()))})",
                                "lmforge evaluates offline, and other metrics would be fetched from the Hugging "
                                "Face hub; use a built-in metric or a !function")
        if cfg.get("process_docs"):
            continue  # columns may be made by process_docs; lm-eval reports what is missing
        needed = _template_columns(cfg)
        if needed:
            for f in _local_data_files(cfg):
                _check_rows(f, needed, where)


def _template_columns(cfg: dict[str, Any]) -> dict[str, list[str]]:
    """{column: [fields that use it]} for the Jinja templates (and bare column names) of a task."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment()
    out: dict[str, list[str]] = {}
    for field in TEMPLATE_FIELDS:
        value = cfg.get(field)
        if not isinstance(value, str) or isinstance(value, _FunctionRef) or value.startswith("/"):
            continue  # a literal list/dict, or a function (load_yaml gives its absolute path)
        if "{{" in value or "{%" in value:
            cols = meta.find_undeclared_variables(env.parse(value))
        elif field != "doc_to_text" and re.fullmatch(r"[A-Za-z_]\w*", value):
            cols = {value}  # a bare column name (lm-eval also accepts a literal target here; rare)
        else:
            continue
        for c in sorted(cols):
            out.setdefault(c, []).append(field)
    return out


def _local_data_files(cfg: dict[str, Any]) -> list[Path]:
    kwargs = cfg.get("dataset_kwargs") or {}
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    flat: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str):
            flat.append(v)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)

    walk(files)
    return [Path(f) for f in flat if Path(f).is_absolute() and Path(f).suffix in LOCAL_DATA_SUFFIXES
            and Path(f).is_file()]


def _check_rows(path: Path, needed: dict[str, list[str]], where: str) -> None:
    with open(path, encoding="utf-8") as fh:
        if path.suffix == ".json":
            try:
                data = json.load(fh)
            except json.JSONDecodeError:
                return  # lm-eval's loader reports it
            rows = enumerate(data if isinstance(data, list) else [], start=1)
            unit = "item"
        else:
            rows = ((i, json.loads(line)) for i, line in enumerate(fh, start=1) if line.strip())
            unit = "line"
        for i, row in rows:
            if not isinstance(row, dict):
                continue
            for col, fields in needed.items():
                if row.get(col) is None:
                    have = ", ".join(sorted(k for k, v in row.items() if v is not None)) or "none"
                    raise DataError(f"{path}:{i}" if unit == "line" else f"{path} item {i}",
                                    f"{where} uses column {col!r} in {' and '.join(fields)}, which this row does "
                                    f"not have (columns: {have})",
                                    f"Add {col!r} to every row, or change the task's template")


# ----------------------------------------------------------------------------------------------
# running lm-eval


@dataclass
class TaskScores:
    """One model's lm-eval results, flattened: {task: {metric: value}} with `<metric>_stderr` beside
    each metric that has one. Metric names drop lm-eval's `,none` filter suffix; any other filter
    becomes `<metric>_<filter>`."""

    metrics: dict[str, dict[str, float]]
    higher_is_better: dict[str, dict[str, bool]]
    samples: dict[str, dict[str, int]]  # task -> {"original": docs, "effective": evaluated}
    versions: dict[str, Any]
    n_shot: dict[str, Any]
    main_metric: dict[str, str]  # task -> its first metric, for the chart


def run_tasks(lm: "HFLM", tm: "TaskManager", names: Sequence[str], *, num_fewshot: int | None, limit: int | None,
              seed: int, batch_size: int, bootstrap_iters: int, apply_chat_template: bool) -> dict[str, Any]:
    """lm_eval.simple_evaluate on an already-loaded HFLM, every seed pinned to `seed`."""
    import lm_eval

    # lm-eval's bootstrap stderr forks a process pool per metric; inside a pipeline's threads that
    # is slow and can hang, so it runs in-process (same numbers)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    return lm_eval.simple_evaluate(
        model=lm, tasks=list(names), task_manager=tm, num_fewshot=num_fewshot, limit=limit, batch_size=batch_size,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        bootstrap_iters=bootstrap_iters, log_samples=True, apply_chat_template=apply_chat_template)


def metric_name(key: str) -> tuple[str, str, bool]:
    """lm-eval's result key -> (lmforge name, lm-eval metric, is a stderr): "acc,none" -> ("acc", "acc",
    False); "exact_match_stderr,strict-match" -> ("exact_match_strict-match_stderr", "exact_match", True)."""
    metric, _, flt = key.partition(",")
    base = metric.removesuffix("_stderr")
    name = base if flt in ("", "none") else f"{base}_{flt}"
    is_stderr = metric != base
    return safe_name(name + ("_stderr" if is_stderr else "")), base, is_stderr


def safe_name(s: str) -> str:
    """Characters MLflow allows in a metric name path segment (no '/')."""
    return re.sub(r"[^A-Za-z0-9_.\- ]", "_", s)


def flatten_results(results: dict[str, Any]) -> TaskScores:
    metrics: dict[str, dict[str, float]] = {}
    higher: dict[str, dict[str, bool]] = {}
    main: dict[str, str] = {}
    hib = results.get("higher_is_better", {})
    for section in ("results", "groups"):
        for task, vals in (results.get(section) or {}).items():
            t = safe_name(task)
            for key, v in vals.items():
                if "," not in key or isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                    continue  # alias, name, sample_len, "N/A" stderrs
                name, base, is_stderr = metric_name(key)
                metrics.setdefault(t, {})[name] = float(v)
                if is_stderr:
                    continue
                main.setdefault(t, name)
                if base in hib.get(task, {}):
                    higher.setdefault(t, {})[name] = bool(hib[task][base])
    samples = {safe_name(t): {"original": int(s["original"]), "effective": int(s["effective"])}
               for t, s in (results.get("n-samples") or {}).items()}
    return TaskScores(metrics=metrics, higher_is_better=higher, samples=samples,
                      versions={safe_name(t): v for t, v in (results.get("versions") or {}).items()},
                      n_shot={safe_name(t): v for t, v in (results.get("n-shot") or {}).items()}, main_metric=main)


def write_results_json(results: dict[str, Any], path: Path, extra: dict[str, Any]) -> None:
    """lm-eval's results in `path`; its samples, when it logged them, one a line in `<name>.samples.jsonl` beside
    it: each task's document, target, the model's answer as scored (after the task's filters) and its metrics. So
    the eval artifact keeps what each model answered to each held-out question, not only the means."""
    from lm_eval.utils import handle_non_serializable

    samples = results.get("samples") or {}
    body = {**{k: v for k, v in results.items() if k != "samples"}, "lmforge": extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    if samples:
        with open(path.with_name(path.stem + ".samples.jsonl"), "w", encoding="utf-8") as f:
            for task in sorted(samples):
                for smp in samples[task]:
                    row = {"task": task, "doc_id": smp.get("doc_id"), "doc": smp.get("doc"),
                           "target": smp.get("target"), "response": smp.get("filtered_resps"),
                           "metrics": {m: smp.get(m) for m in smp.get("metrics", [])}}
                    f.write(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n")
    path.write_text(json.dumps(body, indent=2, default=handle_non_serializable, ensure_ascii=False), encoding="utf-8")
