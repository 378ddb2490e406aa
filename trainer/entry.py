"""Entry point of the training process: `python -m trainer.entry <spec.json>` (under torchrun too).

Reads the job spec, runs the method's recipe and writes `result.json` (rank 0) next to the spec, or
`error-<rank>.json` with the error type, message and traceback. Exit status: 0 done, 1 failed,
2 a setting does not fit the model or data, 3 stopped by SIGTERM after checkpointing.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import traceback
from pathlib import Path

from lmforge.tracking import RedactingFilter
from trainer import checkpoint, determinism, monitoring
from trainer.errors import Preempted, SettingError
from trainer.job import JobSpec, rank, world_size

log = logging.getLogger("trainer.entry")


def recipe_module(method: str):
    """The recipe of a method: the module `trainer.<method>`, which defines `train(spec) -> dict`."""
    if not method.isidentifier():
        raise ValueError(f"not a training method: {method!r}")
    module = importlib.import_module(f"trainer.{method}")
    if not callable(getattr(module, "train", None)):
        raise ValueError(f"trainer.{method} has no train(spec) function: not a training method")
    return module


def setup_logging() -> None:
    """Plain lines on stderr (the parent adds timestamps); rank 0 logs INFO, other ranks warnings only."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    level = logging.INFO if rank() == 0 else logging.WARNING
    for name in ("trainer", "lmforge"):
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(True)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        import transformers

        transformers.utils.logging.set_verbosity_warning()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def _generations_check(spec: JobSpec) -> None:
    """Before/after generations on the control prompts (trainer.generations); a failure here is logged, never
    fatal: the trained artifact is already complete."""
    from trainer import generations

    try:
        generations.control_check(spec)
    except Exception as e:  # noqa: BLE001
        log.warning("generations check skipped: %s: %s", type(e).__name__, str(e).splitlines()[0] if str(e) else "")


def _rss_after_imports() -> float:
    """This process's RSS once the libraries every recipe uses are imported, before any model or data: what the
    preflight subtracts from the peak RSS to compare a CPU run with the memory estimate."""
    import psutil
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    return round(psutil.Process().memory_info().rss / 2**20, 1)


def check_attempt(spec: JobSpec, timeout_s: float = 300) -> None:
    """Several nodes: every rank runs the same attempt of node 0's job spec (trainer/launch.py). A joining node that
    followed an older attempt's spec (node 0 restarted meanwhile) would resume from another checkpoint: each rank
    writes its attempt into torchrun's rendezvous store and compares every other rank's."""
    if spec.attempt is None or world_size() == 1 or "MASTER_ADDR" not in os.environ:
        return
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    store.set(f"lmforge/attempt/{rank()}", spec.attempt)
    for r in range(world_size()):
        other = store.get(f"lmforge/attempt/{r}").decode()
        if other != spec.attempt:
            raise RuntimeError(f"rank {r} runs attempt {other[:8]} of node 0's job spec and rank {rank()} attempt "
                               f"{spec.attempt[:8]}: a node followed an older job spec (node 0 started again "
                               "meanwhile). Stop every node, then start `lmforge run` on node 0 and `lmforge join` "
                               "on the others again")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec_path = Path(argv[0])
    work = spec_path.parent
    setup_logging()
    checkpoint.install_sigterm_handler()
    try:
        spec = JobSpec.read(spec_path)
        monitoring.start(spec)  # rank 0's metrics endpoint, when the stage asked for one
        check_attempt(spec)  # several nodes: all ranks follow the same job spec of node 0
        det = determinism.setup(spec.settings)  # threads, deterministic algorithms, seeds: before anything is built
        recipe = recipe_module(spec.method)
        baseline = _rss_after_imports()
        result = recipe.train(spec)
        # on CPU the baseline is the non-model RSS at the start of training (trainer.metrics.nonmodel_rss_mb):
        # the RSS after the imports misses what the recipe imports and builds later (trl's trainer classes
        # alone ~80 MB, the tokenized data and the Trainer another ~70 MB), none of which the estimate models
        from trainer import metrics

        result = {**result, **det.report(), "rss_after_imports_mb": baseline,
                  "baseline_rss_mb": metrics.nonmodel_rss_mb if metrics.nonmodel_rss_mb is not None else baseline}
        if rank() == 0:
            _generations_check(spec)
            _write(work / "result.json", result)
        return 0
    except SettingError as e:
        _write(work / f"error-{rank()}.json", e.to_json())
        log.error("%s", e)
        return 2
    except Preempted as e:
        _write(work / f"error-{rank()}.json", {"type": "Preempted", "message": str(e)})
        log.warning("%s", e)
        return 3
    except BaseException as e:  # noqa: BLE001  report everything, including KeyboardInterrupt
        _write(work / f"error-{rank()}.json", {"type": type(e).__name__, "message": str(e),
                                                "traceback": traceback.format_exc()})
        log.error("training failed: %s: %s\n%s", type(e).__name__, e, traceback.format_exc())
        return 1
    finally:
        _leave_process_group()


def _leave_process_group() -> None:
    """Destroy this rank's process group (DDP, DeepSpeed, FSDP) before the interpreter tears down. A rank that
    exits with gloo's threads still running can die in std::terminate ("terminate called without an active
    exception", SIGABRT): seen once in CI on 2 cores, rank 1 after a finished training while rank 0 still ran the
    control generations, and torchrun then failed the whole job. Local, not a collective: a rank whose peer crashed
    does not wait for it."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001  leaving is best effort; the result (or error) is already written
        log.warning("could not destroy the process group: %s: %s", type(e).__name__, e)


if __name__ == "__main__":
    sys.exit(main())
