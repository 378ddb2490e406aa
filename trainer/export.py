"""A trained model artifact as a standalone folder that plain transformers loads: no peft, no lmforge, no store.

`export_model(folder, out, dtype=...)` writes:
- the weights as safetensors in `dtype`: a full model as it is; an adapter (lora, qlora) applied to its base (an
  earlier stage's artifact, a GGUF file in a package, or the base weights saved beside it) and merged with peft's
  `merge_and_unload`, the same merge `trainer.models.load_trained` does for eval; a reward model stays a sequence
  classifier (`AutoModelForSequenceClassification`);
- the tokenizer with its chat template;
- `generation_config.json` (eos and pad from the tokenizer) for a generation model.

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


def export_model(folder: Path, out: Path, *, dtype: Dtype = "float32", work_dir: Path | None = None) -> dict[str, Any]:
    """Write the standalone model of the model artifact `folder` into `out` (created; must be empty). Returns what
    was written: architecture, dtype, the source's format and method, and the files."""
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
    model.config.pad_token_id = tok.pad_token_id
    model = model.to(_dtype(dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _drop_path_fields(out)
    leaks = machine_paths(out, [folder, *([work_dir] if work_dir else [])])
    if leaks:
        raise ExportError("the exported folder names paths of this machine, so it would not load elsewhere: "
                          + "; ".join(leaks[:5]))
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    log.info("exported %s (%s, %s) to %s: %d files", folder.name, info.get("method", "full"), dtype, out, len(files))
    return {"architecture": architecture, "dtype": dtype, "source_format": info.get("format", "full"),
            "source_method": info.get("method", "full"), "files": files}


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
