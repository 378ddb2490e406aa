"""eval: perplexity against a plain forward pass, lm-eval tasks with answers known by construction,
preference accuracy, the comparison table, gates, MLflow names, bad input.

The models are tiny GPT-2s over a byte-level BPE tokenizer trained here. `seven` and `five` are the same
random model trained for a few dozen steps with plain torch to answer every "What is a plus b?\\nAnswer:"
with " 7" (resp. " 5"), so their accuracy on a task is the share of documents whose answer is 7 (5).
"""
from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from lmforge.config import parse_config
from lmforge.errors import ArtifactError, ConfigError, DataError, FailedAfterPublish
from lmforge.executor import RunContext, execute_stage
from lmforge.plan import make_plan
from lmforge.shards import iter_samples
from lmforge.stage import StageRuntime
from lmforge.store import ArtifactStore
from lmforge.tracking import Tracker
from tasks import eval as ev_stage
from tasks.evaluation.config import EvalConfig, Expectation, Gate
from tasks.evaluation.engine import chat_loss
from tasks.evaluation.gates import check_expectations, check_gates
from tasks.evaluation.lmeval_tasks import prepare_task_dirs
from tasks.evaluation.preference_accuracy import PairLogprobs, implicit_reward_accuracy, loglik_accuracy
from tasks.evaluation.reports import comparison_rows
from tests.helpers import REPO, basic_config, text_rows, write_jsonl, write_task_dir


# ----------------------------------------------------------------------------------------------
# tiny models


@contextlib.contextmanager
def one_torch_thread():
    """On two shared cores torch's second thread mostly spins against other processes: one is far faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def _corpus() -> list[str]:
    """What the tokenizer learns from: the arithmetic questions and the text rows the shard tests use."""
    qa = [f"What is {a} plus {b}?\nAnswer: {a + b}\n" for a in range(10) for b in range(10)]
    return qa + [r["text"] for r in text_rows(50)]


def _train(model, tok, answer: str, steps: int = 40):
    texts = [f"What is {a} plus {b}?\nAnswer: {answer}\n" for a in range(10) for b in range(10)]
    batch = tok(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """Folders: base (random), seven, five (trained), lora (a random LoRA adapter on base)."""
    with one_torch_thread():
        return _make_models(tmp_path_factory.mktemp("models"))


def _make_models(root: Path) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = Tokenizer(tok_models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=48, n_layer=2, n_head=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    out = {}
    for name, answer in (("base", None), ("seven", "7"), ("five", "5")):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        if answer is not None:
            assert _train(model, tok, answer) < 1.5  # only the two digits of each question stay unpredictable
        out[name] = root / name
        model.save_pretrained(out[name])
        tok.save_pretrained(out[name])
    torch.manual_seed(1)
    lora = get_peft_model(GPT2LMHeadModel.from_pretrained(out["base"]),
                          LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
    out["lora"] = root / "lora"
    lora.save_pretrained(out["lora"])
    return out


def publish_folder(store: ArtifactStore, kind: str, aid: str, folder: Path, tmp: Path):
    """A finished `model` artifact holding `folder`'s files, as a training stage would leave it."""
    staged = tmp / f"staged-{aid}"
    shutil.copytree(folder, staged)
    return store.publish(kind, aid, staged, {"kind": kind, "output": {"type": "model", "data_kind": None},
                                             "result": {}})


def run_stages(tmp: Path, raw: dict, names: list[str], kinds, tracker=None, parent=None):
    plan = make_plan(parse_config(raw, kinds, root=tmp), kinds)
    ctx = RunContext(plan=plan, kinds=kinds, tracker=tracker, parent_run_id=parent)
    for n in names:
        execute_stage(ctx, n)
    return plan


def cfg_of(**kw) -> EvalConfig:
    return EvalConfig.model_validate({"kind": "eval", **kw})


# ----------------------------------------------------------------------------------------------
# perplexity


def plain_perplexity(model, tok, texts: list[str], max_len: int) -> tuple[float, float]:
    """Independent of lm-eval: every token scored once, conditioned on <eos> + up to max_len - 1 tokens
    before it, in disjoint chunks of max_len predictions."""
    total, ntok, nbytes = 0.0, 0, 0
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        seq = [tok.eos_token_id] + ids
        for start in range(0, len(ids), max_len):
            end = min(start + max_len, len(ids))
            lo = max(0, end - max_len)
            with torch.no_grad():
                logp = model(torch.tensor([seq[lo:end]])).logits[0].log_softmax(-1)
            targets = torch.tensor(seq[lo + 1:end + 1])
            total += logp.gather(-1, targets[:, None])[:, 0][-(end - start):].sum().item()
        ntok += len(ids)
        nbytes += len(t.encode("utf-8"))
    return math.exp(-total / ntok), -total / nbytes / math.log(2)


