"""Prometheus metrics of a pipeline run: an HTTP endpoint in each process that does work, and/or a Pushgateway.

Two kinds of process export metrics, each its own (pipeline-level `monitoring:` config, `MonitoringConfig`):

    stage process     `lmforge run` (or a worker): http://address:port/metrics
                      lmforge_stage_state{pipeline,stage,kind,state}   1 for the stage's state, 0 for the others;
                          states: pending (planned, checking the store, waiting for a lease), running, succeeded,
                          cached, failed
                      lmforge_stage_duration_seconds{pipeline,stage,kind}   the latest attempt; grows while it runs
                      lmforge_stage_failures_total, lmforge_stage_retries_total{pipeline,stage,kind}
                      lmforge_stage_result{pipeline,stage,kind,field}   the numbers of a finished stage's result
                          (records, rows_read, train_samples, ..., as in the manifest and MLflow)
                      lmforge_host_cpu_percent, lmforge_host_memory_used_bytes, lmforge_host_memory_total_bytes
    training process  `python -m trainer.entry` on rank 0: http://address:training_port/metrics (port + 1 unless
                      set), the lmforge_train_*, lmforge_checkpoint_* and lmforge_gpu_* metrics (trainer.monitoring)

Either process pushes the same metrics to `pushgateway` (job `lmforge`) every `push_interval_seconds` and when it
exits. Stage metrics are kept whether or not anything serves them (a dict update per state change); the
endpoint, the host and GPU collectors and the pusher start only when configured. GPU metrics come from NVML
(`pynvml`, from the nvidia-ml-py package) only where it imports and finds a GPU; elsewhere they are left out.
This module shapes no artifact (fingerprint.EXCLUDED).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, push_to_gateway, start_http_server
from prometheus_client.core import GaugeMetricFamily
from lmforge.config import MonitoringConfig, PipelineConfig, TrainingMonitoring

log = logging.getLogger(__name__)

STAGE_LABELS = ("pipeline", "stage", "kind")
STATES = ("pending", "running", "succeeded", "cached", "failed")
JOB = "lmforge"  # the Pushgateway job

FAILURES = Counter("lmforge_stage_failures", "Stage attempts that failed.", STAGE_LABELS)
RETRIES = Counter("lmforge_stage_retries", "Stage attempts after the first in one flow run (Prefect retries).",
                  STAGE_LABELS)
RESULT = Gauge("lmforge_stage_result", "A number from the result of the stage's latest artifact (records, bytes, "
               "...), under its field name.", (*STAGE_LABELS, "field"))


def for_training(cfg: PipelineConfig, stage: str, kind: str) -> TrainingMonitoring | None:
    m = cfg.monitoring
    if not (m.training_port_resolved or m.pushgateway):
        return None
    return TrainingMonitoring(pipeline=cfg.name, stage=stage, kind=kind, port=m.training_port_resolved,
                              address=m.address, pushgateway=m.pushgateway,
                              push_interval_seconds=m.push_interval_seconds)


# ----------------------------------------------------------------------------------------------
# stage states (stage process)


@dataclass
class _Stage:
    kind: str
    state: str = "pending"
    started: float | None = None  # wall clock of the running attempt's start
    ended: float | None = None


class _StageCollector:
    """lmforge_stage_state and lmforge_stage_duration_seconds, read at scrape time (a running stage's duration grows)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stages: dict[tuple[str, str], _Stage] = {}
        self.attempts: dict[tuple[str, str, str], int] = {}  # (pipeline, stage, flow run id) -> attempts seen

    def describe(self):
        return [GaugeMetricFamily("lmforge_stage_state", "1 for the stage's current state, 0 for the others.",
                                  labels=[*STAGE_LABELS, "state"]),
                GaugeMetricFamily("lmforge_stage_duration_seconds", "Run time of the stage's latest attempt; grows "
                                  "while it runs.", labels=list(STAGE_LABELS))]

    def collect(self):
        state, duration = self.describe()
        now = time.time()
        with self.lock:
            for (pipeline, stage), s in sorted(self.stages.items()):
                for name in STATES:
                    state.add_metric([pipeline, stage, s.kind, name], float(s.state == name))
                if s.started is not None:
                    duration.add_metric([pipeline, stage, s.kind], (s.ended or now) - s.started)
        yield state
        yield duration


STAGES = _StageCollector()
REGISTRY.register(STAGES)


@contextlib.contextmanager
def stage(cfg: PipelineConfig, name: str, kind: str, flow_run: str | None = None) -> Iterator["StageWatch"]:
    """Around one attempt of a stage (lmforge.executor.execute_stage): pending on the way in, failed (and counted)
    when it raises; the body reports `running` and how it ended. Starts the configured endpoint and pusher."""
    expose(cfg.monitoring, "stages")
    watch = StageWatch(cfg.name, name, kind)
    with STAGES.lock:
        STAGES.stages[(cfg.name, name)] = _Stage(kind)
        if flow_run:  # the same flow run again: Prefect retries the task, or `prefect flow-run retry`
            key = (cfg.name, name, flow_run)
            STAGES.attempts[key] = STAGES.attempts.get(key, 0) + 1
            if STAGES.attempts[key] > 1:
                RETRIES.labels(*watch.labels).inc()
    try:
        yield watch
    except BaseException:
        watch.set("failed")
        FAILURES.labels(*watch.labels).inc()
        raise


@dataclass(frozen=True)
class StageWatch:
    pipeline: str
    stage: str
    kind: str

    @property
    def labels(self) -> tuple[str, str, str]:
        return self.pipeline, self.stage, self.kind

    def set(self, state: str) -> None:
        now = time.time()
        with STAGES.lock:
            s = STAGES.stages.setdefault((self.pipeline, self.stage), _Stage(self.kind))
            s.state = state
            if state == "running":
                s.started, s.ended = now, None
            elif state in ("succeeded", "failed") and s.started is not None and s.ended is None:
                s.ended = now

    def result(self, numbers: dict[str, float]) -> None:
        for field, value in numbers.items():
            RESULT.labels(*self.labels, field).set(value)


def stage_running(pipeline: str, stage: str) -> None:
    """The stage's own work starts (after the cache check and the lease)."""
    with STAGES.lock:
        s = STAGES.stages.get((pipeline, stage))
    if s is not None:
        StageWatch(pipeline, stage, s.kind).set("running")


# ----------------------------------------------------------------------------------------------
# host and GPU collectors


class HostCollector:
    """Host CPU and memory (psutil), read at scrape time."""

    def __init__(self):
        import psutil

        self.psutil = psutil
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement

    def describe(self):
        return []  # read only when scraped, never at registration

    def collect(self):
        vm = self.psutil.virtual_memory()
        yield GaugeMetricFamily("lmforge_host_cpu_percent", "Host CPU use since the previous scrape, percent of all "
                                "cores.", value=self.psutil.cpu_percent(interval=None))
        yield GaugeMetricFamily("lmforge_host_memory_used_bytes", "Host memory in use (total - available).",
                                value=float(vm.total - vm.available))
        yield GaugeMetricFamily("lmforge_host_memory_total_bytes", "Host memory.", value=float(vm.total))


class GpuCollector:
    """Utilization, memory and temperature of each GPU through NVML. `create()` gives None where pynvml does not
    import, NVML does not start or no GPU is found."""

    def __init__(self, nvml, count: int, labels: dict[str, str]):
        self.nvml, self.count, self.labels = nvml, count, labels

    @classmethod
    def create(cls, labels: dict[str, str] | None = None) -> "GpuCollector | None":
        try:
            import pynvml  # nvidia-ml-py; optional: not a dependency of lmforge

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as e:  # noqa: BLE001  ImportError, NVMLError (no driver), anything else: no GPU metrics
            log.debug("no GPU metrics: %s: %s", type(e).__name__, e)
            return None
        return cls(pynvml, count, dict(labels or {})) if count else None

    def describe(self):
        return []

    def collect(self):
        names = list(self.labels)
        util = GaugeMetricFamily("lmforge_gpu_utilization_percent", "Share of the last sample period in which a "
                                 "kernel ran on the GPU (NVML).", labels=[*names, "gpu"])
        used = GaugeMetricFamily("lmforge_gpu_memory_used_bytes", "GPU memory in use.", labels=[*names, "gpu"])
        total = GaugeMetricFamily("lmforge_gpu_memory_total_bytes", "GPU memory.", labels=[*names, "gpu"])
        temp = GaugeMetricFamily("lmforge_gpu_temperature_celsius", "GPU temperature.", labels=[*names, "gpu"])
        nv = self.nvml
        for i in range(self.count):
            values = [*self.labels.values(), str(i)]
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util.add_metric(values, float(nv.nvmlDeviceGetUtilizationRates(h).gpu))
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                used.add_metric(values, float(mem.used))
                total.add_metric(values, float(mem.total))
                temp.add_metric(values, float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)))
            except Exception as e:  # noqa: BLE001  a GPU that fell off the bus must not break the scrape
                log.warning("GPU %d: NVML read failed: %s", i, e)
        yield from (util, used, total, temp)


