"""Token rows: chat records tokenized once (the `tokenize` stage), then streamed into training from the store.

Tokenizing is the same work in every training run that shares data, tokenizer, chat template and max length,
so the `tokenize` stage (tasks/tokenize.py) does it once and writes token shards: webdataset tars like the
`shard` stage's, one JSON record per row. An sft row is what TRL's SFTTrainer prepares from a conversation
(`SFTTrainer._prepare_dataset` in TRL 1.12, language-modelling case), so a run on token shards trains on the
same ids and labels as a run that tokenizes in process (tests/test_tokenize.py checks it against TRL):
- `input_ids`: `apply_chat_template(messages, tokenize=True, return_assistant_tokens_mask=...)`;
- `labels`: the id where the assistant mask is 1 (every id without assistant_only_loss), else -100;
- both cut to max_length_tokens (keep the start); a row left with no label is dropped, and counted.

`TokenRowStream` is the training side: a torch IterableDataset over the token shards of one split, read shard by
shard through their manifest digests (`ShardRef`), so memory holds one shard and one shuffle buffer, never the
data set. Like `trainer.stream.PackedTextStream` (pretrain):
- readers: rank r of R with DataLoader worker w of W is reader r*W+w; with at least as many shards as readers each
  reads its own shards, else every reader reads every shard and keeps every (R*W)-th row;
- a pass reshuffles the shard order (seed, pass); passes follow one another forever and the Trainer stops at
  max_steps (the stage computes it from the row counts the token artifact's manifest lists);
- length grouping in a bounded buffer: `buffer_batches` micro-batches of rows are shuffled (seed, pass, reader),
  sorted by length, cut into micro-batches and the micro-batches shuffled, so each micro-batch holds rows of
  similar length (little padding) while the data still mixes across the buffer. Without grouping the buffer is
  only shuffled.
The stream is a pure function of (shards, settings, pass), so a position is the number of micro-batches a rank has
consumed: on resume the Trainer skips global_step x grad_accumulation_steps batches of this same stream and
lands on the next unseen one (exact resume, as in pretrain); nothing is re-tokenized to get there.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
from typing import Any, Iterator

from torch.utils.data import IterableDataset, get_worker_info

from lmforge.errors import DataError
from lmforge.shards import ShardRef, iter_shards
from trainer import job

log = logging.getLogger(__name__)

IGNORE = -100


def sft_row(tokenizer, messages: list[dict[str, Any]], *, max_length: int, assistant_only_loss: bool,
            where: str) -> dict[str, list[int]] | None:
    """One conversation -> {input_ids, labels} as TRL's SFTTrainer prepares it; None when truncation left no
    label (TRL drops such rows too). The tokenizer's chat template is the one to train with (marked for
    assistant-only loss)."""
    processed = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=assistant_only_loss)
    ids = list(processed["input_ids"])
    if assistant_only_loss:
        mask = processed.get("assistant_masks")
        if mask is None or 1 not in mask:
            raise DataError(where, "the conversation has no assistant token under the chat template's "
                            "{% generation %} markers", "check that the record has an assistant turn, or set "
                            "assistant_only_loss: false")
        labels = [t if m else IGNORE for t, m in zip(ids, mask)]
    else:
        labels = list(ids)
    ids, labels = ids[:max_length], labels[:max_length]
    if all(x == IGNORE for x in labels):
        return None
    return {"input_ids": ids, "labels": labels}


def sft_rows(tokenizer, conversations, *, max_length: int, assistant_only_loss: bool, where: str):
    """(a `datasets.Dataset` of {input_ids, labels}, rows dropped): a chat data set made into token rows in memory,
    as the tokenize stage makes them (`sft_row`): what padding-free packing trains on without a tokenize stage."""
    import datasets

    rows = [sft_row(tokenizer, m, max_length=max_length, assistant_only_loss=assistant_only_loss,
                    where=f"{where}, row {i}") for i, m in enumerate(conversations["messages"])]
    kept = [r for r in rows if r is not None]
    return (datasets.Dataset.from_list(kept) if kept else None), len(rows) - len(kept)


def _ids(tokenizer, x) -> list[int]:
    """TRL's `_tokenize`: a message list through the chat template, a string through the tokenizer."""
    if isinstance(x, list):
        return list(tokenizer.apply_chat_template(x, tokenize=True, return_dict=True)["input_ids"])
    return list(tokenizer(text=x)["input_ids"])


