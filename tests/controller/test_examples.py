"""The shipped example specs are valid job specs."""

from pathlib import Path

import pytest

from everstep.rest.job_spec import JobSpec
from everstep_cli.job_file import load_job_file

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_spec_is_valid(path: Path) -> None:
    spec = JobSpec.model_validate(load_job_file(path))
    assert Path(spec.model_path).is_absolute()


def test_demo_and_math_examples_exist() -> None:
    assert {"demo.yaml", "math.yaml"} <= {p.name for p in EXAMPLES}


def test_the_real_model_example_reads_its_verl_parquet_files() -> None:
    """examples/smollm2-arith.yaml's fields name columns its shipped files have (the model itself comes from
    `make real-model`; tests/real_model runs the job)."""
    from everstep_controller.data.dataset_columns import check_dataset_fields

    spec = JobSpec.model_validate(load_job_file(Path(EXAMPLES[0]).parent / "smollm2-arith.yaml"))
    assert Path(spec.dataset.train_path).is_file() and Path(spec.dataset.eval_path or "").is_file()
    check_dataset_fields(spec.dataset)
    assert spec.dataset.answer_field == "reward_model.ground_truth" and spec.prompt.format.value == "chat"
