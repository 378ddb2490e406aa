"""The generations check after training: the model before and after answer the same control prompts.

Runs in the training process, on rank 0, after the recipe saved its artifact (`trainer.entry`). The model
before is the one the stage started from (a model built from a config with the stage's seed, a loaded base,
or the input model artifact); the model after is reloaded from the saved artifact folder, so the check also
proves the artifact reloads and generates. Decoding is greedy, with the tokenizer's chat template (as a user
turn) when it has one, so both sides get the same input. The side-by-side table goes to the stage's MLflow
run as `generations/control.json` (an MLflow table: the UI shows it under Artifacts and in the Evaluation
view) and `generations/control.md`. It is not part of the artifact: the prompts are run-only settings.

Reward models do not generate: their stage skips the check.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

from trainer import models
from trainer.job import JobSpec, materialize

log = logging.getLogger(__name__)

#: methods whose artifact is not a generative model
NOT_GENERATIVE = frozenset({"reward"})


def generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    """Greedy completions (new text only, special tokens dropped), one prompt at a time (no padding effects)."""
    import torch

    model.eval()
    outs = []
    for p in prompts:
        if tokenizer.chat_template:
            enc = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
        else:
            enc = tokenizer(p, return_tensors="pt")
        enc = {k: v.to(model.device) for k, v in enc.items()}
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        outs.append(tokenizer.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return outs


def table(prompts: Sequence[str], before: Sequence[str], after: Sequence[str]) -> dict[str, list[str]]:
    return {"prompt": list(prompts), "before": list(before), "after": list(after)}


def markdown(stage: str, rows: dict[str, list[str]], max_new_tokens: int) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", "<br>")

    lines = [f"# Control generations: stage {stage}", "", f"Greedy, max_new_tokens {max_new_tokens}.", "",
             "| prompt | before | after |", "|---|---|---|"]
    lines += [f"| {esc(p)} | {esc(b)} | {esc(a)} |" for p, b, a in zip(rows["prompt"], rows["before"], rows["after"])]
    return "\n".join(lines) + "\n"


def control_check(spec: JobSpec) -> dict[str, list[str]] | None:
    """Generate before/after on the stage's control prompts and log the table; None when skipped."""
    settings = spec.settings
    prompts = list(settings.get("control_prompts") or [])
    if not prompts or spec.method in NOT_GENERATIVE:
        return None
    max_new = int(settings.get("control_max_new_tokens", 32))
    t0 = time.monotonic()
    work, out = Path(spec.work_dir), Path(spec.output_dir)
    after_model, tokenizer = models.load_trained(out, work_dir=work / "generations")
    after = generate(after_model, tokenizer, prompts, max_new)
    del after_model
    source = models.ModelSource.model_validate(settings["base_model"]) if settings.get("base_model") else None
    res = models.resolve(source, spec.model, work)
    before_tok = models.load_tokenizer(res, materialize(spec.tokenizer, work) if spec.tokenizer else None)
    before_model = models.load_plain(res, before_tok, seed=int(settings.get("seed", 0)),
                                     dtype=settings.get("dtype", "float32"))
    # the tokenizer the stage saved (its chat template may be a marked copy that renders identically)
    before = generate(before_model, tokenizer, prompts, max_new)
    del before_model
    rows = table(prompts, before, after)
    changed = sum(b != a for b, a in zip(before, after))
    log.info("control generations: %d of %d prompts answered differently after training (%.1fs)", changed,
             len(prompts), time.monotonic() - t0)
    for p, b, a in zip(prompts, before, after):
        log.info("  %r: before %r | after %r", p, b, a)
    _log(spec, rows, max_new)
    return rows


def _log(spec: JobSpec, rows: dict[str, list[str]], max_new_tokens: int) -> None:
    if not (spec.tracking_uri and spec.mlflow_run_id):
        return
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=spec.tracking_uri)
        client.log_table(spec.mlflow_run_id, data=rows, artifact_file="generations/control.json")
        client.log_text(spec.mlflow_run_id, markdown(spec.stage, rows, max_new_tokens), "generations/control.md")
    except Exception as e:  # noqa: BLE001  a tracking hiccup must not fail a finished training
        log.warning("could not log the control generations to MLflow run %s: %s", spec.mlflow_run_id,
                    str(e).splitlines()[0])


def read_logged(client, run_id: str) -> dict[str, Any]:
    """The logged table back from MLflow, as {"prompt": [...], "before": [...], "after": [...]} (for tests)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = client.download_artifacts(run_id, "generations/control.json", d)
        raw = json.loads(Path(path).read_text())
    cols = raw["columns"]
    return {c: [row[i] for row in raw["data"]] for i, c in enumerate(cols)}
