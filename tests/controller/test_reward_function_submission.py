"""`reward.functions` at submission, through the REST app against a real Redis: a file that does not exist, does
not parse or lacks the function is a 422 naming the field; an accepted job carries the file's source (so reward
pods need no shared file); `everstep submit` reads the files beside the job file and sends their source; the
controller sends each function with every reward item."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import yaml
from fastapi.testclient import TestClient

from everstep.rest.job_spec import JobSpec, RewardFunctionSpec, VerifierWeight
from everstep.reward_functions import FunctionConvention, FunctionSourceError, check_function_source
from everstep.v1 import common_pb2
from everstep_cli.job_file import load_job_file
from everstep_controller.api.app import create_app
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.reward_items import RewardItemBuilder
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.manager import JobManager
from everstep_controller.store.job_store import JobStore

VERL = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
TRL = "async def reward(prompts, completions, **kwargs):\n    return [1.0 for _ in completions]\n"
SPEC = {"model_path": "/models/m", "dataset": {"train_path": "/data/train.jsonl"}, "steps": 3}


@pytest.fixture
def client(redis_url: str, tmp_path: Path) -> TestClient:
    store = JobStore(redis.Redis.from_url(redis_url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    return TestClient(create_app(manager, store))


def _post(client: TestClient, functions: list[dict], **reward: object):
    return client.post("/v1/jobs", json={**SPEC, "reward": {"functions": functions, **reward}})


def test_the_controller_reads_the_file_and_ships_its_source(client: TestClient, tmp_path: Path) -> None:
    (tmp_path / "verl_reward.py").write_text(VERL)
    (tmp_path / "trl_reward.py").write_text(TRL)
    created = _post(client, [{"path": str(tmp_path / "verl_reward.py")},
                             {"path": str(tmp_path / "trl_reward.py"), "name": "reward", "weight": 0.5}])
    assert created.status_code == 201, created.text
    reward = created.json()["spec"]["reward"]
    assert [f["source"] for f in reward["functions"]] == [VERL, TRL]
    assert reward["functions"][0]["name"] == "compute_score" and reward["functions"][1]["weight"] == 0.5
    assert reward["verifiers"] == [], "functions alone: no default math verifier beside them"
    (tmp_path / "verl_reward.py").unlink()
    job_id = created.json()["id"]
    assert client.get(f"/v1/jobs/{job_id}").json()["spec"]["reward"]["functions"][0]["source"] == VERL


def test_a_source_sent_with_the_spec_needs_no_file_here(client: TestClient) -> None:
    created = _post(client, [{"path": "/on/the/users/machine/r.py", "source": VERL}],
                    verifiers=[{"name": "math", "weight": 0.5}])
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["reward"]["verifiers"][0]["name"] == "math", "beside the verifiers"


@pytest.mark.parametrize(("file", "function", "field", "message"), [
    (None, "compute_score", "path", "does not exist"),
    ("def compute_score(:\n", "compute_score", "path", "does not parse"),
    (VERL, "score_it", "name", "defines no top-level function 'score_it' (its functions: compute_score)"),
    ("def compute_score(a, b):\n    return 1\n", "compute_score", "name", "follows neither convention"),
])
def test_a_bad_function_file_is_a_422_naming_the_field(client: TestClient, tmp_path: Path, file: str | None,
                                                       function: str, field: str, message: str) -> None:
    path = tmp_path / "reward.py"
    if file is not None:
        path.write_text(file)
    response = _post(client, [{"path": str(tmp_path / "other.py"), "source": VERL},
                              {"path": str(path), "name": function}])
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "reward", "functions", 1, field] and message in error["msg"], error
    assert client.get("/v1/jobs").json() == [], "a rejected spec creates no job"


def test_a_sent_source_that_does_not_parse_names_the_source(client: TestClient) -> None:
    response = _post(client, [{"path": "r.py", "source": "def compute_score(\n"}])
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "reward", "functions", 0, "source"]


def test_two_functions_results_cannot_tell_apart_are_refused(client: TestClient) -> None:
    response = _post(client, [{"path": "a/r.py", "source": VERL}, {"path": "b/r.py", "source": VERL}])
    assert response.status_code == 422 and "function:r.compute_score" in response.text


def test_conventions_are_told_by_the_signature() -> None:
    assert check_function_source(VERL, "compute_score", "r.py") == FunctionConvention.VERL
    assert check_function_source(TRL, "reward", "r.py") == FunctionConvention.TRL
    with pytest.raises(FunctionSourceError, match="neither convention"):
        check_function_source("def f(x):\n    return 1\n", "f", "r.py")


def test_everstep_submit_sends_the_files_source_relative_to_the_job_file(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "job"
    (folder / "rewards").mkdir(parents=True)
    (folder / "rewards" / "mine.py").write_text(VERL)
    spec = {**SPEC, "reward": {"functions": [{"path": "rewards/mine.py"}, {"path": "not-here.py"}]}}
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(tmp_path)  # not the job file's folder
    functions = load_job_file(folder / "job.yaml")["reward"]["functions"]
    assert functions[0] == {"path": str(folder / "rewards" / "mine.py"), "source": VERL}
    assert functions[1] == {"path": str(folder / "not-here.py")}, "left to the controller (which answers 422)"


def test_submit_through_the_cli_client_ships_the_source(client: TestClient, tmp_path: Path) -> None:
    """What `everstep submit` posts: the controller never sees the file, only its source."""
    (tmp_path / "mine.py").write_text(TRL)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(
        {**SPEC, "reward": {"functions": [{"path": "mine.py", "name": "reward"}]}}))
    body = load_job_file(tmp_path / "job.yaml")
    (tmp_path / "mine.py").unlink()
    created = client.post("/v1/jobs", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["reward"]["functions"][0]["source"] == TRL


def test_every_item_carries_each_function_with_the_rows_answer() -> None:
    functions = [RewardFunctionSpec(path="/u/verl_reward.py", source=VERL, weight=0.25),
                 RewardFunctionSpec(path="/u/trl_reward.py", name="reward", source=TRL, allow_network=True)]
    build = RewardItemBuilder([VerifierWeight(name="math")], functions)
    row = PromptRow(index=0, prompt="1 + 2 =", answer="3", prompt_ids=(1,), verifiers=("math",))
    item = build("s0", row, common_pb2.Sequence(output_text="\\boxed{3}", output_ids=[5]))
    math, verl, trl = item.verifiers
    assert math.name == "math" and verl.name == trl.name == "function"
    assert (verl.weight, verl.answer, verl.function.source, verl.function.path) == (0.25, "3", VERL,
                                                                                     "/u/verl_reward.py")
    assert (trl.function.name, trl.function.allow_network) == ("reward", True)
    with pytest.raises(ValueError, match="without their source"):
        RewardItemBuilder([], [RewardFunctionSpec(path="r.py")])


def test_functions_alone_or_neither() -> None:
    assert JobSpec.model_validate({**SPEC, "reward": {"functions": [{"path": "r.py"}]}}).reward.verifiers == []
    assert JobSpec.model_validate(SPEC).reward.verifiers[0].name == "math"
    with pytest.raises(ValueError, match="needs a verifier or a function"):
        JobSpec.model_validate({**SPEC, "reward": {"verifiers": []}})


def test_sources_too_large_to_send_with_every_item_are_refused(client: TestClient) -> None:
    big = VERL + "#" * 200_000 + "\n"
    response = _post(client, [{"path": "a.py", "source": big}, {"path": "b.py", "source": big}])
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "reward", "functions"]
