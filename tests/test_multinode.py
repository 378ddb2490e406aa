"""A training stage on several nodes (trainer/launch.py, flows/join_cmd.py, docs/scale-out.md): node 0 is the
`lmforge run` holding the stage's lease, node 1 an `lmforge join` in its own process tree, the store on the real
SeaweedFS S3 server, gloo on 127.0.0.1.

The default suite checks what `lmforge join` refuses before it waits (bad node rank, a stage that is not
multi-node, a missing stage) and its error when no node 0 comes. The slow test trains for real on 2 "nodes".
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from flows import cli
from tests.helpers import (REPO, artifact, chat_rows, plan_of, run_stages, sft, train_pipeline,
                           write_config, write_jsonl)
from trainer.launch import free_port


def _config(tmp: Path, stages: dict, store: str | None = None) -> Path:
    raw = train_pipeline(tmp, stages)
    if store is not None:
        raw["store"] = store
    write_jsonl(tmp / "data" / "chat.jsonl", chat_rows(200))
    return write_config(tmp, raw)


def _two_nodes(**over) -> dict:
    return sft(method="full", launcher="torchrun", nproc_per_node=1, nnodes=2,
               rdzv_endpoint=f"127.0.0.1:{free_port()}", batch_size_per_device=4, evaluate=False, retries=0, **over)


def test_join_refuses_what_it_cannot_join_and_says_what_to_do_when_no_node_0_comes(tmp_path, capsys):
    cfg = _config(tmp_path, {"multi": _two_nodes(max_steps=4), "single": sft()})

    def join(*args: str) -> tuple[int, str]:
        rc = cli.main(["join", str(cfg), *args])
        err = capsys.readouterr().err.strip()
        return rc, err[err.find("lmforge join:"):]  # after the log lines (MLflow makes its database)

    assert join("--stage", "multi", "--node-rank", "0") == (2, (
        "lmforge join: 1 problem in the pipeline config:\n  - --node-rank 0: stage multi trains on 2 nodes "
        f"(stages.multi.nnodes); node 0 is the `lmforge run` of {cfg}, so `lmforge join` takes node ranks 1 to 1 "
        "(a Kubernetes Indexed Job: JOB_COMPLETION_INDEX; Slurm: SLURM_NODEID)"))
    assert join("--stage", "multi", "--node-rank", "2")[1].startswith(
        "lmforge join: 1 problem in the pipeline config:\n  - --node-rank 2: stage multi trains on 2 nodes")
    assert join("--stage", "single", "--node-rank", "1") == (2, (
        "lmforge join: 1 problem in the pipeline config:\n  - stages.single.nnodes: is 1; `lmforge join` adds nodes "
        "to a stage trained on several: set nnodes (and launcher: torchrun, rdzv_endpoint: <node 0's address>:<port>)"))
    assert join("--stage", "shard", "--node-rank", "1") == (2, (
        "lmforge join: 1 problem in the pipeline config:\n  - --stage shard: no training stage named 'shard' in "
        f"{cfg}; training stages: multi, single"))

    t0 = time.monotonic()
    rc, err = join("--stage", "multi", "--node-rank", "1", "--wait-seconds", "0.5")
    assert time.monotonic() - t0 < 10
    key = f"{tmp_path / 'artifacts'}/_join/train/multi.json"
    assert (rc, err) == (1, (
        f"lmforge join: stage multi: no node 0 published a job spec at {key} within 0 s. Start `lmforge run CONFIG` "
        "on the node that rdzv_endpoint names (node 0): it publishes the spec when stage multi starts training, "
        "after the stages it needs; --wait-seconds sets how long a joining node waits for it"))

    # a record of node 0 is followed only while its attempt trains and its run holds the stage's lease
    from lmforge.lease import Fence
    from trainer.job import JobSpec, JoinRecord

    spec = JobSpec(method="sft", stage="multi", settings={}, train_shards=[], output_dir="o", work_dir="w",
                   checkpoint_uri=f"{tmp_path}/artifacts/sft/abc/_checkpoints",
                   lease=Fence(uri=f"{tmp_path}/artifacts/sft/abc/_lease.json", owner="gone"))
    record = JoinRecord(attempt="a" * 32, state="training", stage="multi", artifact_uri=f"{tmp_path}/artifacts/sft/abc",
                        nnodes=2, nproc_per_node=1, rdzv_endpoint="127.0.0.1:1", host="node0", pid=1,
                        published_at=time.time(), spec=spec)
    record.write(key)
    rc, err = join("--stage", "multi", "--node-rank", "1", "--wait-seconds", "0")
    assert (rc, err.split(". Start")[0]) == (1, (
        f"lmforge join: stage multi: no node 0 published a job spec at {key} within 0 s (the one there, attempt "
        "aaaaaaaa of host node0 pid 1, is abandoned: the lease was released)"))
    record.mark(key, "failed", "TrainingError: the training process failed")
    assert JoinRecord.read(key).state == "failed"
    rc, err = join("--stage", "multi", "--node-rank", "1", "--wait-seconds", "0")
    assert "(the one there, attempt aaaaaaaa of host node0 pid 1, is failed: TrainingError: the training process " \
           "failed)" in err


# ----------------------------------------------------------------------------------------------
# 2 nodes for real


def _start(cfg: Path, log: Path, *args: str) -> subprocess.Popen:
    """`lmforge <args>` in its own session (a node's process tree), its output unbuffered into `log` (the test
    watches node 0's log for its checkpoints)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cfg.parent, env=env,
                            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _start_run(cfg: Path, log: Path, *extra: str) -> subprocess.Popen:
    return _start(cfg, log, "run", str(cfg), *extra)


def _start_join(cfg: Path, stage: str, log: Path) -> subprocess.Popen:
    return _start(cfg, log, "join", str(cfg), "--stage", stage, "--node-rank", "1", "--wait-seconds", "600")


def _kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL to every process of the node that `proc` (in its own session) is, all at once: a node lost, nothing
    cleans up. torchrun starts its ranks in sessions of their own, so killing the process group alone would leave
    the ranks training on."""
    family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    assert any("trainer.entry" in " ".join(p.cmdline()) for p in family)  # the node's ranks are among them
    os.killpg(proc.pid, signal.SIGKILL)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(timeout=30)
    psutil.wait_procs(family, timeout=30)


def _both(cfg: Path, stage: str, run_log: Path, join_log: Path) -> tuple[subprocess.Popen, subprocess.Popen]:
    return _start_run(cfg, run_log), _start_join(cfg, stage, join_log)


def _wait_for_upload(log: Path, after: int, procs, wait_s: float = 600) -> int:
    """The step of the first checkpoint after `after` that node 0 (logging to `log`) reports uploaded: read from its
    log, which says so at once (listing the store takes longer than a tiny model's steps)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        steps = [int(m) for m in re.findall(r"checkpoint (\d+): uploaded and pruned", log.read_text())]
        if any(s > after for s in steps):
            return min(s for s in steps if s > after)
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint after step {after}: {[(p.args[3], p.poll()) for p in procs]}\n"
                         f"{log.read_text()[-3000:]}")


def _weights(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{path}/model.safetensors")


# slow: an `lmforge run`/`lmforge join` pair and a reference training, each starting the ML stack in several
# processes; the default test above covers join's checks and its errors
@pytest.mark.slow
def test_two_nodes_train_as_one_node_with_two_processes(s3, tmp_path, root, kinds_module):
    """nnodes 2 x nproc_per_node 1 (node 1 its own process tree) against nnodes 1 x nproc_per_node 2: same world of 2
    ranks, same data split, same gloo all-reduce, so the same weights, bit for bit."""
    import torch

    from lmforge.store import ArtifactStore
    from trainer.job import ArtifactRef, materialize

    store = f"s3://lmforge-test/multinode-{uuid.uuid4().hex[:8]}"
    same = {"max_steps": 12, "checkpoint_every_steps": 4, "seed": 3}
    cfg = _config(tmp_path, {"nodes": _two_nodes(**same)}, store)
    run = _start_run(cfg, tmp_path / "run.log", "--json", str(tmp_path / "summary.json"))
    join = _start_join(cfg, "nodes", tmp_path / "join.log")
    assert run.wait(timeout=900) == 0, (tmp_path / "run.log").read_text()[-4000:]
    assert join.wait(timeout=120) == 0, (tmp_path / "join.log").read_text()[-4000:]
    joined = (tmp_path / "join.log").read_text()
    aid = json.loads((tmp_path / "summary.json").read_text())["stages"]["nodes"]["artifact_id"]
    assert f"node 1 of 2: node 0 published {store}/sft/{aid}" in joined
    assert "trainer.child" in joined  # node 1 trained: its ranks' lines came through
    art = ArtifactStore(store).require("sft", aid)
    r = art.result
    assert (r["steps"], r["checkpoints_uploaded"], r["resumed_from_step"]) == (12, [4, 8], 0)
    assert r["train_rows"] == 180 and r["epochs"] == round(12 / 23, 4)  # the 2 ranks split the data
    # the same training on one node with 2 processes (another store, same data): the same weights
    one_node = {"one_node": sft(method="full", launcher="torchrun", nproc_per_node=2, batch_size_per_device=4,
                                evaluate=False, **same)}
    plan, _ = run_stages(root, kinds_module, one_node, ["one_node"])
    ref = artifact(plan, "one_node")
    assert ref.id != aid  # nnodes is in the id (it sets the global batch with nproc_per_node)
    a, b = _weights(str(materialize(ArtifactRef.of(art), tmp_path / "two_nodes"))), _weights(ref.path)
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == []


# slow: 3 `lmforge run`/`lmforge join` pairs; the default test above covers join's checks and its errors
@pytest.mark.slow
def test_a_lost_node_fails_both_sides_and_both_rerun_resume_from_the_last_checkpoint(s3, tmp_path, kinds_module):
    """A node killed mid-training (its process group, SIGKILL): first node 1, then, in the rerun, node 0. The other
    side ends with an error saying what happened; the third pair resumes from the last checkpoint and finishes."""
    import yaml

    from trainer import checkpoint

    store = f"s3://lmforge-test/multinode-{uuid.uuid4().hex[:8]}"
    # long enough that the kills land mid-training, after a checkpoint (a node that dies after its ranks finished
    # only delays node 0: torchrun's exit barrier waits for it, then node 0 publishes)
    stage = _two_nodes(max_steps=400, checkpoint_every_steps=10, seed=3)
    cfg = _config(tmp_path, {"lost": stage}, store)
    plan = plan_of(yaml.safe_load(cfg.read_text()), kinds_module, tmp_path)
    uri = plan.store.checkpoint_uri("sft", plan.stages["lost"].artifact_id)
    logs = [(tmp_path / f"run{i}.log", tmp_path / f"join{i}.log") for i in range(3)]

    run, join = _both(cfg, "lost", *logs[0])
    first = _wait_for_upload(logs[0][0], 0, (run, join))
    _kill_node(join)
    assert run.wait(timeout=300) == 1, logs[0][0].read_text()[-4000:]
    out = logs[0][0].read_text()
    assert "the training process failed" in out, out[-4000:]
    assert "This is node 0 of 2: a joining node that stopped" in out
    killed_at = checkpoint.latest_complete(uri)[0]
    assert killed_at >= first and plan.store.get("sft", plan.stages["lost"].artifact_id) is None

    run, join = _both(cfg, "lost", *logs[1])
    second = _wait_for_upload(logs[1][0], killed_at, (run, join))
    _kill_node(run)
    assert join.wait(timeout=300) == 1, logs[1][1].read_text()[-4000:]
    out = logs[1][1].read_text()
    assert "lmforge join: stage lost: node 1's training processes failed" in out, out[-4000:]
    assert "node 0 is gone: the process of run" in out and "Rerun `lmforge run` on node 0 and `lmforge join`" in out
    assert f"resuming at step {killed_at}" in logs[1][0].read_text()
    killed_again = checkpoint.latest_complete(uri)[0]
    assert killed_again >= second > killed_at

    run, join = _both(cfg, "lost", *logs[2])
    assert run.wait(timeout=900) == 0, logs[2][0].read_text()[-4000:]
    assert join.wait(timeout=120) == 0, logs[2][1].read_text()[-4000:]
    r = plan.store.require("sft", plan.stages["lost"].artifact_id).result
    assert (r["resumed_from_step"], r["steps"]) == (killed_again, 400)
    assert r["train_loss_last"] < r["train_loss_first"] - 1.0