def test_perplexity_matches_plain_forward_pass_for_model_and_adapter(tmp_path, kinds, models):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plan = run_stages(tmp_path, basic_config(tmp_path, n=60), ["ingest", "shard"], kinds)
    shard = plan.store.require("shard", plan.stages["shard"].artifact_id)
    adapter = publish_folder(plan.store, "sft", "lora0000", models["lora"], tmp_path)
    # the layout trainer/models.py writes for an adapter on a config-built base: the base inside, recorded
    with_base = tmp_path / "with_base"
    shutil.copytree(models["lora"], with_base)
    shutil.copytree(models["base"], with_base / "base_model")
    (with_base / "lmforge_model.json").write_text(json.dumps({"format": "adapter", "base": {"kind": "saved"}}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models["base"] / f, with_base)
    adapter_with_base = publish_folder(plan.store, "sft", "lora0001", with_base, tmp_path)
    cfg = cfg_of(inputs=["shard", "sft", "sft2"], max_length=8, batch_size=3,
                 models=[{"name": "base", "base": str(models["base"])},
                         {"name": "lora", "input": "sft", "base": "base"}, {"name": "lora2", "input": "sft2"}],
                 perplexity=[{"input": "shard", "split": "validation"}])
    out = tmp_path / "out"
    out.mkdir()
    result = ev_stage.run(cfg, [shard, adapter, adapter_with_base], out)

    texts = [r["text"] for r in iter_samples(shard, "validation")]
    tok = AutoTokenizer.from_pretrained(models["base"])
    assert len(texts) == 6 and max(len(tok(t)["input_ids"]) for t in texts) > 8  # some span several windows
    base = AutoModelForCausalLM.from_pretrained(models["base"]).eval()
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models["base"]),
                                       models["lora"]).merge_and_unload().eval()
    for name, model in (("base", base), ("lora", merged)):
        ppl, bpb = plain_perplexity(model, tok, texts, max_len=8)
        got = result.eval[name]["local_ppl"]
        assert got["token_perplexity"] == pytest.approx(ppl, rel=1e-4)
        assert got["bits_per_byte"] == pytest.approx(bpb, rel=1e-4)
    assert result.eval["lora"]["local_ppl"]["bits_per_byte"] != pytest.approx(
        result.eval["base"]["local_ppl"]["bits_per_byte"], rel=1e-3)  # the adapter was applied
    info = result.tasks[0]
    assert (info["task"], info["documents"], info["bytes"]) == ("local_ppl", 6, sum(len(t.encode()) for t in texts))
    n_tokens = sum(len(tok(t)["input_ids"]) for t in texts)
    assert info["tokens"] == {"base": n_tokens, "lora": n_tokens, "lora2": n_tokens}
    assert result.eval["lora2"] == result.eval["lora"]
    assert [m["origin"] for m in result.models] == [
        str(models["base"]), "sft: sft/lora0000 on base",
        f"sft2: sft/lora0001 on {plan.store.artifact_path('sft', 'lora0001')}/base_model"]


# ----------------------------------------------------------------------------------------------
# lm-eval tasks, table, files


def test_tasks_with_known_answers_table_files_and_limit_note(tmp_path, models, monkeypatch):
    tasks_dir = write_task_dir(tmp_path / "my_tasks")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative data_files must not depend on the working directory
    cfg = cfg_of(models=[{"name": "seven", "base": str(models["seven"])},
                         {"name": "five", "base": str(models["five"])}],
                 tasks=["t_mc", "t_ll", "t_gen", "lmforge_arith_gen"], task_dirs=[str(tasks_dir)], limit=40,
                 control_prompts=["What is 3 plus 4?\nAnswer:", "What is 0 plus 0?\nAnswer:"], max_new_tokens=3)
    out = tmp_path / "out"
    out.mkdir()
    r = ev_stage.run(cfg, [], out)

    # 3 of the 6 test rows answer 7 and 1 answers 5; the shipped arith_test.jsonl asks two-digit sums (none is 7 or 5)
    arith = [json.loads(x)["answer"] for x in
             (REPO / "configs/eval_tasks/data/arith_test.jsonl").read_text().splitlines()]
    em7, em5 = arith[:40].count("7") / 40, arith[:40].count("5") / 40
    assert {t: {k: round(v, 6) for k, v in m.items()} for t, m in r.eval["seven"].items()} == {
        "t_mc": {"acc": 0.5, "acc_stderr": round(math.sqrt(0.25 * 6 / 5 / 6), 6)},
        "t_ll": {"acc": 0.5, "acc_stderr": round(math.sqrt(0.25 * 6 / 5 / 6), 6)},
        "t_gen": {"exact_match": 0.5, "exact_match_stderr": round(math.sqrt(0.25 * 6 / 5 / 6), 6)},
        "lmforge_arith_gen": {"exact_match": em7,
                              "exact_match_stderr": round(math.sqrt(em7 * (1 - em7) * 40 / 39 / 40), 6)}}
    assert [r.eval["five"][t]["acc" if t != "t_gen" else "exact_match"] for t in ("t_mc", "t_ll", "t_gen")] == \
        [pytest.approx(1 / 6)] * 3
    assert r.eval["five"]["lmforge_arith_gen"]["exact_match"] == pytest.approx(em5)
    assert r.notes == ["t_mc: limit 40 is more than its 6 documents; lm-eval evaluated all 6",
                       "t_ll: limit 40 is more than its 6 documents; lm-eval evaluated all 6",
                       "t_gen: limit 40 is more than its 6 documents; lm-eval evaluated all 6"]
    by_task = {t["task"]: t for t in r.tasks}
    assert (by_task["t_mc"]["version"], by_task["t_mc"]["documents"], by_task["t_mc"]["evaluated"]) == (2.0, 6, 6)
    assert (by_task["lmforge_arith_gen"]["documents"], by_task["lmforge_arith_gen"]["evaluated"]) == (len(arith), 40)

    rows = comparison_rows(r.eval, {"t_mc": {"acc": True}, "t_ll": {"acc": True}, "t_gen": {"exact_match": True},
                                    "lmforge_arith_gen": {"exact_match": True}})
    assert rows == [["task", "metric", "better", "seven", "five"],
                    ["t_mc", "acc", "↑", "0.5000 ± 0.2236", "0.1667 ± 0.1667"],
                    ["t_ll", "acc", "↑", "0.5000 ± 0.2236", "0.1667 ± 0.1667"],
                    ["t_gen", "exact_match", "↑", "0.5000 ± 0.2236", "0.1667 ± 0.1667"],
                    ["lmforge_arith_gen", "exact_match", "↑", *[f"{em:.4f} ± {math.sqrt(em * (1 - em) / 39):.4f}"
                                                                 for em in (em7, em5)]]]
    gated = comparison_rows(r.eval, {"t_gen": {"exact_match": True}},
                            [{"metric": "seven/lmforge_arith_gen/exact_match"}, {"metric": "five/t_ll/acc"}])
    assert [row[:2] for row in gated[1:]] == [["lmforge_arith_gen", "exact_match"], ["t_ll", "acc"], ["t_mc", "acc"],
                                              ["t_gen", "exact_match"]]  # the gated metrics (the headline) first
    md = (out / "comparison.md").read_text()
    assert "| t_mc | acc | ↑ | 0.5000 ± 0.2236 | 0.1667 ± 0.1667 |" in md
    assert "Settings: num_fewshot 0, batch_size 8, seed 1234, limit 40," in md
    assert "<td>t_mc</td><td>acc</td><td>↑</td><td>0.5000 ± 0.2236</td>" in (out / "comparison.html").read_text()
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lm_eval_json = json.loads((out / "results" / "seven.json").read_text())
    assert lm_eval_json["results"]["t_mc"]["acc,none"] == 0.5
    assert (lm_eval_json["lmforge"]["limit"], lm_eval_json["lmforge"]["seed"]) == (40, 1234)
    assert lm_eval_json["n-shot"] == {"t_mc": 0, "t_ll": 0, "t_gen": 0, "lmforge_arith_gen": 0}
    # lm-eval read the resolved copy, whose data path is absolute
    copy = (out / "tasks" / "1-my_tasks" / "t_mc.yaml").read_text()
    assert f"test: {tasks_dir / 'data' / 'rows.jsonl'}" in copy
    gens = [json.loads(x) for x in (out / "control_generations.jsonl").read_text().splitlines()]
    assert [(g["model"], g["output"]) for g in gens] == [("seven", " 7\nAnswer"), ("five", " 5\nAnswer"),
                                                         ("seven", " 7\nAnswer"), ("five", " 5\nAnswer")]
    assert (out / "control_generations.md").read_text().splitlines()[4:] == [
        "| prompt | seven | five |", "|---|---|---|",
        "| What is 3 plus 4?<br>Answer: |  7<br>Answer |  5<br>Answer |",
        "| What is 0 plus 0?<br>Answer: |  7<br>Answer |  5<br>Answer |"]


