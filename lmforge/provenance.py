"""Where an artifact came from: code commit, library versions, machine."""
from __future__ import annotations

import functools
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

LIBRARIES = ("lmforge", "prefect", "mlflow", "pydantic", "fsspec", "s3fs", "webdataset", "pyarrow",
             "datasketch", "torch", "transformers", "peft", "trl", "accelerate", "datasets", "lm-eval",
             "deepspeed", "bitsandbytes")


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """Commit of the lmforge checkout, with `-dirty` when it has uncommitted changes; `unknown` outside git."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def environment() -> dict[str, str]:
    return {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine(),
            "host": platform.node()}
