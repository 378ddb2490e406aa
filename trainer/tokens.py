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
                 group_by_length: bool, seed: int, where: str, max_rows: int | None = None, endless: bool = True,
                 rank: int | None = None, world_size: int | None = None):
        if not shards:
            raise DataError(where, "the split has no token shards", "check the tokenize stage's output")
        if len(rows_per_shard) != len(shards):
            raise ValueError("rows_per_shard must list one count per shard")
        self.shards, self.counts = list(shards), list(rows_per_shard)
        self.batch_size, self.buffer_batches, self.group = batch_size, buffer_batches, group_by_length
        self.seed, self.where, self.endless = seed, where, endless
        self.max_rows = max_rows
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
            ids, labels = rec.get("input_ids"), rec.get("labels")
            if not isinstance(ids, list) or not isinstance(labels, list) or len(ids) != len(labels):
                raise DataError(f"{self.where}, shard {ref.url}", f"row {j} is not a token row (fields: "
                                f"{', '.join(sorted(rec))})", "feed this stage the output of a tokenize stage")
            yield {"input_ids": ids, "labels": labels}

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
            ordered = sorted(buf, key=lambda r: len(r["input_ids"]))  # stable: ties keep the shuffled order
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


def read_rows(shards: list[ShardRef], where: str) -> list[dict[str, list[int]]]:
    """Every row of a (small) split in memory, in shard order: the validation split."""
    out = []
    for rec in iter_shards(shards):
        if "input_ids" not in rec or "labels" not in rec:
            raise DataError(where, f"a record is not a token row (fields: {', '.join(sorted(rec))})",
                            "feed this stage the output of a tokenize stage")
        out.append({"input_ids": rec["input_ids"], "labels": rec["labels"]})
    return out
