"""The container image (Dockerfile, `make image`, docs/image.md).

Default suite: .dockerignore leaves out everything git ignores. Slow: `make image` builds the image from a copy of
this checkout with the stack's state, a local store and MLflow's files planted in it; the container runs as a
non-root user and holds none of them; then `lmforge run` of a short pipeline (data stages and a tiny sft) inside a
container with host networking writes to the SeaweedFS S3 and the MLflow server of `lmforge stack` on the host, and
the host verifies every artifact against its manifest and finds the runs in MLflow.
The engine is docker when its daemon answers, else podman (../shared/tools/container-engine.sh sets it up where
there is no daemon); the base image is LMFORGE_TEST_BASE_IMAGE, else localhost/debian:bookworm when the engine has
it (no registry pull), else the Dockerfile's default python:3.11-slim.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, aws_environment, chat_rows, sft, stack_port, train_pipeline, write_jsonl

SECRET = "planted-" + secrets.token_hex(12)  # made at run time: this file (in the image) must not hold it


def _engine() -> str | None:
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0:
        return "docker"
    return "podman" if shutil.which("podman") else None


def _patterns(path: Path) -> set[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def test_dockerignore_leaves_out_what_git_ignores():
    """Each .gitignore line has its .dockerignore counterpart: a root-anchored one (`/x/`) as `x`, one that matches
    at any depth (`x/`, `*.y`) as `**/x`; the stack's state (.lmforge: the S3 secret key) is among them."""
    docker = _patterns(REPO / ".dockerignore")
    missing = []
    for pattern in _patterns(REPO / ".gitignore"):
        bare = pattern.strip("/")
        want = bare if pattern.startswith("/") else f"**/{bare}"
        if want not in docker:
            missing.append(f"{pattern} (as {want})")
    assert not missing, f".dockerignore lacks what .gitignore ignores: {missing}"
    assert {".lmforge", ".git", "artifacts", "mlflow.db", "**/.venv"} <= docker


def _lmforge(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**(env or os.environ), "PYTHONPATH": str(REPO)})


