"""What a flow run needs from the process it runs in, wherever it was started (CLI, deployment worker, retry).

- Stage logs reach the Prefect API. `PREFECT_LOGGING_EXTRA_LOGGERS` is read once, when Prefect configures logging.
  `lmforge run` sets it before importing Prefect; a worker's flow-run process has configured Prefect's logging long
  before it loads flows/pipeline.py, so there the variable comes too late and the stage loggers had only the
  console. `send_logs_to_api` attaches Prefect's API handler itself, as Prefect does for its extra loggers.
- The config path is absolute: a deployment stores it relative to the project root.
- A stage that never ran because an upstream failed ends in a terminal state named `NotRun`: Prefect leaves such
  a task run `Pending`/`NotReady` forever, with the upstream's task run UUID as its message.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

#: the loggers of lmforge's own code (stages, trainer launch, flows)
LOGGERS = ("lmforge", "tasks", "trainer", "flows")
#: the checkout that holds flows/, tasks/, lmforge/
PROJECT_ROOT = Path(__file__).resolve().parent.parent
NOT_RUN = "NotRun"


def send_logs_to_api() -> None:
    """Give lmforge's loggers the handlers of Prefect's `prefect.extra` logger (the API handler), once. Records sent
    outside a flow or task run are dropped by that handler (PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW=ignore)."""
    extra = logging.getLogger("prefect.extra").handlers
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for h in extra:
            if h not in logger.handlers:
                logger.addHandler(h)


def resolve_config_path(config_path: str | Path) -> str:
    """`config_path` made absolute: as given when absolute; a relative one against the working directory when the
    file is there (CLI), else against the project root (a deployment stores `configs/demo.yaml`). A file found in
    neither place is returned as the working-directory path, so loading it names that path."""
    p = Path(config_path).expanduser()
    if p.is_absolute():
        return str(p)
    for base in (Path.cwd(), PROJECT_ROOT):
        if (base / p).is_file():
            return str((base / p).resolve())
    return str((Path.cwd() / p).resolve())


def failed_roots(name: str, inputs: list[str], failed: set[str], roots: dict[str, list[str]]) -> list[str]:
    """The stages whose failure kept `name` from running: its failed inputs, and for an input that did not run
    itself, that input's roots (so `eval` names `sft`, not the `dpo` that never started)."""
    out: list[str] = []
    for i in inputs:
        for r in ([i] if i in failed else roots.get(i, [])):
            if r not in out:
                out.append(r)
    return out


def mark_not_run(future: Any, name: str, upstream: list[str]) -> str:
    """End the task run of a stage that never ran in the terminal state `NotRun` (a Cancelled type: grey, final;
    `prefect flow-run retry` and `lmforge rerun` run it again), with the message `upstream sft failed`."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    message = f"upstream {', '.join(upstream)} failed"
    task_run_id = getattr(future, "task_run_id", None)
    if task_run_id is not None:
        with get_client(sync_client=True) as client:
            client.set_task_run_state(task_run_id, Cancelled(name=NOT_RUN, message=message), force=True)
    logging.getLogger("flows.pipeline").warning("stage %s: %s: %s", name, NOT_RUN, message)
    return message