# ----------------------------------------------------------------------------------------------
# preference accuracy


def test_implicit_reward_accuracy_counts_strict_wins():
    policy = PairLogprobs(chosen=[-1.0, -2.0, -3.0], rejected=[-5.0, -2.0, -1.0])
    ref = PairLogprobs(chosen=[-2.0, -2.0, -2.0], rejected=[-2.0, -2.0, -2.0])
    out = implicit_reward_accuracy(policy, ref, beta=0.5)
    # margins: 0.5*((1) - (-3)) = 2, 0.5*(0 - 0) = 0 (a tie is no win), 0.5*((-1) - (1)) = -1
    assert out["accuracy"] == pytest.approx(1 / 3) and out["reward_margin"] == pytest.approx(1 / 3)
    assert out["accuracy_stderr"] == pytest.approx(math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2 / 3))


def ingested_pairs(tmp_path: Path, kinds, pairs: list[dict]):
    """`pairs` written to a preference dataset and ingested: the records artifact."""
    write_jsonl(tmp_path / "data" / "prefs.jsonl", pairs)
    raw = {"name": "t", "store": str(tmp_path / "artifacts"),
           "datasets": {"prefs": {"path": "data/prefs.jsonl", "kind": "preference"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["prefs"]}}}
    plan = run_stages(tmp_path, raw, ["ingest"], kinds)
    return plan.store.require("ingest", plan.stages["ingest"].artifact_id)


def test_preference_accuracy_of_trained_policy_against_reference(tmp_path, kinds, models):
    # every pair is 7 against 5, so each trained model's preference is known
    pairs = [{"prompt": "What is 3 plus 4?", "chosen": "Answer: 7", "rejected": "Answer: 5"},
             {"prompt": "What is 2 plus 5?", "chosen": "Answer: 7", "rejected": "Answer: 5"},
             {"prompt": "What is 6 plus 1?", "chosen": "Answer: 7", "rejected": "Answer: 5"},
             {"prompt": "What is 1 plus 4?", "chosen": "Answer: 5", "rejected": "Answer: 7"}]
    records = ingested_pairs(tmp_path, kinds, pairs)
    cfg = cfg_of(inputs=["ingest"], models=[{"name": "base", "base": str(models["base"])},
                                            {"name": "seven", "base": str(models["seven"])},
                                            {"name": "five", "base": str(models["five"])}],
                 preference={"input": "ingest", "reference": "base", "beta": 0.1})
    out = tmp_path / "out"
    out.mkdir()
    r = ev_stage.run(cfg, [records], out)
    # `seven` raised " 7" far above the reference and lowered " 5": it prefers the 7s; `five` the 5s
    assert r.eval["seven"]["preference"]["accuracy"] == 0.75
    assert r.eval["five"]["preference"]["accuracy"] == 0.25
    assert r.eval["seven"]["preference"]["reward_margin"] > 0 > r.eval["five"]["preference"]["reward_margin"]
    # the reference is not scored against itself; every model gets log-likelihood accuracy by itself
    assert set(r.eval["base"]["preference"]) == {"loglik_accuracy", "loglik_margin", "loglik_accuracy_stderr",
                                                 "loglik_margin_stderr"}
    assert r.eval["seven"]["preference"]["loglik_accuracy"] == 0.75  # " 7" per token above " 5" on every pair
    assert r.eval["five"]["preference"]["loglik_accuracy"] == 0.25
    assert [t for t in r.tasks if t["task"] == "preference"] == [
        {"task": "preference", "kind": "preference", "input": "ingest", "split": "validation", "reference": "base",
         "beta": 0.1, "pairs": 4, "implicit_dpo": ["seven", "five"], "reward_models": [],
         "loglik": ["base", "five", "seven"],
         "higher_is_better": {"accuracy": True, "reward_margin": True, "loglik_accuracy": True,
                              "loglik_margin": True}}]  # every metric it reports has a direction