# ----------------------------------------------------------------------------------------------
# serving and pushing


_lock = threading.Lock()
_servers: dict[tuple[str, int], Any] = {}  # (address, port asked) -> (server, thread, port bound); Nones: not bound
_pushers: dict[tuple[str, str], "_Pusher"] = {}
_collectors: dict[str, Any] = {}


def expose(m: MonitoringConfig, process: str, *, port: int | None = None, fallback_ports: int = 0,
           gpu_labels: dict[str, str] | None = None, grouping: dict[str, str] | None = None) -> int | None:
    """Start this process's endpoint and pusher as `m` asks (once per address and port; later calls are no-ops).
    `process` is `stages` (host CPU/RAM) or `training` (GPUs, labelled `gpu_labels`). Returns the port bound, or
    None. Never raises: a port in use or an unreachable Pushgateway is logged, and the work goes on."""
    port = m.port if port is None else port
    if not (port or m.pushgateway):
        return None
    with _lock:
        if process == "stages" and "host" not in _collectors:
            _collectors["host"] = HostCollector()
            REGISTRY.register(_collectors["host"])
        if process == "training" and "gpu" not in _collectors:
            _collectors["gpu"] = GpuCollector.create(gpu_labels)
            if _collectors["gpu"] is not None:
                REGISTRY.register(_collectors["gpu"])
        bound = _serve(m.address, port, fallback_ports) if port else None
        if m.pushgateway:
            key = (m.pushgateway, process)
            if key not in _pushers:
                group = {"instance": socket.gethostname(), "process": process, **(grouping or {})}
                _pushers[key] = _Pusher(m.pushgateway, group, m.push_interval_seconds)
                _pushers[key].start()
    return bound


