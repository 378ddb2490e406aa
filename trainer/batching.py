"""Batches without wasted compute: length-grouped, seeded order, and a meter of the padding actually trained on.

sft, reward and dpo pad every micro-batch to its longest row (TRL's collators pad to the longest in the batch).
With rows of mixed length that is a large share of the compute: in an Alpaca-style set, a good part of the tokens a
plain TRL script feeds the model are padding (bench/padding.py measures it; docs/results.md has the figures).
Grouping rows of similar length into a micro-batch removes most of it without changing what is learned per row.

`LengthGroupedSampler` (installed by `group_by_length`) orders one epoch as:
1. a seeded permutation of the rows (torch.Generator seeded by (seed, epoch): no global RNG, so the order is a
   function of the settings and the epoch alone);
2. cut into shuffle buffers of `buffer_batches` micro-batches (a bounded window: grouping never sorts the whole
   data set, so every region of it still mixes);
3. each buffer sorted by length (stable) and cut into micro-batches;
4. the micro-batches of a buffer shuffled (same generator), so lengths do not decrease monotonically.
Resume is exact: the Trainer calls `set_epoch(epoch)` and skips the batches already trained, and the order of an
epoch does not depend on what ran before. Under DDP the Trainer's accelerate shard hands whole micro-batches to
ranks, so each rank's batch is length-grouped too.

`PaddingMeter` counts, on this process, the attention-mask ones (real tokens) and the mask size (tokens the
model computed on) of every training micro-batch `compute_loss` receives: padding_fraction = 1 - real / computed. It
measures what TRL's collator produced, not an estimate.

pretrain streams fixed-length packed blocks (no padding, nothing to group); grpo and ppo keep TRL's own samplers
(GRPO's RepeatSampler must keep a prompt's generations together); the meter still reports their padding where the
trainer goes through `compute_loss` (grpo; ppo's own loop does not, and reports none).
"""
from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

log = logging.getLogger(__name__)


def row_lengths(dataset: Any) -> list[int]:
    """Tokens of each tokenized row as the collator will lay it out: `input_ids` (sft); prompt + the longer of
    chosen and rejected (dpo: both are padded to the batch's longest); the longer of chosen and rejected
    (reward)."""
    cols = set(dataset.column_names)
    if "input_ids" in cols:
        return [len(x) for x in dataset["input_ids"]]
    if {"chosen_ids", "rejected_ids"} <= cols:
        prompts = [len(x) for x in dataset["prompt_ids"]] if "prompt_ids" in cols else [0] * len(dataset)
        return [p + max(len(c), len(r)) for p, c, r in zip(prompts, dataset["chosen_ids"], dataset["rejected_ids"])]
    raise ValueError(f"cannot tell row lengths from columns {sorted(cols)}")


class LengthGroupedSampler:
    """Row indices of one epoch, in micro-batches of similar length (see the module docstring)."""

    def __init__(self, lengths: Sequence[int], batch_size: int, buffer_batches: int, seed: int):
        self.lengths = list(lengths)
        self.batch_size, self.buffer_batches, self.seed = batch_size, buffer_batches, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def order(self, epoch: int) -> list[int]:
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.lengths), generator=g).tolist()
        window = self.batch_size * self.buffer_batches
        out: list[int] = []
        for start in range(0, len(perm), window):
            buf = sorted(perm[start:start + window], key=lambda i: self.lengths[i])
            batches = [buf[i:i + self.batch_size] for i in range(0, len(buf), self.batch_size)]
            for b in torch.randperm(len(batches), generator=g).tolist():
                out += batches[b]
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch))


def padding_of(lengths: Sequence[int], order: Sequence[int], batch_size: int) -> float:
    """The padding fraction of micro-batches taken in `order`: 1 - sum(lengths) / sum(batch rows x longest)."""
    real = slots = 0
    for i in range(0, len(order), batch_size):
        b = [lengths[j] for j in order[i:i + batch_size]]
        real += sum(b)
        slots += max(b) * len(b)
    return 1 - real / slots if slots else 0.0


