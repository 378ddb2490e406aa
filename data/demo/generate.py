"""Writes the demo datasets: small arithmetic facts a tiny model can learn within the demo budget.

chat.jsonl mixes two answer formats, alternating: "What is 3 plus 4?" -> "3 plus 4 equals 7." (the
sentence, as in text.jsonl and preference.jsonl) and "What is 3 plus 4?\nAnswer:" -> "7" (the bare sum,
the prompt and answer format of lmforge's arithmetic eval tasks in configs/eval_tasks, so the demo's eval
shows the SFT model learning). preference.jsonl alternates the same two formats, the chosen answer with the
right sum, the rejected one with a sum off by 1-3. The eval questions are held-out rows, not unseen sums: every single-digit
sum occurs in training.

Run `python data/demo/generate.py` to regenerate; the output is deterministic (seeded) and committed.
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
rng = random.Random(0)
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def fact(a: int, b: int) -> str:
    return f"{a} plus {b} equals {a + b}."


def main() -> None:
    docs = [" ".join(fact(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(rng.randint(4, 10)))
            for _ in range(1500)]
    # duplicates for the dedup stage to find: 20 exact copies, 20 copies with one fact appended
    long_docs = [d for d in docs if d.count(".") == 10]
    docs += rng.sample(docs, 20) + [d + " " + fact(1, 1) for d in rng.sample(long_docs, 20)]
    with open(HERE / "text.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    with open(HERE / "chat.jsonl", "w") as f:
        for i in range(1200):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            if i % 2:
                row = {"instruction": f"What is {a} plus {b}?\nAnswer:", "input": "", "output": str(a + b)}
            else:
                row = {"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} equals {a + b}."}
            f.write(json.dumps(row) + "\n")
    with open(HERE / "preference.jsonl", "w") as f:
        for i in range(3000):  # the two formats of chat.jsonl, alternating: alignment must not unlearn either
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            d = rng.choice([-3, -2, -1, 1, 2, 3])
            wrong = a + b + d if a + b + d >= 0 else a + b - d
            if i % 2:
                row = {"prompt": f"What is {a} plus {b}?\nAnswer:", "chosen": str(a + b), "rejected": str(wrong)}
            else:
                row = {"prompt": f"What is {a} plus {b}?", "chosen": f"{a} plus {b} equals {a + b}.",
                       "rejected": f"{a} plus {b} equals {wrong}."}
            f.write(json.dumps(row) + "\n")
    with open(HERE / "numbers.txt", "w") as f:
        f.write("\n".join(f"{WORDS[i]} is written {i}." for i in range(10)) + "\n")


if __name__ == "__main__":
    main()
