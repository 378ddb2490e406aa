"""Precision, DeepSpeed and FSDP: what a training stage asks for, checked against the machine before it trains.

precision (`precision:`)
    auto   bf16 on CUDA GPUs with compute capability 8.0+ (Ampere, Ada, Hopper, ...), fp16 with a dynamic loss
           scaler on older CUDA GPUs, fp32 on CPU
    bf16   bf16 autocast, weights and optimizer states stay fp32 (under DeepSpeed: bf16 weights, fp32 master
           copies). On CPU it is torch's CPU autocast: it runs, but is fast only on CPUs with AMX / AVX512-BF16,
           and DeepSpeed on CPU refuses it. It is refused on CUDA GPUs older than Ampere.
    fp16   fp16 autocast with a dynamic loss scaler (torch GradScaler, or DeepSpeed's own); CUDA GPUs only
    fp32   no mixed precision

DeepSpeed (`deepspeed:`): a preset name (`configs/deepspeed/<name>.json`: zero2, zero2_offload, zero3,
zero3_offload), a JSON file (relative to the project root) or an inline mapping. The values lmforge owns stay
"auto" (or absent) and transformers fills them from the stage's settings: micro batch and gradient
accumulation, gradient clipping, bf16/fp16. The optimizer and the schedule are the stage's (`optimizer`,
`lr_scheduler`), so `optimizer` and `scheduler` sections are refused. It runs under `launcher: torchrun` or
`launcher: deepspeed`. On CPU it runs under torchrun with gloo: `training_args` sets up DeepSpeed's process
group first (transformers alone would start DeepSpeed on CPU with no backend and a world of one process), and
the launcher sets DS_ACCELERATOR=cpu.

FSDP (`fsdp:`): a preset name (`configs/fsdp/<name>.yaml`: full_shard), an accelerate config file (YAML or
JSON, its `fsdp_config` block is used) or an inline `fsdp_config` mapping, as transformers' TrainingArguments
reads it (the `fsdp_` prefix is optional). CUDA GPUs only: through accelerate on CPU it would silently train as
plain DDP, so it is refused there, naming the field.

Launchers (`trainer.launch.command`): local (one process), torchrun (`nproc_per_node` per node; several nodes
meet at `rdzv_endpoint`), deepspeed (DeepSpeed's launcher, one node, needs a `deepspeed` config).

Everything here is light at import time (no torch): `trainer.settings` checks preset names when a config is
parsed.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from trainer.errors import SettingError

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED_DIR = REPO / "configs" / "deepspeed"
FSDP_DIR = REPO / "configs" / "fsdp"

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
AMPERE = (8, 0)

#: DeepSpeed keys lmforge fills from the stage's settings ("auto" or absent), and the setting each comes from
DEEPSPEED_AUTO = {
    "train_micro_batch_size_per_gpu": "batch_size_per_device",
    "gradient_accumulation_steps": "grad_accumulation_steps",
    "train_batch_size": "batch_size_per_device x grad_accumulation_steps x processes",
    "gradient_clipping": "max_grad_norm",
    "bf16.enabled": "precision",
    "fp16.enabled": "precision",
}
#: DeepSpeed sections that would replace the stage's own settings
DEEPSPEED_REFUSED = {"optimizer": "optimizer and learning_rate", "scheduler": "lr_scheduler and warmup_steps"}

#: keys of transformers' `fsdp_config` (TrainingArguments), without the optional `fsdp_` prefix
FSDP_KEYS = frozenset({
    "version", "auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params", "reshard_after_forward",
    "cpu_offload", "state_dict_type", "cpu_ram_efficient_loading", "activation_checkpointing", "forward_prefetch",
    "backward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers"})
#: accelerate's names for the same things
FSDP_ALIASES = {"offload_params": "cpu_offload"}
#: keys of an accelerate config file that the stage's settings decide (precision, processes, launcher): ignored
ACCELERATE_LAUNCH_KEYS = frozenset({
    "compute_environment", "distributed_type", "mixed_precision", "num_processes", "num_machines", "machine_rank",
    "main_training_function", "rdzv_backend", "same_network", "use_cpu", "downcast_bf16", "gpu_ids",
    "main_process_ip", "main_process_port", "enable_cpu_affinity", "debug", "tpu_env", "tpu_use_cluster",
    "tpu_use_sudo"})


# ----------------------------------------------------------------------------------------------
# precision


def resolve_precision(requested: str, capability: tuple[int, int] | None) -> str:
    """bf16, fp16 or fp32 for `precision: requested` on a device with this CUDA compute capability (None: CPU).

    A pure function of its inputs, so the table can be tested without the hardware."""
    if requested not in PRECISIONS:
        raise SettingError("precision", f"unknown precision {requested!r}; expected one of {', '.join(PRECISIONS)}")
    if requested == "auto":
        if capability is None:
            return "fp32"
        return "bf16" if tuple(capability) >= AMPERE else "fp16"
    if requested == "fp16" and capability is None:
        raise SettingError("precision", "fp16 mixed precision needs a CUDA GPU (its loss scaler is CUDA-only) and "
                           "this machine has none; use precision auto (fp32 on CPU), fp32, or bf16 (CPU autocast)")
    if requested == "bf16" and capability is not None and tuple(capability) < AMPERE:
        major, minor = capability
        raise SettingError("precision", f"bf16 needs a GPU of compute capability 8.0 or more (Ampere or newer); "
                           f"this GPU has {major}.{minor}; use precision fp16 (loss-scaled) or auto")
    return requested


def device_capability() -> tuple[int, int] | None:
    """The CUDA compute capability of this process's GPU, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


