"""lmforge's dpo and reward stages against plain TRL scripts: same model, data and settings, side by side.

    python bench/align_vs_trl.py [--seeds 2] [--method dpo reward] [--dpo-lr 2e-3] [--sft-loss-weight 0]
                                 [--dpo-steps 100] [--reward-steps 1000] [--out DIR]

The starting point is the demo's sft model: the demo's data stages, tokenizer, pretrain and sft (configs/demo.yaml,
run here through `execute_stage`, as `lmforge run` runs them; a store given with --out is reused). Then, for each
seed, on the demo's preference pairs (the train split of its `shard_pairs` artifact):
A  lmforge: the demo's `dpo` (or `reward`) stage with that seed, as stages `dpo_s<seed>` (`reward_s<seed>`);
B  plain: a fresh python running `plain_dpo()` (`plain_reward()`): TRL's DPOTrainer (RewardTrainer) on the same
   pairs in TRL's conversational format, the same sft folder, LoRA, beta, learning rate, schedule, warmup, batch,
   steps, max length and seed, with the Trainer's random order (what a user's script gets). The demo's stages use
   a random order too (`group_by_length: false`), drawn their own way, so the two sides see different batches.
Reported: the training loss at every 10th step for every run (lmforge's from its MLflow run, the plain script's from
its log history), the spread between seeds of one side against the gap between the sides' means, and held-out
figures on the 144 held-out pairs of data/demo/heldout, measured the same way for both sides:
- dpo: the eval stage (tasks/eval.py) with every policy side by side: implicit-reward preference accuracy against
  the sft model, log-likelihood preference accuracy and exact match on the held-out questions (the plain adapters
  are merged into full folders for it);
- reward: pairwise accuracy of each reward model on the held-out pairs (reward_model_scores of
  tasks/evaluation/preference_accuracy.py, what the eval stage uses).
Figures: see the note of the stop that ran it; nothing here is a timed assertion.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CHAIN = ["ingest_text", "filter_text", "dedup_text", "decontaminate_text", "ingest_chat", "decontaminate_chat",
         "ingest_pairs", "decontaminate_pairs", "shard_text", "shard_chat", "shard_pairs", "ingest_heldout_pairs",
         "tokenizer", "pretrain", "sft"]


# ----------------------------------------------------------------------------------------------
# the plain side: what a user writes with TRL alone


def plain_dpo(job: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    s = job["settings"]
    torch.set_num_threads(job["threads"])
    tok = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    lo = s["lora"]
    peft_config = LoraConfig(r=lo["rank"], lora_alpha=lo["alpha"], lora_dropout=lo["dropout"], bias="none",
                             target_modules=lo.get("target_modules", "all-linear"), task_type="CAUSAL_LM")
    losses = ["sigmoid", *(["sft"] if s.get("sft_loss_weight") else [])]
    weights = [1.0, *([s["sft_loss_weight"]] if s.get("sft_loss_weight") else [])]
    args = DPOConfig(output_dir=f"{job['out']}/checkpoints", seed=job["seed"], data_seed=job["seed"], use_cpu=True,
                     bf16=False, max_steps=s["max_steps"], per_device_train_batch_size=s["batch_size_per_device"],
                     learning_rate=s["learning_rate"], lr_scheduler_type=s.get("lr_scheduler", "cosine"),
                     warmup_steps=s.get("warmup_steps", 0), max_length=s["max_length_tokens"], beta=s["beta"],
                     loss_type=losses, loss_weights=weights, logging_steps=job["logging_steps"], save_strategy="no",
                     report_to="none", disable_tqdm=True)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(job_rows(job)),
                         processing_class=tok, peft_config=peft_config)
    t0 = time.perf_counter()
    trainer.train()
    merged = trainer.model.merge_and_unload()  # a full folder, so the eval stage reads it as `base:`
    merged.save_pretrained(job["out"])
    tok.save_pretrained(job["out"])
    return {"loss": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "train_seconds": time.perf_counter() - t0}


def plain_reward(job: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    s = job["settings"]
    torch.set_num_threads(job["threads"])
    tok = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForSequenceClassification.from_pretrained(job["model"], num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    args = RewardConfig(output_dir=f"{job['out']}/checkpoints", seed=job["seed"], data_seed=job["seed"],
                        use_cpu=True, bf16=False, max_steps=s["max_steps"],
                        per_device_train_batch_size=s["batch_size_per_device"], learning_rate=s["learning_rate"],
                        lr_scheduler_type=s.get("lr_scheduler", "cosine"), warmup_steps=s.get("warmup_steps", 0),
                        max_length=s["max_length_tokens"], logging_steps=job["logging_steps"], save_strategy="no",
                        report_to="none", disable_tqdm=True)
    # RewardTrainer's conversational format: chosen and rejected are whole conversations
    rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in job_rows(job)]
    trainer = RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    t0 = time.perf_counter()
    trainer.train()
    trainer.save_model(job["out"])
    tok.save_pretrained(job["out"])
    return {"loss": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "train_seconds": time.perf_counter() - t0}


def job_rows(job: dict) -> list[dict]:
    return [json.loads(x) for x in Path(job["data"]).read_text().splitlines()]


# ----------------------------------------------------------------------------------------------
# the lmforge side and the measurements


def demo_raw(out: Path) -> dict:
    raw = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for d in raw["datasets"].values():  # absolute: the config is read with root=out
        d["path"] = [str(REPO / p) for p in d["path"]] if isinstance(d["path"], list) else str(REPO / d["path"])
    raw["store"], raw["tracking"] = str(out / "artifacts"), f"sqlite:///{out / 'mlflow.db'}"
    return raw


def loss_history(tracker, run_name: str) -> dict[int, float]:
    runs = tracker.client.search_runs([tracker.experiment_id], f"attributes.run_name = '{run_name}'",
                                      order_by=["attributes.start_time DESC"], max_results=1)
    return {m.step: m.value for m in tracker.client.get_metric_history(runs[0].info.run_id, "train/loss")}


def curve_table(curves: dict[str, dict[int, float]], every: int) -> tuple[str, dict[str, float]]:
    """Markdown: step x run; and the mean |gap| between the sides' means against the mean seed spread."""
    names = list(curves)
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    steps = [s for s in steps if s % every == 0] or steps
    lines = ["| step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    gaps, spreads = [], []
    for st in steps:
        lines.append(f"| {st} | " + " | ".join(f"{curves[n][st]:.4f}" for n in names) + " |")
        lm = [curves[n][st] for n in names if n.startswith("lmforge")]
        pl = [curves[n][st] for n in names if n.startswith("plain")]
        gaps.append(abs(statistics.mean(lm) - statistics.mean(pl)))
        spreads += [max(lm) - min(lm), max(pl) - min(pl)]
    return "\n".join(lines), {"mean_gap_between_sides": statistics.mean(gaps),
                              "mean_spread_between_seeds": statistics.mean(spreads)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--method", nargs="+", choices=["dpo", "reward"], default=["dpo", "reward"])
    ap.add_argument("--dpo-lr", type=float, help="default: the demo's")
    ap.add_argument("--dpo-steps", type=int, help="default: the demo's")
    ap.add_argument("--sft-loss-weight", type=float, default=0.0, help="0: pure DPO (the demo uses RPO, 1.0)")
    ap.add_argument("--reward-steps", type=int, help="default: the demo's")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--logging-steps", type=int, default=5)
    ap.add_argument("--out", help="work folder (reused: its store keeps the sft chain)")
    ap.add_argument("--plain", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    if args.plain:
        job = json.loads(args.plain)
        print(json.dumps({"dpo": plain_dpo, "reward": plain_reward}[job["method"]](job)))
        return 0

    out = Path(args.out or tempfile.mkdtemp(prefix="lmforge-bench-align-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf"),
                       "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false", "DO_NOT_TRACK": "1",
                       "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "LMFORGE_WORK_DIR": str(out / "work")})
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from lmforge.config import parse_config
    from lmforge.executor import RunContext, execute_stage
    from lmforge.plan import make_plan
    from lmforge.shards import iter_samples
    from lmforge.tracking import Tracker
    from tasks import REGISTRY
    from tasks.evaluation import preference_accuracy as ev
    from trainer import models
    from trainer.preference import REWARD_MODEL_KIND

    raw = demo_raw(out)
    seeds = list(range(args.seeds))
    dpo = {**raw["stages"]["dpo"], "retries": 0, "sft_loss_weight": args.sft_loss_weight,
           "logging_steps": args.logging_steps, "cpu_threads": args.threads}
    dpo.update({k: v for k, v in (("learning_rate", args.dpo_lr), ("max_steps", args.dpo_steps)) if v is not None})
    reward = {**raw["stages"]["reward"], "retries": 0, "logging_steps": args.logging_steps,
              "cpu_threads": args.threads}
    if args.reward_steps:
        reward["max_steps"] = args.reward_steps
    stages = {n: raw["stages"][n] for n in CHAIN}
    for s in seeds:
        if "dpo" in args.method:
            stages[f"dpo_s{s}"] = {**dpo, "seed": s}
        if "reward" in args.method:
            stages[f"reward_s{s}"] = {**reward, "seed": s}
    if "dpo" in args.method:
        stages["eval"] = {
            "kind": "eval", "retries": 0, "expect_fails_stage": False,
            "inputs": ["sft", *(f"dpo_s{s}" for s in seeds), "ingest_heldout_pairs"],
            "models": [{"name": "sft", "input": "sft"}, *({"name": f"lmforge_s{s}", "input": f"dpo_s{s}"}
                                                          for s in seeds),
                       *({"name": f"plain_s{s}", "base": str(out / f"plain-dpo-{s}")} for s in seeds)],
            "tasks": ["lmforge_arith_gen"], "apply_chat_template": True, "batch_size": 16, "bootstrap_iters": 0,
            "preference": {"input": "ingest_heldout_pairs", "reference": "sft"}}
    if "eval" not in stages:  # --method reward: no eval stage to take the decontaminate stages' tasks from
        for name, st in stages.items():
            if st.get("kind") == "decontaminate" and st.get("eval_stage") == "eval":
                stages[name] = {**{k: v for k, v in st.items() if k != "eval_stage"},
                                "tasks": raw["stages"]["eval"]["tasks"]}  # the same checks (eval_stage is not in ids)
    raw["stages"] = stages
    plan = make_plan(parse_config(raw, REGISTRY, root=out), REGISTRY)
    tracker = Tracker(raw["tracking"], raw["name"])
    ctx = RunContext(plan=plan, kinds=REGISTRY, tracker=tracker, parent_run_id=tracker.start_run("bench", {}))
    t0 = time.perf_counter()
    for name in CHAIN:
        execute_stage(ctx, name)
    print(f"the demo's chain up to sft: {time.perf_counter() - t0:.0f}s (cached where --out held it)", flush=True)
    sft_dir = plan.store.require("sft", plan.stages["sft"].artifact_id).path
    pairs_art = plan.store.require("shard", plan.stages["shard_pairs"].artifact_id)
    data = out / "pairs-train.jsonl"  # the same train split, in TRL's conversational format
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}],
                                        "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                        "rejected": [{"role": "assistant", "content": r["rejected"]}]}) + "\n"
                            for r in iter_samples(pairs_art, "train")))
    held_art = plan.store.require("ingest", plan.stages["ingest_heldout_pairs"].artifact_id)
    from lmforge.records import iter_records
    held = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in iter_records(held_art)]

    figures = {}
    for method in args.method:
        settings = dpo if method == "dpo" else reward
        curves, seconds, heldout = {}, {}, {}
        for s in seeds:
            name = f"{method}_s{s}"
            t0 = time.perf_counter()
            execute_stage(ctx, name)
            art = plan.store.require(method, plan.stages[name].artifact_id)
            curves[f"lmforge s{s}"] = loss_history(tracker, name)
            seconds[f"lmforge s{s}"] = art.result["train_seconds"]
            folder = out / f"plain-{method}-{s}"
            job = {"method": method, "model": sft_dir, "data": str(data), "out": str(folder), "seed": s,
                   "settings": settings, "threads": args.threads, "logging_steps": args.logging_steps}
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--plain", json.dumps(job)],
                                  capture_output=True, text=True, cwd=out)
            if proc.returncode != 0:
                sys.exit(f"plain {method} script failed:\n{proc.stderr[-3000:]}")
            plain = json.loads(proc.stdout.strip().splitlines()[-1])
            curves[f"plain s{s}"] = {int(k): v for k, v in plain["loss"].items()}
            seconds[f"plain s{s}"] = plain["train_seconds"]
            if method == "reward":  # the same scorer reads both; it wants the folder labelled as a reward model
                (folder / models.MODEL_INFO).write_text(json.dumps({"kind": REWARD_MODEL_KIND}))
                for side, f in ((f"lmforge s{s}", Path(art.path)), (f"plain s{s}", folder)):
                    heldout[side] = ev.reward_model_accuracy(ev.reward_model_scores(f, held, batch_size=32))
            print(f"{method} seed {s}: lmforge {time.perf_counter() - t0:.0f}s with the plain script", flush=True)
        if method == "dpo":  # planned again: the plain folders exist now, and their content enters the eval id
            plan = make_plan(parse_config(raw, REGISTRY, root=out), REGISTRY)
            ctx = RunContext(plan=plan, kinds=REGISTRY, tracker=tracker, parent_run_id=ctx.parent_run_id)
            execute_stage(ctx, "eval")
            scores = plan.store.require("eval", plan.stages["eval"].artifact_id).result["eval"]
            for s in seeds:
                for side in ("lmforge", "plain"):
                    sc = scores[f"{side}_s{s}"]
                    heldout[f"{side} s{s}"] = {"implicit_accuracy": sc["preference"]["accuracy"],
                                               "loglik_accuracy": sc["preference"]["loglik_accuracy"],
                                               "exact_match": sc["lmforge_arith_gen"]["exact_match"]}
            heldout["sft (reference)"] = {"loglik_accuracy": scores["sft"]["preference"]["loglik_accuracy"],
                                          "exact_match": scores["sft"]["lmforge_arith_gen"]["exact_match"]}
        table, spread = curve_table(curves, every=10)
        figures[method] = {"settings": {k: settings[k] for k in ("learning_rate", "max_steps", "batch_size_per_device")
                                        if k in settings}, "spread": spread, "heldout": heldout, "seconds": seconds}
        print(f"\n## {method}: training loss (lmforge vs plain TRL), settings {json.dumps(figures[method]['settings'])}"
              + (f", sft_loss_weight {args.sft_loss_weight}" if method == "dpo" else "") + f"\n\n{table}\n")
        print(f"mean gap between the sides' mean curves {spread['mean_gap_between_sides']:.4f}; mean spread between "
              f"seeds within a side {spread['mean_spread_between_seeds']:.4f}")
        print(f"first -> last logged loss: " + ", ".join(
            f"{n} {c[min(c)]:.4f} -> {c[max(c)]:.4f}" for n, c in curves.items()))
        print("\nheld-out (data/demo/heldout, 144 pairs / questions):\n")
        keys = sorted({k for v in heldout.values() for k in v if not k.endswith("_stderr")})
        print("| model | " + " | ".join(keys) + " | train s |\n" + "|---" * (len(keys) + 2) + "|")
        for side, v in heldout.items():
            print(f"| {side} | " + " | ".join(f"{v[k]:.4f}" if k in v else "-" for k in keys) +
                  f" | {seconds.get(side, 0):.1f} |")
    (out / "figures.json").write_text(json.dumps(figures, indent=2))
    print(f"\nfigures: {out / 'figures.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
