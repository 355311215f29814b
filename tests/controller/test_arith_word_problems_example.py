"""examples/data/arith_word_problems.py: verl-schema parquet rows, with the instruction a caller asks for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data" / "arith_word_problems.py"


def _write(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--train", "5", "--test", "3", *args],
                          capture_output=True, text=True, timeout=120)


def test_instruction_follows_every_question_and_the_rows_stay_deterministic(tmp_path: Path) -> None:
    cot = "Think step by step, then put the final answer in \\boxed{}."
    assert _write(tmp_path / "cot", "--instruction", cot).returncode == 0
    assert _write(tmp_path / "plain").returncode == 0
    cot_rows = pq.read_table(tmp_path / "cot" / "train.parquet").to_pylist()
    plain_rows = pq.read_table(tmp_path / "plain" / "train.parquet").to_pylist()
    assert len(cot_rows) == 5 and len(pq.read_table(tmp_path / "cot" / "test.parquet")) == 3
    for cot_row, plain_row in zip(cot_rows, plain_rows, strict=True):
        question = cot_row["extra_info"]["question"]
        assert cot_row["prompt"] == [{"role": "user", "content": f"{question} {cot}"}]
        assert plain_row["prompt"][0]["content"] == f"{question} Put the final answer in \\boxed{{}}."
        assert cot_row["reward_model"] == plain_row["reward_model"], "the same problems, only the instruction differs"


def test_an_instruction_without_boxed_is_refused(tmp_path: Path) -> None:
    result = _write(tmp_path / "out", "--instruction", "Think step by step.")
    assert result.returncode != 0 and "--instruction" in result.stderr and "boxed" in result.stderr
    assert not (tmp_path / "out").exists(), "nothing written"
