"""Length-grouped micro-batches (trainer/batching.py): the seeded order, its bounded buffer, the padding it saves
in a real sft stage, and the measured padding_fraction / nonpad_tokens_per_s in the result and in MLflow.
Exact resume with grouping on (the default) is tests/test_trainer.py's bit-identical resume test."""
from __future__ import annotations

import random

import pytest

from lmforge.tracking import Tracker
from tests.helpers import artifact, chat_store, run_stages, sft, varied_chat
from trainer.batching import LengthGroupedSampler, PaddingMeter, padding_of


def test_order_is_a_seeded_permutation_grouped_within_a_bounded_buffer():
    rng = random.Random(0)
    lengths = [rng.randint(5, 500) for _ in range(1000)]
    s = LengthGroupedSampler(lengths, batch_size=4, buffer_batches=16, seed=3)
    first = list(s)
    assert sorted(first) == list(range(1000))
    assert first == list(LengthGroupedSampler(lengths, 4, 16, seed=3))  # a function of the settings alone
    assert first != list(LengthGroupedSampler(lengths, 4, 16, seed=4))
    s.set_epoch(1)
    assert list(s) != first and sorted(s) == list(range(1000))  # each epoch its own order, every row once
    s.set_epoch(0)
    assert list(s) == first  # what a resumed run's Trainer rebuilds for the epoch it resumes in
    # bounded: the rows of each window of 64 positions are the rows the seeded permutation put in that window
    import torch

    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(3 * 1_000_003)).tolist()
    assert all(set(first[i:i + 64]) == set(perm[i:i + 64]) for i in range(0, 1000, 64))
    # and grouped: far less padding than the random order of the same rows
    grouped, shuffled = padding_of(lengths, first, 4), padding_of(lengths, perm, 4)
    assert shuffled > 0.3 and grouped < shuffled / 4
    # batches inside a buffer are shuffled, not in ascending length order
    maxima = [max(lengths[j] for j in first[i:i + 4]) for i in range(0, 64, 4)]
    assert maxima != sorted(maxima)


def test_padding_meter_counts_attention_masks_of_training_batches_only():
    import torch

    class FakeTrainer:  # the two attributes the meter wraps; the Trainer's real ones in the stage test below
        def compute_loss(self, model, inputs, **kw):
            return 0.0

    t = FakeTrainer()
    meter = PaddingMeter(t)
    model = torch.nn.Linear(1, 1)
    t.compute_loss(model, {"input_ids": torch.zeros(2, 4), "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])})
    model.eval()
    t.compute_loss(model, {"attention_mask": torch.zeros(8, 8)})  # evaluation: not counted
    model.train()
    t.compute_loss(model, {"input_ids": torch.zeros(1, 6, dtype=torch.long)})  # a packed block: no padding
    assert (meter.real, meter.computed, meter.fraction) == (11, 14, round(1 - 11 / 14, 4))
    assert meter.result(2.0) == {"padding_fraction": round(3 / 14, 4), "nonpad_tokens_per_s": 5.5}


@pytest.fixture(scope="module")
def varied_root(tmp_path_factory, kinds_module):
    return chat_store(tmp_path_factory.mktemp("varied"), kinds_module, varied_chat(240))


def test_sft_with_grouped_batches_trains_on_less_padding(varied_root, kinds_module):
    base = sft(method="full", max_steps=12, evaluate=False, max_length_tokens=128, control_prompts=[])
    stages = {"grouped": base, "plain": {**base, "group_by_length": False}}
    tracker = Tracker(f"sqlite:///{varied_root / 'mlflow.db'}", "train")
    plan, _ = run_stages(varied_root, kinds_module, stages, ["grouped", "plain"], tracker=tracker)
    grouped, plain = artifact(plan, "grouped").result, artifact(plan, "plain").result
    assert plain["padding_fraction"] > 0.2  # TRL pads each micro-batch to its longest row
    assert grouped["padding_fraction"] < plain["padding_fraction"] / 2
    assert grouped["nonpad_tokens_per_s"] > 0 and plain["nonpad_tokens_per_s"] > 0
    assert plan.stages["grouped"].artifact_id != plan.stages["plain"].artifact_id  # another data order: another model
    run = tracker.client.search_runs([tracker.experiment_id], "tags.`lmforge.stage` = 'grouped'")[0]
    assert run.data.metrics["padding_fraction"] == grouped["padding_fraction"]
    assert run.data.metrics["nonpad_tokens_per_s"] == grouped["nonpad_tokens_per_s"]
