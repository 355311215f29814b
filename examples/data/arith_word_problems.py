"""Arithmetic word problems written as Parquet files in verl's schema (as `examples/data_preprocess/gsm8k.py`
in verl writes them): `data_source`, `prompt` (a list of chat messages), `ability`,
`reward_model: {style, ground_truth}`, `extra_info`.

    python examples/data/arith_word_problems.py [--out examples/data/arith-word-problems] [--train 256] [--test 64]
        [--instruction "Think step by step, then put the final answer in \\boxed{}."]

One or two operations on small whole numbers, in a handful of everyday phrasings; the instruction asks for
the answer in `\\boxed{}`, which the math and format verifiers read. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "everstep/arith_word_problems"
INSTRUCTION = "Put the final answer in \\boxed{}."
THINGS = ("apples", "pencils", "marbles", "stickers", "books", "cookies", "coins", "shells")
NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Mia", "Ken", "Zoe")


def problem(rng: random.Random) -> tuple[str, int]:
    """(question, answer) of one problem."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b, c = rng.randint(2, 20), rng.randint(2, 12), rng.randint(2, 6)
    kind = rng.randrange(5)
    if kind == 0:
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
    if kind == 1:
        a = a + b
        return f"{name} had {a} {thing} and gave {b} away. How many {thing} are left?", a - b
    if kind == 2:
        return f"{name} buys {c} bags with {b} {thing} in each bag. How many {thing} is that in all?", b * c
    if kind == 3:
        return (f"{name} has {a} {thing}, finds {b} more, then loses {c}. How many {thing} does {name} have?",
                a + b - c)
    total = b * c
    return f"{name} shares {total} {thing} equally among {c} friends. How many {thing} does each friend get?", b


def rows(n: int, split: str, seed: int, instruction: str = INSTRUCTION) -> list[dict]:
    rng = random.Random(f"{seed}-{split}")
    out = []
    for index in range(n):
        question, answer = problem(rng)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index, "answer": str(answer), "question": question},
        })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("arith-word-problems"))
    p.add_argument("--train", type=int, default=256)
    p.add_argument("--test", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--instruction", default=INSTRUCTION,
                   help="what follows every question (default: %(default)r); asking for steps gives long-tailed "
                        "chain-of-thought answers")
    args = p.parse_args()
    if "\\boxed" not in args.instruction:
        p.error("--instruction must ask for the answer in \\boxed{}: the math and format verifiers read it there")
    args.out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.train), ("test", args.test)):
        pq.write_table(pa.Table.from_pylist(rows(n, split, args.seed, args.instruction)), args.out / f"{split}.parquet")
        print(f"{args.out / f'{split}.parquet'}: {n} rows")


if __name__ == "__main__":
    main()
