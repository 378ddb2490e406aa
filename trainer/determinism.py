"""Thread count and determinism of a training process, set by the process itself.

The result of a training run must not depend on what the shell exported (OMP_NUM_THREADS from a Makefile) or on
what else runs on the machine. So each training process:
- runs `cpu_threads` math threads (torch intra-op; OpenMP/MKL through the environment its launcher sets, see
  `thread_env`), one inter-op thread; with a fixed thread count a CPU sums in a fixed order;
- with `deterministic` (the default) turns on torch's deterministic algorithms, cuDNN's deterministic mode and
  the cuBLAS workspace setting that makes cuBLAS reproducible; an op without a deterministic version warns
  instead of failing, and the warning is recorded;
- seeds python, numpy and torch (CPU and every GPU) with the stage's seed before any model or data is built.

`Determinism.report()` says whether the run was deterministic and, if not, why: it goes into the stage's
result and so into the manifest (`deterministic`, `nondeterminism`).
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: environment variables that size the thread pools of OpenMP, MKL and OpenBLAS in a child process
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def thread_env(settings: dict[str, Any]) -> dict[str, str]:
    """What the launcher puts into the training process's environment, overriding the parent's."""
    n = str(int(settings.get("cpu_threads") or 1))
    return {**dict.fromkeys(THREAD_VARS, n), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@dataclass
class Determinism:
    cpu_threads: int
    requested: bool
    notes: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        return {"deterministic": self.requested and not self.notes, "nondeterminism": list(self.notes),
                "cpu_threads": self.cpu_threads}


def setup(settings: dict[str, Any]) -> Determinism:
    """Call first thing in the training process, before torch builds anything."""
    import random

    import numpy as np
    import torch

    threads = int(settings.get("cpu_threads") or 1)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (only possible before any parallel work): keep it
        pass
    det = Determinism(cpu_threads=threads, requested=bool(settings.get("deterministic", True)))
    if det.requested:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        _record_nondeterministic_ops(det)
    else:
        det.notes.append("deterministic: false in the stage's settings")
    seed = int(settings.get("seed", 0))
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # CPU and every CUDA device
    log.info("training process: %d math thread(s), deterministic algorithms %s, seed %d", threads,
             "on" if det.requested else "off", seed)
    return det


def _record_nondeterministic_ops(det: Determinism) -> None:
    """torch warns (warn_only) when an op has no deterministic implementation; keep each such op once."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "deterministic" in text and ("does not have a deterministic implementation" in text
                                        or "use_deterministic_algorithms" in text):
            first = text.splitlines()[0][:300]
            if first not in det.notes:
                det.notes.append(first)
                log.warning("not deterministic: %s", first)
            return
        previous(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    warnings.filterwarnings("always", message=".*deterministic.*")