def group_by_length(trainer: Any, s: Any) -> LengthGroupedSampler | None:
    """With `s.group_by_length`, make `trainer` draw its training rows through a LengthGroupedSampler (seeded by
    `s.seed`); logs the padding a random order would have against the grouped one."""
    if not getattr(s, "group_by_length", False) or getattr(s, "packing", False):
        return None
    ds = trainer.train_dataset
    lengths = row_lengths(ds)
    bs = trainer.args.per_device_train_batch_size
    sampler = LengthGroupedSampler(lengths, bs, s.length_group_buffer, s.seed)
    trainer._get_train_sampler = lambda *a, **k: sampler  # noqa: the Trainer builds its DataLoader from this
    import torch

    shuffled = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(s.seed)).tolist()
    log.info("length-grouped batches (buffer of %d micro-batches of %d): padding %.1f%% of the tokens in an "
             "epoch, against %.1f%% in a random order", s.length_group_buffer, bs,
             100 * padding_of(lengths, sampler.order(0), bs), 100 * padding_of(lengths, shuffled, bs))
    return sampler


class PaddingFree:
    """Padding-free forward passes for trainers whose collators pad (dpo, reward): the model sees each padded
    micro-batch's real tokens concatenated into one row, and its head's output is put back in the padded layout the
    trainer's loss reads, so TRL's loss code runs unchanged and computes exactly what it computed on the padded batch.

    A pre-hook on the backbone (e.g. LlamaModel) takes the right-padded [B, L] input_ids and attention_mask, keeps the
    real tokens as one [1, T] row with position_ids restarting at 0 per row (the padded forward's positions) and passes
    no attention mask; attention stays within each row (`packed_sdpa` for sdpa; eager's block-diagonal mask from the
    position_ids; flash-attention reads them). A hook on the head (lm_head, or a reward model's score) scatters its
    [1, T, X] output back to [B, L, X], zeros at the padding (which the losses mask). Only forwards without a cache are
    packed (TRL's training and evaluation forwards pass use_cache=False; generation keeps its padded, cached path), so
    the packed-sequence detection is never turned off by a cache. Installed on the policy and, in dpo with a full model,
    on the reference copy too.
    """

    def __init__(self, model: Any):
        core = _core_model(model)
        backbone = getattr(core, core.base_model_prefix)
        head = core.get_output_embeddings() if hasattr(core, "lm_head") else getattr(core, "score")
        self.mask = None
        backbone.register_forward_pre_hook(self._pack, with_kwargs=True)
        head.register_forward_hook(self._unpack)

    def _pack(self, module, args, kwargs):
        import torch

        self.mask = None
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if (args or ids is None or mask is None or mask.dim() != 2 or kwargs.get("use_cache") is not False
                or kwargs.get("past_key_values") is not None):
            return None
        m = mask.bool()
        if not torch.equal(m, m.long().cumprod(-1).bool()):  # only right padding keeps rows apart by position
            return None
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        self.mask = m
        return (), {**kwargs, "input_ids": ids[m][None], "position_ids": pos[m][None], "attention_mask": None}

    def _unpack(self, module, args, output):
        if self.mask is None:
            return None
        m, self.mask = self.mask, None
        full = output.new_zeros(*m.shape, output.shape[-1])
        full[m] = output[0]
        return full


def _core_model(model: Any) -> Any:
    """The transformers model inside `model` (a PeftModel, DDP or DeepSpeed wrapper) that holds the backbone and the
    head."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel) and hasattr(m, m.base_model_prefix) and (
                hasattr(m, "lm_head") or hasattr(m, "score")):
            return m
    raise ValueError(f"no transformers model with a backbone and a head in {type(model).__name__}")


PACKED_SDPA = "lmforge_packed_sdpa"


def packed_sdpa(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, position_ids: Any = None,
                **kwargs: Any) -> tuple[Any, None]:
    """transformers' sdpa attention, run once per sequence of a packed row.

    A packed row is one [1, T] row whose position_ids restart at 0 for each sequence. sdpa on it takes the
    block-diagonal causal mask that transformers builds from the position_ids (only when no cache exists), and computes
    all T x T scores, most of them masked. Here each sequence's queries, keys and values are sliced out and given to
    sdpa with `is_causal` and no mask: the same result (the masked scores weigh exactly 0) for the sum of the squared
    sequence lengths instead of T squared, and on CPU torch's fused causal kernel instead of the masked one. Anything
    else (padded batches, decoding with a cache, rows that do not restart) goes to sdpa unchanged."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (position_ids is not None and position_ids.dim() == 2 and query.shape[0] == 1 and position_ids.shape[0] == 1
            and query.shape[2] == key.shape[2] == position_ids.shape[1] > 1):
        starts = (position_ids[0] == 0).nonzero().flatten().tolist()
        if len(starts) > 1 and starts[0] == 0:
            ends = starts[1:] + [query.shape[2]]
            kwargs.pop("is_causal", None)
            parts = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None,
                                            is_causal=True, **kwargs)[0] for a, b in zip(starts, ends)]
            return torch.cat(parts, dim=1), None  # [1, T, heads, head_dim], as sdpa returns it
    return sdpa_attention_forward(module, query, key, value, attention_mask, position_ids=position_ids, **kwargs)


