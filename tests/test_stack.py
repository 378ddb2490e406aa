"""`lmforge stack`: SeaweedFS S3, MLflow on Postgres (artifacts on that S3), a Prefect server and a process worker,
all on 127.0.0.1, started and stopped by PID through the CLI as a user would; `lmforge run` works against it with only
the environment (`lmforge stack env`) changed and `store: s3://lmforge/...`, and everything it wrote is read back
from the servers' own APIs."""
from __future__ import annotations

import pytest
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import boto3
import psutil
import yaml

from tests.helpers import (REPO, aws_environment, chat_rows, sft, stack_port, text_rows, train_pipeline, write_jsonl,
                           write_task_dir)


def _lmforge(*args: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**(env or os.environ), "PYTHONPATH": str(REPO)})


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def _pg_user_exists() -> bool:
    import pwd

    try:
        return bool(pwd.getpwnam("pgserver"))
    except KeyError:
        return False


def test_root_is_told_about_the_pgserver_system_user(caplog, tmp_path):
    """As root, `stack up` says before Postgres starts that pgserver runs it as the system user `pgserver` (creating
    it when missing) and opens the folders above its data and binaries to other users."""
    import logging

    from flows import stack as stack_mod

    caplog.set_level(logging.INFO, logger="flows.stack")
    existed = _pg_user_exists()
    msg = stack_mod._announce_postgres_user(tmp_path / "pg")
    # one record, however many handlers saw it: after an in-process Prefect flow in the same pytest run, caplog's
    # handler can sit on two loggers of the chain and list the same record object twice (CI saw that)
    records = list({id(r): r for r in caplog.records if r.name == "flows.stack"}.values())
    assert [r.getMessage() for r in records] == [msg]
    assert records[0].levelno == (logging.INFO if existed else logging.WARNING)
    assert ("as the existing system user 'pgserver'" if existed else "which pgserver now creates (useradd") in msg
    assert f"the folders above {tmp_path / 'pg'}" in msg and "chmod g+rx,o+rx" in msg
    assert _pg_user_exists() == existed  # it only says so: pgserver, not this, creates the user


