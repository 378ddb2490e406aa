"""tokenize: chat or preference shards -> token shards, made once for every sft, dpo or reward stage that shares them.

Every training run used to tokenize its data again, even when only the learning rate changed. A `tokenize` stage
does it once; its artifact id depends on the data, the tokenizer (its inputs, or `base_model`'s identity), the chat
template, the kind of rows, max_length_tokens and assistant_only_loss, and on nothing that only steers training, so
any number of training stages (other learning rates, epochs, LoRA ranks, ...) read the same token shards, and a
second run of the pipeline reuses them. The training stage then streams the rows from the store
(trainer/tokens.py), shard by shard, so the data set is bounded by the store, not by the training process's memory.

    stages:
      sft_tokens: {kind: tokenize, inputs: [chat_shards, tokenizer]}
      sft:        {kind: sft, inputs: [sft_tokens, tokenizer], max_length_tokens: 256, learning_rate: 1e-3}
      dpo_tokens: {kind: tokenize, inputs: [pair_shards, sft]}
      dpo:        {kind: dpo, inputs: [dpo_tokens, sft]}

`rows` (sft, dpo, reward) and the settings that shape the rows (base_model, max_length_tokens, assistant_only_loss)
are taken from the stages that read the token shards when they are not set here (parse_config's `link`); set and
different from a reader's, or different between two readers, is a config error naming both fields. The tokenize
stage's tokenizer/model inputs must be the reader's, so both sides load the same tokenizer (the training process
checks it again by the vocabulary's fingerprint, and dpo/reward the chat template).

Rows are what TRL's trainers prepare (trainer/tokens.py: sft_row, dpo_row, reward_row): for sft the chat template
is the marked copy the sft stage would pick for assistant-only loss, saved as `chat_template.jinja` and set by the
training stage; ids and labels cut to max_length_tokens, rows without a label dropped and counted; dpo rows whose
prompt fills max_length_tokens and reward rows longer than it dropped, and identical pairs skipped, all counted as
the trainers do. Records are read one shard at a time and written to token shards of at most `rows_per_shard` rows
with `mtime=0` (the same data gives the same bytes); the train and validation splits keep the shard stage's split.
"""
from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Literal

from pydantic import Field

from lmforge import interrupt
from lmforge.config import StageConfig
from lmforge.errors import ConfigError, DataError
from lmforge.log import Progress
from lmforge.shards import SPLITS, iter_shards, shard_refs
from lmforge.port import Port
from lmforge.stage import Result, StageDef, StageRuntime
from lmforge.store import Artifact
from tasks.training import TEMPLATE_FILE, by_type, check_model_inputs, model_source_identity
from trainer.models import ModelSource

log = logging.getLogger(__name__)

ROW_SETTINGS = ("base_model", "max_length_tokens", "assistant_only_loss")  # taken from the readers when unset
READERS = ("sft", "dpo", "reward")  # stage kinds that train on token shards


class TokenizeConfig(StageConfig):
    kind: Literal["tokenize"] = Field(description="Chat or preference shards -> token shards, made once and "
                                      "streamed by every sft, dpo or reward stage that reads them.")
    base_model: ModelSource | None = Field(None, description="Whose tokenizer and chat template, unless a tokenizer "
                                           "or model input gives them; unset: the reading stage's base_model.")
    max_length_tokens: int | None = Field(None, gt=0, description="Rows are cut to this many tokens; unset: the "
                                          "reading stage's max_length_tokens.")
    assistant_only_loss: bool | None = Field(None, description="Labels on assistant tokens only; unset: the "
                                             "reading stage's setting.")
    rows: Literal["sft", "dpo", "reward"] | None = Field(
        None, description="Which training kind the rows are for: sft (chat shards -> ids and labels), dpo (preference "
        "shards -> prompt, chosen and rejected ids) or reward (preference shards -> chosen and rejected ids); unset: "
        "the kind of the stage that reads them.")
    rows_per_shard: int = Field(10_000, gt=0, description="Most rows per token shard.")

    def settings(self) -> dict:
        return model_source_identity(super().settings(), self.base_model, self.project_root)


class TokenizeResult(Result):
    data_kind: str
    rows: str
    records: dict[str, int]
    train_rows: int
    validation_rows: int
    skipped_identical: dict[str, int]  # preference pairs with chosen == rejected
    dropped_no_label: dict[str, int]  # nothing left to learn within max_length_tokens (TRL drops these too)
    tokens: dict[str, int]
    label_tokens: dict[str, int]
    longest_row: int
    max_length_tokens: int
    assistant_only_loss: bool | None
    tokenizer_fingerprint: str
    num_shards: dict[str, int]
    bytes: int
    shards: list[dict]


