"""Writes the data of lmforge's arithmetic eval tasks ("What is 3 plus 4?" -> "7"), like data/demo/generate.py.

Run `python configs/eval_tasks/generate.py` to regenerate; the output is deterministic (seeded) and committed.
Every row: question, answer (the sum, as text), choices (four numbers as text, one of them the answer) and
label (the answer's index in choices). A change to the data is a new task version: bump `metadata.version`
in the task YAMLs that read it.
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def rows(rng: random.Random, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        s = a + b
        wrong = rng.sample([x for x in range(max(0, s - 4), s + 5) if x != s], 3)
        choices = [str(x) for x in wrong + [s]]
        rng.shuffle(choices)
        out.append({"question": f"What is {a} plus {b}?", "answer": str(s), "choices": choices,
                    "label": choices.index(str(s))})
    return out


def write(path: Path, data: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in data:
            f.write(json.dumps(r) + "\n")


def main() -> None:
    rng = random.Random(0)
    write(HERE / "data" / "arith_test.jsonl", rows(rng, 50))
    write(HERE / "data" / "arith_fewshot.jsonl", rows(rng, 10))


if __name__ == "__main__":
    main()
