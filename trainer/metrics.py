"""Training metrics: to the stage's MLflow run, to the log as a progress line, and into the result.

Runs in the training process, on rank 0 only. MLflow is reached by run id through `MlflowClient`
(never the fluent active-run API), at the tracking URI the stage passed down, so the metrics land on
the stage's own child run. Names are stable: `train/loss`, `train/learning_rate`, `train/grad_norm`,
`train/tokens_per_s`, `train/step_time_s`, `train/peak_memory_mb`, `eval/loss`; the step is the
optimizer step.
"""
from __future__ import annotations

import logging
import os
import resource
import time
from typing import Any

from transformers import TrainerCallback

from trainer import monitoring

log = logging.getLogger(__name__)

LOG_KEYS = {"loss": "train/loss", "learning_rate": "train/learning_rate", "grad_norm": "train/grad_norm",
            "eval_loss": "eval/loss", "mean_token_accuracy": "train/mean_token_accuracy"}


def peak_memory_mb() -> float:
    """Peak GPU memory allocated by torch on a GPU run, else the process's peak resident set size."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mb()


def peak_rss_mb() -> float:
    """This process's own peak RSS: VmHWM, the high-water mark of its address space (Linux).

    Not ru_maxrss: Linux carries a process's high-water mark across fork and exec (the kernel records the old
    address space's peak in the new one's rusage), so a training child started by a stage process that held 700 MB
    reports at least 700 MB however little it used itself. Measured: a python started from a process holding
    600 MB reports ru_maxrss 613 MB and VmHWM 13.6 MB. ru_maxrss only where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB (macOS: bytes)


#: on a CPU run, the process's RSS when training begins less the bytes of the model's tensors (parameters and
#: buffers) at that moment: what the process holds that is not the model (libraries imported lazily by the
#: recipe, e.g. trl's trainer classes, the tokenizer, the tokenized dataset, the Trainer and accelerate state).
#: The preflight subtracts it from the peak RSS to compare a CPU run with the memory estimate, which counts the
#: model's tensors, gradients, optimizer states and activations only. None on a GPU or before training begins.
nonmodel_rss_mb: float | None = None