def test_preference_loglik_false_scores_only_the_reference_and_the_policies(tmp_path, kinds, models):
    """`loglik: false`: the entries that are neither reference nor policy are not scored (no log-likelihood passes),
    the policies keep their implicit reward, and nobody gets loglik_accuracy."""
    pairs = [{"prompt": "What is 3 plus 4?", "chosen": "Answer: 7", "rejected": "Answer: 5"},
             {"prompt": "What is 1 plus 4?", "chosen": "Answer: 5", "rejected": "Answer: 7"}]
    records = ingested_pairs(tmp_path, kinds, pairs)
    cfg = cfg_of(inputs=["ingest"], models=[{"name": "base", "base": str(models["base"])},
                                            {"name": "seven", "base": str(models["seven"])},
                                            {"name": "five", "base": str(models["five"])}],
                 preference={"input": "ingest", "reference": "base", "models": ["seven"], "loglik": False}, gates=[])
    out = tmp_path / "out"
    out.mkdir()
    r = ev_stage.run(cfg, [records], out)
    assert set(r.eval["seven"]["preference"]) == {"accuracy", "reward_margin", "accuracy_stderr",
                                                  "reward_margin_stderr"}
    assert "preference" not in r.eval["base"] and "preference" not in r.eval["five"]
    task = [t for t in r.tasks if t["task"] == "preference"][0]
    assert (task["implicit_dpo"], task["loglik"]) == (["seven"], [])


def test_loglik_accuracy_is_length_normalised():
    # chosen: -6 over 3 tokens (-2/token); rejected: -4 over 1 token (-4/token): chosen wins although its sum is lower
    p = PairLogprobs(chosen=[-6.0, -1.0], rejected=[-4.0, -0.5], chosen_tokens=[3, 1], rejected_tokens=[1, 1])
    out = loglik_accuracy(p)
    assert out["loglik_accuracy"] == 0.5 and out["loglik_margin"] == pytest.approx(((-2 + 4) + (-1 + 0.5)) / 2)


def test_preference_without_reference_scores_loglik_only(tmp_path, kinds, models):
    pairs = [{"prompt": "What is 3 plus 4?", "chosen": "Answer: 7", "rejected": "Answer: 5"},
             {"prompt": "What is 1 plus 4?", "chosen": "Answer: 5", "rejected": "Answer: 7"}]
    records = ingested_pairs(tmp_path, kinds, pairs)
    cfg = cfg_of(inputs=["ingest"], models=[{"name": "seven", "base": str(models["seven"])}],
                 preference={"input": "ingest"}, gates=[])
    out = tmp_path / "out"
    out.mkdir()
    r = ev_stage.run(cfg, [records], out)
    assert r.eval["seven"]["preference"]["loglik_accuracy"] == 0.5 and "accuracy" not in r.eval["seven"]["preference"]


# ----------------------------------------------------------------------------------------------
# held-out chat loss


def chat_model(models: dict[str, Path], name: str, root: Path) -> Path:
    """A copy of a test model whose tokenizer has a ChatML-style template with {% generation %} markers."""
    from transformers import AutoTokenizer

    from trainer.chat_templates import chatml

    dest = root / f"{name}-chat"
    if not dest.exists():
        shutil.copytree(models[name], dest)
        tok = AutoTokenizer.from_pretrained(dest)
        tok.chat_template = chatml(start="<s>", end="<|endoftext|>")
        tok.save_pretrained(dest)
    return dest


CONVERSATIONS = [[{"role": "user", "content": f"What is {a} plus {b}?"},
                  {"role": "assistant", "content": "Answer: 7"}] for a, b in ((3, 4), (2, 5), (6, 1))] + [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 plus 6?"},
     {"role": "assistant", "content": "Answer: 7"}, {"role": "user", "content": "And 2 plus 5?"},
     {"role": "assistant", "content": "Answer: 7"}]]


def test_chat_loss_equals_sft_trainers_eval_loss_on_assistant_tokens(tmp_path, models):
    """The NLL per assistant token is TRL's own: SFTTrainer(assistant_only_loss=True).evaluate() on one
    conversation at a time gives each conversation's mean, and batching with padding changes nothing."""
    from datasets import Dataset
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    folder = chat_model(models, "seven", tmp_path)
    lm = HFLM(pretrained=str(folder), batch_size=4, device="cpu")
    batched = chat_loss(lm, CONVERSATIONS, model="seven", batch_size=4)
    singles = [chat_loss(lm, [c], model="seven", batch_size=1) for c in CONVERSATIONS]
    assert batched.conversations == 4 and batched.skipped == 0
    assert batched.tokens == sum(x.tokens for x in singles)
    assert batched.nll == pytest.approx(sum(x.nll * x.tokens for x in singles) / batched.tokens, rel=1e-5)
    # the masked tokens are each reply and its end-of-turn token, nothing of the user's turn
    tok = AutoTokenizer.from_pretrained(folder)
    enc = tok.apply_chat_template(CONVERSATIONS[3], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert tok.decode([i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]) == \
        "Answer: 7<|endoftext|>Answer: 7<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(folder)
    args = SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, per_device_eval_batch_size=1,
                     report_to=[], use_cpu=True, max_length=64, bf16=False)
    for conv, single in zip(CONVERSATIONS, singles):
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([{"messages": conv}]),
                             eval_dataset=Dataset.from_list([{"messages": conv}]), processing_class=tok)
        assert trainer.evaluate()["eval_loss"] == pytest.approx(single.nll, rel=1e-4)


