"""Padding-free packing (`packing: padding_free`: sft, dpo, reward), exact on CPU in fp32.

sft: a micro-batch's rows are concatenated into one row, position_ids restart at 0 for each row and no attention mask
is passed (TRL's DataCollatorForLanguageModeling(padding_free=True)); transformers builds the block-diagonal causal
mask from position_ids for sdpa and eager attention, provided no cache exists (use_cache off in training), and the
training path runs sdpa once per row instead (trainer.batching.packed_sdpa: no compute on the masked pairs).
dpo and reward: TRL's padded batch, packed inside the model (trainer.batching.PaddingFree) for the policy's and the
reference's forwards, the head's output put back in the padded layout TRL's losses read.

Default suite (in process, tiny Llama from tests/helpers.py): per-sequence logits equal the unpacked ones, one sft
step's and one dpo step's loss and gradients equal the padded step's, reward scores equal the padded ones, a short
SFTTrainer run packed and padded ends at the same held-out loss, and the settings refuse bad combinations. Slow: the
stages end to end (sft in memory, dpo, reward), and exact resume after SIGKILL of a streamed sft with packing on.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from tests.helpers import TINY_LLAMA

VOCAB = 48
PAD = 0


def tiny_llama(attn: str = "sdpa", seed: int = 0):
    """attn "packed": sdpa switched to trainer.batching.packed_sdpa, as the padding-free training path does."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.batching import PACKED_SDPA, use_packed_attention

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=VOCAB,
                      pad_token_id=PAD, attn_implementation="sdpa" if attn == "packed" else attn)
    assert cfg.use_cache  # the config default: the trap the training path must turn off
    model = LlamaForCausalLM(cfg).float()
    if attn == "packed":
        use_packed_attention(model)
        assert model.config._attn_implementation == PACKED_SDPA
    return model