@pytest.mark.slow  # minutes: five servers; the stack's pieces (S3, MLflow, Prefect server) run in the default suite one by one
def test_stack_up_run_against_it_and_down(tmp_path):
    stack = tmp_path / "stack"
    ports = {"s3": stack_port(), "mlflow": stack_port(), "prefect": stack_port()}
    existing = _pg_user_exists()  # before `up`: on a machine that never ran it, `up` (as root) creates the user
    up = _lmforge("stack", "up", "--dir", str(stack), "--s3-port", str(ports["s3"]), "--mlflow-port",
                  str(ports["mlflow"]), "--prefect-port", str(ports["prefect"]), cwd=tmp_path)
    state = json.loads((stack / "stack.json").read_text()) if (stack / "stack.json").exists() else {}
    pids = [s["pid"] for s in state.get("servers", [])]
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "stack up in" in up.stdout
        assert (f"pgserver runs it as the {'existing ' if existing else ''}system user 'pgserver'"
                in up.stderr) == (os.geteuid() == 0), up.stderr  # root is told about the user Postgres runs as
        print(up.stdout.splitlines()[0])  # the start-up time, for the notes
        assert [s["name"] for s in state["servers"]] == ["s3", "prefect", "postgres", "mlflow", "worker"]
        status = _lmforge("stack", "status", "--dir", str(stack), cwd=tmp_path)
        assert status.stdout.count(" up ") == 5, status.stdout
        again = _lmforge("stack", "up", "--dir", str(stack), cwd=tmp_path)
        assert again.returncode == 2 and "is already up" in again.stderr

        env_out = _lmforge("stack", "env", "--dir", str(stack), cwd=tmp_path).stdout
        env = dict(line.removeprefix("export ").split("=", 1) for line in env_out.splitlines())
        assert env["MLFLOW_TRACKING_URI"] == f"http://127.0.0.1:{ports['mlflow']}"
        assert env["PREFECT_API_URL"] == f"http://127.0.0.1:{ports['prefect']}/api"
        run_env = {**os.environ, **env}

        write_jsonl(tmp_path / "data" / "t.jsonl", text_rows(40))
        cfg = {"name": "stk", "store": "s3://lmforge/stk", "tracking": "sqlite:///ignored.db",  # the env wins
               "datasets": {"t": {"path": "data/t.jsonl", "kind": "text"}},
               "stages": {"ingest": {"kind": "ingest", "inputs": ["t"]},
                          "shard": {"kind": "shard", "inputs": ["ingest"], "max_count": 20}}}
        (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
        run = _lmforge("run", "p.yaml", "--json", "summary.json", cwd=tmp_path, env=run_env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert not (tmp_path / "ignored.db").exists()
        summary = json.loads((tmp_path / "summary.json").read_text())

        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="lmforge", Prefix="stk/").get("Contents", [])}
        for name in ("ingest", "shard"):
            assert f"stk/{name}/{summary['stages'][name]['artifact_id']}/manifest.json" in keys

        mlflow = env["MLFLOW_TRACKING_URI"]
        with urllib.request.urlopen(f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?experiment_name=stk") as r:
            exp = json.load(r)["experiment"]["experiment_id"]
        runs = _post(f"{mlflow}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp]})["runs"]
        by_id = {r["info"]["run_id"]: r for r in runs}
        parent = by_id[summary["mlflow_run_id"]]
        children = [r for r in runs if {t["key"]: t["value"] for t in r["data"].get("tags", [])}.get(
            "mlflow.parentRunId") == parent["info"]["run_id"]]
        assert sorted(r["info"]["run_name"] for r in children) == ["ingest", "shard"]
        assert {r["info"]["status"] for r in runs} == {"FINISHED"}
        artifacts = {o["Key"] for o in s3.list_objects_v2(Bucket="mlflow").get("Contents", [])}
        assert f"{exp}/{parent['info']['run_id']}/artifacts/config.yaml" in artifacts  # MLflow's files on the S3

        flow_run = _post(f"{env['PREFECT_API_URL']}/flow_runs/filter", {})
        assert [(f["id"], f["state_type"]) for f in flow_run] == [(summary["flow_run_id"], "COMPLETED")]
        with urllib.request.urlopen(f"{env['PREFECT_API_URL']}/work_pools/lmforge") as r:
            assert json.load(r)["type"] == "process"

        # a cached rerun's parent carries the same metric keys as the fresh run's (the compare view has no blanks)
        again = _lmforge("run", "p.yaml", "--json", "again.json", cwd=tmp_path, env=run_env)
        assert again.returncode == 0, again.stderr[-3000:]
        cached = json.loads((tmp_path / "again.json").read_text())
        assert cached["cached"] == 2 and cached["ran"] == 0
        keys = {rid: {m["key"] for m in _post(f"{mlflow}/api/2.0/mlflow/runs/search",
                                              {"experiment_ids": [exp], "filter": f"attributes.run_id = '{rid}'"}
                                              )["runs"][0]["data"].get("metrics", [])}
                for rid in (summary["mlflow_run_id"], cached["mlflow_run_id"])}
        assert keys[summary["mlflow_run_id"]] == keys[cached["mlflow_run_id"]] != set()

        _deployment_run_by_the_stack_worker(tmp_path, env, run_env, s3)
        _s3_killed_mid_run_and_restarted(tmp_path, stack, state, run_env, s3)
    finally:
        down = _lmforge("stack", "down", "--dir", str(stack), cwd=tmp_path)
    assert down.returncode == 0, down.stderr
    assert "stopped: worker" in down.stdout
    left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert left == [], [(p, psutil.Process(p).cmdline()) for p in left]
    for p in ports.values():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))  # free again (nothing listens; a closed connection may be in TIME_WAIT)


def _wait_flow_run(api: str, flow_run_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}") as r:
            fr = json.load(r)
        if fr["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return fr
        time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} did not finish in {timeout} s: {fr['state_type']}")


