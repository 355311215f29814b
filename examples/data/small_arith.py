"""Short arithmetic questions for SmolLM2-135M-Instruct, written as Parquet files in verl's schema (as
`arith_word_problems.py` writes them): `data_source`, `prompt` (one user chat message), `ability`,
`reward_model: {style, ground_truth}`, `extra_info`.

    python examples/data/small_arith.py [--out examples/data/small-arith] [--train 512] [--test 64] [--seed 0]

Sums and products of two one-digit numbers (2..9), half of each, with the instruction to answer with the
number alone. Our copy of SmolLM2-135M-Instruct (dequantized from a Q4_1 GGUF) gets some right at T = 1 and
never boxes: the jobs score it with the math verifier's lenient rule (`params: {extract: last_number}`).
The held-out split's pairs never appear in the train split (train and test are drawn from disjoint
(a, op, b) triples), so a lift on it is not memorized answers. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "everstep/small_arith"
INSTRUCTION = "Answer with the number only."
OPERATIONS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}
WORDS = {"+": "plus", "*": "times"}


def triples(seed: int) -> tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]:
    """All (a, op, b) with 2 <= a, b <= 9, shuffled for ``seed`` and split: a quarter held out, the rest train."""
    every = [(a, op, b) for op in OPERATIONS for a in range(2, 10) for b in range(2, 10)]
    random.Random(f"{seed}-split").shuffle(every)
    held_out = len(every) // 4
    return every[held_out:], every[:held_out]


def row(a: int, op: str, b: int, split: str, index: int, instruction: str) -> dict:
    question = f"What is {a} {WORDS[op]} {b}?"
    answer = str(OPERATIONS[op](a, b))
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def rows(n: int, split: str, seed: int, instruction: str = INSTRUCTION) -> list[dict]:
    """``n`` rows of ``split`` ("train" or "test"), cycling through its shuffled triples."""
    train, test = triples(seed)
    pool = train if split == "train" else test
    if split == "test" and n > len(pool):
        raise ValueError(f"--test {n}: the held-out split has {len(pool)} distinct questions")
    rng = random.Random(f"{seed}-{split}")
    order: list[tuple[int, str, int]] = []
    while len(order) < n:
        order += rng.sample(pool, len(pool))
    return [row(a, op, b, split, index, instruction) for index, (a, op, b) in enumerate(order[:n])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("small-arith"))
    p.add_argument("--train", type=int, default=512)
    p.add_argument("--test", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--instruction", default=INSTRUCTION, help="what follows every question (default: %(default)r)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.train), ("test", args.test)):
        pq.write_table(pa.Table.from_pylist(rows(n, split, args.seed, args.instruction)), args.out / f"{split}.parquet")
        print(f"{args.out / f'{split}.parquet'}: {n} rows")


if __name__ == "__main__":
    main()
