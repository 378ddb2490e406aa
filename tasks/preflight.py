"""preflight: the minimal reproducible run of a training stage, on its planned settings, before the real one.

```yaml
  preflight_sft:
    kind: preflight
    stage: sft          # the training stage to try; its inputs are this stage's inputs (filled in)
    steps: 3            # optimizer steps
```

`parse_config` links the two (`link` below): the preflight gets the training stage's inputs and its whole config
(`target`, part of the preflight's id: change the learning rate and the preflight runs again), and the training
stage gets `after: [preflight_sft]`, so it starts only when the preflight passed. A preflight that fails stops the
pipeline before the expensive stage starts; the stages after it end NotRun, naming the preflight.

What it does, with the training stage's own code (its `run`, so its child process, launcher and checks):
1. loads the model and 2. creates the adapter, exactly as the stage will;
3. runs `steps` optimizer steps on the stage's real data and batch settings;
4. saves a checkpoint after step steps-1 (uploaded to the preflight's own checkpoint folder in the store), then
   the model/adapter after the last step;
5. reloads the saved model/adapter in this process and generates greedily on the control prompts.
It records step time, tokens/s, peak memory (CUDA max allocated on a GPU; on CPU the peak RSS of the training
process, and that peak above the process's non-model RSS when training begins: its RSS then less the bytes of
the model's parameters and buffers, trainer.metrics.nonmodel_rss_mb, so the libraries, tokenized data and Trainer
the estimate does not model are left out; the child runs with glibc's mmap threshold pinned, so that its RSS follows
its live tensors, see _cpu_malloc_tracks_tensors), the checkpoint's size, whether the reload
and the generation worked (and what was generated), and the estimate of trainer/estimate.py for the same
settings, at the mean row length the run's padding meter measured (max_length_tokens is only an upper bound:
rows are padded to the longest of their micro-batch; ppo has no meter and keeps it; the estimate at
max_length_tokens is recorded beside it), with the error of the estimate against the measurement in percent (the
estimate's `comparable` part,
without the CUDA context and the allocator margin that torch's max allocated does not count; on CPU it holds the
CPU runtime's own RSS instead, and is compared with the peak RSS above the baseline).
The trained weights are not kept (the artifact holds `preflight.json` and the generations), only measured.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from lmforge.config import StageConfig
from lmforge.errors import DataError
from lmforge.port import Port
from lmforge.stage import Result, StageDef, StageRuntime
from lmforge.store import Artifact

log = logging.getLogger(__name__)

TRAINING_KINDS = ("pretrain", "sft", "reward", "dpo", "grpo", "ppo")
NOT_GENERATIVE = ("reward",)  # a score head: reloaded and scored, not generated from
DEFAULT_PROMPTS = ["What is 2 plus 3?"]


class PreflightConfig(StageConfig):
    kind: Literal["preflight"] = Field(description="A few optimizer steps of a training stage on its planned "
                                       "settings, a checkpoint, a reload and a generation, measured; the training "
                                       "stage starts only after it passed.")
    stage: str = Field(description="The training stage (pretrain, sft, reward, dpo, grpo, ppo) to try.")
    steps: int = Field(3, ge=2, le=100, description="Optimizer steps to run; a checkpoint is saved and uploaded "
                       "after the second to last (the last one writes the model instead).")
    max_new_tokens: int = Field(16, gt=0, description="Tokens generated per control prompt after the reload.")
    max_estimate_error: float | None = Field(None, gt=0, description="Fail when the memory estimate is further "
                                             "than this fraction from the measured peak (e.g. 0.15); unset: only "
                                             "record the error.")
    target: dict[str, Any] | None = Field(None, description="Filled in from `stage` when the config is read (do "
                                          "not set): the training stage's config, so the preflight's id changes "
                                          "with it.")


class PreflightResult(Result):
    stage: str
    kind: str
    method: str
    steps: int
    step_time_s: float
    tokens_per_s: float
    peak_memory_mb: float
    peak_memory_source: str  # cuda_max_allocated | rss
    baseline_rss_mb: float | None
    peak_above_baseline_mb: float | None
    checkpoint_bytes: int
    reload_ok: bool
    generation_ok: bool
    generations: dict[str, str]
    estimate_mb: float | None
    estimate_compared_mb: float | None  # the part of the estimate the measurement is compared with
    estimate_error_pct: float | None
    estimate_row_tokens: float | None = None  # the row length the estimate was taken at (measured, or max_length)
    estimate_at_max_length_mb: float | None = None  # the estimate's comparable part at max_length_tokens (the plan's)
    notes: list[str]


def link(name: str, cfg: PreflightConfig, stages: dict[str, StageConfig]) -> dict[str, StageConfig]:
    """parse_config's hook: the preflight takes the training stage's inputs and config; the training stage waits
    for the preflight. Returns the replaced configs. ValueError names the field at fault."""
    target = stages.get(cfg.stage)
    if target is None:
        raise ValueError(f"stage: no stage named {cfg.stage!r}; name the training stage to try "
                         f"({', '.join(n for n, s in stages.items() if s.kind in TRAINING_KINDS) or 'none'})")
    if target.kind not in TRAINING_KINDS:
        raise ValueError(f"stage: {cfg.stage!r} is a {target.kind} stage; a preflight tries a training stage "
                         f"({', '.join(TRAINING_KINDS)})")
    if cfg.inputs and list(cfg.inputs) != list(target.inputs):
        raise ValueError(f"inputs: {cfg.inputs} differ from stage {cfg.stage}'s inputs {target.inputs}; leave "
                         "inputs out (they are taken from the stage)")
    body = target.model_dump(mode="json", exclude={"after", "retries", "retry_delay_seconds", "timeout_seconds"})
    new = cfg.model_copy(update={"inputs": list(target.inputs), "target": body})
    new._root = cfg._root
    after = [*target.after, *([name] if name not in target.after else [])]
    tnew = target.model_copy(update={"after": after})
    tnew._root = target._root
    return {name: new, cfg.stage: tnew}


def _target_config(cfg: PreflightConfig):
    from tasks import REGISTRY

    tdef = REGISTRY[cfg.target["kind"]]
    tcfg = tdef.config.model_validate({
        **cfg.target, "max_steps": cfg.steps, "checkpoint_every_steps": cfg.steps - 1, "checkpoint_every_minutes": None,
        "keep_checkpoints": 1, "evaluate": False, "control_prompts": [], "retries": 0, "after": []})
    tcfg._root = cfg._root
    return tdef, tcfg


def run(cfg: PreflightConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> PreflightResult:
    from trainer import checkpoint, generations, models

    tdef, tcfg = _target_config(cfg)
    notes: list[str] = []
    work = Path(tempfile.mkdtemp(prefix=f"lmforge-preflight-{runtime.stage}-"))
    try:
        model_out = work / "model"
        model_out.mkdir()
        t0 = time.monotonic()
        with _cpu_malloc_tracks_tensors():
            trained = tdef.run(tcfg, inputs, model_out, runtime).model_dump(mode="json")  # 1-4: the stage's code
        log.info("preflight %s: %d steps of %s in %.1fs", runtime.stage, trained["steps"], cfg.stage,
                 time.monotonic() - t0)
        latest = checkpoint.latest_complete(runtime.checkpoint_uri)
        if latest is None:
            raise DataError(f"stages.{runtime.stage}", f"the {cfg.steps}-step run of {cfg.stage} left no complete "
                            f"checkpoint in {runtime.checkpoint_uri}", "see the training log above")
        fs, _ = checkpoint.filesystem(runtime.checkpoint_uri)
        ckpt_bytes = int(fs.du(latest[1], total=True))
        # 5. reload what was saved, in this process, and generate
        prompts = list(cfg.target.get("control_prompts") or DEFAULT_PROMPTS)
        gens: dict[str, str] = {}
        reload_ok = generation_ok = False
        try:
            if cfg.target["kind"] in NOT_GENERATIVE:
                from trainer.preference import load_reward_model

                model, tok = load_reward_model(model_out)
                reload_ok = True
                enc = tok(prompts[0], return_tensors="pt")
                score = float(model(**enc).logits[0, 0])
                gens[prompts[0]] = f"reward {score:.4f}"
                generation_ok = score == score  # not NaN
            else:
                model, tok = models.load_trained(model_out, work_dir=work / "reload")
                reload_ok = True
                for p, g in zip(prompts, generations.generate(model, tok, prompts, cfg.max_new_tokens)):
                    gens[p] = g
                generation_ok = all(isinstance(g, str) for g in gens.values())
            del model
        except Exception as e:  # noqa: BLE001  reported as the preflight's failure below
            notes.append(f"reload/generation failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        est = _estimate(cfg, tcfg, inputs, runtime, notes, trained)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    on_gpu = _on_gpu()
    peak = float(trained["peak_memory_mb"])
    base = trained.get("baseline_rss_mb")
    above = round(peak - base, 1) if (base is not None and not on_gpu) else None
    measured = peak if on_gpu else above
    compared = est_total = err = upper = None
    if est is not None:
        est_total = round(est["total_bytes"] / 2**20, 1)
        compared = round(est["comparable_bytes"] / 2**20, 1)
        upper = round(est["at_max_length_comparable_bytes"] / 2**20, 1)
        if measured:
            err = round(100 * (compared - measured) / measured, 1)
    result = PreflightResult(
        stage=cfg.stage, kind=cfg.target["kind"], method=trained.get("method", ""), steps=trained["steps"],
        step_time_s=round(trained["train_seconds"] / max(trained["steps"], 1), 4),
        tokens_per_s=trained.get("tokens_per_s") or 0.0, peak_memory_mb=peak,
        peak_memory_source="cuda_max_allocated" if on_gpu else "rss", baseline_rss_mb=base,
        peak_above_baseline_mb=above, checkpoint_bytes=ckpt_bytes, reload_ok=reload_ok,
        generation_ok=generation_ok, generations=gens, estimate_mb=est_total, estimate_compared_mb=compared,
        estimate_error_pct=err, estimate_row_tokens=est["row_tokens"] if est else None,
        estimate_at_max_length_mb=upper, notes=notes)
    (out / "preflight.json").write_text(json.dumps({**result.model_dump(mode="json"), "estimate": est,
                                                    "training_result": trained}, indent=2))
    log.info("preflight %s: step %.3fs, %.0f tokens/s, peak %.0f MB (%s%s), checkpoint %.1f MB, reload %s, "
             "generation %s, estimate %s MB (error %s%%)", cfg.stage, result.step_time_s, result.tokens_per_s, peak,
             result.peak_memory_source, f", {above:.0f} MB above the baseline" if above is not None else "",
             ckpt_bytes / 2**20, "ok" if reload_ok else "FAILED", "ok" if generation_ok else "FAILED",
             compared, err)
    problems = [n for n in notes if n.startswith("reload")]
    if cfg.max_estimate_error is not None and err is not None and abs(err) > 100 * cfg.max_estimate_error:
        problems.append(f"the memory estimate {compared} MB is {err:+.1f}% from the measured {measured} MB, beyond "
                        f"max_estimate_error {cfg.max_estimate_error}")
    if problems or not (reload_ok and generation_ok):
        raise DataError(f"stages.{runtime.stage}", f"preflight of {cfg.stage} failed: "
                        f"{'; '.join(problems) or 'the reloaded model did not generate'}",
                        f"fix stage {cfg.stage}'s settings (the full result is in the log above) and rerun")
    return result


#: glibc's default mmap threshold (128 KiB), pinned: see _cpu_malloc_tracks_tensors
MALLOC_MMAP_THRESHOLD = 131072


@contextlib.contextmanager
def _cpu_malloc_tracks_tensors():
    """On CPU, start the training child with glibc's mmap threshold pinned (MALLOC_MMAP_THRESHOLD_), so its peak RSS
    is the peak of its live tensors, what the estimate estimates.

    By default glibc raises the threshold to the size of each mmapped block freed (up to 32 MiB), so after the
    first step every activation-sized tensor is carved from the heap, and the heap keeps what is freed: the peak
    RSS then includes the holes left between transient and saved tensors, not tensors at all. Measured on the tiny
    llama of bench/estimate_accuracy.py (LoRA, 4 x 512 tokens): 631 MB above the start with the dynamic threshold,
    437 MB pinned, against 408 MB of estimated activations and adapter. Pinned, each tensor of 128 KiB or more is
    its own mapping, returned to the system when freed. An explicit MALLOC_MMAP_THRESHOLD_ is left as it is; on a
    GPU nothing changes (the measurement is torch's max allocated)."""
    if _on_gpu() or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        yield
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MALLOC_MMAP_THRESHOLD)  # read by the child (launch.child_env)
    try:
        yield
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def measured_row_tokens(trained: dict[str, Any], rows: int, micro_batches: int, limit: int) -> float | None:
    """The mean tokens of a row as the model computed on it, over the micro-batches the run trained: the training
    result's padding meter (trainer/batching.py) gives the real tokens (nonpad_tokens_per_s x train_seconds) and the
    padding fraction of what was computed (rows padded to their micro-batch's longest; packed rows: the real ones).
    None when the stage has no meter (ppo) or it measured nothing."""
    frac, rate, seconds = (trained.get(k) for k in ("padding_fraction", "nonpad_tokens_per_s", "train_seconds"))
    if frac is None or not rate or not seconds or frac >= 1 or rows * micro_batches <= 0:
        return None
    return round(min(limit, rate * seconds / (1 - frac) / (rows * micro_batches)), 1)


