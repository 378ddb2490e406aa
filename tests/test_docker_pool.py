"""A Prefect Docker work pool end to end, as a user runs it (deploy/docker/prefect.yaml, docs/image.md): the lmforge
image from `make image`, a real `prefect server start`, `prefect work-pool create --type docker`, `prefect deploy`,
and Prefect's Docker worker (prefect-docker) starting each flow run as a container through the Docker API: a Docker
daemon's when one answers, else podman's (`podman system service`, started here and stopped by its PID).

The pipeline is tests/helpers.py basic_config (four data stages), its folder mounted into the container at the same
path. Its preference data has a broken line, so the first run fails in ingest_pairs; with the file fixed,
`prefect flow-run retry` reruns that flow run: ingest and shard come from the store, ingest_pairs and shard_pairs run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from tests.helpers import REPO, basic_config, write_config, write_jsonl

POOL = "lmforge-docker-test"
IMAGE = "localhost/lmforge-test:latest"
PAIRS = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(20)]


def api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def _docker_api(tmp: Path) -> tuple[str, str, subprocess.Popen | None]:
    """(engine CLI, DOCKER_HOST, the API service this test started or None)."""
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0:
        return "docker", os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"), None
    if not shutil.which("podman"):
        pytest.skip("no container engine: neither a docker daemon nor podman (../shared/tools/container-engine.sh "
                    "installs podman)")
    sock = tmp / "podman.sock"
    proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"],
                            stdout=open(tmp / "podman-service.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp / "podman-service.log").read_text()
        time.sleep(0.2)
    return "podman", f"unix://{sock}", proc


def _stop(proc: subprocess.Popen | None) -> None:
    """Stop `proc` and what it started, by PID."""
    if proc is None or proc.poll() is not None:
        return
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for p in psutil.wait_procs(children, timeout=10)[1]:
        p.kill()


def _wait_final(url: str, flow_run_id: str, timeout: float = 1200) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        fr = api(url, f"/flow_runs/{flow_run_id}")
        if fr["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return fr
        assert time.monotonic() < deadline, fr["state"]
        time.sleep(3)


def _messages(url: str, flow_run_id: str) -> list[str]:
    logs = api(url, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200,
                                     "sort": "TIMESTAMP_ASC"})
    return [r["message"] for r in logs]


def _plans(messages: list[str]) -> list[list[list[str]]]:
    """Each attempt's plan: [status, stage] per stage line of its `plan:` log message."""
    return [[line.split()[:2] for line in m.splitlines()[-4:]] for m in messages if m.startswith("plan:\n")]