def test_chat_loss_in_the_eval_stage_ranks_the_models(tmp_path, kinds, models):
    """Held-out conversations whose replies are all "Answer: 7": `seven` beats `five`, with a stderr, and a gate
    can use the metric."""
    write_jsonl(tmp_path / "data" / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    raw = {"name": "t", "store": str(tmp_path / "artifacts"),
           "datasets": {"chat": {"path": "data/chat.jsonl", "kind": "chat"}},
           "stages": {"ingest": {"kind": "ingest", "inputs": ["chat"]}}}
    plan = run_stages(tmp_path, raw, ["ingest"], kinds)
    records = plan.store.require("ingest", plan.stages["ingest"].artifact_id)
    cfg = cfg_of(inputs=["ingest"], models=[{"name": "five", "base": str(chat_model(models, "five", tmp_path))},
                                            {"name": "seven", "base": str(chat_model(models, "seven", tmp_path))}],
                 chat_loss=[{"input": "ingest", "name": "held_out_chat"}],
                 gates=[{"metric": "five/held_out_chat/assistant_nll", "against": "seven", "max_regression": 0.0,
                         "stderr_k": 0}])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(FailedAfterPublish) as e:
        ev_stage.run(cfg, [records], out)
    r = e.value.result
    seven, five = r.eval["seven"]["held_out_chat"], r.eval["five"]["held_out_chat"]
    assert seven["assistant_nll"] < five["assistant_nll"]
    assert seven["assistant_perplexity"] == pytest.approx(math.exp(seven["assistant_nll"]))
    assert seven["assistant_nll_stderr"] > 0
    assert r.gates_failed == 1 and "five/held_out_chat/assistant_nll" in r.gates[0]["message"]
    info = next(t for t in r.tasks if t["task"] == "held_out_chat")
    assert info["kind"] == "chat_loss" and info["conversations"] == 4 and info["skipped"] == {"five": 0, "seven": 0}
    assert "held_out_chat" in (out / "comparison.md").read_text()


def test_chat_loss_needs_a_chat_template_and_chat_input(tmp_path, kinds, models):
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(models["seven"]), batch_size=1, device="cpu")  # no chat template
    with pytest.raises(DataError, match="chat_loss needs a chat template"):
        chat_loss(lm, CONVERSATIONS, model="seven", batch_size=1)
    raw = basic_config(tmp_path)
    raw["stages"]["eval"] = {"kind": "eval", "inputs": ["shard"], "models": [{"name": "base", "base": "/m"}],
                             "chat_loss": [{"input": "shard"}]}
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds, root=tmp_path)
    assert e.value.problems == ["stages.eval.inputs: chat_loss[0].input 'shard' is text shards; it needs chat shards "
                                "or chat records (ingest a chat dataset first)"]


# ----------------------------------------------------------------------------------------------
# gates


SCORES = {"base": {"local_ppl": {"bits_per_byte": 1.50, "token_perplexity": 9.0},
                   "t_mc": {"acc": 0.60, "acc_stderr": 0.03}},
          "sft": {"local_ppl": {"bits_per_byte": 1.53, "token_perplexity": 9.5},
                  "t_mc": {"acc": 0.55, "acc_stderr": 0.04}, "t_x": {"odd": 1.0}}}


def test_gates_pass_and_fail_with_direction_and_stderr():
    gates = [Gate(metric="sft/local_ppl/bits_per_byte", against="base", max_regression=0.02),
             Gate(metric="sft/local_ppl/bits_per_byte", against="base", max_regression=0.05),
             Gate(metric="sft/t_mc/acc", against="base", max_regression=0.0, stderr_k=2),
             Gate(metric="sft/t_mc/acc", against="base", max_regression=0.0, stderr_k=0),
             Gate(metric="sft/t_mc/acc_norm", against="base", max_regression=0.0),
             Gate(metric="sft/t_x/odd", against="sft", max_regression=0.0)]
    out = check_gates(gates, SCORES, {"t_mc": {"acc": True}})
    assert [g["passed"] for g in out] == [False, True, True, False, False, False]
    assert [g["message"] for g in out] == [
        "gate sft/local_ppl/bits_per_byte FAILED: 1.53 against base's 1.5 (lower is better), a change of -0.03 for "
        "the better; it may fall behind base by at most 0.02 (max_regression 0.02 + 2 x stderr 0): margin -0.01",
        "gate sft/local_ppl/bits_per_byte passed: 1.53 against base's 1.5 (lower is better), a change of -0.03 for "
        "the better; it may fall behind base by at most 0.05 (max_regression 0.05 + 2 x stderr 0): margin +0.02",
        "gate sft/t_mc/acc passed: 0.55 against base's 0.6 (higher is better), a change of -0.05 for the better; it "
        "may fall behind base by at most 0.1 (max_regression 0 + 2 x stderr 0.05): margin +0.05",
        "gate sft/t_mc/acc FAILED: 0.55 against base's 0.6 (higher is better), a change of -0.05 for the better; it "
        "may fall behind base by at most 0 (max_regression 0 + 0 x stderr 0.05): margin -0.05",
        "gate sft/t_mc/acc_norm: sft has no metric t_mc/acc_norm (it has: local_ppl/bits_per_byte, "
        "local_ppl/token_perplexity, t_mc/acc, t_x/odd)",
        "gate sft/t_x/odd: lmforge does not know whether higher or lower is better for this metric; set "
        "higher_is_better on the gate"]
    assert (out[0]["value"], out[0]["reference"], out[0]["regression"], out[0]["limit"], out[0]["kind"]) == \
        (1.53, 1.5, pytest.approx(0.03), 0.02, "must_not_regress")
    assert out[0]["margin"] == pytest.approx(-0.01) and out[1]["margin"] == pytest.approx(0.02)