def rows(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """Token rows of mixed length, a prompt (label -100) then an answer (labels = ids), as sft rows are."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(2, 9))]
        a = rng.randint(1, 20)
        answer = [a, a + 1, a + 2] + [a + 3] * rng.choice([0, 1, 3, 8, 20])  # learnable: a predicts what follows
        out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer})
    return out


def collate(batch: list[dict], padding_free: bool):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=padding_free)(batch)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "packed"])
def test_packed_logits_equal_the_unpacked_rows(attn, monkeypatch):
    import torch

    model = tiny_llama(attn).eval()
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def counted(q, k, v, attn_mask=None, **kw):  # the (query length, masked) of every sdpa call
        seen.append((q.shape[2], attn_mask is not None))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    batch = rows(4, seed=1)
    packed = collate(batch, padding_free=True)
    assert set(packed) == {"input_ids", "labels", "position_ids"} and packed["input_ids"].shape[0] == 1
    assert packed["input_ids"].shape[1] == sum(len(r["input_ids"]) for r in batch)  # no padding at all
    with torch.no_grad():
        out = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits[0]
        packed_calls, seen[:] = list(seen), []
        starts = [0]
        for r in batch:
            starts.append(starts[-1] + len(r["input_ids"]))
        worst = 0.0
        for r, a, b in zip(batch, starts, starts[1:]):
            alone = model(input_ids=torch.tensor([r["input_ids"]]), use_cache=False).logits[0]
            worst = max(worst, float((out[a:b] - alone).abs().max()))
        assert worst < 1e-5
        layers = len(model.model.layers)
        if attn == "packed":  # each row's own causal attention, unmasked: no score computed across rows
            assert packed_calls == [(len(r["input_ids"]), False) for r in batch] * layers
        elif attn == "sdpa":  # one call over the whole row with the block-diagonal mask
            assert packed_calls == [(starts[-1], True)] * layers
        # the trap: with the config's cache on, the packed-sequence detection is off and rows attend to each other
        cached = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0]
        if attn == "packed":  # packed_sdpa reads the rows from position_ids alone: the trap cannot bite
            assert torch.equal(cached, out)
        else:
            assert float((cached - out).abs().max()) > 1e-2


def test_packed_attention_leaves_padded_batches_and_generation_alone():
    """packed_sdpa only splits packed rows: a padded batch and cached generation give what sdpa gives."""
    import torch

    sdpa, packed = tiny_llama("sdpa").eval(), tiny_llama("packed").eval()
    b = collate(rows(4, seed=6), padding_free=False)
    assert int((b["attention_mask"] == 0).sum()) > 0
    with torch.no_grad():
        a, c = (m(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
                for m in (sdpa, packed))
        assert torch.equal(a, c)
        prompt = torch.tensor([rows(1, seed=7)[0]["input_ids"]])
        gen = [m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=PAD) for m in (sdpa, packed)]
    assert torch.equal(gen[0], gen[1])


def test_one_packed_step_has_the_padded_steps_loss_and_gradients():
    """Loss per assistant token over the micro-batch, as the Trainer weights it (num_items_in_batch counts
    labels[..., 1:] != -100); the packed collator masks each row's first label, which no padded row predicts."""
    import torch

    batch = rows(6, seed=2)
    padded, packed = collate(batch, padding_free=False), collate(batch, padding_free=True)
    assert float((padded["attention_mask"] == 0).float().mean()) > 0.3  # the padded step computes on padding
    count = lambda b: int((b["labels"][..., 1:] != -100).sum())  # noqa: E731 (Trainer._get_num_items_in_batch)
    assert count(padded) == count(packed) == sum(sum(x != -100 for x in r["labels"][1:]) for r in batch)
    losses, grads = [], []
    for b in (padded, packed):
        model = tiny_llama("packed" if b is packed else "sdpa").train()
        loss = model(**b, use_cache=False, num_items_in_batch=torch.tensor(count(b))).loss
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert abs(losses[0] - losses[1]) < 1e-5 and losses[0] > 1
    assert float((grads[0] - grads[1]).abs().max()) < 1e-5


def pairs(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    ids = lambda lo, hi: [rng.randint(1, VOCAB - 1) for _ in range(rng.randint(lo, hi))]  # noqa: E731
    return [{"prompt_ids": ids(2, 9), "chosen_ids": ids(1, 12), "rejected_ids": ids(1, 20)} for _ in range(n)]


def test_dpo_padding_free_forwards_give_the_padded_losses_and_gradients(tmp_path):
    """dpo: TRL's padded preference batch, the policy's and the reference's forwards packed (PaddingFree hooks on
    the backbone and the head), TRL's own loss code unchanged: loss, rewards and gradients equal the padded step's."""
    import torch
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from trainer.batching import PaddingMeter, padding_free
    from trainer.tokens import trainer_class

    batch = DataCollatorForPreference(pad_token_id=PAD)(pairs(4, seed=5))
    assert float((batch["attention_mask"] == 0).float().mean()) > 0.2
    out = []
    for packed in (False, True):
        model, ref = tiny_llama("sdpa", seed=0), tiny_llama("sdpa", seed=1).eval()
        import datasets

        trainer = trainer_class(DPOTrainer)(
            model=model, ref_model=ref, train_dataset=datasets.Dataset.from_list(pairs(8)),
            processing_class=_tokenizer(),
            args=DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], beta=0.1,
                           activation_checkpointing=False, precompute_ref_log_probs=False))
        calls = []
        if packed:  # as the dpo recipe does: PaddingFree hooks and packed_sdpa on the policy and the reference
            assert padding_free(trainer, SimpleNamespace(packing="padding_free"))
            for core in (trainer.model.model, trainer.ref_model.model):  # after PaddingFree's own pre-hook
                core.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape), with_kwargs=True)
        meter = PaddingMeter(trainer, packed)
        model.train()
        loss = trainer.compute_loss(model, dict(batch))
        loss.backward()
        if packed:  # the layers saw one row of the real tokens, not the padded batch
            assert calls == [torch.Size([1, int(batch["attention_mask"].sum())])] * 2  # policy, then reference
            assert meter.fraction == 0.0
        out.append((float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert abs(out[0][0] - out[1][0]) < 1e-6 and out[0][0] > 0
    assert float((out[0][1] - out[1][1]).abs().max()) < 1e-5


def test_reward_padding_free_scores_equal_the_padded_ones():
    """reward: the score is read at each row's last real token of the padded layout; packed, the same scores."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from trainer.batching import PaddingFree

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=VOCAB,
                      pad_token_id=PAD, num_labels=1)
    model = LlamaForSequenceClassification(cfg).float().eval()
    rows = [r["input_ids"] for r in rows_(6)]
    longest = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (longest - len(r)) for r in rows])
    mask = (torch.arange(longest)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        PaddingFree(model)
        packed = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        generating = model(input_ids=ids, attention_mask=mask).logits  # a forward with a cache is left padded
    assert padded.shape == packed.shape == (6, 1)
    assert float((padded - packed).abs().max()) < 1e-5 and torch.equal(generating, padded)


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)},
                                                                        unk_token="t1")), pad_token="t0",
                                   eos_token="t2")


rows_ = rows


def _train(tmp_path, packed: bool, steps: int = 24):
    import datasets
    from trl import SFTConfig, SFTTrainer

    tok = _tokenizer()
    args = SFTConfig(output_dir=str(tmp_path / f"packed{packed}"), use_cpu=True, bf16=False, seed=0, data_seed=0,
                     max_steps=steps, per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=3e-3,
                     lr_scheduler_type="constant", activation_checkpointing=False, report_to=[], save_strategy="no",
                     logging_steps=100, disable_tqdm=True, padding_free=packed, max_length=None,
                     assistant_only_loss=False)
    trainer = SFTTrainer(model=tiny_llama("packed" if packed else "sdpa"), args=args, processing_class=tok,
                         train_dataset=datasets.Dataset.from_list(rows(96, seed=3)),
                         eval_dataset=datasets.Dataset.from_list(rows(24, seed=4)))
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    return before, trainer.evaluate()["eval_loss"]


def test_short_training_packed_and_padded_ends_at_the_same_heldout_loss(tmp_path, caplog):
    """Same rows, same order, same steps: the held-out losses agree far inside 0.5% and training lowered them. TRL's
    warning that rows may attend to each other without flash-attention is not shown for packed_sdpa."""
    before_padded, padded = _train(tmp_path, packed=False)
    with caplog.at_level("WARNING", logger="trl"):
        before_packed, packed = _train(tmp_path, packed=True)
    assert "Padding-free" not in caplog.text
    assert abs(before_packed / before_padded - 1) < 1e-5  # evaluation itself is exact packed
    assert padded < before_padded - 0.5  # learned something
    assert abs(packed / padded - 1) < 0.005


def test_settings_name_padding_free_and_refuse_bad_combinations():
    from trainer.settings import DpoSettings, RewardSettings, SftSettings

    assert SftSettings(packing="padding_free").packing == "padding_free"
    assert SftSettings(packing=True, packing_strategy="wrapped").packing is True
    with pytest.raises(ValidationError, match="packing_strategy wrapped applies to packing: true only"):
        SftSettings(packing="padding_free", packing_strategy="wrapped")
    with pytest.raises(ValidationError, match="packing"):
        SftSettings(packing="padded_free")
    for other in (DpoSettings, RewardSettings):  # padding-free or padded; TRL's packing into rows is sft's
        assert other(packing="padding_free").packing == "padding_free" and other().packing is False
        with pytest.raises(ValidationError, match="Input should be False or 'padding_free'"):
            other(packing=True)


# ----------------------------------------------------------------------------------------------
# the sft stage end to end: slow, each stage starts a training process (the default tests above cover the maths)


@pytest.fixture(scope="module")
def varied_root(tmp_path_factory, kinds_module):
    from tests.helpers import chat_store, varied_chat

    return chat_store(tmp_path_factory.mktemp("varied"), kinds_module, varied_chat(240))


@pytest.mark.slow  # two sft stages in child processes; the in-process tests above check the same exactness
def test_sft_stage_padding_free_trains_without_padding_like_the_padded_stage(varied_root, kinds_module):
    from tests.helpers import artifact, run_stages, sft

    root = varied_root
    base = sft(method="full", max_steps=20, evaluate=True, control_prompts=[], group_by_length=False, seed=2,
               max_length_tokens=128)
    stages = {"padded": base, "packed": {**base, "packing": "padding_free"}}
    plan, _ = run_stages(root, kinds_module, stages, ["padded", "packed"])
    padded, packed = artifact(plan, "padded").result, artifact(plan, "packed").result
    assert packed["padding_fraction"] == 0.0 and padded["padding_fraction"] > 0.05
    assert packed["train_records"] == padded["train_records"] and packed["dropped_fully_masked"] == 0
    assert packed["steps"] == padded["steps"] == 20
    assert abs(packed["eval_loss"] / padded["eval_loss"] - 1) < 0.005
    assert abs(packed["train_loss_first"] - padded["train_loss_first"]) < 1e-4


@pytest.mark.slow  # an sft, then dpo and reward stages packed and padded (five training processes); the default
#                    in-process tests above check the same forwards and losses
def test_dpo_and_reward_stages_padding_free_match_the_padded_stages(tmp_path_factory, kinds_module):
    from tests.helpers import ALIGN_DATA, align_store, artifact, chat_rows, dpo, preference_rows, reward, run_align

    root = align_store(tmp_path_factory.mktemp("align"), kinds_module, chat_rows(200), preference_rows())
    common = {"max_steps": 6, "evaluate": True, "group_by_length": False, "seed": 3}
    stages = {"dpo_padded": dpo(method="full", **common), "dpo_packed": dpo(method="full", packing="padding_free",
                                                                           **common),
              "rw_padded": reward(method="lora", **common), "rw_packed": reward(method="lora", packing="padding_free",
                                                                              **common)}
    plan, _ = run_align(root, kinds_module, stages, [*ALIGN_DATA, *stages])
    r = {n: artifact(plan, n).result for n in stages}
    for kind in ("dpo", "rw"):
        padded, packed = r[f"{kind}_padded"], r[f"{kind}_packed"]
        assert padded["padding_fraction"] > 0.05 and packed["padding_fraction"] == 0.0
        assert packed["steps"] == padded["steps"] == 6
        assert abs(packed["train_loss_first"] - padded["train_loss_first"]) < 1e-4
        assert abs(packed["eval_loss"] / padded["eval_loss"] - 1) < 0.005
    assert r["rw_packed"]["eval_reward_accuracy"] == r["rw_padded"]["eval_reward_accuracy"]