def model_tensor_bytes(model) -> int:
    """Bytes of the distinct storages of a model's parameters and buffers (a tied weight counts once)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a meta or otherwise storage-less tensor
            continue
        seen.setdefault(st.data_ptr(), st.nbytes())
    return sum(seen.values())


def _fault_in(model) -> None:
    """Read one element per page of every parameter and buffer, so all of the model is resident before the RSS is
    taken: transformers loads safetensors memory-mapped, and a page of a weight enters the RSS only when first read
    (in the first forward); subtracting the whole model's bytes from an RSS that holds part of it would put the rest
    into the peak above the baseline (a 135M model loaded from a folder: ~500 MB). The first forward reads them all
    anyway."""
    import torch

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
                continue
            try:
                t.detach().view(-1)[:: max(1, 4096 // t.element_size())].sum()
            except (RuntimeError, TypeError, NotImplementedError):  # a tensor subclass that does not take it
                continue


def _record_nonmodel_rss(model) -> None:
    global nonmodel_rss_mb
    import torch

    if model is None or torch.cuda.is_available():
        return
    import psutil

    _fault_in(model)
    rss = psutil.Process().memory_info().rss
    nonmodel_rss_mb = round((rss - model_tensor_bytes(model)) / 2**20, 1)


class MetricsCallback(TrainerCallback):
    def __init__(self, tracking_uri: str | None, run_id: str | None, progress_every_s: float = 10.0):
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self.progress_every_s = progress_every_s
        self.client = None
        self.losses: list[tuple[int, float]] = []
        self.eval_loss: float | None = None
        self._step_started = 0.0
        self._step_times: list[float] = []
        self._window_t = self._window_tokens = 0.0
        self._last_progress = 0.0
        self.train_seconds = 0.0
        self.tokens_begin = self.tokens_end = 0
        self.start_step = 0
        self.prom = monitoring.current()  # Prometheus series (trainer.monitoring), rank 0 when the stage asked for them
        if int(os.environ.get("RANK", "0")) == 0:  # rank 0 logs; connect before trainer.train(): the first
            self._connect()                        # connection costs 0.4-2 s, once, not in the train loop

    # ---- timing
    def on_train_begin(self, args, state, control, **kwargs):
        now = time.monotonic()
        self._t0 = self._window_t = self._last_progress = now
        self.tokens_begin = self.tokens_end = state.num_input_tokens_seen
        self._window_tokens = float(state.num_input_tokens_seen)
        self.start_step = state.global_step
        if self.prom:
            self.prom.train_begin(args, state)
        _record_nonmodel_rss(kwargs.get("model"))

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.perf_counter()
        if self.prom:
            self.prom.step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self._step_times.append(time.perf_counter() - self._step_started)
        self.tokens_end = state.num_input_tokens_seen
        if self.prom:
            self.prom.step_end(state)

    def on_save(self, args, state, control, **kwargs):
        if self.prom:  # after the checkpoint's write: the wait for the next batch starts here
            self.prom.step_done()

    def on_evaluate(self, args, state, control, **kwargs):
        if self.prom:
            self.prom.step_done()

    def on_train_end(self, args, state, control, **kwargs):
        self.train_seconds = time.monotonic() - self._t0
        self.tokens_end = state.num_input_tokens_seen

    # ---- logging
    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.prom:
            self.prom.logged(logs)
            self.prom.step_done()
        metrics = {LOG_KEYS[k]: float(v) for k, v in logs.items() if k in LOG_KEYS and v is not None}
        if "train/loss" in metrics:
            self.losses.append((state.global_step, metrics["train/loss"]))
            now = time.monotonic()
            tokens = state.num_input_tokens_seen
            if now > self._window_t:
                metrics["train/tokens_per_s"] = (tokens - self._window_tokens) / (now - self._window_t)
            if self._step_times:
                metrics["train/step_time_s"] = sum(self._step_times) / len(self._step_times)
            self._window_t, self._window_tokens, self._step_times = now, float(tokens), []
            metrics["train/peak_memory_mb"] = peak_memory_mb()
            self._progress(state, metrics, now)
        if "eval/loss" in metrics:
            self.eval_loss = metrics["eval/loss"]
        if metrics:
            self._send(metrics, state.global_step)

    def _progress(self, state, m: dict[str, float], now: float) -> None:
        if now - self._last_progress < self.progress_every_s and state.global_step < state.max_steps:
            return
        self._last_progress = now
        done = state.global_step - self.start_step
        rate = done / max(now - self._t0, 1e-9)
        eta = (state.max_steps - state.global_step) / rate if rate > 0 else float("inf")
        log.info("step %d/%d (%.0f%%): loss %.4f, lr %.2e, %.0f tokens/s, %.3f s/step, peak %.0f MB, ETA %.0fs",
                 state.global_step, state.max_steps, 100 * state.global_step / max(state.max_steps, 1),
                 m["train/loss"], m.get("train/learning_rate", float("nan")), m.get("train/tokens_per_s", 0.0),
                 m.get("train/step_time_s", 0.0), m["train/peak_memory_mb"], eta)

    def _connect(self) -> None:
        """The MLflow client, with its store opened (sqlite file, or the server's connection) and the run found."""
        if self.client is not None or not (self.tracking_uri and self.run_id):
            return
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        try:
            self.client.get_run(self.run_id)
        except Exception as e:  # logged again (and warned about) at the first metrics
            log.warning("MLflow run %s not reachable yet: %s", self.run_id, str(e).splitlines()[0])

    def _send(self, metrics: dict[str, float], step: int) -> None:
        if not (self.tracking_uri and self.run_id):
            return
        from mlflow.entities import Metric

        self._connect()
        ts = int(time.time() * 1000)
        try:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v in sorted(metrics.items())],
                                  synchronous=True)
        except Exception as e:  # a tracking hiccup must not kill hours of training
            log.warning("could not log metrics to MLflow run %s: %s", self.run_id, str(e).splitlines()[0])