def test_must_beat_gates_ask_for_an_improvement_beyond_the_stderrs():
    """A model equal to its reference passes every must-not-regress gate and fails every must-beat gate."""
    scores = {"base": {"t_mc": {"acc": 0.30, "acc_stderr": 0.03}, "ppl": {"bits_per_byte": 2.0}},
              "sft": {"t_mc": {"acc": 0.45, "acc_stderr": 0.04}, "ppl": {"bits_per_byte": 1.5}},
              "same": {"t_mc": {"acc": 0.30, "acc_stderr": 0.03}, "ppl": {"bits_per_byte": 2.0}}}
    gates = [Gate(metric="sft/t_mc/acc", against="base", min_improvement=0.0),  # +0.15 > 2 x 0.05
             Gate(metric="sft/t_mc/acc", against="base", min_improvement=0.1),  # +0.15 > 0.1 + 0.1? no
             Gate(metric="sft/ppl/bits_per_byte", against="base", min_improvement=0.4),  # lower is better: +0.5
             Gate(metric="same/t_mc/acc", against="base", min_improvement=0.0),
             Gate(metric="same/t_mc/acc", against="base", max_regression=0.0)]
    out = check_gates(gates, scores, {"t_mc": {"acc": True}})
    assert [(g["kind"], g["passed"]) for g in out] == [("must_beat", True), ("must_beat", False), ("must_beat", True),
                                                       ("must_beat", False), ("must_not_regress", True)]
    equal = round(2 * math.sqrt(2) * 0.03, 6)  # 2 stderrs of the difference of two equal results
    assert [round(g["margin"], 6) for g in out] == [0.05, -0.05, 0.1, -equal, equal]
    assert out[1]["message"] == (
        "gate sft/t_mc/acc FAILED: 0.45 against base's 0.3 (higher is better), a change of +0.15 for the better; it "
        "must beat base by more than 0.2 (min_improvement 0.1 + 2 x stderr 0.05): margin -0.05")
    with pytest.raises(ValueError, match="set exactly one of min_improvement .* and max_regression"):
        Gate(metric="sft/t_mc/acc", against="base")
    with pytest.raises(ValueError, match="set exactly one of min_improvement"):
        Gate(metric="sft/t_mc/acc", against="base", min_improvement=0, max_regression=0)


def test_expectations_report_each_result_against_its_band():
    scores = {"sft": {"t_mc": {"acc": 0.45, "acc_stderr": 0.04}}, "dpo": {"t_mc": {"acc": 0.95}}}
    expect = [Expectation(metric="sft/t_mc/acc", min=0.4, max=0.6), Expectation(metric="dpo/t_mc/acc", min=0.97),
              Expectation(metric="dpo/t_mc/acc_norm", max=1.0)]
    out = check_expectations(expect, scores)
    assert {k: (v["value"], v["met"]) for k, v in out.items()} == {
        "sft/t_mc/acc": (0.45, True), "dpo/t_mc/acc": (0.95, False), "dpo/t_mc/acc_norm": (None, False)}
    assert [v["message"] for v in out.values()] == [
        "expect sft/t_mc/acc in [0.4, 0.6]: 0.45, as expected",
        "expect dpo/t_mc/acc >= 0.97: 0.95, UNEXPECTED, below the band",
        "expect dpo/t_mc/acc_norm <= 1: dpo has no metric t_mc/acc_norm (it has: t_mc/acc)"]
    with pytest.raises(ValueError, match="set min, max or both"):
        Expectation(metric="sft/t_mc/acc")
    with pytest.raises(ValueError, match="min 0.9 is above max 0.5"):
        Expectation(metric="sft/t_mc/acc", min=0.9, max=0.5)


def test_passing_gate_returns_and_logs_reports_on_the_stage_run_only(tmp_path, models):
    tasks_dir = write_task_dir(tmp_path / "my_tasks")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tr = Tracker(uri, "t")
    parent = tr.start_run("t-local", {})
    child = tr.start_run("eval", {}, parent)
    runtime = StageRuntime(pipeline="t", stage="eval", kind="eval", artifact_id="x",
                           store=ArtifactStore(str(tmp_path / "artifacts")), checkpoint_uri="", tracking_uri=uri,
                           mlflow_run_id=child)
    cfg = cfg_of(models=[{"name": "seven", "base": str(models["seven"])},
                         {"name": "five", "base": str(models["five"])}],
                 tasks=["t_mc"], task_dirs=[str(tasks_dir)],
                 gates=[{"metric": "seven/t_mc/acc", "against": "five", "max_regression": 0}])
    out = tmp_path / "out"
    out.mkdir()
    r = ev_stage.run(cfg, [], out, runtime=runtime)
    assert r.gates_failed == 0 and r.gates[0]["passed"] and r.gates[0]["regression"] == pytest.approx(-1 / 3)
    assert r.eval["seven"]["t_mc"] == {"acc": 0.5, "acc_stderr": pytest.approx(0.2236068)}
    assert r.eval["five"]["t_mc"] == {"acc": 1 / 6, "acc_stderr": pytest.approx(1 / 6)}
    # the pipeline's run gets summary/* from the flow, read from the artifact (cached runs too): nothing from here
    assert tr.client.get_run(parent).data.metrics == {}
    assert tr.client.get_run(child).data.metrics == {}  # the executor logs the Result there, after publishing
    assert sorted(a.path for a in tr.client.list_artifacts(child, "eval")) == [
        "eval/comparison.html", "eval/comparison.md", "eval/metrics.png"]


