"""Text shards -> rows of exactly `max_length_tokens` token ids, streamed, for causal-LM training.

`PackedTextStream` is a torch `IterableDataset` over the webdataset shards of one split (`ShardRef`s: local
paths or s3:// through fsspec, each with the size and sha256 its manifest lists). Each reader, one per (rank,
DataLoader worker), reads its own part of the split, tokenizes the `text` records and packs them: every
document's tokens, then EOS, concatenated and cut into rows of `max_length_tokens`. Packing restarts at each
shard and drops the shard's last partial row, so the rows of a shard do not depend on who reads it. Each shard
is read whole and checked against its manifest before its first row is made: a damaged shard fails the
training (and the stage, before anything is published) with an error naming the artifact and the file; the
model never trains on what it holds.

Readers: rank r of R (`RANK`, `WORLD_SIZE`) with DataLoader worker w of W is reader r * W + w of R * W.
- shards >= readers: each reader reads only its shards (every R*W-th of the pass's shard order);
- fewer shards than readers: every reader packs every shard and keeps every R*W-th row, so no rank idles.
Either way each pass gives every row of the split to exactly one reader.

Order and position: a pass reshuffles the shard order (seed, pass) and each reader shuffles its rows in a
buffer (seed, pass, reader); with `endless` (training) the passes follow one another forever and the
Trainer stops at max_steps. The stream is deterministic, so the batches a rank has consumed are a
position: on resume the Trainer skips global_step x grad_accumulation_steps batches of this same stream
and lands on the next unseen batch. Nothing else about the data has to be checkpointed.

Each rank builds its own DataLoader (`loader`): accelerate must neither dispatch the stream from rank 0
nor cut it again per process, as it does with iterable datasets it prepares.
"""
from __future__ import annotations

import itertools
import logging
import random
from typing import Any, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lmforge.errors import DataError
from lmforge.shards import ShardRef, iter_shards
from trainer import job

log = logging.getLogger(__name__)

TOKENIZE_BATCH = 64  # documents per tokenizer call


class PackedTextStream(IterableDataset):
    def __init__(self, shards: list[ShardRef], tokenizer, max_length_tokens: int, *, where: str, seed: int = 0,
                 shuffle_buffer_rows: int = 0, endless: bool = True, rank: int | None = None,
                 world_size: int | None = None):
        if not shards:
            raise DataError(where, "the split has no shards", "check the shard stage's output")
        if tokenizer.eos_token_id is None:
            raise DataError(where, "the tokenizer has no eos token to put between documents",
                            "use a tokenizer with an eos token (the tokenizer stage's has one)")
        self.shards, self.tokenizer, self.length = list(shards), tokenizer, max_length_tokens
        self.where, self.seed, self.buffer, self.endless = where, seed, shuffle_buffer_rows, endless
        self.rank = job.rank() if rank is None else rank  # RANK and WORLD_SIZE, as torchrun sets them
        self.world_size = job.world_size() if world_size is None else world_size

    # ---- who reads what
    def reader(self) -> tuple[int, int]:
        """(this reader's index, number of readers): rank-major, DataLoader worker-minor."""
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank * workers + worker, self.world_size * workers

    def split_by(self, readers: int) -> str:
        return "shard" if len(self.shards) >= readers else "row"

    def shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.shards)))
        if self.buffer:
            random.Random(f"shards:{self.seed}:{epoch}").shuffle(order)
        return order

    # ---- the rows
    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        reader, readers = self.reader()
        if reader == 0:
            log.info("%s: %d shard(s) over %d reader(s) (%d rank(s) x %d worker(s)), split by %s, rows of %d tokens",
                     self.where, len(self.shards), readers, self.world_size, readers // self.world_size,
                     self.split_by(readers), self.length)
        epoch = 0
        while True:
            rows = 0
            for row in self.rows(epoch, reader, readers):
                rows += 1
                yield {"input_ids": row}
            if rows == 0:
                raise DataError(self.where, f"reader {reader} of {readers} got no full row of {self.length} tokens "
                                f"from {len(self.shards)} shard(s)", "add text, lower max_length_tokens, or use fewer "
                                "ranks or DataLoader workers (num_workers)")
            if not self.endless:
                return
            epoch += 1

    def rows(self, epoch: int, reader: int, readers: int) -> Iterator[list[int]]:
        """One pass: this reader's rows, shuffled in the buffer."""
        order = self.shard_order(epoch)
        if self.split_by(readers) == "shard":
            mine: Iterator[list[int]] = (r for i in order[reader::readers] for r in self.pack(self.shards[i]))
        else:
            every = (r for i in order for r in self.pack(self.shards[i]))
            mine = (r for j, r in enumerate(every) if j % readers == reader)
        if not self.buffer:
            yield from mine
            return
        rng, buf = random.Random(f"rows:{self.seed}:{epoch}:{reader}"), []
        for row in mine:
            if len(buf) < self.buffer:
                buf.append(row)
                continue
            k = rng.randrange(self.buffer)
            yield buf[k]
            buf[k] = row
        rng.shuffle(buf)
        yield from buf

    def pack(self, shard: ShardRef) -> Iterator[list[int]]:
        """The packed rows of one shard."""
        return self.pack_texts(self.texts(shard))

    def pack_texts(self, texts: Iterable[str]) -> Iterator[list[int]]:
        """Documents + EOS, concatenated, cut into rows of `length` tokens; the last partial row is dropped."""
        eos, buf = self.tokenizer.eos_token_id, []
        for texts in _batched(texts, TOKENIZE_BATCH):
            for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]:
                buf.extend(ids)
                buf.append(eos)
            while len(buf) >= self.length:
                yield buf[:self.length]
                del buf[:self.length]

    def texts(self, shard: ShardRef) -> Iterator[str]:
        """The documents of one shard, verified whole against its manifest before the first is given."""
        for rec in iter_shards([shard]):
            text = rec.get("text")
            if not isinstance(text, str):
                raise DataError(f"{self.where}, shard {shard.url}", f"record {rec.get('id', '?')} has no text (fields: "
                                f"{', '.join(sorted(rec))})", "feed the pretrain stage text shards")
            yield text


