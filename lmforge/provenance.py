"""Where an artifact came from: code commit, library versions, machine (python, torch, CUDA, GPUs, CPU, host)."""
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
    """Commit of the lmforge checkout, with `-dirty` when it has uncommitted changes. Looked up where the code was
    imported from, then in the working directory (a deployment's pull step moves there: the checkout it runs);
    `$LMFORGE_GIT_COMMIT` when neither is a git checkout (an image built without .git); else `unknown`, and a
    warning says why."""
    import logging
    import os

    why = []
    for where in dict.fromkeys((Path(__file__).resolve().parent, Path.cwd())):
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                                 timeout=10)
            if sha.returncode != 0:
                why.append(f"{where}: {sha.stderr.strip().splitlines()[-1] if sha.stderr.strip() else sha.returncode}")
                continue
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return sha.stdout.strip() + ("-dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError) as e:
            why.append(f"{where}: {type(e).__name__}: {e}")
    if os.environ.get("LMFORGE_GIT_COMMIT"):
        return os.environ["LMFORGE_GIT_COMMIT"]
    logging.getLogger(__name__).warning(
        "git commit unknown (%s); run from a git checkout, or set LMFORGE_GIT_COMMIT (e.g. in a Docker image)",
        "; ".join(why))
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


#: what a resumed training compares with the machine that made its checkpoint
RESUME_KEYS = ("python", "torch", "cuda", "gpu", "gpu_count", "machine", "cpu", "host")


def environment() -> dict[str, str]:
    """Where this process runs: python, torch and CUDA versions, GPU name and count, CPU architecture
    (platform.machine()) and model, OS, host. Every manifest and MLflow run records it (`lmforge.env.*`).
    Computed once per process; torch is imported on the first call only."""
    return dict(_environment())


@functools.lru_cache(maxsize=1)
def _environment() -> dict[str, str]:
    return {"python": sys.version.split()[0], **_torch(), "machine": platform.machine(), "cpu": _cpu_model(),
            "platform": platform.platform(), "host": platform.node()}


def _torch() -> dict[str, str]:
    try:
        import torch
    except ImportError:
        return {"torch": "not installed", "cuda": "none", "gpu": "none", "gpu_count": "0"}
    out = {"torch": torch.__version__, "cuda": torch.version.cuda or "none", "gpu": "none", "gpu_count": "0"}
    try:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            names = [torch.cuda.get_device_name(i) for i in range(n)]
            out.update(gpu=", ".join(dict.fromkeys(names)), gpu_count=str(n))
    except Exception as e:  # noqa: BLE001  a broken driver must not stop a run from being recorded
        out["gpu"] = f"unknown ({type(e).__name__})"
    return out


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform knows; cheap either way."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe(env: dict[str, str]) -> str:
    """`torch 2.13.0/x86_64 host a` (plus the GPUs when there are any), for log lines."""
    gpus = f", {env.get('gpu_count')}x {env.get('gpu')}" if env.get("gpu_count", "0") not in ("0", "") else ""
    return f"torch {env.get('torch', '?')}/{env.get('machine', '?')}{gpus} host {env.get('host', '?')}"


def environment_changes(before: dict[str, str], now: dict[str, str]) -> list[str]:
    """`torch 2.13.0 -> 2.14.0`, ... for every RESUME_KEYS entry that differs."""
    return [f"{k} {before.get(k, '?')} -> {now.get(k, '?')}" for k in RESUME_KEYS if before.get(k) != now.get(k)]