def test_failing_gate_is_published_then_fails_and_fails_again_when_cached(tmp_path, kinds, models):
    tasks_dir = write_task_dir(tmp_path / "my_tasks")
    gates = [{"metric": "five/t_mc/acc", "against": "seven", "max_regression": 0.1},
             {"metric": "five/t_mc/acc", "against": "seven", "max_regression": 0.1, "stderr_k": 0}]
    raw = {"name": "t", "store": str(tmp_path / "artifacts"),
           "stages": {"eval": {"kind": "eval", "retries": 0, "tasks": ["t_mc"], "task_dirs": [str(tasks_dir)],
                               "models": [{"name": "seven", "base": str(models["seven"])},
                                          {"name": "five", "base": str(models["five"])}], "gates": gates,
                               "expect": [{"metric": "five/t_mc/acc", "min": 0.5},
                                          {"metric": "seven/t_mc/acc", "min": 0.4, "max": 0.6}]}}}
    plan = make_plan(parse_config(raw, kinds, root=tmp_path), kinds)
    tr = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t")
    parent = tr.start_run("t-local", {})
    ctx = RunContext(plan=plan, kinds=kinds, tracker=tr, parent_run_id=parent)
    # with 2 x the stderr of the difference (6 documents each) the first gate passes; without, the second fails
    # and five lands below the band its expectation declares (seven inside its own)
    message = ("1 of 2 eval gate(s) failed and 1 of 2 result(s) outside their expected band:\n"
               "  - gate five/t_mc/acc FAILED: 0.1667 against seven's 0.5 (higher is better), a change of -0.3333 for "
               "the better; it may fall behind seven by at most 0.1 (max_regression 0.1 + 0 x stderr 0.2789): margin "
               "-0.2333\n"
               "  - expect five/t_mc/acc >= 0.5: 0.1667, UNEXPECTED, below the band")
    with pytest.raises(FailedAfterPublish) as e:
        execute_stage(ctx, "eval")
    assert str(e.value) == message
    art = plan.store.require("eval", plan.stages["eval"].artifact_id)  # published all the same
    assert art.manifest["failure"] == message and art.result["gates_failed"] == 1
    assert art.result["expectations_failed"] == 1 and {k: v["met"] for k, v in art.result["expectations"].items()} \
        == {"five/t_mc/acc": False, "seven/t_mc/acc": True}
    assert [g["passed"] for g in art.result["gates"]] == [True, False]
    assert sorted({f["path"].split("/")[0] for f in art.manifest["files"]}) == [
        "comparison.html", "comparison.md", "metrics.json", "metrics.png", "results", "tasks"]
    with art.open("comparison.md") as f:
        md = f.read().decode()
    assert "| must not regress | five/t_mc/acc | seven | 0.1667 | 0.5000 | worse by <= 0.1 | -0.2333 | FAIL |" in md
    assert "| five/t_mc/acc | 0.5 .. inf | 0.1667 | UNEXPECTED |" in md
    assert "| seven/t_mc/acc | 0.4 .. 0.6 | 0.5000 | as expected |" in md
    with pytest.raises(FailedAfterPublish):
        execute_stage(ctx, "eval")  # cached: fails again without evaluating
    runs = tr.client.search_runs([tr.experiment_id], "attributes.run_name = 'eval'")
    assert sorted((r.data.tags["cached"], r.info.status, r.data.metrics["eval/five/t_mc/acc"]) for r in runs) == [
        ("false", "FAILED", pytest.approx(1 / 6)), ("true", "FAILED", pytest.approx(1 / 6))]
    # MLflow: the count and each expectation, met (1) or not (0), with its band
    m = runs[0].data.metrics
    assert (m["expectations_failed"], m["expectations/five/t_mc/acc/met"], m["expectations/five/t_mc/acc/min"],
            m["expectations/seven/t_mc/acc/met"]) == (1, 0, 0.5, 1)
    assert tr.client.get_run(parent).data.metrics == {}  # summary/* comes from the flow (tests/test_mlflow_view.py)


# ----------------------------------------------------------------------------------------------
# pipeline: config, executor, MLflow, ids


def test_eval_stage_in_a_pipeline_logs_its_child_and_id_ignores_paths(tmp_path, kinds, models):
    raw = basic_config(tmp_path, n=40)
    raw["stages"]["eval"] = {"kind": "eval", "inputs": ["shard"], "retries": 0,
                             "models": [{"name": "base", "base": str(models["base"])}],
                             "perplexity": [{"input": "shard", "max_docs": 3}]}
    tr = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t")
    parent = tr.start_run("t-local", {})
    plan = run_stages(tmp_path, raw, ["ingest", "shard", "eval"], kinds, tracker=tr, parent=parent)
    art = plan.store.require("eval", plan.stages["eval"].artifact_id)
    bpb = art.result["eval"]["base"]["local_ppl"]["bits_per_byte"]
    assert 0 < bpb < 20 and art.result["gates_failed"] == 0
    assert sorted(f["path"] for f in art.manifest["files"]) == ["comparison.html", "comparison.md", "metrics.json",
                                                                 "metrics.png"]
    child = tr.client.search_runs([tr.experiment_id], "tags.`lmforge.stage` = 'eval'")[0]
    assert child.data.metrics["eval/base/local_ppl/bits_per_byte"] == bpb  # the executor, from the Result
    # the model enters the id by content: the same folder elsewhere gives the same id
    moved = tmp_path / "elsewhere" / "base"
    shutil.copytree(models["base"], moved)
    raw["stages"]["eval"]["models"][0]["base"] = str(moved)
    again = make_plan(parse_config(raw, kinds, root=tmp_path), kinds).stages["eval"]
    assert again.artifact_id == plan.stages["eval"].artifact_id and again.action == "cached"
    assert plan.stages["eval"].settings["models"][0]["base"].startswith("sha256:")


