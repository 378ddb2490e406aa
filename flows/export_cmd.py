"""`lmforge export` and `lmforge generate`: a trained model out of the store as a standalone folder, and a quick
try of any model with its chat template.

A SOURCE is a model folder on disk (an exported one, a downloaded registry version), `models:/<name>@<alias>` or
`models:/<name>/<version>` (downloaded from the MLflow registry of the config's tracking URI, or of
$MLFLOW_TRACKING_URI), or the id of a model artifact (a unique prefix) in a store: read in place and verified on a
local store, downloaded verified from an object store.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from flows.run_cmd import kinds
from flows.store_cmd import _add_store_args, _store
from lmforge.config import load_config
from lmforge.errors import DataError
from lmforge.store import Artifact


def _source_folder(args: argparse.Namespace, tmp: Path) -> tuple[Path, Artifact | None]:
    """The model folder of SOURCE, and its artifact when it is one in a store."""
    source = args.source
    if Path(source).is_dir():
        return Path(source), None
    if source.startswith("models:/"):
        from mlflow.artifacts import download_artifacts

        if args.config:  # models:/ resolves against the registry of the environment (MLflow 3.17)
            tracking = load_config(args.config, kinds()).tracking_uri
            os.environ["MLFLOW_TRACKING_URI"] = os.environ["MLFLOW_REGISTRY_URI"] = tracking
        return Path(download_artifacts(artifact_uri=source, dst_path=str(tmp / "registry"))), None
    if "/" in source or source.startswith("."):
        raise DataError(f"source {source!r}", "no such folder",
                        "give a model folder, models:/NAME@ALIAS or an artifact id from `lmforge artifacts ls`")
    art = _store(args).find(source)
    if art.store.local:
        art.verify()
        return Path(art.path), art
    return art.download(tmp / art.id), art


def cmd_export(args: argparse.Namespace) -> int:
    from tasks.card import NEWEST
    from tasks.export import make_export
    from trainer.errors import SettingError

    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="lmforge-export-") as tmp:
        folder, art = _source_folder(args, Path(tmp))
        if art is not None and art.kind == "export":  # already standalone: its files as the store has them
            if out.exists() and any(out.iterdir()):
                raise SettingError("out", f"{out} is not empty; export into a new folder")
            art.download(out)
            got = {**art.result, "files": sorted(art.files)}
        else:
            got = make_export(art if art is not None else folder, out, dtype=args.dtype,
                              max_new_tokens=args.max_new_tokens, evaluation=NEWEST,
                              intended_use=args.intended_use or "", license=args.license)
    print(f"exported {args.source} ({got['source_method']}, {got['architecture']}, {got['dtype']}) to {args.out}: "
          f"{', '.join(got['files'])}")
    return 0


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.json is None:
        if args.prompt is None:
            raise DataError("prompt", "none given", "give a PROMPT, or --json FILE with one prompt a line (a JSON "
                            "string, or an object with a 'prompt' field)")
        return [args.prompt]
    prompts = []
    for n, line in enumerate(Path(args.json).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{args.json}, line {n}", f"not JSON ({e.msg})",
                            "write one prompt a line, as a JSON string or an object with a 'prompt' field") from None
        prompt = row.get("prompt") if isinstance(row, dict) else row
        if not isinstance(prompt, str):
            raise DataError(f"{args.json}, line {n}", "no prompt",
                            "write a JSON string or an object with a 'prompt' field")
        prompts.append(prompt)
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from trainer.generations import generate
    from trainer.models import load_trained

    prompts = _prompts(args)
    with tempfile.TemporaryDirectory(prefix="lmforge-generate-") as tmp:
        folder, _ = _source_folder(args, Path(tmp))
        model, tok = load_trained(folder, Path(tmp) / "work")
    answers = generate(model, tok, prompts, args.max_new_tokens)  # the greedy answers lmforge's reports show
    if args.json is None:
        print(answers[0])
    else:
        for p, a in zip(prompts, answers):
            sys.stdout.write(json.dumps({"prompt": p, "answer": a}) + "\n")
    return 0


def add_parsers(sub) -> None:
    e = sub.add_parser("export", help="write a trained model as a standalone folder (adapters merged, safetensors, "
                                      "tokenizer with chat template, generation config, model card, MLflow model) "
                                      "that plain transformers and MLflow load")
    e.add_argument("source", help="artifact id (or prefix), models:/NAME@ALIAS, or a model folder")
    e.add_argument("out", help="the folder to write (new or empty)")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the exported weights (default float32)")
    e.add_argument("--intended-use", help="the model card's intended use and limits (an artifact source gets a card)")
    e.add_argument("--license", default="unknown", help="the model card's license (default: unknown)")
    e.add_argument("--max-new-tokens", type=int, default=64,
                   help="longest answer the MLflow model serves by default (default 64)")
    _add_store_args(e)
    e.set_defaults(fn=cmd_export)

    g = sub.add_parser("generate", help="answer a prompt with a model, greedily, through its chat template")
    g.add_argument("source", help="artifact id (or prefix), models:/NAME@ALIAS, or a model folder")
    g.add_argument("prompt", nargs="?", help="the question (one user turn)")
    g.add_argument("--json", metavar="FILE", help="answer every prompt of FILE (one a line: a JSON string or "
                                                   "{\"prompt\": ...}); prints one JSON object a line")
    g.add_argument("--max-new-tokens", type=int, default=32, help="longest answer in tokens (default 32)")
    _add_store_args(g)
    g.set_defaults(fn=cmd_generate)
