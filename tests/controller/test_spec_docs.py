from pathlib import Path

from everstep_controller.spec.docs import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "job-spec.md"


def test_job_spec_doc_is_generated_from_the_schema() -> None:
    assert DOC.read_text() == render(), "run: python -m everstep_controller.spec.docs > docs/job-spec.md"
    for field in ("scheduler.token_budget", "algorithm.loss.alpha", "evaluation.samples_per_prompt"):
        assert f"`{field}`" in DOC.read_text()