def _context(dest: Path) -> Path:
    """This checkout's files as git sees them (tracked and untracked, not ignored), plus what a user's checkout
    accumulates and must stay out of the image: the stack's state with its secret, a store, MLflow's files, a venv
    and bytecode."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    planted = {".lmforge/stack.json": json.dumps({"secret_key": SECRET}), "mlflow.db": SECRET,
               "artifacts/shard/x/manifest.json": SECRET, "mlartifacts/0/x": SECRET, ".venv/pyvenv.cfg": SECRET,
               "flows/__pycache__/x.cpython-311.pyc": SECRET, "bench/out/x.json": SECRET}
    for rel, text in planted.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(text)
    return dest


def _base_image(engine: str) -> str:
    if os.environ.get("LMFORGE_TEST_BASE_IMAGE"):
        return os.environ["LMFORGE_TEST_BASE_IMAGE"]
    local = "localhost/debian:bookworm"
    have = subprocess.run([engine, "image", "inspect", local], capture_output=True, timeout=60).returncode == 0
    return local if have else "python:3.11-slim"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


# slow: building the image installs the whole lock (minutes), and the run starts the stack and trains in a container;
# the default suite keeps the .dockerignore check above, and tests/test_stack.py runs the same pipeline kind on the host
@pytest.mark.slow
def test_image_runs_a_pipeline_on_the_host_stack(tmp_path):
    engine = _engine()
    if engine is None:
        pytest.skip("no container engine: neither a docker daemon nor podman (../shared/tools/container-engine.sh "
                    "installs podman)")
    image = "localhost/lmforge-test:latest"
    ctx = _context(tmp_path / "context")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    t0 = time.monotonic()
    build = subprocess.run(["make", "-C", str(REPO), "image", f"ENGINE={engine}", f"IMAGE={image}", f"CONTEXT={ctx}",
                            f"BASE_IMAGE={_base_image(engine)}"], capture_output=True, text=True, timeout=3600)
    build_s = time.monotonic() - t0
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    size = int(subprocess.run([engine, "image", "inspect", "--format", "{{.Size}}", image], capture_output=True,
                              text=True, check=True).stdout.strip())
    print(f"image {image}: built in {build_s:.0f} s, {size / 2**30:.2f} GiB")

    def in_image(*cmd: str) -> str:
        r = subprocess.run([engine, "run", "--rm", "--network", "host", image, *cmd], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    assert in_image("id", "-un").strip() == "lmforge" and in_image("id", "-u").strip() != "0"
    # torch's CPU build, from the wheel pip uses on this machine when its find-links folder holds it
    dist_info = "/opt/venv/lib/python3.11/site-packages/torch-2.13.0+cpu.dist-info"
    torch = json.loads(in_image("cat", f"{dist_info}/direct_url.json"))
    wheels = os.environ.get("PIP_FIND_LINKS") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True).stdout
    if wheels.split() and list(Path(wheels.split()[0]).glob("torch-2.13.0+cpu-*.whl")):
        assert torch["url"] == "file:///wheels/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl", torch
    top = set(in_image("ls", "-A", "/opt/lmforge").split())
    assert {"flows", "lmforge", "tasks", "trainer", "configs", "pyproject.toml"} <= top, top
    assert not top & {".lmforge", "mlflow.db", "artifacts", "mlartifacts", ".venv", ".git", "bench/out"}, top
    assert in_image("sh", "-c", "ls -d /opt/lmforge/bench/out 2>/dev/null; find /opt/lmforge -name __pycache__; "
                    f"grep -rl {SECRET} /opt/lmforge /home 2>/dev/null; true").strip() == ""

    # the stack on the host, the pipeline in the container with the stack's environment
    stack = tmp_path / "stack"
    ports = {"s3": stack_port(), "mlflow": stack_port(), "prefect": stack_port()}
    up = _lmforge("stack", "up", "--dir", str(stack), "--s3-port", str(ports["s3"]), "--mlflow-port",
                  str(ports["mlflow"]), "--prefect-port", str(ports["prefect"]), cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        env_out = _lmforge("stack", "env", "--dir", str(stack), cwd=tmp_path).stdout
        env = dict(line.removeprefix("export ").split("=", 1) for line in env_out.splitlines())
        work = tmp_path / "run"
        write_jsonl(work / "data" / "chat.jsonl", chat_rows(100))
        cfg = train_pipeline(work, {"sft": sft(method="full", max_steps=6, evaluate=False)})
        cfg.update(name="image", store="s3://lmforge/image", tracking="sqlite:///ignored.db")  # the env wins
        (work / "mlflow.db").unlink(missing_ok=True)
        (work / "pipeline.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        work.chmod(0o777)  # the container's user writes the summary here
        passed = [a for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                              "MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL", "PREFECT_API_URL")
                  for a in ("-e", f"{k}={env[k]}")]
        run = subprocess.run([engine, "run", "--rm", "--network", "host", "-v", f"{work}:/run-dir", "-w", "/run-dir",
                              *passed, image, "lmforge", "run", "pipeline.yaml", "--json", "summary.json"],
                             capture_output=True, text=True, timeout=1800)
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        assert not (work / "ignored.db").exists()
        summary = json.loads((work / "summary.json").read_text())
        assert sorted(summary["stages"]) == ["ingest", "sft", "shard", "tokenizer"]

        # from the host: every artifact is in the S3 store and matches its manifest; the build's commit is recorded
        from lmforge.store import ArtifactStore

        with aws_environment(env):
            store = ArtifactStore("s3://lmforge/image")
            for name, kind in (("ingest", "ingest"), ("shard", "shard"), ("tokenizer", "tokenizer"), ("sft", "sft")):
                art = store.get(kind, summary["stages"][name]["artifact_id"])
                assert art is not None, name
                art.verify()
                assert art.manifest["git_commit"] == (head or "unknown"), art.manifest["git_commit"]
            r = store.get("sft", summary["stages"]["sft"]["artifact_id"]).result
            assert r["steps"] == 6 and r["train_loss_last"] < r["train_loss_first"], r

        mlflow = env["MLFLOW_TRACKING_URI"]
        with urllib.request.urlopen(f"{mlflow}/api/2.0/mlflow/experiments/get-by-name?experiment_name=image") as resp:
            exp = json.load(resp)["experiment"]["experiment_id"]
        runs = _post(f"{mlflow}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp]})["runs"]
        parent = {r["info"]["run_id"]: r for r in runs}[summary["mlflow_run_id"]]
        children = [r for r in runs if {t["key"]: t["value"] for t in r["data"].get("tags", [])}.get(
            "mlflow.parentRunId") == parent["info"]["run_id"]]
        assert sorted(r["info"]["run_name"] for r in children) == ["ingest", "sft", "shard", "tokenizer"]
        assert {r["info"]["status"] for r in runs} == {"FINISHED"}
        sft_run = next(r for r in children if r["info"]["run_name"] == "sft")
        assert "train/loss" in {m["key"] for m in sft_run["data"].get("metrics", [])}
    finally:
        down = _lmforge("stack", "down", "--dir", str(stack), cwd=tmp_path)
        assert down.returncode == 0, down.stdout + down.stderr
