"""The REST API fuzzed from its own OpenAPI document (schemathesis, in process, against a real Redis):
schema-valid and schema-violating requests to every operation, none answered with a 5xx."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from everstep.rest.job_spec import JobSpec
from everstep_controller.api.app import create_app
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.manager import JobManager
from everstep_controller.store.job_store import JobStore

EXAMPLES_PER_OPERATION = {("POST", "/v1/jobs"): 40}  # the job spec: the one deep schema
DEFAULT_EXAMPLES = 8


def test_fuzzed_requests_never_get_a_server_error(redis_url: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EVERSTEP_API_TOKEN", raising=False)  # every /v1 route reachable by the fuzzer
    store = JobStore(redis.Redis.from_url(redis_url))
    # the job manager's loop is not started: submitted jobs stay PENDING, the API is what is fuzzed
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(manager, store))
    statuses: Counter[tuple[str, int]] = Counter()
    server_errors: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9, [op.label for op in operations]

    # random ids name no job: one more pass gives the job routes the id of a job that exists
    existing = manager.submit(JobSpec(model_path="/models/m", dataset={"train_path": "/data/train.jsonl"})).id
    passes = [(operation, mode, None) for operation in operations for mode in GenerationMode]
    passes += [(operation, GenerationMode.POSITIVE, {"job_id": existing})
               for operation in operations if "{job_id}" in operation.path]

    for operation, mode, path_parameters in passes:
        examples = EXAMPLES_PER_OPERATION.get((operation.method.upper(), operation.path), DEFAULT_EXAMPLES)

        @given(case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters))
        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def call(case: schemathesis.Case) -> None:
            response = case.call()
            statuses[(case.operation.label, response.status_code)] += 1
            if response.status_code >= 500:
                server_errors.append(f"{case.as_curl_command()} -> {response.status_code}: {response.text[:300]}")

        try:
            call()
        except Unsatisfiable:  # nothing to violate (an operation without parameters or body)
            assert mode == GenerationMode.NEGATIVE

    assert not server_errors, "\n".join(server_errors[:5])
    num_cases = sum(statuses.values())
    assert num_cases >= 150, statuses
    codes = {code for _, code in statuses}
    assert {200, 201, 404, 409, 422} <= codes, statuses  # accepted, unknown ids, refused actions, rejected specs