def _with_eos(example: dict[str, Any], eos: str) -> dict[str, Any]:
    """TRL's add_eos for plain-text pairs: chosen and rejected end with the eos token."""
    if isinstance(example["chosen"], list):
        return example
    return {**example, **{k: example[k] if example[k].endswith(eos) else example[k] + eos
                          for k in ("chosen", "rejected")}}


def dpo_row(tokenizer, example: dict[str, Any], *, max_length: int) -> dict[str, list[int]] | None:
    """A {prompt, chosen, rejected} pair (trainer.preference.pair_example) -> DPOTrainer's {prompt_ids, chosen_ids,
    rejected_ids} (TRL 1.12 `DPOTrainer._prepare_dataset`); None when the prompt alone fills max_length (DPOTrainer
    drops those: its keep_start truncation would leave no completion token). The collator cuts the rest."""
    ex = _with_eos(example, tokenizer.eos_token)
    if isinstance(ex["prompt"], list):
        prompt = list(tokenizer.apply_chat_template(ex["prompt"], tokenize=True, return_dict=True,
                                                    add_generation_prompt=True)["input_ids"])
    else:
        prompt = _ids(tokenizer, ex["prompt"])
    chosen, rejected = _ids(tokenizer, ex["prompt"] + ex["chosen"]), _ids(tokenizer, ex["prompt"] + ex["rejected"])
    if len(prompt) >= max_length:
        return None
    return {"prompt_ids": prompt, "chosen_ids": chosen[len(prompt):], "rejected_ids": rejected[len(prompt):]}


def reward_row(tokenizer, example: dict[str, Any], *, max_length: int) -> dict[str, list[int]] | None:
    """A pair -> RewardTrainer's {chosen_ids, rejected_ids} (prompt + completion each, TRL 1.12
    `RewardTrainer._prepare_dataset`); None when either is longer than max_length (RewardTrainer drops those)."""
    ex = _with_eos(example, tokenizer.eos_token)
    chosen, rejected = _ids(tokenizer, ex["prompt"] + ex["chosen"]), _ids(tokenizer, ex["prompt"] + ex["rejected"])
    if len(chosen) > max_length or len(rejected) > max_length:
        return None
    return {"chosen_ids": chosen, "rejected_ids": rejected}


#: the columns of a token row, by the training kind it is made for
FIELDS = {"sft": ("input_ids", "labels"), "dpo": ("prompt_ids", "chosen_ids", "rejected_ids"),
          "reward": ("chosen_ids", "rejected_ids")}


def row_length(row: dict[str, list[int]]) -> int:
    """Tokens a row takes in its padded micro-batch (as trainer.batching.row_lengths counts them)."""
    if "input_ids" in row:
        return len(row["input_ids"])
    return len(row.get("prompt_ids", ())) + max(len(row["chosen_ids"]), len(row["rejected_ids"]))


