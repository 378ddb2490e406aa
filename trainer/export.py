"""A trained model artifact as a standalone folder that plain transformers loads: no peft, no lmforge, no store.

`export_model(folder, out, dtype=...)` writes:
- the weights as safetensors in `dtype`: a full model as it is; an adapter (lora, qlora) applied to its base (an
  earlier stage's artifact, a GGUF file in a package, or the base weights saved beside it) and merged with peft's
  `merge_and_unload`, the same merge `trainer.models.load_trained` does for eval; a reward model stays a sequence
  classifier (`AutoModelForSequenceClassification`);
- the tokenizer with its chat template;
- `generation_config.json` (eos and pad from the tokenizer, greedy) for a generation model;
- with `mlflow=True`, what makes the same folder an MLflow `transformers` model (`write_mlflow_model`): `MLmodel`
  pointing at the folder itself for the weights, `components/tokenizer/`, and the environment files. So one folder
  is both: `AutoModelForCausalLM.from_pretrained(folder)` and `mlflow.pyfunc.load_model(folder)` /
  `mlflow models serve` read it, and a registry version that holds it needs nothing else.

Nothing written names a path of the machine that made it: transformers' and peft's path fields are dropped, and
the export fails (`ExportError`) when a file still holds the source folder's path, the store's work folder or this
Python's prefix. `machine_paths` is that check, for tests and for anything that ships a folder.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from trainer.errors import SettingError
from trainer.models import MODEL_INFO, _dtype, load_trained
from trainer.preference import REWARD_MODEL_KIND, load_reward_model

log = logging.getLogger(__name__)

Dtype = Literal["float32", "bfloat16", "float16"]
#: fields where transformers and peft record the folder a model was loaded from
PATH_FIELDS = ("_name_or_path", "name_or_path", "base_model_name_or_path")


class ExportError(SettingError):
    """An exported folder that would not stand alone: it names a path of this machine."""

    def __init__(self, problem: str):
        super().__init__("export", problem)


def export_model(folder: Path, out: Path, *, dtype: Dtype = "float32", work_dir: Path | None = None,
                 mlflow: bool = False, max_new_tokens: int = 64, uid: str = "") -> dict[str, Any]:
    """Write the standalone model of the model artifact `folder` into `out` (created; must be empty). Returns what
    was written: architecture, dtype, the source's format and method, parameters, and the files. `mlflow`: also the
    MLflow model files (`write_mlflow_model`; `max_new_tokens` is its serving default, `uid` what makes them
    reproducible)."""
    folder, out = Path(folder), Path(out)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SettingError("dtype", f"{dtype!r} is not an export dtype; use float32, bfloat16 or float16")
    if out.exists() and any(out.iterdir()):
        raise SettingError("out", f"{out} is not empty; export into a new folder")
    info = json.loads((folder / MODEL_INFO).read_text()) if (folder / MODEL_INFO).is_file() else {"format": "full"}
    if info.get("kind") == REWARD_MODEL_KIND:
        model, tok = load_reward_model(folder)
        architecture = "sequence_classification"
    else:
        scratch = work_dir or Path(tempfile.mkdtemp(prefix="lmforge-export-"))  # an adapter's base, downloaded
        try:
            model, tok = load_trained(folder, scratch)
        finally:
            if work_dir is None:
                shutil.rmtree(scratch, ignore_errors=True)
        architecture = "causal_lm"
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.do_sample = False  # greedy unless asked: the answers lmforge scored
    model.config.pad_token_id = tok.pad_token_id
    model = model.to(_dtype(dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _drop_path_fields(out)
    if mlflow:
        write_mlflow_model(out, model, tok, architecture=architecture, max_new_tokens=max_new_tokens, uid=uid)
    leaks = machine_paths(out, [folder, *([work_dir] if work_dir else [])])
    if leaks:
        raise ExportError("the exported folder names paths of this machine, so it would not load elsewhere: "
                          + "; ".join(leaks[:5]))
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    log.info("exported %s (%s, %s) to %s: %d files", folder.name, info.get("method", "full"), dtype, out, len(files))
    return {"architecture": architecture, "dtype": dtype, "source_format": info.get("format", "full"),
            "source_method": info.get("method", "full"), "parameters": sum(p.numel() for p in model.parameters()),
            "files": files}


#: what `write_mlflow_model` adds to a standalone folder (besides components/)
MLFLOW_FILES = ("MLmodel", "conda.yaml", "python_env.yaml", "requirements.txt")
#: the packages a server of the model needs, pinned to this environment's versions
SERVING_PACKAGES = ("mlflow", "torch", "transformers", "tokenizers", "safetensors", "accelerate")


def write_mlflow_model(out: Path, model, tok, *, architecture: str, max_new_tokens: int, uid: str) -> list[str]:
    """Make the standalone folder `out` an MLflow `transformers` model as well, with MLflow's own writer:
    - a generation model with a chat template is logged for MLflow's `llm/v1/chat` task: `/invocations` takes
      `{"messages": [...]}` and answers through the tokenizer's chat template, greedily, at most `max_new_tokens`
      (the python_function config: `do_sample: false`; a request's `temperature`, `max_tokens` override it);
      without a chat template, plain `text-generation`;
    - a reward model is a `text-classification` model whose score is the raw reward (`function_to_apply: none`).
    MLflow writes the weights under `model/`; here `MLmodel` points at the folder itself (`model_binary: .`), so
    they are stored once, and the tokenizer goes to `components/tokenizer/` where MLflow's loader reads it. The
    written files do not depend on the clock: `uid` (the export's identity) gives `model_uuid`. Returns the files
    added."""
    import importlib.metadata as md
    import uuid

    import mlflow.transformers
    from huggingface_hub import ModelCard
    from mlflow.models import Model

    causal = architecture == "causal_lm"
    if causal:
        task = "llm/v1/chat" if tok.chat_template else "text-generation"
        config = {"do_sample": False, "max_new_tokens": int(max_new_tokens)}
    else:
        task, config = "text-classification", {"function_to_apply": "none"}
    requirements = [f"{p}=={md.version(p)}" for p in SERVING_PACKAGES]
    with tempfile.TemporaryDirectory(prefix="lmforge-mlflow-") as tmp:
        saved = Path(tmp) / "model"
        # a card given, so MLflow does not look one up on the Hub; lmforge's own card is README.md
        mlflow.transformers.save_model({"model": model, "tokenizer": tok}, path=str(saved), task=task,
                                       model_config=config, pip_requirements=requirements,
                                       model_card=ModelCard("---\nlibrary_name: transformers\n---\n"))
        mm = Model.load(str(saved / "MLmodel"))
        flavor = mm.flavors["transformers"]
        flavor["model_binary"] = "."  # the weights of the folder itself
        flavor.pop("source_model_name", None)  # the path the model was loaded from
        mm.model_uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"lmforge:{uid or out.name}").hex
        mm.utc_time_created = "1970-01-01 00:00:00.000000"  # reproducible: the store records when it was made
        mm.save(str(out / "MLmodel"))
        for name in MLFLOW_FILES[1:]:
            shutil.copyfile(saved / name, out / name)
        shutil.copytree(saved / "components", out / "components")
    return sorted([*MLFLOW_FILES, *(p.relative_to(out).as_posix() for p in (out / "components").rglob("*")
                                    if p.is_file())])


def _drop_path_fields(out: Path) -> None:
    for path in out.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and any(k in data for k in PATH_FIELDS):
            for k in PATH_FIELDS:
                data.pop(k, None)
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def machine_paths(folder: Path, extra: list[Path] = ()) -> list[str]:
    """`file: path` for each file of `folder` holding a path of this machine: `folder` itself, `extra` (the source
    artifact, the work folder) and this Python's prefix (where site-packages, and a GGUF base, live). Generic roots
    such as /tmp are not searched: a code-trained vocabulary may hold them as tokens."""
    roots = {str(Path(p).resolve()) for p in [folder, *extra]} | {str(Path(p)) for p in [folder, *extra]}
    roots |= {sys.prefix, os.path.realpath(sys.prefix)}
    needles = sorted({r for r in roots if r not in ("/", "")}, key=len, reverse=True)
    found = []
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        if path.suffix == ".safetensors":  # weights; their header is JSON of tensor names and shapes only
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        hit = next((n for n in needles if n in text), None)
        if hit:
            found.append(f"{path.relative_to(folder)}: {hit}")
    return found