def test_config_problems_are_reported_with_their_paths(tmp_path, kinds):
    raw = basic_config(tmp_path)
    raw["stages"]["eval"] = {"kind": "eval", "inputs": ["shard_pairs"],
                             "models": [{"name": "base", "base": "/m"}], "perplexity": [{"input": "shard_pairs"}]}
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds, root=tmp_path)
    assert e.value.problems == ["stages.eval.inputs: perplexity[0].input 'shard_pairs' is preference shards; it needs "
                                "text shards or text records (ingest a raw dataset first)"]
    raw["stages"]["eval"] = {"kind": "eval", "inputs": ["shard"], "models": [{"name": "base", "base": "/m"}]}
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds, root=tmp_path)
    assert e.value.problems == ["stages.eval.inputs: input(s) shard not used; name each in models (input:), "
                                "perplexity, chat_loss or preference"]
    raw["stages"]["eval"] = {"kind": "eval", "models": [{"name": "base", "base": "/m"}],
                             "gates": [{"metric": "base/t/acc", "against": "bse", "max_regression": 0}]}
    with pytest.raises(ConfigError) as e:
        parse_config(raw, kinds, root=tmp_path)
    assert e.value.problems == ["stages.eval.gates: value error, [0].against: 'bse' is not a model name (base), got "
                                "[{'metric': 'base/t/acc', 'against': 'bse', 'max_regression': 0}]"]


# ----------------------------------------------------------------------------------------------
# bad input


def test_missing_model_folder_and_artifact_without_model(tmp_path, models):
    missing = tmp_path / "nope"
    with pytest.raises(DataError) as e:
        ev_stage.run(cfg_of(models=[{"name": "base", "base": str(missing)}]), [], tmp_path)
    assert str(e.value) == (f"models[0].base: model folder {missing} does not exist. Give a local Hugging Face "
                            "model folder (config.json, weights, tokenizer files); relative paths resolve against the "
                            "project root")
    store = ArtifactStore(str(tmp_path / "artifacts"))
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "not_a_model" / "notes.txt").write_text("hi")
    art = publish_folder(store, "sft", "empty000", tmp_path / "not_a_model", tmp_path)
    with pytest.raises(ArtifactError) as e:
        ev_stage.run(cfg_of(inputs=["sft"], models=[{"name": "sft", "input": "sft"}]), [art], tmp_path)
    assert str(e.value) == (f"models[0].input: {art.uri} holds no model: no config.json (Hugging Face model) or "
                            "adapter_config.json (peft adapter) at its top or under model/ (it has: notes.txt). Point "
                            "`input:` at a training stage")


def test_unknown_task_and_missing_column(tmp_path, models):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConfigError) as e:
        ev_stage.run(cfg_of(models=[{"name": "base", "base": str(models["base"])}],
                            tasks=["lmforge_arith_mc", "lmforge_arith_mcq"]), [], out)
    assert e.value.problems == [
        "tasks[1]: lm-eval does not know task 'lmforge_arith_mcq' (did you mean 'lmforge_arith_mc'?). Tasks in the "
        "task folders: lmforge_arith_gen, lmforge_arith_ll, lmforge_arith_ll_chat, lmforge_arith_mc; others come "
        "from lm-eval (`lm-eval ls "
        "tasks`). Add the folder with its YAML to task_dirs, or fix the name"]

    tasks_dir = write_task_dir(tmp_path / "bad_tasks", missing_column="question")
    out = tmp_path / "out2"
    out.mkdir()
    with pytest.raises(DataError) as e:
        ev_stage.run(cfg_of(models=[{"name": "base", "base": str(models["base"])}], tasks=["t_mc"],
                            task_dirs=[str(tasks_dir)]), [], out)
    assert str(e.value) == (f"{tasks_dir / 'data' / 'rows.jsonl'}:1: task t_mc ({tasks_dir / 't_mc.yaml'}) uses "
                            "column 'question' in doc_to_text, which this row does not have (columns: answer, "
                            "choices, label). Add 'question' to every row, or change the task's template")


def test_task_copies_get_absolute_data_paths_and_keep_functions(tmp_path):
    src = write_task_dir(tmp_path / "tasks")
    (src / "utils.py").write_text("def keep(ds):\n    return ds\n")
    (src / "t_fn.yaml").write_text("task: t_fn\ndataset_path: json\ndataset_kwargs:\n  data_files: [data/rows.jsonl]\n"
                                   "process_docs: !function utils.keep\n")
    (copy,) = prepare_task_dirs([src], tmp_path / "work")
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()) == [
        "t_fn.yaml", "t_gen.yaml", "t_ll.yaml", "t_mc.yaml", "utils.py"]  # data files stay where they are
    assert (copy / "t_fn.yaml").read_text() == (
        f"# resolved copy of {src / 't_fn.yaml'}: relative data paths made absolute by lmforge\n"
        f"task: t_fn\ndataset_path: json\ndataset_kwargs:\n  data_files:\n  - {src / 'data' / 'rows.jsonl'}\n"
        "process_docs: !function 'utils.keep'\n")
    (src / "t_fn.yaml").write_text("task: t_fn\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                   "    test: data/missing.jsonl\n")
    with pytest.raises(DataError) as e:
        prepare_task_dirs([src], tmp_path / "work2")
    assert str(e.value) == (f"{src / 't_fn.yaml'}: dataset_kwargs.data_files.test: 'data/missing.jsonl' does not "
                            f"exist (looked for {src / 'data' / 'missing.jsonl'}). Fix the path; paths in a task YAML "
                            "resolve against the YAML's folder")
