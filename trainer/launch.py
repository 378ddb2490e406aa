"""Run a training job in a child process and bring back its result or its error.

    local      python -m trainer.entry <spec.json>
    torchrun   python -m torch.distributed.run --standalone --nproc-per-node N -m trainer.entry <spec.json>
               node K of M nodes (node 0: `lmforge run`, the others: `lmforge join`, see below):
               ... --nnodes M --node-rank K --rdzv-backend static --rdzv-endpoint host:port --max-restarts 0 ...
    deepspeed  python -m deepspeed.launcher.runner --num_gpus N --master_port <free> --no_local_rank
               --module trainer.entry <spec.json>      (one node; DeepSpeed's own launcher)

The launch settings (launcher, nproc_per_node, nnodes, rdzv_endpoint) and the sharding (deepspeed, fsdp) come
from the stage's settings; `trainer.distributed.prepare` checks their combination, the precision and the
hardware here, before any process starts, and replaces a deepspeed/fsdp preset or file (relative to the
project root) by its content. DeepSpeed and FSDP run under torchrun too (DeepSpeed ZeRO-2/3 on CPU with gloo).

The child is a fresh interpreter: GPU memory is freed when it exits, a crash stays contained, and the
same command scales to more GPUs. Before it starts, the newest complete checkpoint is downloaded
from the stage's checkpoint URI, so the child resumes from it. The child's output streams into this
process's log line by line (logger `trainer.child`). It writes `result.json` (rank 0) or
`error-<rank>.json`; a setting error comes back as `SettingError` naming the field, anything else as
`TrainingError` with the exit status, the child's error and the tail of its log. A stop request (SIGTERM/SIGINT
to `lmforge run`, handled in its main thread: `lmforge.interrupt`) reaches every running training process through
`stop_all` (not torchrun or the DeepSpeed launcher, which would kill the ranks before they checkpoint), so each rank
saves and stops at the end of its step. Whatever ends the wait for a child (an exception, a stage timeout) ends the
child's whole process tree first.

Several nodes (`nnodes` > 1, docs/scale-out.md): the `lmforge run` that holds the stage's lease is node 0. It
publishes a `JoinRecord` (trainer/job.py: its job spec, the rendezvous, nnodes) at a key the other nodes know from the
config alone, then starts its torchrun as node 0, which hosts the rendezvous at `rdzv_endpoint`. Each other node runs
`lmforge join CONFIG --stage NAME --node-rank K` (`join_node`): it waits for the record, downloads the checkpoint node
0 resumes from, starts its torchrun as node K and, once its ranks are done, waits for node 0 to publish the artifact.
Node ranks are fixed (torchrun's static rendezvous), so global rank 0, the one rank that uploads checkpoints and
writes the model, is always on node 0. A joining node takes no lease, uploads nothing and publishes nothing; it
fails, naming node 0, when node 0's attempt failed or node 0 lost its lease, and its ranks fail when a peer dies
(the rendezvous breaks). Every rank checks that all ranks run the same attempt (trainer/entry.py).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Iterator

from lmforge import interrupt
from lmforge.owner import claim, work_base
from trainer import checkpoint, determinism, distributed
from trainer.errors import Preempted, SettingError, TrainingError
from trainer.job import JobSpec, JoinRecord

log = logging.getLogger(__name__)
child_log = logging.getLogger("trainer.child")

REPO = Path(__file__).resolve().parent.parent
TAIL_LINES = 40
#: training jobs this process runs at once (stages run in threads): two jobs on the same cores or GPU slow each
#: other far more than they gain (2 trainings on 2 CPU cores: ~15x slower each), or run out of GPU memory
TRAINING_SLOTS = threading.BoundedSemaphore(max(1, int(os.environ.get("LMFORGE_MAX_PARALLEL_TRAINING", "1"))))
LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
          "CRITICAL": logging.CRITICAL}


@contextlib.contextmanager
def work_dir(stage: str, artifact_id: str) -> Iterator[Path]:
    """Local scratch for one attempt (spec, result, local checkpoints, downloads); removed afterwards."""
    path = work_base("lmforge-train") / f"{stage}-{artifact_id}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    claim(path, stage, artifact_id)  # whose it is: the next run removes it if this process dies (kill -9)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def command(launcher: str, nproc_per_node: int, spec_path: Path, *, nnodes: int = 1, rdzv_endpoint: str | None = None,
            rdzv_id: str = "lmforge", master_port: int | None = None, node_rank: int | None = None) -> list[str]:
    """The command line that starts the training processes of one node. With `node_rank`, node `node_rank` of
    `nnodes` (static rendezvous: node 0 hosts it at `rdzv_endpoint`, and global rank 0 is on node 0); without it,
    several nodes meet at `rdzv_endpoint` in whatever order they come (c10d)."""
    entry = ["-m", "trainer.entry", str(spec_path)]
    if launcher == "local":
        if nproc_per_node != 1 or nnodes != 1:
            raise SettingError("nproc_per_node", f"launcher local runs one process, got nproc_per_node "
                               f"{nproc_per_node} and nnodes {nnodes}; set launcher: torchrun for more")
        return [sys.executable, *entry]
    if launcher == "torchrun":
        if rdzv_endpoint and node_rank is not None:  # no restarts: a lost node fails the attempt on every node
            where = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=static",
                     f"--rdzv-endpoint={rdzv_endpoint}", "--max-restarts=0"]
        elif rdzv_endpoint:  # every node runs this same command and meets the others there
            where = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                     f"--rdzv-id={rdzv_id}"]
        elif nnodes == 1:
            where = ["--standalone"]
        else:
            raise SettingError("rdzv_endpoint", f"nnodes {nnodes} needs a rendezvous endpoint host:port that every "
                               "node reaches, e.g. the first node's address 10.0.0.1:29400")
        return [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc-per-node={nproc_per_node}", *entry]
    if launcher == "deepspeed":
        if nnodes != 1:
            raise SettingError("launcher", f"nnodes {nnodes} needs launcher torchrun (one torchrun per node, meeting at "
                               "rdzv_endpoint); DeepSpeed's launcher needs ssh and a hostfile for several nodes")
        return [sys.executable, "-m", "deepspeed.launcher.runner", f"--num_gpus={nproc_per_node}",
                f"--master_port={master_port or free_port()}", "--no_local_rank", "--module", "trainer.entry",
                str(spec_path)]
    raise SettingError("launcher", f"unknown launcher {launcher!r}; expected local, torchrun or deepspeed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    return env


def run(spec: JobSpec, *, root: Path | None = None, launcher: str | None = None,
        nproc_per_node: int | None = None, join: str | None = None) -> dict[str, Any]:
    """Run the job to completion; returns the child's result dict.

    Launch settings come from `spec.settings` (launcher, nproc_per_node, nnodes, rdzv_endpoint, deepspeed, fsdp);
    `launcher` / `nproc_per_node` override them. `root` is the project root that a deepspeed/fsdp file path is
    relative to. A combination this machine cannot run raises SettingError before any process starts. With
    nnodes > 1 this is node 0: it publishes its JoinRecord at `join` (trainer.job.join_uri) for the other nodes."""
    settings = dict(spec.settings)
    if launcher is not None:
        settings["launcher"] = launcher
    if nproc_per_node is not None:
        settings["nproc_per_node"] = nproc_per_node
    capability = distributed.device_capability()
    settings = distributed.prepare(settings, root, capability)
    work = Path(spec.work_dir)
    restored = checkpoint.restore_latest(spec.checkpoint_uri, work / "resume")
    spec = spec.model_copy(update={"settings": settings})
    if restored is not None:
        checkpoint.warn_if_environment_changed(spec.checkpoint_uri, restored[1], spec.stage)
        spec = spec.model_copy(update={"resume_from": str(restored[0]), "resume_step": restored[1]})
    nnodes = int(settings.get("nnodes", 1))
    if nnodes > 1:
        if join is None:
            raise SettingError("nnodes", f"nnodes {nnodes}: a multi-node training runs as a pipeline stage (`lmforge "
                               "run`), whose other nodes join through `lmforge join`")
        spec = spec.model_copy(update={"attempt": uuid.uuid4().hex})
    spec_path = work / "spec.json"
    spec.write(spec_path)
    rdzv_id = "lmforge-" + hashlib.sha256(spec.checkpoint_uri.encode()).hexdigest()[:16]  # the same on every node
    cmd = command(settings.get("launcher", "local"), int(settings.get("nproc_per_node", 1)), spec_path,
                  nnodes=nnodes, rdzv_endpoint=settings.get("rdzv_endpoint"), rdzv_id=rdzv_id,
                  node_rank=0 if nnodes > 1 else None)
    # the training processes size their own thread pools: what the shell exported must not change the result
    env = child_env({**distributed.child_env(cuda=capability is not None), **determinism.thread_env(settings)})
    if not TRAINING_SLOTS.acquire(blocking=False):
        log.info("stage %s: waiting for a training slot (another stage is training; LMFORGE_MAX_PARALLEL_TRAINING "
                 "sets how many train at once)", spec.stage)
        TRAINING_SLOTS.acquire()
    try:
        if nnodes == 1:
            return _run_child(spec, cmd, env, work)
        record = JoinRecord(attempt=spec.attempt, state="training", stage=spec.stage,
                            artifact_uri=spec.checkpoint_uri.rsplit("/", 1)[0], nnodes=nnodes,
                            nproc_per_node=int(settings.get("nproc_per_node", 1)),
                            rdzv_endpoint=settings["rdzv_endpoint"], host=socket.gethostname(), pid=os.getpid(),
                            published_at=time.time(), spec=spec)
        record.write(join)
        log.info("stage %s: node 0 of %d; published the job spec at %s: start `lmforge join CONFIG --stage %s "
                 "--node-rank K` on each other node (K = 1..%d); they meet at %s", spec.stage, nnodes, join,
                 spec.stage, nnodes - 1, settings["rdzv_endpoint"])
        try:
            result = _run_child(spec, cmd, env, work)
        except BaseException as e:
            record.mark(join, "failed", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            raise
        record.mark(join, "trained")
        return result
    finally:
        TRAINING_SLOTS.release()


def _run_child(spec: JobSpec, cmd: list[str], env: dict[str, str], work: Path) -> dict[str, Any]:
    rc, tail = _stream_child(spec, cmd, env, work)
    return _outcome(spec, rc, work, tail)


# ----------------------------------------------------------------------------------------------
# a joining node (`lmforge join`): nodes 1 .. nnodes-1 of a stage whose node 0 is an `lmforge run`

#: how often a joining node looks at node 0's record, its lease and the artifact
JOIN_POLL_SECONDS = float(os.environ.get("LMFORGE_JOIN_POLL_SECONDS", "2"))


def node0_live(record: JoinRecord) -> tuple[bool, str]:
    """Is node 0's attempt still on (it holds the stage's lease), and a few words on who node 0 is or why not."""
    if record.spec.lease is None:
        return True, f"host {record.host}, pid {record.pid}"
    return record.spec.lease.live()


def wait_for_record(uri: str, stage: str, wait_s: float) -> JoinRecord:
    """Node 0's record of an attempt that is training now and whose run holds the stage's lease; waits up to
    `wait_s` for one (an older attempt's record, finished or abandoned, is waited past)."""
    deadline, logged = time.monotonic() + wait_s, 0.0
    while True:
        interrupt.check(f"stage {stage}: waiting for node 0's job spec")
        record = JoinRecord.read(uri)
        seen = ""
        if record is not None:
            live, why = node0_live(record)
            if record.state == "training" and live:
                return record
            seen = f" (the one there, attempt {record.attempt[:8]} of host {record.host} pid {record.pid}, is " + \
                   (f"{record.state}{': ' + record.error if record.error else ''}" if record.state != "training"
                    else f"abandoned: {why}") + ")"
        if time.monotonic() > deadline:
            raise TrainingError(
                f"stage {stage}: no node 0 published a job spec at {uri} within {wait_s:.0f} s{seen}. Start "
                f"`lmforge run CONFIG` on the node that rdzv_endpoint names (node 0): it publishes the spec when "
                f"stage {stage} starts training, after the stages it needs; --wait-seconds sets how long a joining "
                f"node waits for it")
        if time.monotonic() - logged > 30:
            log.info("stage %s: waiting for node 0's job spec at %s%s", stage, uri, seen)
            logged = time.monotonic()
        interrupt.wait(JOIN_POLL_SECONDS)


def join_node(uri: str, stage: str, node_rank: int, wait_s: float) -> dict[str, Any]:
    """Node `node_rank` of `stage`: wait for node 0's record at `uri`, train with it, then wait until node 0
    publishes the artifact. Returns what happened; raises TrainingError (naming node 0 when it was node 0 that
    failed), Preempted after a stop request, SettingError for a node rank the record does not have."""
    record = wait_for_record(uri, stage, wait_s)
    if not 0 < node_rank < record.nnodes:
        raise SettingError("node_rank", f"node rank {node_rank} does not exist: node 0 (host {record.host}) trains "
                           f"on {record.nnodes} nodes, so the joining nodes are 1 to {record.nnodes - 1}")
    settings = record.spec.settings  # as node 0 prepared them: deepspeed / fsdp files already read
    capability = distributed.device_capability()
    aid = record.artifact_uri.rstrip("/").rsplit("/", 1)[1]
    log.info("stage %s: node %d of %d joins attempt %s of node 0 (host %s, pid %s) at %s", stage, node_rank,
             record.nnodes, record.attempt[:8], record.host, record.pid, record.rdzv_endpoint)
    with work_dir(f"{stage}-node{node_rank}", aid) as work:
        spec = record.spec.model_copy(update={"work_dir": str(work), "output_dir": str(work / "output"),
                                              "resume_from": None})
        (work / "output").mkdir()
        if record.spec.resume_step is not None:  # the checkpoint node 0 resumes from, not whatever is newest now
            local = checkpoint.download(spec.checkpoint_uri, record.spec.resume_step, work / "resume")
            spec = spec.model_copy(update={"resume_from": str(local)})
        spec.write(work / "spec.json")
        cmd = command("torchrun", record.nproc_per_node, work / "spec.json", nnodes=record.nnodes,
                      rdzv_endpoint=record.rdzv_endpoint, node_rank=node_rank)
        env = child_env({**distributed.child_env(cuda=capability is not None), **determinism.thread_env(settings)})
        rc, tail = _stream_child(spec, cmd, env, work)
        if rc != 0:
            _joined_node_failed(spec, record, uri, node_rank, rc, work, tail)
    return _wait_for_publish(record, uri, node_rank)


def _joined_node_failed(spec: JobSpec, record: JoinRecord, uri: str, node_rank: int, rc: int, work: Path,
                        tail: list[str]) -> None:
    err = _child_error(work)
    now = JoinRecord.read(uri)
    if now is not None and now.attempt == record.attempt and now.state == "failed":
        node0 = f"node 0's attempt failed: {now.error}"
    else:
        live, why = node0_live(record)
        node0 = "node 0 is still running" if live else f"node 0 is gone: {why}"
    how = f"exit status {rc}" if rc > 0 else f"killed by {signal.Signals(-rc).name}"
    cause = f"{err['type']}: {str(err['message']).splitlines()[0] if err['message'] else ''}" if err else \
        "no error report (see the log lines below)"
    lines = "\n".join(f"    {x}" for x in tail[-15:])
    raise TrainingError(
        f"stage {spec.stage}: node {node_rank}'s training processes failed ({how}): {cause}; {node0}. A node that "
        f"stops (or loses the network) breaks the rendezvous at {record.rdzv_endpoint} for every node.\n"
        f"  last log lines of the training processes:\n{lines}\n"
        f"  Rerun `lmforge run` on node 0 and `lmforge join` on every other node: they resume from the newest "
        f"checkpoint in {spec.checkpoint_uri}.")


def _wait_for_publish(record: JoinRecord, uri: str, node_rank: int) -> dict[str, Any]:
    """After this node's ranks are done: wait until node 0 publishes the artifact (its manifest appears)."""
    from lmforge.store import MANIFEST, filesystem

    fs, manifest = filesystem(f"{record.artifact_uri}/{MANIFEST}")

    def published() -> bool:
        fs.invalidate_cache(manifest.rsplit("/", 1)[0])
        return fs.exists(manifest)

    log.info("stage %s: node %d is done training; waiting for node 0 to publish %s", record.stage, node_rank,
             record.artifact_uri)
    while not published():
        now = JoinRecord.read(uri)
        live, why = node0_live(record)
        failed = now is not None and now.attempt == record.attempt and now.state == "failed"
        if (failed or not live) and not published():
            what = f"its attempt failed: {now.error}" if failed else why
            raise TrainingError(f"stage {record.stage}: node 0 (host {record.host}, pid {record.pid}) ended without "
                                f"publishing {record.artifact_uri}: {what}. Rerun `lmforge run` on node 0 and "
                                "`lmforge join` on every other node to resume from the newest checkpoint")
        interrupt.wait(JOIN_POLL_SECONDS)
        interrupt.check(f"stage {record.stage}: waiting for node 0 to publish")
    log.info("stage %s: node 0 published %s; node %d is done", record.stage, record.artifact_uri, node_rank)
    return {"stage": record.stage, "artifact": record.artifact_uri, "node_rank": node_rank, "nnodes": record.nnodes,
            "attempt": record.attempt}


def _stream_child(spec: JobSpec, cmd: list[str], env: dict[str, str], work: Path) -> tuple[int, list[str]]:
    """Start `cmd`, stream its output into the log; (exit status, last lines)."""
    interrupt.check(f"stage {spec.stage}")  # a stop request came while this stage waited for its slot
    log.info("stage %s: training in a child process: %s", spec.stage, " ".join(cmd))
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, errors="replace")
    with _LIVE_LOCK:
        _LIVE.add(proc)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    try:
        if interrupt.requested():  # the request came between the check and the start
            stop_training(proc)
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            tail.append(line)
            child_log.log(_level(line), "%s", line)
        rc = proc.wait()
    finally:  # an exception or a stage timeout here must not leave a trainer running beside the retry
        with _LIVE_LOCK:
            _LIVE.discard(proc)
        if proc.poll() is None:
            end_process_tree(proc, f"stage {spec.stage}")
    return rc, list(tail)


