"""Checkpoints in the store, so a failed or preempted stage resumes where it stopped.

Layout under the stage's checkpoint URI (`{store}/{kind}/{artifact_id}/_checkpoints/`, local or s3):

    checkpoint-<step>/   the transformers Trainer checkpoint folder: model or adapter, optimizer,
                         scheduler, RNG states (one per rank), trainer_state.json (step, data position)
    checkpoint-<step>/DONE   written last: {"step", "files": [{"path", "bytes", "sha256"}]}

A checkpoint without DONE does not exist: a kill during the upload leaves a folder that the next
upload or prune removes. `CheckpointCallback` asks the Trainer to save every N steps and/or M
minutes, uploads each checkpoint as soon as it is saved (rank 0, after all ranks wrote their RNG
state, in a background thread while the training goes on) and prunes the oldest beyond `keep`. On
SIGTERM it saves, uploads (waiting for it) and stops; the recipe then
exits with `Preempted`. Before a run, the parent downloads the newest complete checkpoint
(`restore_latest`) and the recipe passes it to `trainer.train(resume_from_checkpoint=...)`, which
restores model, optimizer, scheduler, RNG and the position in the data.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from lmforge import provenance
from lmforge.store import filesystem, is_local, sha256_file

log = logging.getLogger(__name__)

DONE = "DONE"
PREFIX = "checkpoint-"
_STEP = re.compile(rf"^{PREFIX}(\d+)$")
_stop_signal: list[int] = []  # set by the SIGTERM handler, read by the callback at the next step end


def install_sigterm_handler() -> None:
    """On SIGTERM (preemption, `kill`, Prefect cancel) finish the step, save, upload, then stop."""

    def handler(signum, frame):  # noqa: ARG001
        if not _stop_signal:
            log.warning("SIGTERM: saving a checkpoint at the end of this step, then stopping")
        _stop_signal.append(signum)

    signal.signal(signal.SIGTERM, handler)


def stop_requested() -> bool:
    return bool(_stop_signal)


# ----------------------------------------------------------------------------------------------
# the remote side


def list_checkpoints(uri: str) -> list[tuple[int, str, bool]]:
    """(step, path, complete) of every checkpoint folder under `uri`, oldest first."""
    fs, root = filesystem(uri)
    fs.invalidate_cache(root)  # s3fs caches listings: a pruned checkpoint would still be listed
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        m = _STEP.match(Path(str(e).rstrip("/")).name)
        if m:
            path = f"{root}/{m.group(0)}"
            complete = fs.exists(f"{path}/{DONE}")
            # some S3 servers (SeaweedFS) keep an emptied prefix as a folder, and `find` returns it itself
            if complete or [f for f in fs.find(path) if f.rstrip("/") != path]:
                out.append((int(m.group(1)), path, complete))
    return sorted(out)


def latest_complete(uri: str) -> tuple[int, str] | None:
    done = [(step, path) for step, path, complete in list_checkpoints(uri) if complete]
    return done[-1] if done else None


def upload(local_dir: Path, uri: str, step: int) -> str:
    """Copy a checkpoint folder to `uri/checkpoint-<step>/`, then write DONE listing every file."""
    if not local_dir.is_dir() or not any(p.is_file() for p in local_dir.rglob("*")):
        raise FileNotFoundError(f"{local_dir}: no checkpoint files to upload (was it deleted before its upload?)")
    fs, root = filesystem(uri)
    dest = f"{root}/{PREFIX}{step}"
    if fs.exists(dest):  # a half-uploaded leftover of a killed run
        fs.rm(dest, recursive=True)
    files = []
    t0 = time.monotonic()
    for p in sorted(local_dir.rglob("*")):
        if p.is_file():
            rel = p.relative_to(local_dir).as_posix()
            target = f"{dest}/{rel}"
            fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(p), target)
            files.append({"path": rel, "bytes": p.stat().st_size, "sha256": sha256_file(p)})
    marker = json.dumps({"step": step, "files": files, "uploaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "environment": provenance.environment()})  # a resume elsewhere says what changed
    write_whole(fs, f"{dest}/{DONE}", marker.encode())
    log.info("checkpoint %d uploaded: %d files, %.1f MB in %.1fs -> %s/%s%d", step, len(files),
             sum(f["bytes"] for f in files) / 2**20, time.monotonic() - t0, uri, PREFIX, step)
    return dest


def write_whole(fs, path: str, data: bytes) -> None:
    """Write a small file so that it is never seen half-written: on a local disk a temp file renamed into place
    (a kill -9 between creating DONE and writing it left an empty DONE that made the checkpoint look complete and
    failed the resume); an object store's PUT is atomic already."""
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    fs.pipe_file(tmp, data)
    os.replace(tmp, path)


