"""Logging setup and a periodic progress line (count, rate, ETA)."""
from __future__ import annotations

import logging
import time

from lmforge.tracking import RedactingFilter

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Log lmforge's loggers to stderr, with secrets redacted on every handler (idempotent).

    Under Prefect, whose console handler already serves these loggers (PREFECT_LOGGING_EXTRA_LOGGERS),
    no second handler is added; the redaction filter goes onto Prefect's handlers too (console and
    API), since logger-level filters do not apply to records from child loggers.
    """
    names = ("lmforge", "tasks", "trainer", "flows")
    handlers = [h for n in names for h in logging.getLogger(n).handlers]
    root = logging.getLogger()
    prefect_console = any(type(h).__name__ == "PrefectConsoleHandler" for h in handlers + root.handlers)
    if not prefect_console and not any(getattr(h, "_lmforge", False) for h in root.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
        h._lmforge = True  # type: ignore[attr-defined]
        root.addHandler(h)
    for h in handlers + root.handlers:
        if not any(isinstance(f, RedactingFilter) for f in h.filters):
            h.addFilter(RedactingFilter())
    for n in names:
        logging.getLogger(n).setLevel(level)
    # bitsandbytes logs a missing optional CPU kernel at every import; the fallback works
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


class Progress:
    """Logs `what: n/total (pct) at rate/s, ETA` at most every `every_s` seconds, and once at the end."""

    def __init__(self, logger: logging.Logger, what: str, total: int | None = None, unit: str = "records",
                 every_s: float = 5.0):
        self.log, self.what, self.total, self.unit, self.every = logger, what, total, unit, every_s
        self.n = 0
        self.t0 = self.last = time.monotonic()

    def update(self, k: int = 1) -> None:
        self.n += k
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self._emit(now)

    def _emit(self, now: float, done: bool = False) -> None:
        dt = max(now - self.t0, 1e-9)
        rate = self.n / dt
        if self.total and not done:
            eta = (self.total - self.n) / rate if rate > 0 else float("inf")
            self.log.info("%s: %d/%d %s (%.0f%%), %.0f/s, ETA %.0fs", self.what, self.n, self.total, self.unit,
                          100 * self.n / self.total, rate, eta)
        else:
            self.log.info("%s: %d %s%s, %.0f/s, %.1fs", self.what, self.n, self.unit, " done" if done else "",
                          rate, dt)

    def done(self) -> None:
        self._emit(time.monotonic(), done=True)
