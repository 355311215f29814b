"""examples/smollm2-lora.yaml and smollm2-full.yaml pass the controller's submission checks, and their data
(examples/data/small_arith.py) is deterministic, as shipped, with held-out questions never seen in training.
The jobs themselves take minutes on the real model: docs/benchmarks.md, "SmolLM2 learns: settings tried"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from everstep.rest.job_spec import JobSpec
from everstep_cli.job_file import load_job_file
from everstep_controller.data.file_checks import check_job_input
from everstep_reward.verifiers.math import MathParams

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPT = EXAMPLES / "data" / "small_arith.py"
SPECS = ("smollm2-lora.yaml", "smollm2-full.yaml")


@pytest.mark.parametrize("name", SPECS)
def test_the_smollm2_specs_pass_the_submission_checks(name: str) -> None:
    """The checks a POST /v1/jobs runs (verifiers and their params, dataset fields; with `make real-model` done,
    also the chat template, lengths and LoRA targets against the model's files)."""
    spec = JobSpec.model_validate(load_job_file(EXAMPLES / name))
    check_job_input(spec)
    assert Path(spec.dataset.train_path).is_file() and Path(spec.dataset.eval_path or "").is_file()
    (math,) = [v for v in spec.reward.verifiers if v.name == "math"]
    assert MathParams.model_validate(math.params).extract == "last_number", "the values are the reward service's"
    assert (spec.trainer.lora is not None) == (name == "smollm2-lora.yaml")


def test_the_two_specs_differ_only_in_the_trainer_and_the_name() -> None:
    lora, full = (JobSpec.model_validate(load_job_file(EXAMPLES / n)).model_dump() for n in SPECS)
    for spec in (lora, full):
        spec.pop("name"), spec.pop("trainer")
    assert lora == full


def _write(out: Path, *args: str) -> None:
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], check=True, capture_output=True,
                   timeout=120)


def test_the_data_script_is_deterministic_and_wrote_the_shipped_files(tmp_path: Path) -> None:
    _write(tmp_path / "a")
    _write(tmp_path / "b")
    for split in ("train", "test"):
        a = pq.read_table(tmp_path / "a" / f"{split}.parquet").to_pylist()
        assert a == pq.read_table(tmp_path / "b" / f"{split}.parquet").to_pylist()
        assert a == pq.read_table(EXAMPLES / "data" / "small-arith" / f"{split}.parquet").to_pylist()
    _write(tmp_path / "c", "--seed", "1")
    assert (pq.read_table(tmp_path / "c" / "train.parquet").to_pylist()
            != pq.read_table(tmp_path / "a" / "train.parquet").to_pylist()), "another seed, other rows"


def test_held_out_questions_are_not_in_training_and_answers_are_right(tmp_path: Path) -> None:
    _write(tmp_path)
    train, test = (pq.read_table(tmp_path / f"{s}.parquet").to_pylist() for s in ("train", "test"))
    assert len(train) == 512 and len(test) == 32 == len({r["extra_info"]["question"] for r in test})
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    for r in train + test:
        words = r["extra_info"]["question"].removeprefix("What is ").removesuffix("?").split()
        a, op, b = int(words[0]), words[1], int(words[2])
        assert r["reward_model"]["ground_truth"] == str(a + b if op == "plus" else a * b)
        content = f"{r['extra_info']['question']} Answer with the number only."
        assert r["prompt"] == [{"role": "user", "content": content}]


def test_more_held_out_rows_than_questions_is_refused(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--test", "33"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "--test 33" in result.stderr


def test_the_demo_plot_is_titled_after_the_spec_it_ran() -> None:
    from everstep_cli.demo import demo_title

    titles = [demo_title(JobSpec.model_validate(load_job_file(EXAMPLES / n)).model_dump(mode="json"))
              for n in (*SPECS, "demo.yaml")]
    assert titles == ["everstep demo smollm2-lora: GRPO + icepop (LoRA), sync rollouts",
                      "everstep demo smollm2-full: GRPO + icepop (full), sync rollouts",
                      "everstep demo demo: GRPO + icepop (full), C3PO++ rollouts"]


def test_the_demo_summary_gives_each_engine_its_share_of_the_tokens() -> None:
    from everstep_cli.demo import _engine_shares

    engine = {"state": "serving", "weight_version": 30, "sequences_finished": 10}
    record = {"engines": [{**engine, "address": "a:1", "tokens_generated": 300},
                          {**engine, "address": "b:2", "tokens_generated": 100}]}
    assert _engine_shares(record) == [{"address": "a:1", "tokens_generated": 300, "share": 0.75},
                                      {"address": "b:2", "tokens_generated": 100, "share": 0.25}]
    assert _engine_shares({"engines": []}) == []
