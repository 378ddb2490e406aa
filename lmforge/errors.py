"""Errors that reach users. Each one says what was given, what was expected and how to fix it."""
from __future__ import annotations


class LmforgeError(Exception):
    """Base class. `retryable=False` tells the orchestrator that retrying cannot help."""

    retryable = True


class ConfigError(LmforgeError):
    """One or more problems in a pipeline config, each with its dotted path."""

    retryable = False

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        head = f"{source}: " if source else ""
        n = len(self.problems)
        lines = [f"{head}{n} problem{'s' if n != 1 else ''} in the pipeline config:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class DataError(LmforgeError):
    """Bad input data. `where` is `file:line` (or `file`, or a dataset name)."""

    retryable = False

    def __init__(self, where: str, problem: str, fix: str | None = None):
        self.where, self.problem, self.fix = where, problem, fix
        super().__init__(f"{where}: {problem}" + (f". {fix}" if fix else ""))


class ArtifactError(LmforgeError):
    """An artifact is missing, incomplete or does not match its manifest."""

    retryable = False


class FailedAfterPublish(LmforgeError):
    """A stage finished its work but its outcome fails a check (e.g. an eval gate).

    The executor publishes the artifact with `result` (so the failure can be inspected and
    compared), records `failure` in the manifest, and then fails the stage. A cached rerun of
    the same artifact fails again with the same message: a gate cannot pass by being cached.
    """

    retryable = False

    def __init__(self, message: str, result):
        self.result = result
        super().__init__(message)


class StageFailed(LmforgeError):
    """Raised by the flow when one or more stages failed; names each stage and its cause."""

    retryable = False

    def __init__(self, failures: dict[str, str], flow_run_id: str | None = None, bad_input: set[str] | None = None):
        self.failures = failures
        self.flow_run_id = flow_run_id
        #: the stages that failed on bad config or data (ConfigError, DataError, ArtifactError); when every failed
        #: stage did (the rest only waited on them), the run failed on bad input: the CLI exits 2, not 1
        self.bad_input = set(bad_input or ())
        ran = {n for n, cause in failures.items() if not cause.startswith("not run: upstream")}
        self.only_bad_input = bool(ran) and ran <= self.bad_input
        lines = [f"{len(failures)} stage(s) failed:"]
        lines += [f"  - stage '{name}': {cause}" for name, cause in failures.items()]
        lines.append("Finished stages are kept: fix the cause and run the same command again to redo only the "
                     "failed stages and what depends on them"
                     + (f" (or: prefect flow-run retry {flow_run_id} --entrypoint flows/pipeline.py:pipeline)"
                        if flow_run_id else "") + ".")
        super().__init__("\n".join(lines))
