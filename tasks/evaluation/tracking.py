"""MLflow for the eval stage: its reports attached to the stage's run. Reads the artifact, writes nothing into it."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.stage import StageRuntime


def log_reports(runtime: StageRuntime | None, out: Path) -> None:
    """The reports on this stage's run. The Result's metrics reach the stage's run through the executor, which
    logs them after publishing, also when gates fail (FailedAfterPublish); the pipeline's run gets them as
    `summary/<model>/<task>/<metric>` from the flow, read from the artifact, so a cached run has them too."""
    if runtime is None or not runtime.tracking_uri or not runtime.mlflow_run_id:
        return
    from lmforge.tracking import Tracker

    tr = Tracker(runtime.tracking_uri, runtime.pipeline)
    run_id = runtime.mlflow_run_id
    for name in ("comparison.md", "comparison.html", "control_generations.md"):
        if (out / name).exists():
            tr.log_text(run_id, (out / name).read_text(encoding="utf-8"), f"eval/{name}")
    with tr.lock:
        tr.client.log_artifact(run_id, str(out / "metrics.png"), "eval")
