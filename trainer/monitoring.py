"""Prometheus metrics of the training process (rank 0), served while it trains (lmforge.monitoring has the rest).

`start(spec)` (trainer.entry) opens the endpoint at the job's `monitoring.port` when the stage asked for one;
`MetricsCallback` feeds the numbers through `current()`, and the checkpoint callback reports its uploads. Labels
pipeline, stage, kind on every series:

    lmforge_train_step, lmforge_train_max_steps          optimizer steps done, and planned
    lmforge_train_loss, lmforge_train_learning_rate, lmforge_eval_loss   the last logged values
    lmforge_train_tokens_per_second, lmforge_train_samples_per_second    over the last second or more of steps
    lmforge_train_tokens_total, lmforge_train_samples_total              counters (samples: rows per optimizer
                                                   step as configured, batch x accumulation x ranks; packed rows
                                                   when packing)
    lmforge_train_step_seconds           histogram: compute of one optimizer step (forward, backward, optimizer)
    lmforge_train_data_wait_seconds      histogram: before each step, the wait for its batches (from the end of
                                         the previous step, its logging, checkpoint and eval, to the start of this
                                         one): the time the accelerator idles waiting on the data loader
    lmforge_checkpoint_upload_seconds    histogram: each checkpoint's upload and prune (in the background)
    lmforge_checkpoint_last_upload_timestamp_seconds   the last upload's end; the training's start before one
    lmforge_gpu_utilization_percent, lmforge_gpu_memory_used_bytes, lmforge_gpu_memory_total_bytes,
    lmforge_gpu_temperature_celsius{gpu}  where NVML finds GPUs

Times are the host's view: on a GPU without a sync the step time is the time to queue the work.
"""
from __future__ import annotations

import logging
import math
import time

from prometheus_client import Counter, Gauge, Histogram

from lmforge import monitoring
from lmforge.config import MonitoringConfig
from trainer.job import rank

log = logging.getLogger(__name__)

LABELS = monitoring.STAGE_LABELS
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
UPLOAD_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
RATE_WINDOW_S = 1.0  # tokens/s and samples/s over at least this many seconds of steps

STEP = Gauge("lmforge_train_step", "Optimizer steps done.", LABELS)
MAX_STEPS = Gauge("lmforge_train_max_steps", "Optimizer steps planned.", LABELS)
LOSS = Gauge("lmforge_train_loss", "Training loss, last logged.", LABELS)
LR = Gauge("lmforge_train_learning_rate", "Learning rate, last logged.", LABELS)
EVAL_LOSS = Gauge("lmforge_eval_loss", "Validation loss, last evaluated.", LABELS)
TOKENS_PER_S = Gauge("lmforge_train_tokens_per_second", "Input tokens per second (all ranks), recent steps.", LABELS)
SAMPLES_PER_S = Gauge("lmforge_train_samples_per_second", "Training rows per second (all ranks), recent steps.", LABELS)
TOKENS = Counter("lmforge_train_tokens", "Input tokens trained on (all ranks).", LABELS)
SAMPLES = Counter("lmforge_train_samples", "Training rows trained on (all ranks).", LABELS)
STEP_SECONDS = Histogram("lmforge_train_step_seconds", "Compute time of one optimizer step.", LABELS,
                         buckets=STEP_BUCKETS)
DATA_WAIT = Histogram("lmforge_train_data_wait_seconds", "Wait for the next step's batches after the previous step "
                      "ended.", LABELS, buckets=WAIT_BUCKETS)
UPLOAD_SECONDS = Histogram("lmforge_checkpoint_upload_seconds", "Upload (and prune) time of one checkpoint.", LABELS,
                           buckets=UPLOAD_BUCKETS)
LAST_UPLOAD = Gauge("lmforge_checkpoint_last_upload_timestamp_seconds", "When the last checkpoint upload ended "
                    "(the training's start before the first one).", LABELS)


