"""Deployments as a user runs them: a real `prefect server start` on 127.0.0.1, `lmforge deploy`, `prefect deployment
run`, a real process worker (`lmforge worker --run-once`: Prefect's process worker with an exit status), then
`lmforge status` and `lmforge rerun`.

One server for the module (it is slow to start on a loaded machine). The pipeline is the tiny data-only one of
tests/helpers.py basic_config (four stages), so a worker run is short, most of it imports.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from flows.flowrun import PROJECT_ROOT, resolve_config_path
from tests.helpers import REPO, basic_config, write_config, write_jsonl

POOL = "lmforge-test"
STAGES = ["ingest", "shard", "ingest_pairs", "shard_pairs"]
BAD_PAIRS = ["datasets.pairs.path=data/pairs_bad.jsonl"]


@pytest.fixture(scope="module")
def server(prefect_server):
    """The session's real Prefect server (tests/conftest.py)."""
    return prefect_server


def api(url: str, path: str, body: dict | None = None):
    req = urllib.request.Request(url + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"}, method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def client_env(url: str) -> dict[str, str]:
    """What a user's shell (and the worker) has: the server's URL and this checkout's code."""
    return {**os.environ, "PREFECT_API_URL": url, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def sh(url: str, args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=client_env(url), capture_output=True, text=True, timeout=timeout)


def lmforge(url: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return sh(url, [sys.executable, "-m", "flows.cli", *args], cwd)


def trigger_and_work(url: str, cwd: Path, params: dict | None = None,
                     deployment: str = "lmforge-pipeline/t") -> tuple[str, subprocess.CompletedProcess]:
    """`prefect deployment run` then `lmforge worker --run-once`: (flow run id, the worker's process)."""
    run = sh(url, [sys.executable, "-m", "prefect", "deployment", "run", deployment,
                   *(["--params", json.dumps(params)] if params else [])], cwd)
    assert run.returncode == 0, run.stdout + run.stderr
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", run.stdout).group(1)
    worker = lmforge(url, "worker", "--pool", POOL, "--run-once", cwd=cwd)
    return flow_run_id, worker


def worker_report(worker: subprocess.CompletedProcess) -> list[str]:
    """The lines `lmforge worker` prints once it stopped: one per flow run (and its cause), then the summary."""
    lines = worker.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("flow run "))
    return lines[first:]


def task_runs(url: str, flow_run_id: str) -> dict[str, dict]:
    trs = api(url, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
    return {t["name"]: t for t in trs}


def log_lines(url: str, flow_run_id: str) -> list[tuple[str, str]]:
    logs = api(url, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200,
                                     "sort": "TIMESTAMP_ASC"})
    return [(r["name"], r["message"]) for r in logs]


def manifests(store: Path) -> dict[str, dict]:
    return {f"{p.parent.parent.name}/{p.parent.name}": json.loads(p.read_text()) for p in store.glob("*/*/manifest.json")}


@pytest.fixture(scope="module")
def deployed(server, tmp_path_factory):
    """The tiny pipeline deployed with `lmforge deploy`, and one deployment run of it by a process worker."""
    tmp = tmp_path_factory.mktemp("deploy")
    cfg = write_config(tmp, basic_config(tmp))
    out = lmforge(server, "deploy", str(cfg), "--name", "t", "--pool", POOL, cwd=tmp)
    assert out.returncode == 0, out.stdout + out.stderr
    flow_run_id, worker = trigger_and_work(server, tmp)
    return {"url": server, "tmp": tmp, "cfg": cfg, "deploy_out": out.stdout, "flow_run_id": flow_run_id,
            "worker": worker}


def test_resolve_config_path_against_project_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a worker's flow run starts in a temp folder
    assert resolve_config_path("configs/demo.yaml") == str(PROJECT_ROOT / "configs/demo.yaml")
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/demo.yaml").write_text("{}")
    assert resolve_config_path("configs/demo.yaml") == str(tmp_path / "configs/demo.yaml")  # the CLI's cwd first
    assert resolve_config_path("/abs/x.yaml") == "/abs/x.yaml"


def test_prefect_yaml_names_the_worker_with_an_exit_status():
    """prefect.yaml, `lmforge deploy` and the README start the same worker: `lmforge worker` (Prefect's process worker,
    whose --run-once exits non-zero when a flow run failed, unlike `prefect worker start --run-once`)."""
    text = (PROJECT_ROOT / "prefect.yaml").read_text()
    assert re.search(r"^#\s+lmforge worker --pool lmforge\s", text, re.M)
    assert not re.search(r"^#\s+prefect worker start", text, re.M)
    assert "lmforge worker --pool lmforge" in (PROJECT_ROOT / "docs" / "operations.md").read_text()


def test_deploy_registers_manual_and_nightly(deployed):
    url = deployed["url"]
    assert api(url, f"/work_pools/{POOL}")["type"] == "process"  # created by lmforge deploy
    manual = api(url, "/deployments/name/lmforge-pipeline/t")
    nightly = api(url, "/deployments/name/lmforge-pipeline/t-nightly")
    assert manual["schedules"] == []
    assert [(s["schedule"]["cron"], s["schedule"]["timezone"], s["active"]) for s in nightly["schedules"]] == \
        [("0 3 * * *", "UTC", True)]
    for d in (manual, nightly):
        assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
        assert d["parameters"] == {"config_path": str(deployed["cfg"]), "overrides": [], "force": []}
        assert d["work_pool_name"] == POOL and d["entrypoint"] == "flows/pipeline.py:pipeline"
    assert f"\n  lmforge worker --pool {POOL}\n" in deployed["deploy_out"]  # the worker with an exit status
    assert "prefect deployment run lmforge-pipeline/t" in deployed["deploy_out"]


def test_deployment_run_is_a_cli_run(deployed):
    url, tmp, fr_id = deployed["url"], deployed["tmp"], deployed["flow_run_id"]
    assert deployed["worker"].returncode == 0, deployed["worker"].stdout[-3000:] + deployed["worker"].stderr[-3000:]
    assert api(url, f"/flow_runs/{fr_id}")["state"]["type"] == "COMPLETED", deployed["worker"].stderr[-3000:]
    name = api(url, f"/flow_runs/{fr_id}")["name"]
    assert worker_report(deployed["worker"]) == [f"flow run {fr_id} {name}: Completed",
                                                 f"lmforge worker: 1 flow run(s) in pool '{POOL}': 1 Completed; exit 0"]
    made = manifests(tmp / "artifacts")
    assert len(made) == 4 and {m["produced_by"]["flow_run_id"] for m in made.values()} == {fr_id}

    # a CLI run of the same config finds every artifact the deployment run made: same ids, nothing rewritten
    before = {p: p.read_bytes() for p in (tmp / "artifacts").glob("*/*/manifest.json")}
    cli = lmforge(url, "run", str(deployed["cfg"]), "--json", str(tmp / "cli.json"), cwd=tmp)
    assert cli.returncode == 0, cli.stderr[-3000:]
    summary = json.loads((tmp / "cli.json").read_text())
    assert (summary["ran"], summary["cached"]) == (0, 4)
    assert {f"{m['kind']}/{m['artifact_id']}" for m in made.values()} == \
        {f"{s['uri'].split('/')[-2]}/{s['artifact_id']}" for s in summary["stages"].values()}
    assert {p: p.read_bytes() for p in (tmp / "artifacts").glob("*/*/manifest.json")} == before

    # the MLflow parent of the deployment run: the checkout's commit and the config's absolute path
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    exp = client.get_experiment_by_name("t")
    parent, = client.search_runs([exp.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{fr_id}' and "
                                                                    "tags.`lmforge.pipeline` = 't'")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert re.fullmatch(re.escape(head) + "(-dirty)?", parent.data.tags["lmforge.git_commit"])
    assert parent.data.tags["lmforge.config_path"] == str(deployed["cfg"])
    assert parent.info.status == "FINISHED"

    # the stage logs, plan first, reached the Prefect API (the UI's log tab) with their task runs
    logs = log_lines(url, fr_id)
    plan = [m for n, m in logs if n == "flows.pipeline" and m.startswith("plan:\n")]
    assert len(plan) == 1
    assert [line.split()[:2] for line in plan[0].splitlines()[-4:]] == [["run", s] for s in STAGES]
    assert sorted(m.split(": done in ")[0] for n, m in logs if n == "lmforge.executor" and ": done in " in m) == \
        [f"stage {s}" for s in sorted(STAGES)]


def test_failed_stage_not_run_status_and_rerun(deployed):
    url, tmp = deployed["url"], deployed["tmp"]
    write_jsonl(tmp / "data/pairs_bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, "not json"])
    fr_id, worker = trigger_and_work(url, tmp, {"overrides": BAD_PAIRS})
    assert worker.returncode == 1, worker.stdout[-3000:] + worker.stderr[-3000:]  # `prefect worker start` exits 0
    fr = api(url, f"/flow_runs/{fr_id}")
    assert fr["state"]["type"] == "FAILED"
    report = worker_report(worker)
    assert report[0] == f"flow run {fr_id} {fr['name']}: Failed: Flow run encountered an exception: StageFailed: " \
                        "2 stage(s) failed:"
    assert report[1].startswith(f"  - stage 'ingest_pairs': DataError: {tmp / 'data/pairs_bad.jsonl'}:2: invalid JSON")
    assert report[2] == "  - stage 'shard_pairs': not run: upstream ingest_pairs failed"
    assert report[-1] == f"lmforge worker: 1 flow run(s) in pool '{POOL}': 1 Failed; exit 1"
    trs = task_runs(url, fr_id)
    assert {n: (t["state"]["type"], t["state"]["name"]) for n, t in trs.items()} == {
        "ingest": ("COMPLETED", "Completed"), "shard": ("COMPLETED", "Completed"),
        "ingest_pairs": ("FAILED", "Failed"), "shard_pairs": ("CANCELLED", "NotRun")}
    assert trs["shard_pairs"]["state"]["message"] == "upstream ingest_pairs failed"
    messages = [m for _, m in log_lines(url, fr_id)]
    plan, = [m for m in messages if m.startswith("plan:\n")]
    assert [line.split()[:2] for line in plan.splitlines()[-4:]] == \
        [["cached", "ingest"], ["cached", "shard"], ["run", "ingest_pairs"], ["run", "shard_pairs"]]
    assert [m.split(" /")[0] for m in messages if ": cached " in m] == ["stage ingest: cached", "stage shard: cached"]
    assert "stage shard_pairs: NotRun: upstream ingest_pairs failed" in messages

    st = lmforge(url, "status", fr_id, "--json", cwd=tmp)
    assert st.returncode == 0, st.stderr[-3000:]
    st = json.loads(st.stdout)
    assert st["flow_run_id"] == fr_id and st["deployment"] == "t" and st["state"] == "Failed"
    assert st["parameters"]["overrides"] == BAD_PAIRS
    rows = {s["stage"]: s for s in st["stages"]}
    assert [s["stage"] for s in st["stages"]] == STAGES
    assert {n: (s["state"], s["in_store"], s["cached"]) for n, s in rows.items()} == {
        "ingest": ("Completed", True, True), "shard": ("Completed", True, True),
        "ingest_pairs": ("Failed", False, None), "shard_pairs": ("NotRun", False, None)}
    assert rows["ingest_pairs"]["error"].startswith(
        f"Task run encountered an exception DataError: {tmp / 'data/pairs_bad.jsonl'}:2: invalid JSON")
    assert rows["shard_pairs"]["error"] == "upstream ingest_pairs failed"
    text = lmforge(url, "status", fr_id, cwd=tmp).stdout
    assert re.search(r"^  shard_pairs +NotRun +shard/[0-9a-f]{16} \(absent\) +- .* upstream ingest_pairs failed$",
                     text, re.M), text

    # fix the data, rerun that flow run: only the failed stage and its dependant run
    write_jsonl(tmp / "data/pairs_bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    rerun = lmforge(url, "rerun", fr_id, "--json", str(tmp / "rerun.json"), cwd=tmp)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((tmp / "rerun.json").read_text())
    assert {n: s["status"] for n, s in summary["stages"].items()} == \
        {"ingest": "cached", "shard": "cached", "ingest_pairs": "ran", "shard_pairs": "ran"}
    latest = json.loads(lmforge(url, "status", "--json", cwd=tmp).stdout)  # default: the latest flow run
    assert latest["flow_run_id"] == summary["flow_run_id"] and latest["state"] == "Completed"
    assert {s["stage"]: (s["state"], s["cached"]) for s in latest["stages"]} == {
        "ingest": ("Completed", True), "shard": ("Completed", True),
        "ingest_pairs": ("Completed", False), "shard_pairs": ("Completed", False)}
    assert api(url, f"/flow_runs/{summary['flow_run_id']}")["tags"] == [f"rerun-of:{fr_id}"]


def test_worker_exits_4_naming_the_missing_pull_folder(deployed):
    """A deployment whose pull step folder is gone (the checkout moved): the flow run crashes before any stage, and
    `lmforge worker --run-once` exits 4 and names the folder (Prefect prints it on the console only)."""
    url, tmp = deployed["url"], deployed["tmp"]
    manual = api(url, "/deployments/name/lmforge-pipeline/t")
    gone = tmp / "moved-away"
    api(url, "/deployments/", {"name": "t-moved", "flow_id": manual["flow_id"], "work_pool_name": POOL,
                               "entrypoint": manual["entrypoint"], "parameters": manual["parameters"],
                               "pull_steps": [{"prefect.deployments.steps.set_working_directory":
                                               {"directory": str(gone)}}]})
    fr_id, worker = trigger_and_work(url, tmp, deployment="lmforge-pipeline/t-moved")
    assert worker.returncode == 4, worker.stdout[-3000:] + worker.stderr[-3000:]
    fr = api(url, f"/flow_runs/{fr_id}")
    assert fr["state"]["type"] == "CRASHED" and task_runs(url, fr_id) == {}
    assert worker_report(worker) == [
        f"flow run {fr_id} {fr['name']}: Crashed: {fr['state']['message']}",
        f"  cause: the pull step's folder {gone} does not exist on this machine (set_working_directory of deployment "
        "'t-moved'): the checkout moved or was deleted. Run `lmforge deploy` again from the checkout, or put the "
        "checkout back at that path",
        f"lmforge worker: 1 flow run(s) in pool '{POOL}': 1 Crashed; exit 4"]
    assert fr["state"]["message"].startswith("Process exited with status code: 1")


def test_worker_with_nothing_waiting_and_a_missing_pool(deployed):
    url, tmp = deployed["url"], deployed["tmp"]
    idle = lmforge(url, "worker", "--pool", POOL, "--run-once", cwd=tmp)
    assert idle.returncode == 0, idle.stderr[-3000:]
    assert idle.stdout.splitlines() == [f"lmforge worker: no flow run was waiting in work pool '{POOL}'; nothing ran"]
    missing = lmforge(url, "worker", "--pool", "no-such-pool", "--run-once", cwd=tmp)
    assert missing.returncode == 2 and missing.stdout == ""
    assert "--pool no-such-pool: no work pool 'no-such-pool' in the Prefect API at hand" in missing.stderr
    assert "no-such-pool" not in {p["name"] for p in api(url, "/work_pools/filter", {})}  # not created