def use_packed_attention(model: Any) -> None:
    """Run `model`'s sdpa attention per packed sequence (`packed_sdpa`). flash-attention reads the position_ids
    itself and eager keeps its block-diagonal mask; both are left as they are. The setting is not saved with the
    model (transformers keeps the attention implementation out of config.json)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    if PACKED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_SDPA, packed_sdpa)
        AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # padded batches keep sdpa's mask
    core = _core_model(model)
    if core.config._attn_implementation == "sdpa":
        core.set_attn_implementation(PACKED_SDPA)
    if core.config._attn_implementation in (PACKED_SDPA, "eager"):  # TRL warns about anything but flash-attention
        logging.getLogger("trl.trainer.sft_trainer").addFilter(_attention_checked)
        log.info("padding-free: attention per packed row (%s)", core.config._attn_implementation)


def _attention_checked(record: logging.LogRecord) -> bool:
    """Drop TRL's warning that padding-free training may let the rows of a packed batch attend to each other
    without flash-attention: with packed_sdpa and eager they do not (tests/test_packing.py checks it)."""
    return "Padding-free training is enabled, but the attention implementation" not in record.getMessage()


def padding_free(trainer: Any, s: Any) -> bool:
    """With `packing: padding_free` (dpo, reward), pack the forwards of the trainer's model, and of its reference
    model when it holds one of its own; whether it did."""
    if getattr(s, "packing", False) != "padding_free":
        return False
    PaddingFree(trainer.model)
    use_packed_attention(trainer.model)
    if getattr(trainer, "ref_model", None) is not None:
        PaddingFree(trainer.ref_model)
        use_packed_attention(trainer.ref_model)
    log.info("padding-free forwards: each micro-batch's rows concatenated, position_ids restarting per row")
    return True


class PaddingMeter:
    """Real and computed tokens of every micro-batch this process trains on (see the module docstring); with
    `packed` (PaddingFree forwards) the model computes on the real tokens only."""

    def __init__(self, trainer: Any, packed: bool = False):
        self.real = self.computed = 0
        self.packed = packed
        compute_loss = trainer.compute_loss

        def measured(model, inputs, *args, **kwargs):  # GRPO builds its tensors before compute_loss, not before
            if model.training:                          # training_step; evaluation runs in eval mode
                self.add(inputs)
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = measured

    def add(self, inputs: Any) -> None:
        if not isinstance(inputs, dict):
            return
        masks = [v for k, v in inputs.items() if k.endswith("attention_mask") and hasattr(v, "sum")]
        if not masks:  # GRPO: the forward input is prompt + completion, each with its own mask
            masks = [inputs[k] for k in ("prompt_mask", "completion_mask") if hasattr(inputs.get(k), "sum")]
        if not masks and hasattr(inputs.get("input_ids"), "numel"):  # packed blocks (pretrain): no padding at all
            n = int(inputs["input_ids"].numel())
            self.real, self.computed = self.real + n, self.computed + n
        for m in masks:
            self.real += int(m.sum())
            self.computed += int(m.sum() if self.packed else m.numel())

    @property
    def fraction(self) -> float | None:
        return round(1 - self.real / self.computed, 4) if self.computed else None

    def result(self, seconds: float) -> dict[str, Any]:
        """`padding_fraction` and `nonpad_tokens_per_s` of this process (rank 0's in the stage result)."""
        return {"padding_fraction": self.fraction,
                "nonpad_tokens_per_s": round(self.real / seconds, 1) if seconds > 0 and self.real else None}