def _estimate(cfg: PreflightConfig, tcfg, inputs: list[Artifact], runtime: StageRuntime,
              notes: list[str], trained: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """trainer/estimate.py for the stage's settings, its model taken from base_model or the model input, at the
    row length the run measured (the config's max_length_tokens is an upper bound: rows are padded to the longest of
    their micro-batch only); the estimate at max_length_tokens goes into the notes."""
    from trainer import estimate as E
    from trainer.distributed import resolve_precision, device_capability
    from trainer.pipeline_estimate import response_tokens

    try:
        shape = _shape(tcfg, inputs, runtime.stage)
        kind = cfg.target["kind"]
        world = tcfg.nproc_per_node * tcfg.nnodes if tcfg.launcher != "local" else 1
        plan = E.Plan(kind=kind, method=tcfg.method, dtype=tcfg.dtype,
                      precision=resolve_precision(tcfg.precision, device_capability()),
                      micro_batch=tcfg.batch_size_per_device, grad_accumulation_steps=tcfg.grad_accumulation_steps,
                      seq_tokens=tcfg.max_length_tokens, gradient_checkpointing=tcfg.gradient_checkpointing,
                      attn_implementation="sdpa", optimizer=tcfg.optimizer, world_size=world,
                      lora_rank=tcfg.lora.rank, lora_targets=tcfg.lora.target_modules, lora_dropout=tcfg.lora.dropout,
                      quant_double=tcfg.lora.double_quant,
                      reference_copy=tcfg.method == "full" and (kind in ("dpo", "ppo") or
                                                                 (kind == "grpo" and tcfg.beta > 0)),
                      reward_shape=_reward_shape(inputs) if kind in ("ppo", "grpo") else None,
                      value_model=kind == "ppo", value_method=getattr(tcfg, "value_model", "full"),
                      generation=kind in ("ppo", "grpo"), response_tokens=response_tokens(tcfg),
                      device="cuda" if _on_gpu() else "cpu")
        rows = 2 * plan.micro_batch if kind in ("reward", "dpo") else plan.micro_batch
        steps = (trained or {}).get("steps") or cfg.steps
        measured = measured_row_tokens(trained or {}, rows, steps * plan.grad_accumulation_steps, plan.seq_tokens)
        upper = E.estimate_memory(shape, plan)
        est = E.estimate_memory(shape, replace(plan, row_tokens=measured)) if measured else upper
        if measured:
            notes.append(f"estimate at the measured {measured:g} tokens per row; at max_length_tokens "
                         f"{plan.seq_tokens}: {upper.comparable / 2**20:,.1f} MB")
        return {**est.to_json(), "row_tokens": measured or plan.seq_tokens, "row_tokens_measured": bool(measured),
                "at_max_length_comparable_bytes": upper.comparable}
    except Exception as e:  # noqa: BLE001  the measurement stands without it
        notes.append(f"no estimate: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return None


def _shape(tcfg, inputs: list[Artifact], stage: str):
    from trainer.shapes import shape_from_config, source_shape

    vocab = None
    for a in inputs:
        if a.manifest.get("output", {}).get("type") == "tokenizer":
            from transformers import AutoTokenizer

            vocab = len(AutoTokenizer.from_pretrained(a.path)) if Path(a.path).exists() else None
    if tcfg.base_model is not None:
        return source_shape(tcfg, stage, vocab)
    for a in inputs:
        if a.manifest.get("output", {}).get("type") == "model":
            for rel in ("config.json", "model/config.json", "base_model/config.json"):
                if rel in a.files:
                    with a.open(rel) as f:
                        return shape_from_config(json.load(f), f"{a.kind}/{a.id}/{rel}")
            shape = _adapter_base_shape(a)
            if shape is not None:
                return shape
    raise ValueError("no model config found among the inputs")


def _reward_shape(inputs: list[Artifact]):
    """The shape of the reward model among the inputs (a reward stage's artifact: a full sequence-classification
    model with its config.json), or None: ppo's reward and value models, grpo's reward model."""
    from trainer.shapes import shape_from_config

    for a in inputs:
        if a.kind == "reward" and "config.json" in a.files:
            with a.open("config.json") as f:
                return shape_from_config(json.load(f), f"{a.kind}/{a.id}/config.json")
    return None


def _adapter_base_shape(a: Artifact):
    """The shape of an adapter artifact's base, from its lmforge_model.json: a GGUF file (SmolLM2's sft adapter, the
    input of its reward, dpo, ppo and grpo stages) or a local model folder; None for other bases."""
    from trainer.models import MODEL_INFO
    from trainer.shapes import shape_from_config, shape_from_gguf

    if MODEL_INFO not in a.files:
        return None
    with a.open(MODEL_INFO) as f:
        base = json.load(f).get("base") or {}
    folder = Path(base["path"]) if isinstance(base.get("path"), str) else None
    if base.get("kind") == "gguf" and folder is not None and base.get("gguf_file"):
        return shape_from_gguf(str(folder / base["gguf_file"]), base.get("describe") or base["gguf_file"])
    if folder is not None and (folder / "config.json").exists():
        return shape_from_config(json.loads((folder / "config.json").read_text()), str(folder))
    return None


def output_port(cfg: PreflightConfig, inputs: list[Port]) -> Port:
    if cfg.target is None:
        raise ValueError("stage: the training stage was not linked (set `stage:` to a training stage's name)")
    tdef, tcfg = _target_config(cfg)
    tdef.output_port(tcfg, inputs)  # the inputs the training stage itself accepts
    return Port("preflight")


STAGE = StageDef(kind="preflight", version="1",
                 code=("trainer.entry", "trainer.sft", "trainer.reward", "trainer.dpo", "trainer.grpo", "trainer.ppo",
                       "trainer.pretrain", "trainer.estimate"),
                 config=PreflightConfig, run=run, output_port=output_port, wants_runtime=True, link=link,
                 description="a few steps of a training stage on its settings, checkpoint, reload, generate; "
                             "measured against the memory estimate; gates the stage", output_type="preflight")
