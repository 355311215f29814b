"""The shipped example specs are valid job specs."""

from pathlib import Path

import pytest

from everstep_controller.job_file import load_job_file
from everstep_controller.spec import JobSpec

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_spec_is_valid(path: Path) -> None:
    spec = JobSpec.model_validate(load_job_file(path))
    assert Path(spec.model_path).is_absolute()


def test_demo_and_math_examples_exist() -> None:
    assert {"demo.yaml", "math.yaml"} <= {p.name for p in EXAMPLES}