def run(cfg: TokenizeConfig, inputs: list[Artifact], out: Path, runtime: StageRuntime) -> TokenizeResult:
    import webdataset as wds

    from tasks.shard import written_shards
    from trainer import chat_templates, launch, models, tokens
    from trainer.errors import SettingError
    from trainer.job import ArtifactRef, materialize

    found = by_type(inputs)
    shards = found["shards"][0]
    tok_art, model_art = found.get("tokenizer", [None])[0], found.get("model", [None])[0]
    max_length = cfg.max_length_tokens or 1024
    kind = cfg.rows or "sft"
    aol = (True if cfg.assistant_only_loss is None else cfg.assistant_only_loss) if kind == "sft" else None
    base = cfg.base_model
    if base is not None and base.path is not None:
        base = base.model_copy(update={"path": str(cfg.local_path(base.path))})
    try:
        with launch.work_dir(runtime.stage, runtime.artifact_id) as work:
            res = models.resolve(base, ArtifactRef.of(model_art) if model_art else None, work)
            tokenizer = models.load_tokenizer(res, materialize(ArtifactRef.of(tok_art), work) if tok_art else None)
        if aol:  # the template the sft stage would pick: a marked copy that renders the same text
            first = [r["messages"] for r in itertools.islice(iter_shards(shard_refs(shards, "train")), 20)
                     if "messages" in r]
            marked = chat_templates.training_template(tokenizer, first)
            if marked is not None:
                tokenizer.chat_template = marked
    except SettingError as e:
        raise ConfigError([f"stages.{runtime.stage}.{e.field}: {e.problem}"]) from None
    (out / TEMPLATE_FILE).write_text(tokenizer.chat_template or "")
    make = _row_maker(kind, tokenizer, max_length, aol)

    counts, dropped = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    records, identical = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    ntok, nlab, longest = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0), 0
    total = sum(shards.result.get(f"{s}_samples", 0) for s in SPLITS) or None
    progress = Progress(log, f"tokenize {shards.kind}/{shards.id}", total=total)
    for split in SPLITS:
        refs = shard_refs(shards, split)
        writer = wds.ShardWriter(str(out / f"{split}-%06d.tar"), maxcount=cfg.rows_per_shard, verbose=0, mtime=0)
        try:
            for k, rec in enumerate(interrupt.checked(iter_shards(refs), f"tokenize {split}")):
                where = f"stage {runtime.stage}: {shards.kind}/{shards.id} {split} record {k} (id {rec.get('id', '?')})"
                records[split] += 1
                progress.update()
                row = make(rec, where)
                if row is SKIP:
                    identical[split] += 1
                    continue
                if row is None:
                    dropped[split] += 1
                    continue
                writer.write({"__key__": f"{counts[split]:09d}", "json": {"id": rec.get("id"), **row}})
                counts[split] += 1
                n = tokens.row_length(row)
                ntok[split] += sum(len(v) for v in row.values()) if kind != "sft" else n
                nlab[split] += sum(x != tokens.IGNORE for x in row["labels"]) if kind == "sft" else 0
                longest = max(longest, n)
        finally:
            writer.close()
    progress.done()
    if counts["train"] == 0:
        raise DataError(f"stage {runtime.stage}", f"no {kind} training row is left within max_length_tokens "
                        f"{max_length} ({records['train']} read, {identical['train']} with chosen == rejected, "
                        f"{dropped['train']} {DROPPED[kind]})", "raise max_length_tokens or check the data")
    if any(dropped.values()):
        log.warning("stage %s: %s record(s) %s and are dropped", runtime.stage, dropped, DROPPED[kind])
    if any(identical.values()):
        log.warning("stage %s: %s pair(s) have chosen == rejected (nothing to prefer) and are skipped", runtime.stage,
                    identical)
    written = written_shards(out, counts)
    return TokenizeResult(
        data_kind=f"{kind}_tokens", rows=kind, records=records, train_rows=counts["train"],
        validation_rows=counts["validation"], skipped_identical=identical, dropped_no_label=dropped, tokens=ntok,
        label_tokens=nlab, longest_row=longest, max_length_tokens=max_length,
        assistant_only_loss=aol, tokenizer_fingerprint=tokens.tokenizer_fingerprint(tokenizer),
        num_shards={s: sum(1 for x in written if x["split"] == s) for s in SPLITS},
        bytes=sum(x["bytes"] for x in written), shards=written)


SKIP = object()  # a preference pair with chosen == rejected
DROPPED = {"sft": "have no label within max_length_tokens",
           "dpo": "have a prompt of max_length_tokens or more (no completion token would be left)",
           "reward": "are longer than max_length_tokens"}


