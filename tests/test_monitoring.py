"""Prometheus metrics: scraped over HTTP from a real training stage while it trains, collected by a real Prometheus
server, and the alert rules checked with promtool; data stages' states, durations, results, failures and retries.

One tiny Llama sft stage (tests/helpers.py) trains once per module, with the stage process's and
the training process's endpoints on free ports and a Prometheus server (deploy/prometheus/get-prometheus.sh: Debian's
package, unpacked into .venv/prometheus) scraping both every second.
"""
from __future__ import annotations

import json
import math
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from lmforge import monitoring
from lmforge.config import parse_config
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from tests.helpers import REPO, artifact, basic_config, sft, train_pipeline, write_jsonl

STEPS = 300  # tiny steps: seconds of training, so that a 1 s scrape interval sees it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, timeout: float = 2.0) -> dict[tuple[str, tuple], float] | None:
    """{(sample name, sorted labels): value} from http://127.0.0.1:port/metrics, or None when nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:  # noqa: S310
            text = r.read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    """The one sample `name` whose labels include `labels`."""
    found = [v for (n, lab), v in samples.items() if n == name and labels.items() <= dict(lab).items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def names(samples: dict) -> set[str]:
    return {n for n, _ in samples}


# ----------------------------------------------------------------------------------------------
# a Prometheus server


def prometheus_bin() -> Path:
    """The folder with `prometheus` and `promtool`, installed by deploy/prometheus/get-prometheus.sh if missing."""
    import shutil

    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        pytest.skip("Prometheus comes from Debian's package (apt-get download + dpkg -x): this host has no apt-get/dpkg")
    out = subprocess.run([str(REPO / "deploy" / "prometheus" / "get-prometheus.sh")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip().splitlines()[-1])


class Daemon:
    """A server binary on 127.0.0.1:<free port>, its log in `work`, stopped by its pid."""

    def __init__(self, bin_dir: Path, work: Path, name: str, args: list[str]):
        self.bin, self.work, self.port, self.name = bin_dir, work, free_port(), name
        work.mkdir(parents=True, exist_ok=True)
        self.log = open(work / f"{name}.log", "w")
        self.proc = subprocess.Popen([str(bin_dir / name), f"--web.listen-address=127.0.0.1:{self.port}", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.ready():
            assert self.proc.poll() is None, (work / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"{name} did not get ready in 60 s"
            time.sleep(0.2)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Prometheus(Daemon):
    def __init__(self, bin_dir: Path, work: Path, targets: dict[str, int]):
        work.mkdir(parents=True, exist_ok=True)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                                     for job, port in targets.items()]}
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        super().__init__(bin_dir, work, "prometheus", [f"--config.file={work / 'prometheus.yml'}",
                                                       f"--storage.tsdb.path={work / 'data'}"])

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]


# ----------------------------------------------------------------------------------------------
# one training stage, scraped while it trains


@pytest.fixture(scope="module")
def trained(root, kinds_module, tmp_path_factory):
    stage_port, training_port = free_port(), free_port()
    work = tmp_path_factory.mktemp("prometheus")
    prom: Prometheus | None = None
    gateway: Daemon | None = None
    why = None
    try:
        bin_dir = prometheus_bin()
    except pytest.skip.Exception as e:
        why = str(e)
    else:
        prom = Prometheus(bin_dir, work, {"lmforge-stages": stage_port, "lmforge-training": training_port})
        gateway = Daemon(bin_dir, work, "prometheus-pushgateway", [f"--persistence.file={work / 'pushgateway.data'}"])
    raw = train_pipeline(root, {"sft_prom": sft(method="full", max_steps=STEPS, checkpoint_every_steps=100)})
    raw["name"] = "mon"
    raw["monitoring"] = {"port": stage_port, "training_port": training_port, "push_interval_seconds": 1,
                         "pushgateway": f"http://127.0.0.1:{gateway.port}" if gateway else None}
    plan = make_plan(parse_config(raw, kinds_module, root=root), kinds_module)
    ctx = RunContext(plan=plan, kinds=kinds_module)
    done: dict[str, Any] = {}

    def train():
        try:
            done["out"] = [execute_stage(ctx, n) for n in ("tokenizer", "sft_prom")]  # tokenizer: cached
        except BaseException as e:  # noqa: BLE001  re-raised below
            done["error"] = e

    scrapes: list[tuple[dict, dict | None]] = []  # (training process, stage process) while the training runs
    thread = threading.Thread(target=train)
    thread.start()
    try:
        while thread.is_alive():
            t = scrape(training_port, timeout=1)
            if t is not None:
                scrapes.append((t, scrape(stage_port, timeout=1)))
            time.sleep(0.2)
        thread.join()
        if "error" in done:
            raise done["error"]
        if prom is not None:  # its last scrape of the stage process sees the stage succeeded
            deadline = time.monotonic() + 20
            while not prom.query('lmforge_stage_state{stage="sft_prom",state="succeeded"} == 1'):
                assert time.monotonic() < deadline, "Prometheus never scraped the finished stage"
                time.sleep(0.5)
        yield {"plan": plan, "scrapes": scrapes, "after": scrape(stage_port), "prom": prom, "gateway": gateway,
               "why_no_prom": why}
    finally:
        monitoring.shutdown()
        for daemon in (prom, gateway):
            if daemon is not None:
                daemon.stop()


def test_training_metrics_scraped_over_http_while_it_trains(trained):
    scrapes = trained["scrapes"]
    r = artifact(trained["plan"], "sft_prom").result
    assert r["steps"] == STEPS
    labels = {"pipeline": "mon", "stage": "sft_prom", "kind": "sft"}
    mid = [t for t, _ in scrapes if 0 < value(t, "lmforge_train_step", **labels) < STEPS]
    assert mid, f"no scrape while steps ran ({len(scrapes)} scrapes)"
    last = scrapes[-1][0]
    step = value(last, "lmforge_train_step", **labels)
    assert 0 < step <= STEPS and value(last, "lmforge_train_max_steps", **labels) == STEPS
    loss = value(last, "lmforge_train_loss", **labels)
    assert math.isfinite(loss) and 0 < loss < 10  # cross-entropy over a ~300-token vocabulary starts near ln(288)
    assert value(last, "lmforge_train_learning_rate", **labels) > 0
    assert value(last, "lmforge_train_tokens_per_second", **labels) > 0
    assert value(last, "lmforge_train_samples_per_second", **labels) > 0
    assert 0 < value(last, "lmforge_train_tokens_total", **labels) <= r["tokens"]
    assert value(last, "lmforge_train_samples_total", **labels) % 8 == 0  # batch 8, one device, no accumulation
    # one step time and one data wait per optimizer step (read a moment apart while steps run: at most one apart)
    for t in mid:
        steps = value(t, "lmforge_train_step", **labels)
        assert abs(value(t, "lmforge_train_step_seconds_count", **labels) - steps) <= 1
        assert abs(value(t, "lmforge_train_data_wait_seconds_count", **labels) - steps) <= 1
        assert value(t, "lmforge_train_samples_total", **labels) in (8 * steps, 8 * (steps + 1))
    assert value(last, "lmforge_train_step_seconds_sum", **labels) > 0
    wait, compute = (value(last, f"lmforge_train_{m}_seconds_sum", **labels) for m in ("data_wait", "step"))
    assert 0 < wait < compute * 5  # a tiny in-memory dataset: waiting on it is not most of the time
    # checkpoints at steps 100 and 200 (the final model is the artifact, not a checkpoint)
    uploads = max(value(t, "lmforge_checkpoint_upload_seconds_count", **labels) for t, _ in scrapes)
    assert uploads in (1, 2) and r["checkpoints_uploaded"] == [100, 200]
    assert value(last, "lmforge_checkpoint_upload_seconds_sum", **labels) > 0
    assert time.time() - 600 < value(last, "lmforge_checkpoint_last_upload_timestamp_seconds", **labels) < time.time()
    assert not any(n.startswith("lmforge_gpu_") for n in names(last))  # no NVML / no GPU here: left out cleanly
    # the stage process meanwhile: the stage is running, its duration grows; afterwards it succeeded
    during = [s for t, s in scrapes if s is not None and t in mid]
    assert during and all(value(s, "lmforge_stage_state", stage="sft_prom", state="running") == 1 for s in during)
    assert all(value(s, "lmforge_stage_state", stage="sft_prom", state="succeeded") == 0 for s in during)
    assert all(value(s, "lmforge_stage_duration_seconds", stage="sft_prom") > 0 for s in during)
    after = trained["after"]
    mon = {"pipeline": "mon"}
    assert value(after, "lmforge_stage_state", stage="sft_prom", state="succeeded", **mon) == 1
    assert value(after, "lmforge_stage_state", stage="sft_prom", state="running", **mon) == 0
    assert value(after, "lmforge_stage_state", stage="tokenizer", state="cached", kind="tokenizer", **mon) == 1
    manifest_seconds = artifact(trained["plan"], "sft_prom").manifest["timings"]["seconds"]
    assert value(after, "lmforge_stage_duration_seconds", stage="sft_prom", **mon) == pytest.approx(manifest_seconds,
                                                                                                    abs=2)
    assert value(after, "lmforge_stage_result", stage="sft_prom", field="steps", **mon) == STEPS
    import psutil

    assert value(after, "lmforge_host_memory_total_bytes") == psutil.virtual_memory().total
    assert 0 <= value(after, "lmforge_host_cpu_percent") <= 100


def test_prometheus_server_scrapes_both_endpoints_and_the_deploy_files_check(trained):
    prom = trained["prom"]
    if prom is None:
        pytest.skip(trained["why_no_prom"])
    # the training process is gone: its last real samples, behind the staleness marker
    tokens = prom.query('last_over_time(lmforge_train_tokens_total{stage="sft_prom"}[10m])')
    assert len(tokens) == 1 and tokens[0]["metric"]["job"] == "lmforge-training"
    assert 0 < float(tokens[0]["value"][1]) <= artifact(trained["plan"], "sft_prom").result["tokens"]
    steps = prom.query('max_over_time(lmforge_train_step{stage="sft_prom"}[10m])')
    assert len(steps) == 1 and 0 < float(steps[0]["value"][1]) <= STEPS  # scraped while steps ran
    loss = prom.query('last_over_time(lmforge_train_loss{pipeline="mon",kind="sft"}[10m])')
    assert len(loss) == 1 and math.isfinite(float(loss[0]["value"][1]))
    up = {r["metric"]["job"]: float(r["value"][1]) for r in prom.query("max_over_time(up[10m])")}
    assert up == {"lmforge-stages": 1.0, "lmforge-training": 1.0}
    state = prom.query('lmforge_stage_state{stage="sft_prom",state="succeeded"}')
    assert [(r["metric"]["job"], r["value"][1]) for r in state] == [("lmforge-stages", "1")]
    # the shipped rules and config: valid, and the alerts fire when (and only when) they should
    promtool = str(prom.bin / "promtool")
    deploy = REPO / "deploy" / "prometheus"
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        out = subprocess.run([promtool, *args], cwd=deploy, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        assert "SUCCESS" in out.stdout + out.stderr
    # every lmforge metric that the alerts and the dashboard query is one that lmforge exports
    exported = names(trained["after"]) | names(trained["scrapes"][-1][0]) | {
        f"lmforge_gpu_{m}" for m in ("utilization_percent", "memory_used_bytes", "memory_total_bytes",
                                     "temperature_celsius")} | {"lmforge_stage_failures_total",
                                                               "lmforge_stage_retries_total"}
    exported |= {n.rsplit("_", 1)[0] for n in exported if n.endswith(("_sum", "_count", "_bucket"))}
    import re

    used = set(re.findall(r"lmforge_[a-z_]+", (deploy / "alerts.yml").read_text()))
    used |= set(re.findall(r"lmforge_[a-z_]+", (REPO / "deploy" / "grafana" / "lmforge.json").read_text()))
    assert used - {"lmforge_stage_failures", "lmforge_stage_retries"} <= exported, used - exported
    dashboard = json.loads((REPO / "deploy" / "grafana" / "lmforge.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r"\$__range", "1h", target["expr"]).replace("$pipeline", ".*").replace("$stage", ".*")
            prom.query(expr)  # every panel's query parses and runs


def test_both_processes_push_to_a_real_pushgateway(trained):
    gateway = trained["gateway"]
    if gateway is None:
        pytest.skip(trained["why_no_prom"])
    r = artifact(trained["plan"], "sft_prom").result
    # the training process pushed once more as it exited: its final figures, exactly
    pushed = scrape(gateway.port)
    group = {"job": "lmforge", "process": "training", "pipeline": "mon", "stage": "sft_prom", "kind": "sft"}
    assert value(pushed, "lmforge_train_step", **group) == STEPS
    assert value(pushed, "lmforge_train_tokens_total", **group) == r["tokens"]
    assert value(pushed, "lmforge_train_samples_total", **group) == 8 * STEPS
    assert value(pushed, "lmforge_train_step_seconds_count", **group) == STEPS
    assert value(pushed, "lmforge_train_data_wait_seconds_count", **group) == STEPS
    assert value(pushed, "lmforge_checkpoint_upload_seconds_count", **group) == 2
    # the stage process pushes every second: the stage's final state arrives
    deadline = time.monotonic() + 15
    while True:
        pushed = scrape(gateway.port)
        done = [v for (n, lab), v in pushed.items() if n == "lmforge_stage_state" and dict(lab).get("process") ==
                "stages" and dict(lab).get("stage") == "sft_prom" and dict(lab)["state"] == "succeeded"]
        if done == [1.0]:
            break
        assert time.monotonic() < deadline, done
        time.sleep(0.5)


# ----------------------------------------------------------------------------------------------
# data stages


def test_data_stages_states_durations_results_failures_and_retries(tmp_path, kinds):
    port = free_port()
    raw = basic_config(tmp_path, n=50)
    raw["name"] = "mondata"
    raw["monitoring"] = {"port": port}
    plan = make_plan(parse_config(raw, kinds, root=tmp_path), kinds)
    ctx = RunContext(plan=plan, kinds=kinds, flow_run={"id": "flow-1"})
    try:
        for name in ("ingest", "shard"):
            execute_stage(ctx, name)
        s = scrape(port)
        assert s is not None, "the stage process serves no metrics"
        for name, kind in (("ingest", "ingest"), ("shard", "shard")):
            states = {st: value(s, "lmforge_stage_state", pipeline="mondata", stage=name, kind=kind, state=st)
                      for st in monitoring.STATES}
            assert states == {"pending": 0, "running": 0, "succeeded": 1, "cached": 0, "failed": 0}
            assert 0 < value(s, "lmforge_stage_duration_seconds", pipeline="mondata", stage=name) < 60
        ingest = artifact(plan, "ingest").result
        assert ingest["records"] == 50
        assert value(s, "lmforge_stage_result", pipeline="mondata", stage="ingest", field="records") == 50
        assert value(s, "lmforge_stage_result", pipeline="mondata", stage="ingest", field="rows_read") == 50
        shard = artifact(plan, "shard").result
        assert shard["train_samples"] + shard["validation_samples"] == 50
        assert value(s, "lmforge_stage_result", pipeline="mondata", stage="shard",
                     field="train_samples") == shard["train_samples"]
        # a second run finds the artifacts: cached
        execute_stage(RunContext(plan=plan, kinds=kinds, flow_run={"id": "flow-2"}), "ingest")
        s = scrape(port)
        assert value(s, "lmforge_stage_state", pipeline="mondata", stage="ingest", state="cached") == 1
        assert value(s, "lmforge_stage_state", pipeline="mondata", stage="ingest", state="succeeded") == 0
        # a dataset file that changed after planning fails its ingest; the retry in the same flow run fails too
        write_jsonl(tmp_path / "data" / "pairs.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
        for _ in range(2):
            with pytest.raises(Exception, match="pairs.jsonl"):
                execute_stage(ctx, "ingest_pairs")
        s = scrape(port)
        labels = {"pipeline": "mondata", "stage": "ingest_pairs", "kind": "ingest"}
        assert value(s, "lmforge_stage_state", state="failed", **labels) == 1
        assert value(s, "lmforge_stage_state", state="running", **labels) == 0
        assert value(s, "lmforge_stage_failures_total", **labels) == 2
        assert value(s, "lmforge_stage_retries_total", **labels) == 1
        assert ("lmforge_stage_retries_total", tuple(sorted({"pipeline": "mondata", "stage": "ingest",
                                                             "kind": "ingest"}.items()))) not in s
    finally:
        monitoring.shutdown()


def test_monitoring_is_off_by_default_and_never_changes_an_artifact_id(tmp_path, kinds):
    raw = basic_config(tmp_path)
    plain = make_plan(parse_config(raw, kinds, root=tmp_path), kinds)
    assert plain.cfg.monitoring.port == 0 and monitoring.for_training(plain.cfg, "sft", "sft") is None
    raw["monitoring"] = {"port": 9400, "pushgateway": "http://127.0.0.1:9091"}
    watched = make_plan(parse_config(raw, kinds, root=tmp_path), kinds)
    assert {n: sp.artifact_id for n, sp in watched.stages.items()} == {n: sp.artifact_id
                                                                       for n, sp in plain.stages.items()}
    spec = monitoring.for_training(watched.cfg, "sft", "sft")
    assert (spec.port, spec.address, spec.pushgateway) == (9401, "127.0.0.1", "http://127.0.0.1:9091")
    # the monitoring code is no part of any stage's code fingerprint: editing it keeps every artifact
    from lmforge import fingerprint

    for kind in kinds:
        mods = fingerprint.for_stage(kinds[kind]).modules
        assert not {"lmforge/monitoring.py", "trainer/monitoring.py"} & set(mods), kind
    assert "trainer/checkpoint.py" in fingerprint.for_stage(kinds["sft"]).modules  # which imports trainer.monitoring
