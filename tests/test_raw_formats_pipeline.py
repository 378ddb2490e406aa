"""Issue 13's "done when": a config that names raw LLaMA-Factory-style files (alpaca_en_demo.json: one JSON array of
instruction/input/output rows; dpo_en_demo.json: ShareGPT conversations with chosen/rejected message objects) and
TRL's conversational preference layout (JSON Lines) runs sft -> dpo -> eval with no conversion step, through the
Prefect flow; the preference sources are combined by a mix stage, and eval reports held-out chat loss and
preference log-likelihood accuracy for base vs sft vs dpo."""
from __future__ import annotations

import json
import random

import yaml

from flows.pipeline import pipeline as run_pipeline
from lmforge.store import ArtifactStore
from tests.helpers import TINY_LLAMA


def digit_pairs(seed: int, n: int) -> list[tuple[int, int]]:
    """n seeded pairs of digits to add."""
    rng = random.Random(seed)
    return [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n)]


def alpaca_rows(n: int) -> list[dict]:
    return [{"instruction": "Add the two numbers.", "input": f"{a} and {b}", "output": f"{a} plus {b} is {a + b}.",
             **({"system": "Answer in one sentence."} if i % 3 == 0 else {})}
            for i, (a, b) in enumerate(digit_pairs(0, n))]


def llama_factory_pairs(n: int) -> list[dict]:
    return [{"conversations": [{"from": "human", "value": f"Add the two numbers.\n\n{a} and {b}"}],
             "chosen": {"from": "gpt", "value": f"{a} plus {b} is {a + b}."},
             "rejected": {"from": "gpt", "value": f"{a} plus {b} is {a + b + 1}."}} for a, b in digit_pairs(1, n)]


def trl_conversational_pairs(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": "Add the two numbers."},
                        {"role": "assistant", "content": "Which ones?"},
                        {"role": "user", "content": f"{a} and {b}"}],
             "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
             "rejected": [{"role": "assistant", "content": f"{a} plus {b} is {a + b + 2}."}]}
            for a, b in digit_pairs(2, n)]


def test_raw_alpaca_llama_factory_and_trl_files_run_sft_dpo_eval(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "alpaca_en_demo.json").write_text(json.dumps(alpaca_rows(240), indent=2))  # one array, as shipped
    (data / "dpo_en_demo.json").write_text(json.dumps(llama_factory_pairs(120), indent=2))
    (data / "trl_pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trl_conversational_pairs(120)))
    lora = {"rank": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"}
    fast = {"max_length_tokens": 96, "batch_size_per_device": 8, "logging_steps": 5, "retries": 0,
            "control_prompts": []}
    cfg = {
        "name": "rawfmt", "store": str(tmp_path / "artifacts"), "tracking": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "datasets": {"alpaca": {"path": "data/alpaca_en_demo.json", "kind": "chat"},
                     "lf_pairs": {"path": "data/dpo_en_demo.json", "kind": "preference"},
                     "trl_pairs": {"path": "data/trl_pairs.jsonl", "kind": "preference"}},
        "stages": {
            "ingest_chat": {"kind": "ingest", "inputs": ["alpaca"]},
            "ingest_lf": {"kind": "ingest", "inputs": ["lf_pairs"]},
            "ingest_trl": {"kind": "ingest", "inputs": ["trl_pairs"]},
            "pairs": {"kind": "mix", "inputs": ["ingest_lf", "ingest_trl"], "weights": {"ingest_lf": 1, "ingest_trl": 1}},
            "shard_chat": {"kind": "shard", "inputs": ["ingest_chat"], "validation_fraction": 0.15},
            "shard_pairs": {"kind": "shard", "inputs": ["pairs"], "validation_fraction": 0.15},
            "tokenizer": {"kind": "tokenizer", "inputs": ["shard_chat"], "vocab_size": 300, "min_frequency": 1},
            "sft": {"kind": "sft", "inputs": ["shard_chat", "tokenizer"], "base_model": {"config": TINY_LLAMA},
                    "method": "lora", "lora": lora, "max_steps": 40, "learning_rate": 5e-3, **fast},
            "dpo": {"kind": "dpo", "inputs": ["shard_pairs", "sft"], "method": "lora", "lora": lora, "max_steps": 10,
                    "learning_rate": 1e-3, **fast},
            "eval": {"kind": "eval", "inputs": ["sft", "dpo", "shard_chat", "shard_pairs"], "retries": 0,
                     "models": [{"name": "base", "input": "sft", "without_adapter": True},
                                {"name": "sft", "input": "sft"}, {"name": "dpo", "input": "dpo"}],
                     "chat_loss": [{"input": "shard_chat"}],
                     "preference": {"input": "shard_pairs", "reference": "sft"},
                     "gates": [{"metric": "sft/chat_loss/assistant_nll", "against": "base", "max_regression": 0.0}]},
        },
    }
    path = tmp_path / "rawfmt.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    summary = run_pipeline(config_path=str(path))
    assert summary["failed"] == 0 and summary["ran"] == len(cfg["stages"])
    store = ArtifactStore(str(tmp_path / "artifacts"))

    def result(name):
        return store.require(cfg["stages"][name]["kind"], summary["stages"][name]["artifact_id"]).result

    assert result("ingest_chat")["records"] == 240 and result("ingest_lf")["records"] == 120
    # the TRL rows keep their multi-turn prompt as messages
    rec = next(iter(store.require("ingest", summary["stages"]["ingest_trl"]["artifact_id"]).open("records/part-00000.jsonl")))
    rec = json.loads(rec)
    assert [m["role"] for m in rec["prompt_messages"]] == ["user", "assistant", "user"]
    assert result("pairs")["records"] == 240
    assert result("sft")["steps"] == 40 and result("dpo")["steps"] == 10
    scores = result("eval")["eval"]
    nll = {m: scores[m]["chat_loss"]["assistant_nll"] for m in ("base", "sft", "dpo")}
    assert nll["sft"] < nll["base"] - 0.3  # sft learned the held-out answers' form (5.0 vs 5.7 seen); the base is random
    assert all(0 <= scores[m]["preference"]["loglik_accuracy"] <= 1 for m in ("base", "sft", "dpo"))
    assert "accuracy" in scores["dpo"]["preference"]
    assert result("eval")["gates_failed"] == 0