def _batched(items: Iterable[str], n: int) -> Iterator[list[str]]:
    """Lists of `n` items, the last one shorter."""
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


def packed_rows(shards: list[ShardRef], tokenizer, max_length_tokens: int, *, where: str,
                max_records: int | None = None) -> list[list[int]]:
    """Every packed row of a split, in shard order, in memory (validation, and training without streaming):
    the rows one pass of the stream gives, from the first `max_records` records of the split when set."""
    one = PackedTextStream(shards, tokenizer, max_length_tokens, where=where, endless=False, rank=0, world_size=1)
    out: list[list[int]] = []
    left = max_records
    for shard in shards:
        texts: Iterable[str] = one.texts(shard)
        if left is not None:
            texts = list(itertools.islice(texts, left))
            left -= len(texts)
        out.extend(one.pack_texts(texts))
        if left == 0:
            break
    return out


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full rows, no padding: every token is attended to and predicts the next (the model shifts labels)."""
    ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def loader(stream: PackedTextStream, *, batch_size: int, num_workers: int, prefetch_factor: int | None,
           pin_memory: bool, collate_fn=collate) -> DataLoader:
    """This rank's DataLoader over its part of the stream (pinning only where there is a GPU)."""
    return DataLoader(stream, batch_size=batch_size, collate_fn=collate_fn, num_workers=num_workers,
                      prefetch_factor=prefetch_factor if num_workers > 0 else None,
                      pin_memory=pin_memory and torch.cuda.is_available(), drop_last=True)


def trainer_class(base):
    """`base` (the transformers Trainer or a TRL trainer), except that a torch stream (PackedTextStream for
    pretrain, trainer.tokens.TokenRowStream for sft) gets this rank's own DataLoader (`loader`) with the trainer's
    collator; anything else goes through the Trainer's own."""

    class StreamTrainer(base):
        def get_train_dataloader(self):
            if not isinstance(self.train_dataset, IterableDataset):
                return super().get_train_dataloader()
            a = self.args
            return loader(self.train_dataset, batch_size=self._train_batch_size, num_workers=a.dataloader_num_workers,
                          prefetch_factor=a.dataloader_prefetch_factor, pin_memory=a.dataloader_pin_memory,
                          collate_fn=self.data_collator)

    return StreamTrainer