# ----------------------------------------------------------------------------------------------
# presets and config files


def presets(folder: Path) -> dict[str, Path]:
    """Shipped presets in `folder`: file stem -> path (configs/deepspeed/*.json, configs/fsdp/*.yaml)."""
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.iterdir()) if p.suffix in (".json", ".yaml", ".yml")}


def is_preset_name(value: str) -> bool:
    """A bare name (no folder, no file suffix) names a shipped preset; anything else is a file path."""
    return "/" not in value and "\\" not in value and Path(value).suffix.lower() not in (".json", ".yaml", ".yml")


def check_preset_name(field: str, value: Any) -> Any:
    """At config parse time: a preset name must exist; paths and mappings are checked when the stage starts."""
    if value is None or isinstance(value, dict):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a preset name, a file path or a mapping, got {value!r}")
    folder = DEEPSPEED_DIR if field == "deepspeed" else FSDP_DIR
    if is_preset_name(value) and value not in presets(folder):
        known = ", ".join(presets(folder)) or "none"
        raise ValueError(f"no {field} preset {value!r}; shipped presets: {known} (in {folder.relative_to(REPO)}/); "
                         "or give a .json/.yaml file path or a mapping")
    return value


def _read_file(field: str, value: str, root: Path | None) -> tuple[Any, str]:
    """(parsed content, name for messages) of a preset or a file path (relative to `root`)."""
    folder = DEEPSPEED_DIR if field == "deepspeed" else FSDP_DIR
    if is_preset_name(value):
        found = presets(folder)
        if value not in found:
            raise SettingError(field, f"no preset {value!r}; shipped presets: {', '.join(found) or 'none'}")
        path, name = found[value], f"preset {value} ({found[value].relative_to(REPO)})"
    else:
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = (root or REPO) / path
        name = value
        if not path.is_file():
            raise SettingError(field, f"{value}: no such file (looked at {path}); paths are relative to the project "
                               f"root; or use a preset: {', '.join(presets(folder))}")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text), name
        except json.JSONDecodeError as e:
            raise SettingError(field, f"{name}: not valid JSON: {e}") from None
    import yaml

    try:
        return yaml.safe_load(text), name
    except yaml.YAMLError as e:
        raise SettingError(field, f"{name}: not valid YAML: {str(e).splitlines()[0]}") from None