def _log_counts(api: str, flow_run_id: str, *, until=lambda counts: True, timeout: float = 60) -> dict[str, list[str]]:
    """{stage: ["running" | "cached", ...]} from the flow run's lmforge log lines in the Prefect API, in order, all
    pages of them. The flow run's process ships its logs in batches and can set the final state before the last batch
    lands, so this polls until `until(counts)` holds (or `timeout` passes; the caller's assertions then say what is
    missing)."""
    deadline = time.monotonic() + timeout
    while True:
        out: dict[str, list[str]] = {}
        offset = 0
        while True:
            page = _post(f"{api}/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200,
                                                "offset": offset, "sort": "TIMESTAMP_ASC"})
            for line in page:
                m = re.match(r"stage (\w+): (running|cached) ", line["message"])
                if m:
                    out.setdefault(m.group(1), []).append(m.group(2))
            if len(page) < 200:
                break
            offset += len(page)
        if until(out) or time.monotonic() > deadline:
            return out
        time.sleep(1)


def _deployment_run_by_the_stack_worker(tmp_path, env, run_env, s3) -> None:
    """`lmforge deploy`, `prefect deployment run`: the stack's long-running process worker picks the run up; its
    artifacts land in S3 and its MLflow runs on the MLflow server, like a CLI run's. A stage made to fail through a
    config override (a data file with a bad row), fixed, then `prefect flow-run retry`: the worker runs only that
    stage and its dependant again. The registry on the MLflow server: `<pipeline>-sft` @candidate once sft's export
    finished,
    @champion only once the whole run (eval gates included) passed."""
    write_jsonl(tmp_path / "data" / "chat.jsonl", chat_rows(60))
    write_jsonl(tmp_path / "data" / "pairs_bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, "not json"])
    raw = train_pipeline(tmp_path, {
        "sft": sft(method="full", max_steps=4, evaluate=False),
        "eval": {"kind": "eval", "inputs": ["sft"], "retries": 0, "models": [{"name": "sft", "input": "sft"}],
                 "tasks": ["t_mc"], "task_dirs": [str(write_task_dir(tmp_path / "tasks"))],
                 "gates": [{"metric": "sft/t_mc/acc", "against": "sft", "max_regression": 0.0}]},
        "export": {"kind": "export", "inputs": ["sft"], "retries": 0},  # what the registry holds
        "ingest_pairs": {"kind": "ingest", "inputs": ["pairs"], "retries": 0},
        "shard_pairs": {"kind": "shard", "inputs": ["ingest_pairs"], "retries": 0}})
    raw.update({"name": "stkdeploy", "store": "s3://lmforge/stkdeploy"})
    del raw["tracking"]
    raw["datasets"]["pairs"] = {"path": "data/pairs_bad.jsonl", "kind": "preference"}
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(raw))
    dep = _lmforge("deploy", "d.yaml", "--name", "d", "--pool", "lmforge", "--no-schedule", cwd=tmp_path,
                   env=run_env)
    assert dep.returncode == 0, dep.stdout + dep.stderr
    api = env["PREFECT_API_URL"]
    trig = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "lmforge-pipeline/d"], cwd=tmp_path,
                          env={**run_env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert trig.returncode == 0, trig.stdout + trig.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", trig.stdout).group(1)
    fr = _wait_flow_run(api, flow_run_id, timeout=600)
    assert fr["state_type"] == "FAILED", fr["state"]  # ingest_pairs: the bad row
    first = _log_counts(api, flow_run_id, until=lambda c: all(n in c for n in ("ingest_pairs", "eval", "export")))
    assert first["ingest_pairs"] == ["running"] and "shard_pairs" not in first
    assert all(first[n] == ["running"] for n in ("ingest", "shard", "tokenizer", "sft", "eval", "export"))

    mlflow = env["MLFLOW_TRACKING_URI"]

    def aliases() -> dict[str, str]:
        with urllib.request.urlopen(f"{mlflow}/api/2.0/mlflow/registered-models/get?name=stkdeploy-sft") as r:
            return {a["alias"]: a["version"] for a in json.load(r)["registered_model"].get("aliases", [])}

    assert set(aliases()) == {"candidate"}  # sft finished; the run failed, so no champion

    write_jsonl(tmp_path / "data" / "pairs_bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])  # fixed
    retry = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "retry", flow_run_id], cwd=tmp_path,
                           env={**run_env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    time.sleep(2)
    fr = _wait_flow_run(api, flow_run_id, timeout=600)
    assert fr["state_type"] == "COMPLETED", fr["state"]
    both = _log_counts(api, flow_run_id, until=lambda c: "shard_pairs" in c and len(c.get("eval", [])) == 2
                       and len(c.get("export", [])) == 2)
    assert both["ingest_pairs"] == ["running", "running"] and both.get("shard_pairs") == ["running"], both
    assert all(both[n] == ["running", "cached"] for n in ("ingest", "shard", "tokenizer", "sft", "eval", "export")), \
        both
    assert aliases() == {"candidate": aliases()["candidate"], "champion": aliases()["candidate"]}

    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="lmforge", Prefix="stkdeploy/").get("Contents", [])}
    assert sum(k.endswith("/manifest.json") for k in keys) == 8, keys  # 8 stages, each a finished artifact
    with urllib.request.urlopen(f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?experiment_name=stkdeploy") as r:
        exp = json.load(r)["experiment"]["experiment_id"]
    runs = _post(f"{mlflow}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp]})["runs"]
    tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
    parent = [t for t in tags if t.get("prefect.flow_run_id") == flow_run_id and "lmforge.pipeline" in t]
    assert len(parent) == 1 and parent[0]["lmforge.config_path"] == str(tmp_path / "d.yaml")  # the retry continued it
    children = sorted(t.get("mlflow.runName") for t in tags if "mlflow.parentRunId" in t)
    assert children == sorted(["ingest", "shard", "tokenizer", "sft", "eval", "export", "ingest_pairs", "shard_pairs"])


def _s3_killed_mid_run_and_restarted(tmp_path, stack, state, run_env, s3) -> None:
    """The S3 server dies while a run uploads (kill -9 of its process group) and comes back (`lmforge stack up`
    starts only what is down): the stages' retries complete the run, and nothing in the bucket is half-visible or
    corrupt."""
    from lmforge.store import ArtifactStore

    write_jsonl(tmp_path / "data" / "k.jsonl", text_rows(3000, prefix="killed"))
    cfg = {"name": "stkkill", "store": "s3://lmforge/stkkill",
           "datasets": {"k": {"path": "data/k.jsonl", "kind": "text"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["k"], "retries": 3, "retry_delay_seconds": 5},
                      "shard": {"kind": "shard", "inputs": ["ingest"], "max_count": 100, "retries": 3,
                                "retry_delay_seconds": 5}}}
    (tmp_path / "k.yaml").write_text(yaml.safe_dump(cfg))
    log = tmp_path / "kill.log"
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "k.yaml", "--json", "k.json"], cwd=tmp_path,
                            env={**run_env, "PYTHONPATH": str(REPO)}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    staging = Path(os.environ["LMFORGE_WORK_DIR"]) / "lmforge-staging"
    deadline = time.monotonic() + 180
    while not list(staging.glob("shard-*/out/*")) and time.monotonic() < deadline:  # shard is writing its tars
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.02)
    s3_pid = next(s["pid"] for s in state["servers"] if s["name"] == "s3")
    os.killpg(s3_pid, signal.SIGKILL)
    time.sleep(8)  # the upload fails while it is down
    back = _lmforge("stack", "up", "--dir", str(stack), cwd=tmp_path)
    assert back.returncode == 0 and "started: s3)" in back.stdout, back.stdout + back.stderr
    assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    out = log.read_text()
    print("S3 outage during shard:", "a stage retried" if "Retry" in out else "s3fs's own retries sufficed")
    with aws_environment(run_env):
        store = ArtifactStore("s3://lmforge/stkkill")
        arts = store.list()
        for art in arts:
            art.verify()
    dirs = {k.split("/")[1] + "/" + k.split("/")[2] for o in s3.list_objects_v2(Bucket="lmforge",
            Prefix="stkkill/").get("Contents", []) for k in [o["Key"]] if not k.split("/")[1].startswith("_")}
    assert dirs == {f"{a.kind}/{a.id}" for a in arts}  # every folder in the bucket is a finished artifact
    assert len(dirs) == 2
