"""The demo task: right answers, a long-tailed length distribution, a verifiable format."""

from __future__ import annotations

import json

import math_verify
import pytest

from everstep_tools.demo.task import (
    Problem,
    TaskConfig,
    generate_problems,
    parse_prompt,
    read_problems,
    solution_text,
    split_train_eval,
    write_problems,
)


def test_answers_are_the_value_of_the_chain():
    config = TaskConfig()
    for problem in generate_problems(500, seed=3, config=config, distinct=False):
        words = problem.prompt.split()
        arithmetic = " ".join(w for w in words[:-1] if not w.isalpha())  # the labels dropped
        assert eval(arithmetic) == problem.answer  # the prompt read as Python arithmetic
        assert all(0 <= v <= config.max_value for v in [problem.start, *problem.values])
        assert all(1 <= abs(op) <= config.max_operand for op in problem.operands)
        assert parse_prompt(problem.prompt) == problem


def test_solution_steps_are_correct_and_end_in_the_box():
    problem = Problem(7, (3, -5, 8))
    assert problem.prompt == "7 a + 3 b - 5 c + 8 ="
    assert solution_text(problem) == "a 7 + 3 = 10 , b 10 - 5 = 5 , c 5 + 8 = 13 \\boxed{ 13 }"
    for problem in generate_problems(200, seed=4, distinct=False):
        steps = solution_text(problem).split(" \\boxed{")[0].split(" , ")
        assert len(steps) == problem.num_ops
        for label, step in zip("abcdefghijklmnopqrstuvwxyz", steps, strict=False):
            assert step.startswith(f"{label} ")
            left, right = step[2:].split(" = ")
            assert eval(left) == int(right)


def test_a_sloppy_teacher_slips_by_one_and_carries_on_from_what_it_wrote():
    import random

    config, rng = TaskConfig(), random.Random(0)
    problems = generate_problems(2000, seed=7, config=config, distinct=False)
    steps_total = slipped = wrong_answers = 0
    for problem in problems:
        text = solution_text(problem, slip_probability=0.2, rng=rng, max_value=config.max_value)
        body, box = text.split(" \\boxed{ ")
        value = problem.start
        steps = body.split(" , ")
        assert len(steps) == problem.num_ops
        for label, operand, step in zip("abcdefghijklmnopqrstuvwxyz", problem.operands, steps, strict=False):
            words = step.split()
            assert words[0] == label and int(words[1]) == value  # starts from the value it wrote before
            written = int(words[-1])
            assert abs(written - (value + operand)) <= 1 and 0 <= written <= config.max_value
            slipped += written != value + operand
            steps_total += 1
            value = written
        assert box == f"{value} }}"  # the box holds the last written value
        wrong_answers += value != problem.answer
    assert 0.15 < slipped / steps_total < 0.21  # a few slips are impossible (they would leave the range)
    assert wrong_answers > 0.2 * len(problems)
    assert solution_text(problems[0]) == solution_text(problems[0], slip_probability=0.0)
    with pytest.raises(ValueError, match="slip_probability"):
        solution_text(problems[0], slip_probability=0.5)


def test_a_terse_teacher_sometimes_gives_only_the_right_boxed_answer():
    import random

    rng = random.Random(0)
    problems = generate_problems(2000, seed=8, distinct=False)
    texts = [solution_text(p, direct_answer_probability=0.6, rng=rng) for p in problems]
    direct = [t for t, p in zip(texts, problems, strict=True) if t == f"\\boxed{{ {p.answer} }}"]
    worked = [t for t, p in zip(texts, problems, strict=True) if t == solution_text(p)]
    assert len(direct) + len(worked) == len(problems)  # either the bare answer or the full working
    assert 0.56 < len(direct) / len(problems) < 0.64
    with pytest.raises(ValueError, match="direct_answer_probability"):
        solution_text(problems[0], direct_answer_probability=0.5)


def test_solution_length_has_a_long_tail():
    problems = generate_problems(5000, seed=5, distinct=False)
    lengths = sorted(len(solution_text(p).split()) for p in problems)
    share_short = sum(p.num_ops <= 4 for p in problems) / len(problems)
    assert share_short > 0.6  # most chains are short
    assert lengths[0] <= 10  # a few tokens
    assert lengths[len(lengths) // 2] <= 40
    assert lengths[-1] >= 150  # ... to a couple of hundred (plus a prompt of up to ~70)
    assert sum(n >= 100 for n in lengths) / len(lengths) > 0.03


def test_generation_is_deterministic_and_the_split_is_disjoint(tmp_path):
    assert generate_problems(50, seed=9) == generate_problems(50, seed=9)
    assert generate_problems(50, seed=9) != generate_problems(50, seed=10)
    train, held_out = split_train_eval(3000, 200, seed=0)
    assert len({p.prompt for p in held_out}) == 200
    assert not {p.prompt for p in train} & {p.prompt for p in held_out}
    write_problems(tmp_path / "eval.jsonl", held_out)
    rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert rows[0] == {"prompt": held_out[0].prompt, "answer": str(held_out[0].answer),
                       "num_ops": held_out[0].num_ops}
    assert list(read_problems(tmp_path / "eval.jsonl")) == held_out


def test_math_verify_accepts_the_solution_and_rejects_a_wrong_one():
    for problem in generate_problems(30, seed=6, distinct=False):
        text = solution_text(problem)
        gold = math_verify.parse(f"\\boxed{{{problem.answer}}}")
        assert math_verify.verify(gold, math_verify.parse(text))
        assert math_verify.verify(math_verify.parse(str(problem.answer)), math_verify.parse(text))
        wrong = text.rsplit("\\boxed{", 1)[0] + f"\\boxed{{ {problem.answer + 1} }}"
        assert not math_verify.verify(gold, math_verify.parse(wrong))


@pytest.mark.parametrize("bad", [{"max_value": 1}, {"max_operand": 0}, {"max_ops": 0}, {"tail_exponent": 0}])
def test_task_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        TaskConfig(**bad)