#: training processes this process started and that still run: a stop request reaches each of them
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()


def stop_all() -> list[int]:
    """SIGTERM to every training process of every running stage (each checkpoints at the end of its step and
    stops). Called from the main thread's signal handler; returns the pids asked."""
    with _LIVE_LOCK:
        procs = list(_LIVE)
    return [pid for proc in procs for pid in stop_training(proc)]


def kill_all() -> None:
    """SIGKILL every running training process tree at once (a second stop request): checkpoints already
    uploaded are kept."""
    import psutil

    with _LIVE_LOCK:
        procs = list(_LIVE)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                with contextlib.suppress(psutil.Error):
                    p.kill()


def end_process_tree(proc: subprocess.Popen, what: str, grace_seconds: float = 30.0) -> None:
    """Stop `proc` and everything it started: SIGTERM to the training processes (they checkpoint and exit), then,
    after `grace_seconds`, SIGKILL to whatever of the tree is left (launchers, ranks, DataLoader workers)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    log.warning("%s: ending its training process tree (%s)", what, ", ".join(str(p.pid) for p in tree))
    stop_training(proc)
    _, alive = psutil.wait_procs(tree, timeout=grace_seconds)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)


def _level(line: str) -> int:
    head = line.split(" ", 1)[0].rstrip(":")
    if head.startswith("[rank") and " " in line:  # torchrun's "[rank1]: ..." prefix
        head = line.split(" ", 2)[1].rstrip(":")
    return LEVELS.get(head, logging.INFO)


def training_processes(proc) -> list:
    """The processes running trainer.entry as their main module: `proc` itself (launcher local) or the ranks that
    torchrun / the DeepSpeed launcher started (their DataLoader workers and the launchers are left out)."""
    import psutil

    def is_entry(p) -> bool:
        try:
            cmd = p.cmdline()
        except psutil.Error:
            return False
        return "-m" in cmd and cmd.index("-m") + 1 < len(cmd) and cmd[cmd.index("-m") + 1] == "trainer.entry"

    try:
        top = psutil.Process(proc.pid)
        tree = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    found = [p for p in tree if is_entry(p)]
    pids = {p.pid for p in found}
    return [p for p in found if p.ppid() not in pids]  # forked DataLoader workers share their rank's command line


def stop_training(proc) -> list[int]:
    """SIGTERM to every training process of the launched `proc` (each rank checkpoints at the end of its step and
    stops); returns their pids."""
    ranks = training_processes(proc) or [proc]
    for p in ranks:
        with contextlib.suppress(Exception):  # already gone
            p.send_signal(signal.SIGTERM)
    return [p.pid for p in ranks]


def _child_error(work: Path) -> dict[str, Any] | None:
    """The first error a training rank reported in `work` (error-<rank>.json); a setting error or a stop request
    is raised as itself, the rest is returned for the caller's message."""
    errors = sorted(work.glob("error-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    err = json.loads(errors[0].read_text()) if errors else None
    if err and err.get("type") == "SettingError":
        raise SettingError(err["field"], err["problem"])
    if err and err.get("type") == "Preempted":
        raise Preempted(err["message"])
    return err


def _outcome(spec: JobSpec, rc: int, work: Path, tail: list[str]) -> dict[str, Any]:
    result_path = work / "result.json"
    if rc == 0 and result_path.is_file():
        return json.loads(result_path.read_text())
    err = _child_error(work)
    if err and err.get("type") == "LeaseLost":  # fenced off its checkpoints: another run builds this stage now
        from lmforge.lease import LeaseLost

        raise LeaseLost(err["message"])
    how = f"exit status {rc}"
    if rc < 0:
        name = signal.Signals(-rc).name
        how = f"killed by {name}" + (" (often the out-of-memory killer: check `dmesg`, lower batch_size_per_device "
                                     "or max_length_tokens, or use method lora/qlora)" if -rc == signal.SIGKILL else "")
    elif rc == 0:
        how = "exit status 0 but no result.json"
    cause = f"{err['type']}: {err['message']}" if err else "no error report (see the log lines below)"
    lines = "\n".join(f"    {x}" for x in tail[-15:])
    nodes = "" if spec.attempt is None else (
        f"\n  This is node 0 of {spec.settings.get('nnodes')}: a joining node that stopped (or lost the network) "
        f"breaks the rendezvous at {spec.settings.get('rdzv_endpoint')} for every node; see the `lmforge join` logs. "
        "Rerun `lmforge join` on the other nodes too.")
    raise TrainingError(f"stage {spec.stage}: the training process failed ({how}): {cause}\n"
                        f"  last log lines of the training process:\n{lines}\n"
                        f"  Completed checkpoints in {spec.checkpoint_uri} are kept; rerun the stage to resume.{nodes}")
