"""The architecture a training stage trains, as the numbers the memory and FLOPs formulas need.

`ModelShape` comes from a model's config alone: a transformers config dict (`base_model.config`, a local folder's
config.json, a hub model's config.json when it is in the local Hugging Face cache) or a GGUF file's header, never
the weights. A stage without base_model takes the model of the training stage among its inputs (sft <- pretrain),
and a config-built model without vocab_size takes the vocab_size of the tokenizer stage upstream (the most it can
have). Read by the estimate (trainer/estimate.py, trainer/gpus.py, trainer/pipeline_estimate.py) and by the
preflight stage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.config import PipelineConfig
from lmforge.errors import ConfigError
from trainer.errors import SettingError

TRAINING_KINDS = ("pretrain", "sft", "reward", "dpo", "ppo", "grpo")
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: model types whose decoder has the llama layout (separate q/k/v/o, a gated or plain MLP, RMSNorm)
LLAMA_FAMILY = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                          "phi3", "olmo", "olmo2", "granite", "cohere", "stablelm", "smollm3", "starcoder2",
                          "internlm2", "deepseek", "yi"})
NON_GATED = frozenset({"starcoder2", "stablelm"})


@dataclass(frozen=True)
class ModelShape:
    """What the memory and FLOPs formulas need from a model config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    gated_mlp: bool = True
    attention_bias: bool = False
    source: str = ""

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by peft's module name."""
        h, qd, kd, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        out = {"q_proj": (h, qd), "k_proj": (h, kd), "v_proj": (h, kd), "o_proj": (qd, h), "up_proj": (h, i),
               "down_proj": (i, h)}
        if self.gated_mlp:
            out["gate_proj"] = (h, i)
        return out

    def layer_params(self) -> int:
        """Parameters of one decoder layer: its linears, their biases and two norms."""
        n = sum(i * o for i, o in self.linears().values()) + 2 * self.hidden_size
        if self.attention_bias:
            n += (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return n

    def linear_params(self) -> int:
        """Weights of every decoder linear layer (the ones QLoRA quantizes)."""
        return self.num_layers * sum(i * o for i, o in self.linears().values())

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """lm_head weights that are not the embeddings (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def backbone_params(self) -> int:
        """Everything but lm_head: embeddings, layers, final norm."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size

    def params(self) -> int:
        return self.backbone_params() + self.head_params()

    def score_model_params(self) -> int:
        """A reward/value model on this backbone: a 1-wide score head instead of lm_head."""
        return self.backbone_params() + self.hidden_size

    def matmul_params(self, lm_head: bool = True) -> int:
        """Parameters used in a matmul per token (FLOPs): the layers' linears and the head (tied or not)."""
        return self.linear_params() + (self.vocab_size * self.hidden_size if lm_head else self.hidden_size)

    def lora_params(self, rank: int, targets: list[str] | str) -> int:
        linears = self.linears()
        names = list(linears) if targets == "all-linear" else [t.rsplit(".", 1)[-1] for t in targets]
        unknown = [t for t in names if t not in linears]
        if unknown:
            raise SettingError("lora.target_modules", f"{', '.join(unknown)} not among the linear layers the "
                               f"estimate knows for {self.model_type} ({', '.join(linears)}); use those names or "
                               "all-linear")
        return self.num_layers * sum(rank * (linears[t][0] + linears[t][1]) for t in names)


def shape_from_config(cfg: dict[str, Any], source: str, vocab_size: int | None = None) -> ModelShape:
    """A ModelShape from a transformers config dict (a config.json, a `base_model.config`, AutoConfig.to_dict()).

    `vocab_size` fills a missing vocab_size (a config-built model takes its tokenizer's size)."""
    cfg = dict(cfg.get("text_config") or cfg) if isinstance(cfg.get("text_config"), dict) else dict(cfg)
    model_type = str(cfg.get("model_type", ""))
    if model_type not in LLAMA_FAMILY:
        raise SettingError("base_model", f"model_type {model_type!r} ({source}): the estimate knows the llama-style "
                           f"decoder layout only ({', '.join(sorted(LLAMA_FAMILY))}); use one of those or add "
                           "its layout to trainer/shapes.py")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
               if cfg.get(k) is None]
    if missing or (cfg.get("vocab_size") is None and vocab_size is None):
        cfg = {**_defaults(model_type), **cfg}  # what transformers fills in when it builds this config
    vocab = cfg.get("vocab_size") if cfg.get("vocab_size") is not None else vocab_size
    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return ModelShape(
        model_type=model_type, vocab_size=int(vocab), hidden_size=h, num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or h // heads), intermediate_size=int(cfg["intermediate_size"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), gated_mlp=model_type not in NON_GATED,
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")), source=source)


def _defaults(model_type: str) -> dict[str, Any]:
    """transformers' defaults for a model type (imports transformers: only when a config leaves fields out)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type).to_dict()


def shape_from_gguf(path: str, source: str) -> ModelShape:
    """A ModelShape from a GGUF file's metadata (the `gguf` package reads the header; tensors stay on disk)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)

    def value(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = value("general.architecture")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    heads = int(value(f"{arch}.attention.head_count"))
    h = int(value(f"{arch}.embedding_length"))
    cfg = {"model_type": "llama" if arch not in LLAMA_FAMILY else arch, "hidden_size": h,
           "num_hidden_layers": int(value(f"{arch}.block_count")), "num_attention_heads": heads,
           "num_key_value_heads": int(value(f"{arch}.attention.head_count_kv", heads)),
           "head_dim": int(value(f"{arch}.attention.key_length", h // heads)),
           "intermediate_size": int(value(f"{arch}.feed_forward_length")),
           "vocab_size": len(tokens.data) if tokens is not None else None,
           "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    return shape_from_config(cfg, source)


# ----------------------------------------------------------------------------------------------
# the model of a stage of a pipeline config


def config_error(name: str, e: SettingError) -> ConfigError:
    """A stage's SettingError as the ConfigError the CLI reports, with the field's path."""
    return ConfigError([f"stages.{name}.{e.field}: {e.problem}"])


def tokenizer_vocab(cfg: PipelineConfig, name: str) -> int | None:
    """vocab_size of the nearest tokenizer stage upstream of `name` (breadth first), if any."""
    todo, seen = list(cfg.stages[name].inputs), set()
    while todo:
        n = todo.pop(0)
        if n in seen or n not in cfg.stages:
            continue
        seen.add(n)
        if cfg.stages[n].kind == "tokenizer":
            return int(cfg.stages[n].vocab_size)
        todo += cfg.stages[n].inputs
    return None


def model_shape(cfg: PipelineConfig, name: str) -> ModelShape:
    """The architecture a training stage trains: its base_model, or the model of the training stage it reads."""
    st = cfg.stages[name]
    src = getattr(st, "base_model", None)
    if src is not None:
        try:
            return source_shape(st, name, tokenizer_vocab(cfg, name))
        except SettingError as e:
            raise config_error(name, e) from None
    upstream = [i for i in st.inputs if i in cfg.stages and cfg.stages[i].kind in TRAINING_KINDS
                and cfg.stages[i].kind != "reward"]
    if not upstream:
        raise ConfigError([f"stages.{name}.base_model: no base model and no training stage among the inputs "
                           f"({', '.join(st.inputs)}); set base_model (config, path, package+file or hub)"])
    return model_shape(cfg, upstream[0])


def reward_shape(cfg: PipelineConfig, name: str) -> ModelShape | None:
    rewards = [i for i in cfg.stages[name].inputs if i in cfg.stages and cfg.stages[i].kind == "reward"]
    return model_shape(cfg, rewards[0]) if rewards else None


def source_shape(st, name: str, vocab: int | None) -> ModelShape:
    """The shape of stage `st`'s base_model (config, local folder, GGUF package or cached hub config); `vocab`
    fills a config without vocab_size. Raises SettingError naming the base_model field."""
    src = st.base_model
    if src.config is not None:
        return shape_from_config(src.config, f"stages.{name}.base_model.config", vocab)
    if src.path is not None:
        f = st.local_path(src.path) / "config.json"
        if not f.is_file():
            raise SettingError("base_model.path", f"{f} does not exist; the estimate reads the model's config.json "
                               "from the folder: point base_model.path at a save_pretrained folder")
        return shape_from_config(json.loads(f.read_text()), str(f))
    if src.package is not None:
        from trainer.models import gguf_location

        f = gguf_location(src.package, src.file or "")
        return shape_from_gguf(str(f), f"GGUF {f.name} ({src.package})")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(src.hub, "config.json", revision=src.revision)
    if not isinstance(cached, str):
        raise SettingError("base_model.hub", f"the config.json of {src.hub!r} is not in the local Hugging Face cache "
                           "and the estimate downloads nothing; download it once (`huggingface-cli download "
                           f"{src.hub} config.json`), or copy its contents into base_model.config")
    return shape_from_config(json.loads(Path(cached).read_text()), f"hub {src.hub} (cached config.json)")