def prune(uri: str, keep: int) -> list[int]:
    """Delete the oldest complete checkpoints beyond `keep`, and incomplete leftovers. Returns the steps removed."""
    fs, _ = filesystem(uri)
    entries = list_checkpoints(uri)
    complete = [(s, p) for s, p, c in entries if c]
    doomed = complete[:-keep] if keep > 0 else complete
    doomed += [(s, p) for s, p, c in entries if not c]
    for step, path in doomed:
        if fs.exists(f"{path}/{DONE}"):
            fs.rm(f"{path}/{DONE}")  # first: a half-deleted checkpoint must not look complete
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:  # already gone (an object store's prefix vanishes with its last object)
            pass
    return sorted(s for s, _ in doomed)


def _verified_listing(fs, src: str, where: str) -> list[dict[str, Any]]:
    """DONE's file list, each entry with path, bytes and sha256; an error naming the checkpoint when it has none."""
    from lmforge.errors import ArtifactError

    fix = (f"delete {where} to resume from the complete checkpoint before it (or from step 0 when there is none), "
           "or rerun the stage with --force to start over")
    try:
        marker = json.loads(fs.cat_file(f"{src}/{DONE}"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{where}/{DONE}: not valid JSON ({e}); {fix}") from None
    files = marker.get("files") if isinstance(marker, dict) else None
    if not files or not all(isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("bytes"), int)
                            and isinstance(f.get("sha256"), str) for f in files):
        raise ArtifactError(f"{where}: its {DONE} marker lists no files with sizes and sha256, so the checkpoint "
                            f"cannot be verified before resuming from it; {fix}")
    return files


def _copy_hashing(fs, src: str, target: Path) -> tuple[int, str]:
    """Copy one file out of the store; (bytes, sha256) of what was copied, hashed on the way (one read)."""
    h, n = hashlib.sha256(), 0
    with fs.open(src, "rb") as r, open(target, "wb") as w:
        while b := r.read(1 << 20):
            h.update(b)
            n += len(b)
            w.write(b)
    return n, h.hexdigest()


def download(uri: str, step: int, dest: Path) -> Path:
    """Fetch `checkpoint-<step>` into `dest/checkpoint-<step>`, every file hashed as it streams and checked against
    the size and sha256 that DONE lists, before the training resumes from any of it.

    A checkpoint that does not match (or whose DONE lists no digests) is an error naming it, not a silent fall
    back to an older one: the store was changed or damaged, which the user should know, and falling back may
    throw away days of training without a word. The error says how to resume from the one before."""
    from lmforge.errors import ArtifactError

    fs, root = filesystem(uri)
    src, where = f"{root}/{PREFIX}{step}", f"{uri}/{PREFIX}{step}"
    files = _verified_listing(fs, src, where)
    local = dest / f"{PREFIX}{step}"
    shutil.rmtree(local, ignore_errors=True)
    for f in files:
        target = local / f["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            got = _copy_hashing(fs, f"{src}/{f['path']}", target)
        except FileNotFoundError:
            got = None
        if got != (f["bytes"], f["sha256"]):
            shutil.rmtree(local, ignore_errors=True)
            seen = "the file is missing" if got is None else f"read {got[0]} bytes, sha256 {got[1][:12]}…"
            raise ArtifactError(f"{where}/{f['path']}: does not match its DONE listing ({seen}; DONE lists "
                                f"{f['bytes']} bytes, sha256 {f['sha256'][:12]}…). The checkpoint was modified or "
                                f"damaged after its upload; delete {where} to resume from the complete checkpoint "
                                "before it (or from step 0 when there is none), or rerun the stage with --force to "
                                "start over")
    return local


def restore_latest(uri: str, dest: Path) -> tuple[Path, int] | None:
    """Download the newest complete checkpoint, verified against its DONE listing, or None when there is none."""
    found = latest_complete(uri)
    if found is None:
        return None
    step, _ = found
    local = download(uri, step, dest)
    log.info("resuming from checkpoint %d (%s/%s%d), every file verified against its DONE listing", step, uri,
             PREFIX, step)
    return local, step


def saved_environment(uri: str, step: int) -> dict[str, str] | None:
    """The environment (python, torch, CUDA, GPUs, CPU, host) that DONE of checkpoint-<step> records; None for a
    checkpoint saved before lmforge recorded it."""
    fs, root = filesystem(uri)
    try:
        marker = json.loads(fs.cat_file(f"{root}/{PREFIX}{step}/{DONE}"))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    env = marker.get("environment") if isinstance(marker, dict) else None
    return env if isinstance(env, dict) else None


def warn_if_environment_changed(uri: str, step: int, stage: str) -> list[str]:
    """Before resuming from checkpoint-<step>: a WARNING naming what differs between the machine that saved it and
    this one. The resume goes on, but its result may differ from an uninterrupted run's. Returns the changes."""
    before = saved_environment(uri, step)
    if before is None:
        return []
    now = provenance.environment()
    changes = provenance.environment_changes(before, now)
    if changes:
        log.warning("resuming %s from step %d made on %s, now %s (%s): the result may differ from a run without the "
                    "interruption", stage, step, provenance.describe(before), provenance.describe(now),
                    ", ".join(changes))
    return changes


# ----------------------------------------------------------------------------------------------
# the training side


def _agree(flags: list[bool]) -> list[bool]:
    """Any rank's flag set -> set on every rank (time- and signal-based decisions differ across ranks)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flags
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([int(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CheckpointCallback(TrainerCallback):
    """Saves every N steps / M minutes and on SIGTERM; rank 0 uploads each checkpoint in a background thread.

    The training goes on while checkpoint N uploads; the upload is joined before the next save (the Trainer's
    rotation, save_total_limit 1, deletes the local checkpoint-N when it writes the next one), at the end of
    training and after a SIGTERM's save, so the stage never finishes or stops with an upload in flight. An
    upload that failed fails the training at that join, as it would have in the loop."""

    def __init__(self, uri: str, every_steps: int | None, every_minutes: float | None, keep: int, fence=None):
        self.uri, self.every_steps, self.every_minutes, self.keep = uri, every_steps, every_minutes, keep
        self.fence = fence  # lmforge.lease.Fence: the checkpoints belong to the lease holder
        self.last_save = time.monotonic()
        self.stopped_by_signal = False
        self.uploaded: list[int] = []
        # per checkpoint: the Trainer's write (step end -> on_save: model, optimizer, scheduler, RNG, state; plus
        # that step's logging when it falls on the same step), the upload + prune (rank 0, in the background; 0
        # on other ranks) and how long the training waited for that upload at its join (rank 0)
        self.seconds_writing: list[float] = []
        self.seconds_uploading: list[float] = []
        self.seconds_waiting: list[float] = []
        self._save_asked: float | None = None
        self._pending: tuple[int, threading.Thread, dict[str, Any]] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.last_save = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        by_steps = bool(self.every_steps) and state.global_step % self.every_steps == 0
        by_time = bool(self.every_minutes) and time.monotonic() - self.last_save >= 60 * self.every_minutes
        by_time, stop = _agree([by_time, stop_requested()])
        if stop:
            self.stopped_by_signal = True
            control.should_training_stop = True
        final = state.global_step >= state.max_steps  # the recipe writes the final model itself
        if stop or ((by_steps or by_time) and not final):
            self.wait_for_upload()  # before the Trainer writes the next one and rotates this one away
            control.should_save = True
            self._save_asked = time.perf_counter()
        return control

    def on_save(self, args, state, control, **kwargs):
        self.wait_for_upload()  # normally joined at on_step_end; a loop that saves on its own (TRL's PPO) may not
        _barrier()  # every rank has written its files (rng_state_<rank>.pth) before rank 0 uploads
        writing = time.perf_counter() - self._save_asked if self._save_asked is not None else 0.0
        self.seconds_writing.append(round(writing, 4))
        self._save_asked = None
        log.info("checkpoint %d: written in %.3fs%s", state.global_step, writing,
                 "; uploading in the background" if state.is_world_process_zero else "")
        if state.is_world_process_zero:
            local = Path(args.output_dir) / f"{PREFIX}{state.global_step}"
            outcome: dict[str, Any] = {}
            thread = threading.Thread(target=self._upload, args=(local, state.global_step, outcome),
                                      name=f"checkpoint-upload-{state.global_step}", daemon=True)
            thread.start()
            self._pending = (state.global_step, thread, outcome)
        else:
            self.seconds_uploading.append(0.0)
            self.seconds_waiting.append(0.0)
        self.last_save = time.monotonic()
        if self.stopped_by_signal:
            self.wait_for_upload()  # the process exits next: the checkpoint must be in the store first
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.wait_for_upload()

    def _upload(self, local: Path, step: int, outcome: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            if self.fence is not None:
                self.fence.check(f"checkpoint {step}: upload to {self.uri}")
            upload(local, self.uri, step)
            if self.fence is not None:
                self.fence.check(f"checkpoint {step}: prune of {self.uri}")
            removed = prune(self.uri, self.keep)
            if removed:
                log.info("pruned checkpoints %s (keeping the newest %d)", removed, self.keep)
        except BaseException as e:  # re-raised on the training thread at the join
            outcome["error"] = e
        outcome["seconds"] = time.perf_counter() - t0
        if "error" not in outcome:
            from trainer import monitoring  # prometheus_client: imported where training runs, not by every stage

            monitoring.checkpoint_uploaded(outcome["seconds"])

    def wait_for_upload(self) -> None:
        """Join the checkpoint upload in flight, if any; its error, if it failed, is raised here."""
        if self._pending is None:
            return
        step, thread, outcome = self._pending
        t0 = time.perf_counter()
        thread.join()
        waited = time.perf_counter() - t0
        self._pending = None
        if "error" in outcome:
            raise outcome["error"]
        self.uploaded.append(step)
        self.seconds_uploading.append(round(outcome["seconds"], 4))
        self.seconds_waiting.append(round(waited, 4))
        log.info("checkpoint %d: uploaded and pruned in %.3fs in the background; the training waited %.3fs for it",
                 step, outcome["seconds"], waited)


def summary(callback: CheckpointCallback) -> dict[str, Any]:
    return {"uploaded_steps": list(callback.uploaded), "stopped_by_signal": callback.stopped_by_signal,
            "seconds_writing": list(callback.seconds_writing), "seconds_uploading": list(callback.seconds_uploading),
            "seconds_waiting": list(callback.seconds_waiting)}


def callback_for(spec, s) -> "CheckpointCallback":
    """The checkpoint callback every recipe uses, from the job spec and the recipe's settings."""
    return CheckpointCallback(spec.checkpoint_uri, s.checkpoint_every_steps, s.checkpoint_every_minutes,
                              s.keep_checkpoints, fence=spec.lease)


def train_resumable(trainer, spec, ckpt: "CheckpointCallback"):
    """Train from the newest uploaded checkpoint (if any); a SIGTERM ends in `Preempted` after a checkpoint.

    Returns the trainer's final state. Shared by every recipe so preemption behaves the same in all.
    """
    from trainer.errors import Preempted

    if stop_requested():
        raise Preempted(f"stage {spec.stage}: SIGTERM before training started; nothing to save")
    if spec.resume_from:
        log.info("resuming at step %d from %s", spec.resume_step, spec.resume_from)
    try:
        trainer.train(resume_from_checkpoint=spec.resume_from)
    except BaseException:
        try:  # a crash: the last checkpoint, still uploading, is what the rerun resumes from
            ckpt.wait_for_upload()
        except Exception as e:
            log.warning("checkpoint upload failed too: %s", e)
        raise
    ckpt.wait_for_upload()  # a loop that does not call on_train_end
    state = trainer.state
    if ckpt.stopped_by_signal:
        raise Preempted(f"stage {spec.stage}: stopped by SIGTERM at step {state.global_step}; checkpoint "
                        f"{state.global_step} is in {spec.checkpoint_uri}; rerun the stage to resume from it")
    return state