def tokenizer_fingerprint(tokenizer) -> str:
    """What must match between the tokenize stage and the training stage: vocabulary, special tokens and
    the class (not the chat template, which the token artifact carries with it)."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), separators=(",", ":")).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


class TokenRowStream(IterableDataset):
    """This rank's token rows, endless, length-grouped in a bounded buffer (see the module docstring)."""

    def __init__(self, shards: list[ShardRef], rows_per_shard: list[int], *, batch_size: int, buffer_batches: int,
                 group_by_length: bool, seed: int, where: str, fields: tuple[str, ...] = FIELDS["sft"],
                 max_rows: int | None = None, endless: bool = True, rank: int | None = None,
                 world_size: int | None = None):
        if not shards:
            raise DataError(where, "the split has no token shards", "check the tokenize stage's output")
        if len(rows_per_shard) != len(shards):
            raise ValueError("rows_per_shard must list one count per shard")
        self.shards, self.counts = list(shards), list(rows_per_shard)
        self.batch_size, self.buffer_batches, self.group = batch_size, buffer_batches, group_by_length
        self.seed, self.where, self.endless = seed, where, endless
        self.fields, self.max_rows = tuple(fields), max_rows
        self.rank = job.rank() if rank is None else rank
        self.world_size = job.world_size() if world_size is None else world_size

    @property
    def rows(self) -> int:
        """Rows in one pass over the split (all readers together)."""
        total = sum(self.counts)
        return min(total, self.max_rows) if self.max_rows is not None else total

    def first_rows(self, n: int = 8):
        """A `datasets.Dataset` of the split's first few rows: what a TRL trainer is built with (it checks and
        prepares its train_dataset when constructed) before the stream replaces it."""
        import datasets

        first = next(i for i in range(len(self.shards)) if self._limit(i))
        return datasets.Dataset.from_list(list(itertools.islice(self._shard_rows(first), n)))

    def reader(self) -> tuple[int, int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * workers + worker, self.world_size * workers

    def _limit(self, i: int) -> int:
        """Rows of shard i inside max_rows (the first max_rows rows of the split in manifest order)."""
        if self.max_rows is None:
            return self.counts[i]
        before = sum(self.counts[:i])
        return max(0, min(self.counts[i], self.max_rows - before))

    def _shard_rows(self, i: int) -> Iterator[dict[str, list[int]]]:
        keep = self._limit(i)
        if keep == 0:
            return
        ref = self.shards[i]
        for j, rec in enumerate(iter_shards([ref])):  # the shard verified whole before its first row
            if j >= keep:
                return
            yield token_row(rec, self.fields, f"{self.where}, shard {ref.url}, row {j}")

    def _pass(self, epoch: int, reader: int, readers: int) -> Iterator[dict[str, list[int]]]:
        order = [i for i in range(len(self.shards)) if self._limit(i)]
        random.Random(f"shards:{self.seed}:{epoch}").shuffle(order)
        if len(order) >= readers:
            for i in order[reader::readers]:
                yield from self._shard_rows(i)
        else:
            k = 0
            for i in order:
                for row in self._shard_rows(i):
                    if k % readers == reader:
                        yield row
                    k += 1

    def _grouped(self, rows: Iterator[dict[str, list[int]]], rng: random.Random) -> Iterator[dict[str, list[int]]]:
        window = self.batch_size * self.buffer_batches
        buf: list[dict[str, list[int]]] = []

        def flush():
            rng.shuffle(buf)
            if not self.group:
                return list(buf)
            ordered = sorted(buf, key=row_length)  # stable: ties keep the shuffled order
            batches = [ordered[i:i + self.batch_size] for i in range(0, len(ordered), self.batch_size)]
            rng.shuffle(batches)
            return [r for b in batches for r in b]

        for row in rows:
            buf.append(row)
            if len(buf) == window:
                yield from flush()
                buf = []
        if buf:
            yield from flush()

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        reader, readers = self.reader()
        if reader == 0:
            log.info("%s: %d token rows in %d shard(s), streamed to %d reader(s), micro-batches %s in buffers of %d",
                     self.where, self.rows, len(self.shards), readers,
                     "grouped by length" if self.group else "shuffled", self.buffer_batches)
        epoch = 0
        while True:
            rng = random.Random(f"rows:{self.seed}:{epoch}:{reader}")
            n = 0
            for row in self._grouped(self._pass(epoch, reader, readers), rng):
                n += 1
                yield row
            if n == 0:
                raise DataError(self.where, f"reader {reader} of {readers} got no token row from {len(self.shards)} "
                                "shard(s)", "add data, or use fewer ranks or DataLoader workers (num_workers)")
            if not self.endless:
                return
            epoch += 1


def token_row(rec: dict[str, Any], fields: tuple[str, ...], where: str) -> dict[str, list[int]]:
    """The row's token columns, checked: a record of another layout is a DataError naming it."""
    row = {f: rec.get(f) for f in fields}
    bad = [f for f, v in row.items() if not isinstance(v, list)]
    if bad or ("labels" in row and len(row["labels"]) != len(row["input_ids"])):
        raise DataError(where, f"not a token row of {', '.join(fields)} (fields: {', '.join(sorted(rec))})",
                        "feed this stage the output of a tokenize stage made for it")
    return row


def read_rows(shards: list[ShardRef], where: str, fields: tuple[str, ...] = FIELDS["sft"]) -> list[dict]:
    """Every row of a (small) split in memory, in shard order: the validation split."""
    return [token_row(rec, fields, where) for rec in iter_shards(shards)]


def stream_data(spec, s, tokenizer, kind: str):
    """(train stream, validation rows as a datasets.Dataset or None, optimizer steps) of a training stage whose
    input is a tokenize stage's token shards (`spec.token_data`).

    The rows were made with this model's tokenizer (checked by its vocabulary's fingerprint) and chat template:
    sft's template (the marked copy the tokenize stage picked) is set on the tokenizer, so the saved model carries
    it; dpo and reward must render with the template the rows were made with. Steps: `max_steps`, else
    ceil(epochs x micro-batches per rank per pass / grad_accumulation_steps), as the Trainer counts a map-style
    epoch."""
    import math

    import datasets

    td = spec.token_data
    where = f"stage {spec.stage} train split ({td['artifact']})"
    if td.get("rows", "sft") != kind:
        raise DataError(where, f"the token rows were made for a {td.get('rows', 'sft')} stage, not {kind}",
                        f"give this stage a tokenize stage of its own (rows: {kind})")
    mine = tokenizer_fingerprint(tokenizer)
    if mine != td["tokenizer_fingerprint"]:
        raise DataError(where, f"the token shards were made with another tokenizer (fingerprint "
                        f"{td['tokenizer_fingerprint']}, this model's is {mine})", "give the tokenize stage the same "
                        "tokenizer and model inputs (or base_model) as this stage")
    for field in ("max_length_tokens", "assistant_only_loss"):
        if td.get(field) is not None and td[field] != getattr(s, field, td[field]):
            raise DataError(where, f"the token rows were made with {field} {td[field]}, this stage trains with "
                            f"{getattr(s, field)}", f"set the same {field} on both stages (or leave it out of the "
                            "tokenize stage)")
    if kind == "sft":
        tokenizer.chat_template = td["chat_template"] or tokenizer.chat_template
    elif (td["chat_template"] or None) != (tokenizer.chat_template or None):
        raise DataError(where, "the token rows were rendered with another chat template than this model's",
                        "give the tokenize stage the same model input as this stage")
    train = TokenRowStream(spec.train_shards, td["rows_per_shard"]["train"], batch_size=s.batch_size_per_device,
                           buffer_batches=s.length_group_buffer, seed=s.seed,
                           group_by_length=s.group_by_length and getattr(s, "packing", False) != "padding_free",
                           where=where, fields=FIELDS[kind], max_rows=s.max_train_records)
    eval_ds = None
    if s.evaluate and spec.validation_shards:
        rows = read_rows(spec.validation_shards, f"stage {spec.stage} validation split", FIELDS[kind])
        eval_ds = datasets.Dataset.from_list(rows) if rows else None
    per_rank = math.ceil(train.rows / (s.batch_size_per_device * job.world_size()))
    steps = s.max_steps or max(1, math.ceil(s.epochs * max(per_rank // s.grad_accumulation_steps, 1)))
    log.info("%s: %d rows streamed, %d optimizer steps (%s)", where, train.rows, steps,
             "max_steps" if s.max_steps else f"{s.epochs:g} epoch(s)")
    return train, eval_ds, steps


def pair_counts(td: dict[str, Any], train_rows: int) -> dict[str, int]:
    """A preference stage's record counts when it streams token rows: what the tokenize stage read, skipped
    (chosen == rejected) and kept."""
    return {"train_records": td["records"]["train"], "validation_records": td["records"]["validation"],
            "skipped_identical_pairs": td["skipped_identical"]["train"] + td["skipped_identical"]["validation"],
            "train_pairs": train_rows}


def epochs_done(steps: int, s, rows: int) -> float:
    """Passes over the streamed split that `steps` optimizer steps took (all ranks)."""
    return round(steps * s.grad_accumulation_steps * s.batch_size_per_device * job.world_size() / max(rows, 1), 4)


def build_trainer(base, train, **kwargs):
    """`base` (a TRL trainer class) on `train`: a data set, or a TokenRowStream. A stream has no length, and TRL
    checks and prepares its data set while it builds the trainer: it is built on the stream's first rows, then the
    stream is set as what trains."""
    if not isinstance(train, TokenRowStream):
        return base(train_dataset=train, **kwargs)
    trainer = trainer_class(base)(train_dataset=train.first_rows(), **kwargs)
    trainer.train_dataset = train
    return trainer


def trainer_class(base):
    """`base` (a TRL trainer) for token rows: the stream gets this rank's own DataLoader (trainer.stream's
    trainer_class), and a data set that already holds token rows is taken as prepared (DPOTrainer would tokenize
    it again)."""
    from trainer import stream

    class TokenRowTrainer(stream.trainer_class(base)):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            cols = set(getattr(dataset, "column_names", None) or ())
            if any(set(f) <= cols for f in FIELDS.values()):
                return dataset
            return super()._prepare_dataset(dataset, *args, **kwargs)

    return TokenRowTrainer
