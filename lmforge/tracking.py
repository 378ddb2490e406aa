"""The one place that talks to MLflow.

One experiment per pipeline name; a parent run per pipeline run; a nested child run per stage.
Runs are addressed by id through `MlflowClient`, never through the fluent "active run" stack, so
stages running concurrently in threads cannot log into each other's runs. Everything that goes to
MLflow passes through `redact()` first.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from lmforge.owner import process_gone, process_started

log = logging.getLogger(__name__)

SECRET_NAME = re.compile(r"(secret|password|passwd|token|api[_-]?key|access[_-]?key|credential|private[_-]?key)", re.I)
MAX_PARAM = 6000
REDACTED = "***"


def _environ() -> dict[str, str]:
    """A snapshot of os.environ; another thread (MLflow's telemetry) may delete a key while we iterate."""
    for _ in range(100):
        try:
            return dict(os.environ)
        except (KeyError, RuntimeError):  # a key deleted mid-copy, or the mapping changed size: copy again
            continue
    return dict(os.environ)


def _secret_values() -> list[str]:
    return sorted((v for k, v in _environ().items() if SECRET_NAME.search(k) and len(v) >= 6),
                  key=len, reverse=True)


def redact(value: str) -> str:
    """Strip passwords from URLs and any secret environment value from a string."""
    if not isinstance(value, str):
        return value
    if "://" in value and "@" in value:
        try:
            parts = urlsplit(value)
            if parts.password:
                netloc = f"{parts.username}:{REDACTED}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
                value = urlunsplit(parts._replace(netloc=netloc))
        except ValueError:
            pass
    for secret in _secret_values():
        value = value.replace(secret, REDACTED)
    return value


class RedactingFilter(logging.Filter):
    """Logging filter: secret environment values and URL passwords never reach a log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a broken format string is the caller's bug, not ours to hide
            return True
        clean = redact(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        return True


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings -> {"a.b": "value"}, values redacted. Redaction goes by value (secret environment values,
    URL passwords), never by the setting's name: max_length_tokens or pad_token are settings, not secrets (configs
    hold no credentials; those come from the environment)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
            out[key] = redact(s)[:MAX_PARAM]
    return out


@contextlib.contextmanager
def _sqlite_init_lock(uri: str):
    """An exclusive file lock beside a sqlite tracking database while MLflow opens (and maybe creates) it: two
    `lmforge run` starting at once on a fresh mlflow.db both ran MLflow's alembic migration, and one failed
    ("Can't locate revision ... in 'alembic_version'")."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    path = Path(uri.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _process_tags() -> dict[str, str]:
    started = process_started(os.getpid())
    return {"lmforge.host": platform.node(), "lmforge.pid": str(os.getpid()),
            "lmforge.pid_started": f"{started:.3f}" if started else ""}


MODEL_DIR = "model"  # a model version's files, in its MLflow run's artifacts
MODEL_ONLY = "model"  # tag lmforge.contents of a version that holds the model files only
#: The files of a model artifact that make up the model: weights (full or adapter, sharded or not, GGUF), config,
#: tokenizer, chat template and model card (lmforge_model.json, README.md), and an export's MLflow model files
#: (MLmodel, its environment files and components/). Not: checkpoints, manifest, leases, history, or a stage's
#: reports beside the model (ppo's heldout_generations.json).
MODEL_FILE = re.compile(r"(config|generation_config|adapter_config|tokenizer|tokenizer_config|special_tokens_map"
                        r"|added_tokens|vocab|preprocessor_config|lmforge_model)\.json|(model|pytorch_model"
                        r"|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)|(model|pytorch_model)\.(safetensors|bin)"
                        r"\.index\.json|tokenizer\.model|vocab\.txt|merges\.txt|chat_template\.(jinja|json)"
                        r"|README\.md|[^/]+\.gguf|MLmodel|conda\.yaml|python_env\.yaml|requirements\.txt"
                        r"|components/[^/]+/[^/]+")


def model_files(paths: list[str]) -> list[str]:
    """Of an artifact's files (paths relative to it), those of the model (`MODEL_FILE`: top level only, but for an
    MLflow model's components/), sorted."""
    return sorted(p for p in paths if MODEL_FILE.fullmatch(p))


def _local_folder(uri: str) -> Path | None:
    """The local folder of a `file:` (or plain path) artifact URI; None for anything remote."""
    from urllib.parse import urlparse
    from urllib.request import url2pathname

    parts = urlparse(uri)
    if parts.scheme == "file":
        return Path(url2pathname(parts.path))
    return Path(uri) if parts.scheme == "" else None


def registered_model_name(pipeline: str, stage: str) -> str:
    """One registered model per trained stage: `<pipeline>-<stage>` (`models:/demo-sft@champion`)."""
    return f"{pipeline}-{stage}"


#: MLflow 3's experiment kind, which picks the UI's view of the experiment; without it a new experiment of a store
#: with no runs yet may open on the GenAI pages (traces, evaluation runs)
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


class Tracker:
    def __init__(self, uri: str, experiment: str):
        from mlflow.tracking import MlflowClient  # heavy import, paid only when tracking is used

        self.uri = uri
        self.lock = threading.RLock()  # one writer at a time: sqlite stores lock on concurrent writes
        with _sqlite_init_lock(uri):  # two runs creating one new sqlite store race on its schema migration
            self.client = MlflowClient(tracking_uri=uri)
            exp = self.client.get_experiment_by_name(experiment)
        if exp is not None:
            self.experiment_id = exp.experiment_id
        else:
            location = None
            if uri.startswith("sqlite:///"):  # keep run files beside the db, not in the cwd
                location = (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri()
            try:  # the kind opens MLflow's UI on its model-training pages (runs, metrics, compare), not GenAI's
                self.experiment_id = self.client.create_experiment(experiment, artifact_location=location,
                                                                   tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            except Exception:  # created concurrently by another process
                self.experiment_id = self.client.get_experiment_by_name(experiment).experiment_id

    def __getstate__(self) -> dict[str, Any]:  # travels to Dask workers: client and lock are rebuilt there
        return {"uri": self.uri, "experiment_id": self.experiment_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self.uri, self.experiment_id = state["uri"], state["experiment_id"]
        self.lock = threading.RLock()
        self.client = MlflowClient(tracking_uri=self.uri)

    def start_run(self, name: str, tags: dict[str, str], parent_id: str | None = None) -> str:
        with self.lock:
            tags = {k: redact(str(v)) for k, v in tags.items()}
            tags.update(_process_tags())  # which process ends it: a run whose process died is ended by the next run
            if parent_id:
                tags["mlflow.parentRunId"] = parent_id
            run = self.client.create_run(self.experiment_id, run_name=name, tags=tags)
            return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, Any], new_only: bool = False) -> None:
        """`new_only`: skip names the run already has (a run reopened by a retry: MLflow refuses to change a param)."""
        with self.lock:
            from mlflow.entities import Param

            flat = {k[:250]: v for k, v in flatten(params).items()}
            if new_only:
                have = self.client.get_run(run_id).data.params
                flat = {k: v for k, v in flat.items() if k not in have}
            items = [Param(k, v) for k, v in sorted(flat.items())]
            for i in range(0, len(items), 100):
                self.client.log_batch(run_id, params=items[i:i + 100], synchronous=True)

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        with self.lock:
            from mlflow.entities import Metric

            ts = int(time.time() * 1000)
            # MLflow accepts only [A-Za-z0-9_-. :/] in names: e.g. special_tokens/<|im_end|> -> special_tokens/_im_end_
            items = [Metric(re.sub(r"[^A-Za-z0-9_\-. :/]", "_", k), float(v), ts, step)
                     for k, v in sorted(metrics.items())]
            for i in range(0, len(items), 500):
                self.client.log_batch(run_id, metrics=items[i:i + 500], synchronous=True)

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        with self.lock:
            from mlflow.entities import RunTag

            items = [RunTag(k, redact(str(v))[:MAX_PARAM]) for k, v in tags.items()]
            self.client.log_batch(run_id, tags=items, synchronous=True)

    def log_text(self, run_id: str, text: str, path: str) -> None:
        with self.lock:
            self.client.log_text(run_id, redact(text), path)

    def find_runs(self, filter_string: str, max_results: int = 100) -> list[Any]:
        """Runs of this experiment, newest first."""
        with self.lock:
            return self.client.search_runs([self.experiment_id], filter_string, max_results=max_results,
                                           order_by=["attributes.start_time DESC"])

    def reopen_run(self, run_id: str, tags: dict[str, Any], drop_tags: tuple[str, ...] = ()) -> None:
        """A run continued by a retry: RUNNING again, owned by this process, with `tags` set and `drop_tags` gone."""
        with self.lock:
            have = self.client.get_run(run_id).data.tags
            for k in drop_tags:
                if k in have:
                    self.client.delete_tag(run_id, k)
            self.client.update_run(run_id, status="RUNNING")
            self.set_tags(run_id, {**tags, **_process_tags()})

    def log_file(self, run_id: str, local_path: str, artifact_dir: str) -> None:
        with self.lock:
            self.client.log_artifact(run_id, local_path, artifact_dir)

    def ensure_registered_model(self, name: str, tags: dict[str, Any], description: str = "") -> None:
        """Registered model `name` exists, tagged with its pipeline and stage, with `description` up to date."""
        from mlflow.exceptions import MlflowException

        with self.lock:
            model_tags = {k: redact(str(tags[k])) for k in ("lmforge.pipeline", "lmforge.stage") if k in tags}
            try:
                self.client.create_registered_model(name, tags=model_tags, description=description)
            except MlflowException as e:
                if "already exists" not in str(e).lower() and "RESOURCE_ALREADY_EXISTS" not in str(e):
                    raise
                if self.client.get_registered_model(name).description != description:
                    self.client.update_registered_model(name, description=description)

    def register_model(self, name: str, folder: Path, files: list[str], run_id: str, tags: dict[str, Any],
                       description: str = "") -> str:
        """A version of registered model `name` holding the model `files` of `folder` (paths relative to it), once
        per artifact and model: a model-only version with the same lmforge.artifact_id and lmforge.model_digest is
        reused. The files go into run `run_id`'s artifacts under `model/` (`log_model_files`) and the version's
        source is `runs:/<run_id>/model`, so `models:/<name>@<alias>` downloads the model and nothing else. Returns
        the version; aliases are the caller's (`set_alias`)."""
        with self.lock:
            tags = {**{k: redact(str(v))[:MAX_PARAM] for k, v in tags.items()}, "lmforge.contents": MODEL_ONLY}
            self.ensure_registered_model(name, tags, description)
            version = self.model_version(name, tags.get("lmforge.artifact_id", ""),
                                         digest=tags.get("lmforge.model_digest"))
            if version is None:
                source = self.log_model_files(run_id, folder, files)
                version = self.client.create_model_version(name, source=source, run_id=run_id, tags=tags,
                                                           description=description).version
            return str(version)

    def log_model_files(self, run_id: str, folder: Path, files: list[str]) -> str:
        """Put `files` (relative to `folder`) under `model/` in run `run_id`'s artifacts; returns
        `runs:/<run_id>/model`. A run whose artifacts are a local folder (the sqlite store's `mlartifacts/`) gets
        hard links where the file system allows, so the weights are not stored twice; otherwise (an MLflow
        server, object storage) MLflow uploads them."""
        with self.lock:
            dest = _local_folder(self.client.get_run(run_id).info.artifact_uri)
            for rel in files:
                if dest is not None:
                    target = dest / MODEL_DIR / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
                    tmp.unlink(missing_ok=True)
                    try:
                        os.link(folder / rel, tmp)
                    except OSError:  # another file system, or one without hard links: a copy
                        shutil.copyfile(folder / rel, tmp)
                    os.replace(tmp, target)
                else:
                    sub = "/".join([MODEL_DIR, *rel.split("/")[:-1]])
                    self.client.log_artifact(run_id, str(folder / rel), sub)
            return f"runs:/{run_id}/{MODEL_DIR}"

    def model_version(self, name: str, artifact_id: str, digest: str | None = None) -> str | None:
        """The version of registered model `name` made from artifact `artifact_id`, if any: the newest, a
        model-only one first (versions registered before lmforge.contents existed point at the whole artifact
        folder). With `digest`, only a model-only version of those very model files (`lmforge.model_digest`)."""
        from mlflow.exceptions import MlflowException

        with self.lock:
            try:
                versions = self.client.search_model_versions(f"name='{name}'")
            except MlflowException:
                return None
            found = sorted((v.tags.get("lmforge.contents") == MODEL_ONLY, int(v.version)) for v in versions
                           if v.tags.get("lmforge.artifact_id") == artifact_id
                           and (digest is None or (v.tags.get("lmforge.contents") == MODEL_ONLY
                                                   and v.tags.get("lmforge.model_digest") == digest)))
            return str(found[-1][1]) if found else None

    def version_tags(self, name: str, version: str) -> dict[str, str]:
        with self.lock:
            return dict(self.client.get_model_version(name, str(version)).tags)

    def alias_version(self, name: str, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        with self.lock:
            try:
                return str(self.client.get_model_version_by_alias(name, alias).version)
            except MlflowException:
                return None

    def set_alias(self, name: str, alias: str, version: str) -> None:
        with self.lock:
            self.client.set_registered_model_alias(name, alias, str(version))

    def end_runs_of_dead_processes(self) -> list[str]:
        """Runs left RUNNING by a process that died without ending them (kill -9, the OOM killer, a lost node): on
        this host, a run whose process is gone is set KILLED, with a note. Returns their ids."""
        with self.lock:
            running = self.client.search_runs([self.experiment_id], "attributes.status = 'RUNNING'", max_results=1000)
            ended = []
            for r in running:
                t = r.data.tags
                if t.get("lmforge.host") != platform.node() or not t.get("lmforge.pid", "").isdigit():
                    continue
                started = float(t["lmforge.pid_started"]) if t.get("lmforge.pid_started") else None
                if not process_gone(int(t["lmforge.pid"]), started):
                    continue
                self.client.set_tag(r.info.run_id, "lmforge.ended_by",
                                    f"its process {t['lmforge.pid']} on {platform.node()} died without ending it "
                                    "(kill -9?); ended by a later run")
                self.client.set_terminated(r.info.run_id, status="KILLED")
                ended.append(r.info.run_id)
            return ended

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        with self.lock:
            self.client.set_terminated(run_id, status=status)