# slow: builds the image (minutes when its dependency layer is not cached) and starts two containers that each import
# the ML stack; the default suite's tests/test_deploy.py covers deployments, failure reports and reruns on a process
# pool, and tests/test_image.py's default test the image's context
@pytest.mark.slow
def test_docker_pool_runs_the_deployment_and_retry_reruns_the_failed_part(prefect_server, tmp_path):
    url = prefect_server
    engine, docker_host, service = _docker_api(tmp_path)
    worker = None
    try:
        base = os.environ.get("LMFORGE_TEST_BASE_IMAGE") or (
            "localhost/debian:bookworm" if subprocess.run([engine, "image", "inspect", "localhost/debian:bookworm"],
                                                          capture_output=True).returncode == 0 else "python:3.11-slim")
        build = subprocess.run(["make", "-C", str(REPO), "image", f"ENGINE={engine}", f"IMAGE={IMAGE}",
                                f"BASE_IMAGE={base}"], capture_output=True, text=True, timeout=3600)
        assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]

        # the pipeline's folder, mounted at the same path; the image's user (uid 1000) writes the store and MLflow
        work = tmp_path / "work"
        cfg = basic_config(work)
        cfg["datasets"]["pairs"]["path"] = str(work / "data" / "pairs.jsonl")
        cfg["datasets"]["text"]["path"] = str(work / "data" / "text.jsonl")
        write_jsonl(work / "data" / "pairs.jsonl", [*PAIRS[:5], "not json", *PAIRS[5:]])
        config = write_config(work, cfg)
        for p in [work, *work.rglob("*")]:
            p.chmod(0o777 if p.is_dir() else 0o666)

        env = {**os.environ, "PREFECT_API_URL": url, "DOCKER_HOST": docker_host, "PYTHONPATH": str(REPO),
               "PREFECT_HOME": str(tmp_path / "client-home")}

        def prefect(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
            r = subprocess.run([sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=timeout)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
            return r

        prefect("work-pool", "create", POOL, "--type", "docker")
        # the shipped deployment file, with this test's pool, image, mount and config
        spec = yaml.safe_load((REPO / "deploy" / "docker" / "prefect.yaml").read_text())
        dep, = spec["deployments"]
        dep["work_pool"]["name"] = POOL
        dep["work_pool"]["job_variables"].update(image=IMAGE, volumes=[f"{work}:{work}"])
        dep["parameters"]["config_path"] = str(config)
        (tmp_path / "prefect.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
        prefect("--no-prompt", "deploy", "--prefect-file", str(tmp_path / "prefect.yaml"), "--name", dep["name"])

        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type",
                                   "docker"], cwd=tmp_path, env={**env, "PREFECT_HOME": str(tmp_path / "worker-home")},
                                  stdout=open(tmp_path / "worker.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        out = prefect("deployment", "run", f"lmforge-pipeline/{dep['name']}").stdout
        fr_id = re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)
        fr = _wait_final(url, fr_id)
        log = lambda: (tmp_path / "worker.log").read_text()[-4000:]  # noqa: E731
        assert fr["state"]["type"] == "FAILED", (fr["state"], log())
        trs = {t["name"]: t["state"] for t in api(url, "/task_runs/filter",
                                                   {"flow_runs": {"id": {"any_": [fr_id]}}})}
        assert {n: (s["type"], s["name"]) for n, s in trs.items()} == {
            "ingest": ("COMPLETED", "Completed"), "shard": ("COMPLETED", "Completed"),
            "ingest_pairs": ("FAILED", "Failed"), "shard_pairs": ("CANCELLED", "NotRun")}, log()
        messages = _messages(url, fr_id)  # the stages' logs, sent from the container to the Prefect API
        assert _plans(messages) == [[["run", "ingest"], ["run", "shard"], ["run", "ingest_pairs"],
                                     ["run", "shard_pairs"]]], messages
        assert any(f"DataError: {work / 'data' / 'pairs.jsonl'}:6: invalid JSON" in m for m in messages), messages
        done = {p.parent.parent.name + "/" + p.parent.name: p.stat().st_mtime_ns
                for p in (work / "artifacts").glob("*/*/manifest.json")}
        assert sorted(k.split("/")[0] for k in done) == ["ingest", "shard"], done

        # fix the data, retry the same flow run: the worker starts a new container, which reruns only the failed part
        write_jsonl(work / "data" / "pairs.jsonl", PAIRS)
        prefect("flow-run", "retry", fr_id)
        time.sleep(2)
        fr = _wait_final(url, fr_id)
        assert fr["state"]["type"] == "COMPLETED" and fr["run_count"] == 2, (fr["state"], fr["run_count"], log())
        plans = _plans(_messages(url, fr_id))
        assert plans[-1] == [["cached", "ingest"], ["cached", "shard"], ["run", "ingest_pairs"],
                             ["run", "shard_pairs"]], plans
        after = {p.parent.parent.name + "/" + p.parent.name: p.stat().st_mtime_ns
                 for p in (work / "artifacts").glob("*/*/manifest.json")}
        assert {k: v for k, v in after.items() if k in done} == done  # the first run's artifacts untouched
        assert sorted(k.split("/")[0] for k in after) == ["ingest", "ingest", "shard", "shard"], after
    finally:
        _stop(worker)
        _stop(service)


def test_docker_deployment_runs_the_code_where_the_image_holds_it():
    """deploy/docker/prefect.yaml's pull step enters the folder the Dockerfile puts the checkout in, as the image's
    user, and its entrypoint and config exist there."""
    spec = yaml.safe_load((REPO / "deploy" / "docker" / "prefect.yaml").read_text())
    dockerfile = (REPO / "Dockerfile").read_text()
    workdir = re.search(r"^WORKDIR (\S+)$", dockerfile, re.M).group(1)
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": workdir}}]
    assert re.search(r"^USER lmforge$", dockerfile, re.M)
    dep, = spec["deployments"]
    path, func = dep["entrypoint"].split(":")
    assert (REPO / path).is_file() and f"def {func}(" in (REPO / path).read_text()
    assert (REPO / dep["parameters"]["config_path"]).is_file()
    assert dep["work_pool"]["job_variables"]["env"]["PREFECT_HOME"].startswith("/home/lmforge/")