def _get(d: Mapping[str, Any], dotted: str) -> Any:
    node: Any = d
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def check_deepspeed(cfg: Any, name: str = "the mapping") -> dict[str, Any]:
    """A DeepSpeed config that lmforge can fill: every problem at once, in one SettingError on `deepspeed`."""
    if not isinstance(cfg, dict):
        raise SettingError("deepspeed", f"{name}: expected a mapping (JSON object), got {type(cfg).__name__}")
    problems = []
    stage = _get(cfg, "zero_optimization.stage")
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        problems.append(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    for key, setting in DEEPSPEED_AUTO.items():
        v = _get(cfg, key)
        if v is not None and v != "auto":
            problems.append(f"{key} is {v!r}; lmforge fills it from {setting}: write \"auto\" or leave it out")
    for key, settings in DEEPSPEED_REFUSED.items():
        if key in cfg:
            problems.append(f"remove the {key} section; the stage's {settings} settings decide it")
    if problems:
        raise SettingError("deepspeed", f"{name}: " + "; ".join(problems))
    return cfg


def deepspeed_offloads(cfg: Mapping[str, Any] | None) -> bool:
    """Does this DeepSpeed config keep optimizer states (or parameters) on the CPU?"""
    if not cfg:
        return False
    return any((_get(cfg, f"zero_optimization.{k}.device") or "none") != "none"
               for k in ("offload_optimizer", "offload_param"))


def load_deepspeed(value: str | dict | None, root: Path | None = None) -> dict[str, Any] | None:
    """The checked DeepSpeed config of `deepspeed:` (preset, file relative to `root`, or mapping)."""
    return _load("deepspeed", value, root, check_deepspeed)


def _load(field: str, value: str | dict | None, root: Path | None, check) -> dict[str, Any] | None:
    """`check`ed config of setting `field`: None, a mapping, or a preset or file read by `_read_file`."""
    if value is None:
        return None
    if isinstance(value, dict):
        return check(value)
    cfg, name = _read_file(field, value, root)
    return check(cfg, name)


def check_fsdp(cfg: Any, name: str = "the mapping") -> dict[str, Any]:
    """transformers' `fsdp_config` from an accelerate config file or a plain mapping; unknown keys refused."""
    if not isinstance(cfg, dict):
        raise SettingError("fsdp", f"{name}: expected a mapping, got {type(cfg).__name__}")
    if "fsdp_config" in cfg:  # an accelerate config file: the launch keys are the stage's settings
        kind = cfg.get("distributed_type", "FSDP")
        if kind != "FSDP":
            raise SettingError("fsdp", f"{name}: distributed_type is {kind!r}; an FSDP config has FSDP")
        unknown = sorted(set(cfg) - ACCELERATE_LAUNCH_KEYS - {"fsdp_config"})
        if unknown:
            raise SettingError("fsdp", f"{name}: unknown keys {', '.join(unknown)} next to fsdp_config")
        ignored = sorted(set(cfg) & {"mixed_precision", "num_processes", "num_machines", "use_cpu"})
        if ignored:
            log.info("fsdp %s: %s come from the stage settings (precision, nproc_per_node, nnodes), not the file",
                     name, ", ".join(ignored))
        cfg = cfg["fsdp_config"]
        if not isinstance(cfg, dict):
            raise SettingError("fsdp", f"{name}: fsdp_config must be a mapping, got {type(cfg).__name__}")
    out, unknown = {}, []
    for key, v in cfg.items():
        k = FSDP_ALIASES.get(key.removeprefix("fsdp_"), key.removeprefix("fsdp_"))
        if k in FSDP_KEYS:
            out[k] = v
        else:
            unknown.append(key)
    if unknown:
        raise SettingError("fsdp", f"{name}: unknown fsdp_config keys {', '.join(sorted(unknown))}; known: "
                           f"{', '.join(sorted(FSDP_KEYS))} (each may carry an fsdp_ prefix)")
    if out.get("version", 2) not in (1, 2):
        raise SettingError("fsdp", f"{name}: version must be 1 or 2, got {out['version']!r}")
    return out


def load_fsdp(value: str | dict | None, root: Path | None = None) -> dict[str, Any] | None:
    """The checked `fsdp_config` of `fsdp:` (preset, file relative to `root`, or mapping)."""
    return _load("fsdp", value, root, check_fsdp)


# ----------------------------------------------------------------------------------------------
# combinations


def check(settings: Mapping[str, Any], capability: tuple[int, int] | None) -> str:
    """Raise SettingError (naming the field) for a launch, sharding or precision setting this machine cannot run;
    returns the resolved precision. `settings` is a stage's settings dict (defaults apply to missing keys);
    `capability` the CUDA compute capability, None on CPU."""
    launcher = settings.get("launcher", "local")
    nproc, nnodes = int(settings.get("nproc_per_node", 1)), int(settings.get("nnodes", 1))
    ds, fsdp = settings.get("deepspeed"), settings.get("fsdp")
    cuda = capability is not None
    if nnodes > 1 and launcher != "torchrun":
        raise SettingError("launcher", f"nnodes {nnodes} needs launcher torchrun (one torchrun per node, meeting at "
                           f"rdzv_endpoint); launcher {launcher} runs on one node")
    if nnodes > 1 and not settings.get("rdzv_endpoint"):
        raise SettingError("rdzv_endpoint", f"nnodes {nnodes} needs a rendezvous endpoint host:port that every "
                           "node reaches, e.g. the first node's address 10.0.0.1:29400")
    if launcher == "local" and nproc != 1:
        raise SettingError("nproc_per_node", f"launcher local runs one process, got nproc_per_node {nproc}; set "
                           "launcher: torchrun for more")
    if ds is not None and fsdp is not None:
        raise SettingError("fsdp", "fsdp and deepspeed are both set; they are two ways to shard the same training: "
                           "keep one")
    if fsdp is not None and not cuda:
        raise SettingError("fsdp", "FSDP needs CUDA GPUs and this machine has none (through accelerate on CPU it "
                           "would silently train as plain DDP); on CPU remove fsdp and use launcher: torchrun (DDP), "
                           "or deepspeed: zero2 / zero3")
    if fsdp is not None and launcher != "torchrun":
        raise SettingError("launcher", f"fsdp shards the model across processes started by torchrun; launcher is "
                           f"{launcher}: set launcher: torchrun")
    if launcher == "deepspeed" and ds is None:
        raise SettingError("deepspeed", "launcher deepspeed needs a DeepSpeed config: set deepspeed to a preset "
                           "(zero2, zero3, ...), a JSON file or a mapping; for plain DDP use launcher: torchrun")
    if ds is not None and launcher == "local":
        raise SettingError("launcher", "deepspeed needs a distributed launcher: set launcher: torchrun (any "
                           "nproc_per_node, 1 included) or launcher: deepspeed")
    precision = resolve_precision(settings.get("precision", "auto"), capability)
    if ds is not None and not cuda and precision == "bf16":
        raise SettingError("precision", "bf16 with deepspeed needs a GPU (transformers refuses DeepSpeed bf16 on "
                           "CPU); use precision auto or fp32 on CPU")
    if (precision == "fp16" and ds is None and settings.get("method", "lora") == "full"
            and settings.get("dtype", "float32") == "float16"):
        raise SettingError("dtype", "float16 weights cannot be trained fully with fp16 mixed precision (the loss "
                           "scaler cannot unscale fp16 gradients); load them as float32 (dtype: float32) or use "
                           "precision bf16")
    return precision


def prepare(settings: dict[str, Any], root: Path | None, capability: tuple[int, int] | None) -> dict[str, Any]:
    """In the stage process, before the training process starts: check the combination, and replace a
    `deepspeed` / `fsdp` preset or file by its checked content, so the training process needs no project root."""
    check(settings, capability)
    out = dict(settings)
    if out.get("deepspeed") is not None:
        out["deepspeed"] = load_deepspeed(out["deepspeed"], root)
    if out.get("fsdp") is not None:
        out["fsdp"] = load_fsdp(out["fsdp"], root)
    return out


def child_env(cuda: bool) -> dict[str, str]:
    """Environment of the training processes: without CUDA, DeepSpeed (ours, or imported by transformers and
    accelerate when installed) is told it runs on the CPU instead of searching for an accelerator."""
    return {} if cuda else {"DS_ACCELERATOR": "cpu"}


def parameter_count(module, trainable_only: bool = True) -> int:
    """Parameters of `module`, also after DeepSpeed ZeRO-3 partitioned them: a partitioned parameter's `numel()` is
    0 on every rank, its full size is `ds_numel`."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad or not trainable_only)


def init_deepspeed_on_cpu(timeout_s: float = 1800) -> None:
    """DeepSpeed on CPU under torchrun: set up accelerate's state with DeepSpeed's process group on gloo.

    transformers (5.24) starts DeepSpeed without a backend when there is no GPU, and accelerate then counts a
    world of one process: every rank would train on all the data with a wrong train_batch_size. Set up here,
    the state is reused by TrainingArguments (`accelerator_config={"use_configured_state": True}`)."""
    from datetime import timedelta

    from accelerate import PartialState
    from accelerate.utils import DistributedType

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        state = PartialState(backend="gloo", timeout=timedelta(seconds=timeout_s))
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    if state.distributed_type != DistributedType.DEEPSPEED:  # pragma: no cover  (an accelerate change)
        raise RuntimeError(f"accelerate set up {state.distributed_type} instead of DeepSpeed on CPU")
