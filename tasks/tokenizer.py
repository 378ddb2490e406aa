"""tokenizer: shards -> a byte-level BPE tokenizer with a chat template that marks assistant turns.

Trains on the train split of its shard inputs: text records' `text`, chat records' message contents,
preference records' prompt, chosen and rejected. Byte-level BPE (HF `tokenizers`) never meets an
unknown character. The chat template is ChatML (`<|im_start|>role\\n...<|im_end|>\\n`) with each
assistant turn's content and end-of-turn token inside `{% generation %}...{% endgeneration %}`, so
SFT can put the loss on assistant tokens only (TRL `assistant_only_loss=True`) and the model learns
to stop. The output loads with `AutoTokenizer.from_pretrained(folder)`.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import Field, field_validator, model_validator

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.errors import DataError
from lmforge.log import Progress
from lmforge.shards import iter_samples
from lmforge.port import Port
from lmforge.stage import Result, StageDef, expect_inputs
from lmforge.store import Artifact

log = logging.getLogger(__name__)
SAMPLE_CONVERSATION = [{"role": "system", "content": "Be brief."},
                       {"role": "user", "content": "What is 2 plus 3?"},
                       {"role": "assistant", "content": "2 plus 3 equals 5."},
                       {"role": "user", "content": "And 4 plus 4?"},
                       {"role": "assistant", "content": "8."}]


class TokenizerConfig(StageConfig):
    kind: Literal["tokenizer"] = Field(description="Trains a byte-level BPE tokenizer with a chat template.")
    vocab_size: int = Field(8000, ge=300, description="Vocabulary size, special tokens and the 256 byte tokens "
                            "included.")
    min_frequency: int = Field(2, ge=1, description="A pair must occur this often to be merged.")
    pad_token: str = Field("<|endoftext|>", min_length=1, description="Padding token (also ends plain-text documents).")
    turn_start_token: str = Field("<|im_start|>", min_length=1, description="Opens each chat turn.")
    turn_end_token: str = Field("<|im_end|>", min_length=1, description="Closes each chat turn; the tokenizer's eos.")
    extra_special_tokens: list[str] = Field(default_factory=list, description="More special tokens, never split.")
    chat_template: str | None = Field(
        None, description="Jinja chat template; it must wrap assistant output in {% generation %}..."
        "{% endgeneration %}. Default: ChatML built from turn_start_token and turn_end_token.")
    max_records: int | None = Field(None, gt=0, description="Train on at most this many records.")
    split_digits: bool = Field(False, description="Every digit its own token, as Llama and SmolLM2 do: 27 is '2' "
                               "'7', never a merged '27', so a model can learn arithmetic digit by digit.")

    @field_validator("chat_template")
    @classmethod
    def _marked(cls, v: str | None) -> str | None:
        from trainer.chat_templates import has_markers

        if v is not None and not has_markers(v):
            raise ValueError("must wrap assistant output in {% generation %}...{% endgeneration %}, so SFT can "
                             "put the loss on assistant tokens")
        return v

    @model_validator(mode="after")
    def _distinct(self) -> "TokenizerConfig":
        specials = self.special_tokens()
        dupes = sorted({t for t in specials if specials.count(t) > 1})
        if dupes:
            raise ValueError(f"special tokens must differ; {', '.join(dupes)} given more than once")
        return self

    def special_tokens(self) -> list[str]:
        return [self.pad_token, self.turn_start_token, self.turn_end_token, *self.extra_special_tokens]


class TokenizerResult(Result):
    vocab_size: int
    records: int
    characters: int
    special_tokens: dict[str, int]
    sample_tokens: int
    chars_per_token: float


def _texts(rec: dict[str, Any]) -> Iterator[str]:
    if "text" in rec:
        yield rec["text"]
    elif "messages" in rec:
        for m in rec["messages"]:
            yield m["content"]
    else:
        for k in ("prompt", "chosen", "rejected"):
            if k in rec:
                yield rec[k]


def run(cfg: TokenizerConfig, inputs: list[Artifact], out: Path) -> TokenizerResult:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from trainer.chat_templates import chatml

    stats = {"records": 0, "characters": 0}
    sample: list[str] = []
    total = sum(int(a.result.get("train_samples", 0)) for a in inputs)
    progress = Progress(log, "tokenizer: reading", total=min(total, cfg.max_records or total))

    def corpus() -> Iterator[str]:
        for art in inputs:
            # Interrupted raised here comes out of train_from_iterator as it is (tokenizers passes it on)
            for rec in interrupt.checked(iter_samples(art, "train"), "tokenizer reading"):
                if cfg.max_records is not None and stats["records"] >= cfg.max_records:
                    return
                stats["records"] += 1
                progress.update()
                for text in _texts(rec):
                    stats["characters"] += len(text)
                    if len(sample) < 2000:
                        sample.append(text)
                    yield text

    bpe = Tokenizer(models.BPE())
    level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), level])
                         if cfg.split_digits else level)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets map tokens back to characters
    bpe.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=cfg.special_tokens(),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    progress.done()
    if stats["records"] == 0:
        raise DataError(f"tokenizer inputs {', '.join(a.id for a in inputs)}", "the train split holds no records",
                        "check the upstream stages' drop counts")

    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=cfg.turn_end_token, pad_token=cfg.pad_token,
                                  additional_special_tokens=cfg.extra_special_tokens or None)
    tok.chat_template = cfg.chat_template or chatml(cfg.turn_start_token, cfg.turn_end_token)
    _check_template(tok, cfg)
    tok.save_pretrained(out)

    reloaded = AutoTokenizer.from_pretrained(str(out))  # what every later stage does
    n_tokens = sum(len(ids) for ids in reloaded(sample, add_special_tokens=False)["input_ids"])
    n_chars = sum(len(t) for t in sample)
    log.info("tokenizer: %d tokens from %d records, %.2f characters per token on %d samples", len(reloaded),
             stats["records"], n_chars / max(n_tokens, 1), len(sample))
    return TokenizerResult(vocab_size=len(reloaded), records=stats["records"], characters=stats["characters"],
                           special_tokens={t: reloaded.convert_tokens_to_ids(t) for t in cfg.special_tokens()},
                           sample_tokens=n_tokens, chars_per_token=round(n_chars / max(n_tokens, 1), 4))


def _check_template(tok, cfg: TokenizerConfig) -> None:
    """The assistant mask must cover each assistant reply and end on the end-of-turn token."""
    try:
        enc = tok.apply_chat_template(SAMPLE_CONVERSATION, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    except Exception as e:
        raise DataError("chat_template", f"does not render a sample conversation ({type(e).__name__}: {e})",
                        "fix the Jinja template") from None
    masked = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    text = tok.decode(masked)
    want = "".join(m["content"] + cfg.turn_end_token for m in SAMPLE_CONVERSATION if m["role"] == "assistant")
    if text != want:
        raise DataError("chat_template", f"marks {text!r} as assistant output in a sample conversation; expected "
                        f"{want!r} (each reply and its {cfg.turn_end_token})",
                        "put {% generation %}...{% endgeneration %} around the reply and its end-of-turn token only")


def output_port(cfg: TokenizerConfig, inputs: list[Port]) -> Port:
    expect_inputs(inputs, "tokenizer", types={"shards"}, same_kind=False)
    return Port("tokenizer")


STAGE = StageDef(kind="tokenizer", version="1", config=TokenizerConfig, run=run, output_port=output_port,
                 description="shards -> byte-level BPE tokenizer with a chat template marking assistant turns",
                 output_type="tokenizer")
