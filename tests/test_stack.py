"""`lmforge stack`: SeaweedFS S3, MLflow on Postgres (artifacts on that S3), a Prefect server and a process worker,
all on 127.0.0.1, started and stopped by PID through the CLI as a user would; `lmforge run` works against it with only
the environment (`lmforge stack env`) changed and `store: s3://lmforge/...`, and everything it wrote is read back
from the servers' own APIs."""
from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import urllib.request

import boto3
import psutil
import yaml

from tests.conftest import REPO, text_rows, write_jsonl


def _lmforge(*args: str, cwd, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**(env or os.environ), "PYTHONPATH": str(REPO)})


def _free_port() -> int:
    while True:
        p = random.randrange(33000, 40000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def test_stack_up_run_against_it_and_down(tmp_path):
    stack = tmp_path / "stack"
    ports = {"s3": _free_port(), "mlflow": _free_port(), "prefect": _free_port()}
    up = _lmforge("stack", "up", "--dir", str(stack), "--s3-port", str(ports["s3"]), "--mlflow-port",
                  str(ports["mlflow"]), "--prefect-port", str(ports["prefect"]), cwd=tmp_path)
    state = json.loads((stack / "stack.json").read_text()) if (stack / "stack.json").exists() else {}
    pids = [s["pid"] for s in state.get("servers", [])]
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "stack up in" in up.stdout
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