def _row_maker(kind: str, tokenizer, max_length: int, aol: bool | None):
    """rec, where -> the token row, None (dropped: nothing to learn within max_length) or SKIP (identical pair)."""
    from trainer import tokens
    from trainer.preference import pair_example

    conversational = bool(tokenizer.chat_template)  # as the dpo and reward recipes decide it
    make_pair = tokens.dpo_row if kind == "dpo" else tokens.reward_row

    def make(rec: dict, where: str):
        if kind == "sft":
            if not isinstance(rec.get("messages"), list):
                raise DataError(where, f"no messages (fields: {', '.join(sorted(rec))})",
                                "rows: sft reads chat shards")
            return tokens.sft_row(tokenizer, rec["messages"], max_length=max_length, assistant_only_loss=bool(aol),
                                  where=where)
        example = pair_example(rec, conversational, where)
        return SKIP if example is None else make_pair(tokenizer, example, max_length=max_length)

    return make


def output_port(cfg: TokenizeConfig, inputs: list[Port]) -> Port:
    kind = cfg.rows or "sft"
    data = "chat" if kind == "sft" else "preference"
    check_model_inputs(cfg, inputs, "tokenize", (data,), f"{data} shards (rows: {kind})")  # base_model: the reader's
    return Port("shards", f"{kind}_tokens")


def link(name: str, cfg: TokenizeConfig, stages: dict[str, StageConfig]) -> dict[str, StageConfig]:
    """parse_config's hook: unset row settings come from the stages that read this one; set ones must agree with
    them, and the readers' tokenizer/model inputs must be this stage's. ValueError names the field at fault."""
    readers = {n: s for n, s in stages.items() if name in s.inputs and n != name and s.kind in READERS}
    kinds = {s.kind for s in readers.values()}  # other readers: the graph check reports them
    if cfg.rows is not None and kinds - {cfg.rows}:
        n = next(n for n, s in readers.items() if s.kind != cfg.rows)
        raise ValueError(f"rows: {cfg.rows} rows, but stage {n} is a {readers[n].kind} stage; leave rows out (it "
                         "follows the reading stage) or give that stage a tokenize stage of its own")
    if len(kinds) > 1:
        raise ValueError(f"rows: stages of kinds {', '.join(sorted(kinds))} read these token shards; each training "
                         "kind needs token rows of its own: give each a tokenize stage")
    for n, s in readers.items():
        mine = [i for i in cfg.inputs if _lends_tokenizer(i, stages)]
        theirs = [i for i in s.inputs if i != name]
        if sorted(mine) != sorted(theirs):
            raise ValueError(f"inputs: the tokenizer/model inputs {mine} differ from stage {n}'s other inputs "
                             f"{theirs}; give both stages the same tokenizer and model inputs")
    update: dict = {"rows": next(iter(kinds))} if cfg.rows is None and kinds else {}
    for field in ROW_SETTINGS:
        values = {n: getattr(s, field) for n, s in readers.items() if hasattr(s, field)}
        if field == "base_model":  # a dpo stage starts from its model input and has no base_model
            values = {n: v for n, v in values.items() if v is not None or readers[n].kind != "dpo"}
        mine = getattr(cfg, field)
        for n, v in values.items():
            if mine is not None and v != mine:
                raise ValueError(f"{field}: {_show(mine)} differs from stages.{n}.{field} ({_show(v)}); the token "
                                 f"rows must be made as stage {n} trains on them: leave {field} out here, or set "
                                 "the same value")
        distinct = {repr(v): (n, v) for n, v in values.items()}
        if mine is None and len(distinct) > 1:
            a, b = list(distinct.values())[:2]
            raise ValueError(f"{field}: stages {a[0]} and {b[0]} read these token shards with different {field} "
                             f"({_show(a[1])} vs {_show(b[1])}); give each its own tokenize stage")
        if mine is None and distinct:
            update[field] = next(iter(distinct.values()))[1]
    if not update:
        return {}
    new = cfg.model_copy(update=update)
    new._root = cfg._root
    return {name: new}


def _lends_tokenizer(name: str, stages: dict[str, StageConfig]) -> bool:
    """Whether stage `name`'s output carries a tokenizer: a tokenizer or a model, as its kind declares
    (StageDef.output_type), so a new stage kind needs nothing here. A dataset or an unknown name lends none."""
    from tasks import REGISTRY

    s = stages.get(name)
    kind = REGISTRY.get(s.kind) if s is not None else None
    return kind is not None and kind.output_type in ("model", "tokenizer")


def _show(v) -> str:
    return v.model_dump_json(exclude_none=True) if hasattr(v, "model_dump_json") else repr(v)


STAGE = StageDef(kind="tokenize", version="1", config=TokenizeConfig, run=run, output_port=output_port,
                 wants_runtime=True, code=("trainer.tokens", "trainer.chat_templates"), link=link,
                 description="chat or preference shards -> token shards, made once for the sft/dpo/reward stages "
                 "that read them", output_type="shards")
