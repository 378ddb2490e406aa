"""A multi-turn preference prompt (records' `prompt_messages`) reaches every consumer as turns: DPO and reward
training data, GRPO/PPO prompts, eval's chat-template rendering and reward-model scoring input, filter's PII masking.
Flat records (no `prompt_messages`) are read exactly as before."""
from __future__ import annotations

from types import SimpleNamespace

from tests.helpers import run_filter

SYS = {"role": "system", "content": "be brief"}
MULTI = {"id": "m", "prompt": "be brief\nq1\nr1\nq2", "chosen": "yes", "rejected": "no",
         "prompt_messages": [SYS, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "r1"},
                             {"role": "user", "content": "q2"}]}
FLAT = {"id": "f", "prompt": "p", "chosen": "c", "rejected": "r"}


def test_preference_dataset_keeps_turns_when_conversational(monkeypatch):
    from trainer import data, preference

    monkeypatch.setattr(data, "iter_records", lambda shards: iter([MULTI, FLAT]))
    pairs = preference.preference_dataset(["s"], "test", conversational=True)
    assert pairs.dataset.to_list() == [
        {"prompt": MULTI["prompt_messages"], "chosen": [{"role": "assistant", "content": "yes"}],
         "rejected": [{"role": "assistant", "content": "no"}]},
        {"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "assistant", "content": "c"}],
         "rejected": [{"role": "assistant", "content": "r"}]},
    ]
    pairs = preference.preference_dataset(["s"], "test", conversational=False)
    assert pairs.dataset.to_list() == [{"prompt": "be brief\nq1\nr1\nq2", "chosen": "yes", "rejected": "no"},
                                       {"prompt": "p", "chosen": "c", "rejected": "r"}]


def test_grpo_and_ppo_prompts_keep_turns():
    from trainer.prompts import record_prompt  # shared by the grpo and ppo recipes

    assert record_prompt(MULTI, True, "t") == {"prompt": MULTI["prompt_messages"], "answer": "yes"}
    assert record_prompt(MULTI, False, "t") == {"prompt": "be brief\nq1\nr1\nq2", "answer": "yes"}
    assert record_prompt(FLAT, True, "t") == {"prompt": [{"role": "user", "content": "p"}], "answer": "c"}
    assert record_prompt(FLAT, False, "t") == {"prompt": "p", "answer": "c"}


def test_eval_renders_turns_with_the_chat_template():
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from lmforge.records import prompt_turns
    from trainer import chat_templates
    from tasks.evaluation.engine import format_prompt

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = chat_templates.SMOLLM2
    lm = SimpleNamespace(tokenizer=tok)
    assert format_prompt(lm, prompt_turns(MULTI), True, "m") == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\nr1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n")
    assert format_prompt(lm, prompt_turns(FLAT), True, "m") == format_prompt(lm, "p", True, "m")
    assert format_prompt(lm, MULTI["prompt"], False, "m") == "be brief\nq1\nr1\nq2"


def test_filter_masks_pii_in_prompt_turns(tmp_path):
    rec = {**MULTI, "prompt": "be brief\nmail me at a@example.com\nr1\nq2",
           "prompt_messages": [SYS, {"role": "user", "content": "mail me at a@example.com"},
                               {"role": "assistant", "content": "r1"}, {"role": "user", "content": "q2"}]}
    r = run_filter(tmp_path, [rec], kind="preference", pii={"email": True})
    assert r.kept == [{**rec, "prompt": "be brief\nmail me at <EMAIL>\nr1\nq2",
                       "prompt_messages": [SYS, {"role": "user", "content": "mail me at <EMAIL>"},
                                           {"role": "assistant", "content": "r1"}, {"role": "user", "content": "q2"}]}]
    assert r.result.pii_masked == {"email": 2, "ip": 0}