class TrainingMetrics:
    """One training process's series. All methods are cheap (a few dict lookups) and safe from any thread."""

    def __init__(self, pipeline: str, stage: str, kind: str):
        labels = (pipeline, stage, kind)
        self.step, self.max_steps, self.loss, self.lr, self.eval_loss = (
            g.labels(*labels) for g in (STEP, MAX_STEPS, LOSS, LR, EVAL_LOSS))
        self.tokens_per_s, self.samples_per_s = TOKENS_PER_S.labels(*labels), SAMPLES_PER_S.labels(*labels)
        self.tokens, self.samples = TOKENS.labels(*labels), SAMPLES.labels(*labels)
        self.step_seconds, self.data_wait = STEP_SECONDS.labels(*labels), DATA_WAIT.labels(*labels)
        self.upload_seconds, self.last_upload = UPLOAD_SECONDS.labels(*labels), LAST_UPLOAD.labels(*labels)
        self._ready_at: float | None = None  # when the previous step (and its logging, saving, eval) ended
        self._step_started = 0.0
        self._tokens_seen = 0
        self._rows_per_step = 0
        self._window: tuple[float, int, int] | None = None  # (time, tokens, steps) where the rate window starts
        self._rate_set = False

    # ---- called by MetricsCallback
    def train_begin(self, args, state) -> None:
        self._rows_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        self._tokens_seen = state.num_input_tokens_seen
        self.step.set(state.global_step)
        self.max_steps.set(state.max_steps)
        self.last_upload.set(time.time())
        now = time.perf_counter()
        self._ready_at, self._window = now, (now, state.num_input_tokens_seen, state.global_step)

    def step_begin(self) -> None:
        now = time.perf_counter()
        if self._ready_at is not None:
            self.data_wait.observe(now - self._ready_at)
        self._step_started = now

    def step_end(self, state) -> None:
        now = time.perf_counter()
        self.step_seconds.observe(now - self._step_started)
        tokens = state.num_input_tokens_seen
        if tokens > self._tokens_seen:
            self.tokens.inc(tokens - self._tokens_seen)
        self._tokens_seen = tokens
        self.samples.inc(self._rows_per_step)
        self.step.set(state.global_step)  # last: a scrape between these lines sees the counters ahead, never behind
        t0, tokens0, step0 = self._window or (now, tokens, state.global_step)
        if now - t0 >= RATE_WINDOW_S or not self._rate_set:  # the first step's rate at once, then per window
            dt = max(now - t0, 1e-9)
            self.tokens_per_s.set((tokens - tokens0) / dt)
            self.samples_per_s.set((state.global_step - step0) * self._rows_per_step / dt)
            self._window, self._rate_set = (now, tokens, state.global_step), True
        self._ready_at = now

    def step_done(self) -> None:
        """The step's logging, checkpoint write or evaluation ended: the wait for data starts now."""
        if self._ready_at is not None:
            self._ready_at = time.perf_counter()

    def logged(self, logs: dict) -> None:
        for key, gauge in (("loss", self.loss), ("learning_rate", self.lr), ("eval_loss", self.eval_loss)):
            v = logs.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                gauge.set(v)

    # ---- called by the checkpoint callback's upload thread
    def checkpoint_uploaded(self, seconds: float) -> None:
        self.upload_seconds.observe(seconds)
        self.last_upload.set(time.time())


_current: TrainingMetrics | None = None


def start(spec) -> None:
    """Rank 0 of a job whose stage asked for metrics: the series, the endpoint (and pusher), GPU collector included."""
    global _current
    m = spec.monitoring
    if m is None or rank() != 0:
        return
    try:
        _current = TrainingMetrics(m.pipeline, m.stage, m.kind)
        cfg = MonitoringConfig(port=m.port, address=m.address, pushgateway=m.pushgateway,
                               push_interval_seconds=m.push_interval_seconds)
        monitoring.expose(cfg, "training", fallback_ports=8 if m.port else 0,
                          gpu_labels={"pipeline": m.pipeline, "stage": m.stage},
                          grouping={"pipeline": m.pipeline, "stage": m.stage})
    except Exception as e:  # noqa: BLE001  metrics must never stop a training
        log.warning("Prometheus metrics off for this training: %s: %s", type(e).__name__, e)


def current() -> TrainingMetrics | None:
    """This process's training metrics, or None (monitoring off, or not rank 0)."""
    return _current


def checkpoint_uploaded(seconds: float) -> None:
    if _current is not None:
        _current.checkpoint_uploaded(seconds)
