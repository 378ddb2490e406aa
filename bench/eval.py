"""Perplexity throughput: lmforge's eval path against a plain lm-eval run, same model, same texts.

    python bench/eval.py [--docs 1500] [--batch-size 16] [--threads 1] [--model DIR]

Texts: the first `--docs` documents of data/demo/text.jsonl. Model: `--model` (a local HF folder), else a
small GPT-2 (4 layers, 256 wide) over a byte-level BPE trained here on the same texts.
Three comparisons, tokens scored per second (tokens = the model's tokens of all texts):
- end to end, one fresh process each: `python -m lm_eval --model hf --tasks <ppl task> --include_path ...`
  (a loglikelihood_rolling task YAML over the texts, like wikitext) against a process that loads the model
  with lmforge (`tasks.evaluation.engine.load_lm`) and scores the texts with `tasks.evaluation.engine.perplexity`;
- in process, model loaded: `perplexity()` against `lm_eval.simple_evaluate` on the same HFLM and task.
It also checks that both report the same bits per byte.
Target (issue 5): lmforge / lm-eval >= 0.95.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TASK = "bench_ppl"
TASK_YAML = """task: bench_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def make_model(folder: Path, texts: list[str]) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=256, n_layer=4, n_head=4,
                                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def worker(model: str, data: str, batch_size: int, task_dir: str | None) -> dict:
    """lmforge's path in this process: load, score; optionally lm-eval's simple_evaluate on the same HFLM."""
    t_start = time.perf_counter()
    from tasks.evaluation import engine as ev
    from tasks.evaluation import lmeval_tasks

    texts = [json.loads(x)["text"] for x in Path(data).read_text().splitlines()]
    lm = ev.load_lm(ev.ModelSource("bench", Path(model), Path(model)), batch_size=batch_size, device="cpu")
    p = ev.perplexity(lm, texts)
    out = {"tokens": p.tokens, "bits_per_byte": p.bits_per_byte, "scoring_s": p.seconds,
           "total_s": time.perf_counter() - t_start}
    if task_dir:
        tm = lmeval_tasks.task_manager([Path(task_dir)], [TASK])
        t0 = time.perf_counter()
        res = lmeval_tasks.run_tasks(lm, tm, [TASK], num_fewshot=0, limit=None, seed=1234, batch_size=batch_size,
                                     bootstrap_iters=0, apply_chat_template=False)
        out["lm_eval_in_process_s"] = time.perf_counter() - t0
        out["lm_eval_bits_per_byte"] = res["results"][TASK]["bits_per_byte,none"]
    return out


def run_json(cmd: list[str], env: dict[str, str]) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return (json.loads(last) if last.startswith("{") else {}), seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in every process (OMP_NUM_THREADS)")
    ap.add_argument("--model", help="a local Hugging Face model folder; default: a small GPT-2 built here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--task-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.data, args.batch_size, args.task_dir)))
        return

    tmp = Path(tempfile.mkdtemp(prefix="lmforge-bench-eval-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
           "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    os.environ.update(env)
    texts = [json.loads(x)["text"] for x in (ROOT / "data/demo/text.jsonl").read_text().splitlines()][:args.docs]
    data = tmp / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    task_dir = tmp / "tasks"
    task_dir.mkdir()
    (task_dir / "bench_ppl.yaml").write_text(TASK_YAML.format(data=data))
    model = Path(args.model) if args.model else tmp / "model"
    if not args.model:
        make_model(model, texts)

    py = sys.executable
    worker_cmd = [py, str(Path(__file__).resolve()), "--worker", "--model", str(model), "--data", str(data),
                  "--batch-size", str(args.batch_size)]
    cli_cmd = [py, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model}", "--tasks", TASK,
               "--include_path", str(task_dir), "--batch_size", str(args.batch_size), "--device", "cpu",
               "--output_path", str(tmp / "lm_eval_out")]
    subprocess.run(cli_cmd[:3] + ["--help"], env=env, capture_output=True)  # warm the file cache for both
    ours, ours_s = run_json(worker_cmd, env)
    _, cli_s = run_json(cli_cmd, env)
    cli_json = json.loads(next((tmp / "lm_eval_out").rglob("results_*.json")).read_text())
    cli_bpb = cli_json["results"][TASK]["bits_per_byte,none"]
    inproc, _ = run_json(worker_cmd + ["--task-dir", str(task_dir)], env)

    tokens = ours["tokens"]
    rows = [("end to end (fresh process)", tokens / ours_s, tokens / cli_s),
            ("in process, model loaded", tokens / inproc["scoring_s"], tokens / inproc["lm_eval_in_process_s"])]
    print(f"\nperplexity: {len(texts)} docs, {tokens:,} tokens, batch_size {args.batch_size}, "
          f"{args.threads} thread(s), model {model.name if args.model else 'GPT-2 4x256 (built here)'}\n")
    print(f"{'path':<28} {'lmforge tok/s':>14} {'lm-eval tok/s':>14} {'ratio':>7}")
    for name, a, b in rows:
        print(f"{name:<28} {a:>14,.0f} {b:>14,.0f} {a / b:>7.2f}")
    print(f"\nbits per byte: lmforge {ours['bits_per_byte']:.6f}, lm-eval CLI {cli_bpb:.6f}, "
          f"lm-eval in process {inproc['lm_eval_bits_per_byte']:.6f}")
    print("target: lmforge / lm-eval >= 0.95")
    print(json.dumps({"docs": len(texts), "tokens": tokens, "e2e_ratio": round(rows[0][1] / rows[0][2], 3),
                      "inproc_ratio": round(rows[1][1] / rows[1][2], 3), "bpb_lmforge": ours["bits_per_byte"],
                      "bpb_lm_eval": cli_bpb}))


if __name__ == "__main__":
    main()