def _serve(address: str, port: int, fallback_ports: int) -> int | None:
    if (address, port) in _servers:
        return _servers[(address, port)][2]
    for p in range(port, port + 1 + fallback_ports):
        try:
            server, thread = start_http_server(p, addr=address)
        except OSError as e:
            log.warning("metrics endpoint %s:%d not started: %s", address, p, e.strerror or e)
            continue
        _servers[(address, port)] = (server, thread, p)
        log.info("Prometheus metrics at http://%s:%d/metrics", address, p)
        return p
    _servers[(address, port)] = (None, None, None)  # said once; the next stage does not try (and warn) again
    return None


def shutdown() -> None:
    """Stop every endpoint and pusher of this process (a final push first). For tests and clean exits."""
    with _lock:
        servers, pushers = list(_servers.values()), list(_pushers.values())
        _servers.clear()
        _pushers.clear()
    for server, thread, _ in servers:
        if server is None:
            continue
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    for p in pushers:
        p.stop()


class _Pusher(threading.Thread):
    """Pushes the registry to a Pushgateway every `interval` seconds, and once more when stopped or at exit."""

    def __init__(self, url: str, grouping: dict[str, str], interval: float):
        super().__init__(name="lmforge-pushgateway", daemon=True)
        self.url, self.grouping, self.interval = url, grouping, interval
        self.done = threading.Event()
        self.failed = False
        atexit.register(self.stop)

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.push()

    def push(self) -> None:
        try:
            push_to_gateway(self.url, job=JOB, registry=REGISTRY, grouping_key=self.grouping, timeout=10)
            self.failed = False
        except Exception as e:  # noqa: BLE001  monitoring must never stop the work
            if not self.failed:  # once per outage, not every interval
                log.warning("could not push metrics to the Pushgateway %s: %s", self.url, str(e).splitlines()[0])
            self.failed = True

    def stop(self) -> None:
        if not self.done.is_set():
            self.done.set()
            self.push()
