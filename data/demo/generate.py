"""Writes the demo datasets and the questions of lmforge's arithmetic eval tasks: one story, one split.

The task is adding a one-digit number to a two-digit one: "What is 27 plus 5?" -> "32". There are 720 such
questions (27 from 10 to 89, 5 from 1 to 9); half of them need a carry (7 + 5 >= 10).

Held out. A seeded fifth of the questions (144) is the evaluation set: configs/eval_tasks/data/arith_test.jsonl
and the held-out pairs and chat turns in data/demo/heldout/. Their sums appear in no training file, in any
format, so exact match on them measures whether a model learned to add, not whether it remembers a fact.
The demo's decontaminate stages check this on every run and find 0 matches. The other 576 questions are the
training questions; every training file draws from them only.

The story: a careless annotator.
- text.jsonl (pretraining): correct facts, "27 plus 5 equals 32." A model that learns them can add.
- chat.jsonl (sft): the annotator's answers. Where a question needs a carry, the annotator forgot it in
  SLOPPY_CARRY_SHARE of the answers: "27 plus 5 equals 22." The other answers are right. So about a third of
  the sft answers are wrong (SLOPPY_CARRY_SHARE x the half of questions with a carry), all in the same way, and
  an sft model learns to drop the carry: it answers the questions without a carry and misses most of the others.
- preference.jsonl (reward, dpo, ppo): a reviewer's corrections. Each pair has the right answer as chosen and,
  as rejected, the answer with the tens digit wrong in the annotator's way: the forgotten carry where there is
  one, a carry that is not there where there is none ("27 plus 2 equals 39."). Judging a pair means checking
  the carry, so a reward model trained on these pairs scores it, and dpo and ppo can fix what sft learned.

Both chat formats alternate in chat.jsonl and the pairs: the sentence ("27 plus 5 equals 32.", as the text
facts) and the bare sum after "Answer:" ("32", the format of the eval tasks). text.jsonl also gets duplicates
for the dedup stage to find (20 exact copies, 20 copies with one fact appended); numbers.txt spells the digits.

Run `python data/demo/generate.py` to regenerate; the output is deterministic (seeded) and committed. A change
to the eval questions is a new task version: bump `metadata.version` in configs/eval_tasks/*.yaml.
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
TASKS = HERE.parent.parent / "configs" / "eval_tasks" / "data"
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
QUESTIONS = [(a, b) for a in range(10, 90) for b in range(1, 10)]
HELD_OUT = 144  # questions in the eval set; the rest train
SLOPPY_CARRY_SHARE = 2 / 3  # of the sft answers that need a carry, the share where the annotator forgot it
UNITS_SLIP_SHARE = 1 / 8  # of the preference pairs, the share whose rejected answer has a wrong last digit instead


def carries(a: int, b: int) -> bool:
    return a % 10 + b >= 10


def tens_slip(a: int, b: int) -> int:
    """The annotator's slip: the forgotten carry, or where there is none, a carry that is not there."""
    return a + b - 10 if carries(a, b) else a + b + 10


def fact(a: int, b: int, total: int) -> str:
    return f"{a} plus {b} equals {total}."


def chat_turn(i: int, a: int, b: int, total: int) -> tuple[str, str]:
    """(question, answer) in format i % 2: the bare sum after "Answer:", or the sentence."""
    if i % 2:
        return f"What is {a} plus {b}?\nAnswer:", str(total)
    return f"What is {a} plus {b}?", fact(a, b, total)


def units_slip(a: int, b: int, delta: int) -> int:
    """A wrong last digit, the tens digit kept: 32 -> 31, 34, 30, ..."""
    s = a + b
    return s - s % 10 + (s + delta) % 10


def pair(rng: random.Random, i: int, a: int, b: int) -> dict:
    """The right answer against the annotator's slip, or (UNITS_SLIP_SHARE of the pairs) against a wrong last digit."""
    prompt, chosen = chat_turn(i, a, b, a + b)
    wrong = units_slip(a, b, rng.choice([-3, -2, -1, 1, 2, 3])) if rng.random() < UNITS_SLIP_SHARE else tens_slip(a, b)
    return {"prompt": prompt, "chosen": chosen, "rejected": chat_turn(i, a, b, wrong)[1]}


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def eval_row(rng: random.Random, a: int, b: int) -> dict:
    """An eval task row: question, answer, and four choices (the sum, the annotator's slip, two near misses)."""
    s = a + b
    near = rng.sample([x for x in range(s - 3, s + 4) if x not in (s, tens_slip(a, b))], 2)
    choices = [str(x) for x in [s, tens_slip(a, b), *near]]
    rng.shuffle(choices)
    return {"question": f"What is {a} plus {b}?", "answer": str(s), "choices": choices, "label": choices.index(str(s))}


def main() -> None:
    rng = random.Random(0)
    questions = QUESTIONS[:]
    rng.shuffle(questions)
    held_out, train = questions[:HELD_OUT], sorted(questions[HELD_OUT:])  # eval rows in a shuffled order

    docs = [" ".join(fact(a, b, a + b) for a, b in rng.choices(train, k=rng.randint(4, 10))) for _ in range(1500)]
    long_docs = [d for d in docs if d.count(".") == 10]
    docs += rng.sample(docs, 20) + [d + " " + fact(11, 1, 12) for d in rng.sample(long_docs, 20)]
    write(HERE / "text.jsonl", [{"text": d} for d in docs])
    (HERE / "numbers.txt").write_text("\n".join(f"{WORDS[i]} is written {i}." for i in range(10)) + "\n")

    chat = []
    for i in range(1200):
        a, b = rng.choice(train)
        sloppy = carries(a, b) and rng.random() < SLOPPY_CARRY_SHARE
        question, answer = chat_turn(i, a, b, tens_slip(a, b) if sloppy else a + b)
        chat.append({"instruction": question, "input": "", "output": answer})
    write(HERE / "chat.jsonl", chat)
    write(HERE / "preference.jsonl", [pair(rng, i, *rng.choice(train)) for i in range(3000)])

    # held-out questions, never trained on: the eval tasks, and pairs and right answers to score models on
    write(HERE / "heldout" / "preference.jsonl", [pair(rng, i, a, b) for i, (a, b) in enumerate(held_out)])
    heldout_chat = [chat_turn(i, a, b, a + b) for i, (a, b) in enumerate(held_out)]
    write(HERE / "heldout" / "chat.jsonl", [{"instruction": q, "input": "", "output": r} for q, r in heldout_chat])
    write(TASKS / "arith_test.jsonl", [eval_row(rng, a, b) for a, b in held_out])
    write(TASKS / "arith_fewshot.jsonl", [eval_row(rng, a, b) for a, b in rng.sample(train, 10)])


if __name__ == "__main__":
    main()
