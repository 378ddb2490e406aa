"""Errors of the training engine. They cross the parent/child process boundary as JSON.

`SettingError` names the stage setting at fault (`lora.target_modules`, `base_model.path`, ...), relative to
the stage; the stage turns it into a `ConfigError` with the full path `stages.<name>.<field>`.
"""
from __future__ import annotations

from typing import Any

from lmforge.errors import LmforgeError


class SettingError(LmforgeError):
    """A stage setting that cannot work with the given model or data. Retrying cannot help."""

    retryable = False

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}")

    def to_json(self) -> dict[str, Any]:
        return {"type": "SettingError", "field": self.field, "problem": self.problem}


class TrainingError(LmforgeError):
    """The training process failed: its exit status, its error and the tail of its log."""


class Preempted(LmforgeError):
    """Training stopped on SIGTERM after saving and uploading a checkpoint; a rerun resumes from it."""
