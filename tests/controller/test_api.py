"""The REST API against a real Redis; the job manager's loop is not started, so jobs stay PENDING."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from everstep.rest.job_spec import JobSpec
from everstep_cli.job_file import load_job_file
from everstep_controller.api.app import create_app
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.job_data import load_job_data
from everstep_controller.run.manager import JobManager
from everstep_controller.spec.submission_checks import JobInputError
from everstep_controller.store.job_store import JobStore

SPEC = {"model_path": "/models/m", "dataset": {"train_path": "/data/train.jsonl"}, "steps": 3}


@pytest.fixture
def client(redis_url: str, tmp_path: Path) -> TestClient:
    store = JobStore(redis.Redis.from_url(redis_url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    return TestClient(create_app(manager, store))


def test_create_get_list_and_defaults(client: TestClient) -> None:
    created = client.post("/v1/jobs", json=SPEC)
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["state"] == "PENDING" and job["step"] == 0
    assert job["spec"]["algorithm"]["loss"]["correction"] == "icepop"
    assert job["spec"]["algorithm"]["loss"]["alpha"] == 0.5 and job["spec"]["algorithm"]["loss"]["beta"] == 5.0
    assert client.get(f"/v1/jobs/{job['id']}").json()["id"] == job["id"]
    assert [j["id"] for j in client.get("/v1/jobs").json()] == [job["id"]]
    assert client.get(f"/v1/jobs/{job['id']}/metrics").json() == []
    assert client.get("/v1/jobs/nope").status_code == 404


@pytest.mark.parametrize(
    ("patch", "field_path"),
    [
        ({"steps": 0}, ["body", "steps"]),
        ({"algorithm": {"group_size": 1}}, ["body", "algorithm", "group_size"]),
        ({"algorithm": {"loss": {"correction": "magic"}}}, ["body", "algorithm", "loss", "correction"]),
        ({"scheduler": {"token_budget": -5}}, ["body", "scheduler", "token_budget"]),
        ({"unknown_field": 1}, ["body", "unknown_field"]),
    ],
)
def test_bad_spec_gives_422_naming_the_field(client: TestClient, patch: dict, field_path: list[str]) -> None:
    response = client.post("/v1/jobs", json={**SPEC, **patch})
    assert response.status_code == 422
    assert field_path in [e["loc"] for e in response.json()["detail"]]
    assert client.get("/v1/jobs").json() == [], "a rejected spec creates no job"


@pytest.mark.parametrize(
    ("verifiers", "field_path", "message"),
    [
        ([{"name": "mathh"}], ["body", "reward", "verifiers", 0, "name"], "unknown verifier 'mathh' (known: code, "),
        ([{"name": "math", "params": {"nonsense": 1}}], ["body", "reward", "verifiers", 0, "params", "nonsense"],
         "params.nonsense: unknown option of the math verifier (known: extract)"),
        ([{"name": "math"}, {"name": "length", "params": {"max_length": 64, "max_tokens": 8}}],
         ["body", "reward", "verifiers", 1, "params", "max_tokens"],
         "(known: cache_length, fallback_unit, max_length)"),
    ],
)
def test_an_unknown_verifier_or_option_is_a_422_naming_it(client: TestClient, verifiers: list[dict],
                                                          field_path: list, message: str) -> None:
    """Refused at submission, not at the first score after the workers have loaded the model."""
    response = client.post("/v1/jobs", json={**SPEC, "reward": {"verifiers": verifiers}})
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == field_path and message in error["msg"]
    assert client.get("/v1/jobs").json() == [], "a rejected spec creates no job"
    known = [{"name": "math"}, {"name": "length", "params": {"max_length": 64, "cache_length": 8}},
             {"name": "code", "params": {"reward_mode": "all_pass"}, "language": "python"}]
    assert client.post("/v1/jobs", json={**SPEC, "reward": {"verifiers": known}}).status_code == 201


FINE_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}


@pytest.mark.parametrize(("parameters", "message"), [
    ({"type": "object", "properties": {"q": {"type": "strng"}}},
     "tool 'search': parameters.properties.q.type: 'strng' is not valid under any of the given schemas"),
    ({"type": "object", "properties": {"q": {"type": "string"}}, "required": "q"},
     "tool 'search': parameters.required: 'q' is not of type 'array'"),
    ({"type": "string"}, "tool 'search': parameters.type: the arguments are a JSON object: the top-level type must be "
                         "'object', not 'string'"),
    ({"type": "object", "properties": {"q": {"type": "string", "format": "int32"}}},
     "tool 'search': parameters.properties.q.format: format 'int32' is not one the validator checks"),
], ids=["misspelt-type", "required-as-string", "top-level-string", "unchecked-format"])
def test_a_tool_with_a_broken_schema_is_a_422_naming_the_tool_and_the_path(client: TestClient, parameters: dict,
                                                                           message: str) -> None:
    """Issue 40's three schemas (accepted before, then checked letter by letter or not at all), and a format the
    validator would skip: refused at submission, through the REST app."""
    tools = {"environment": "http", "url": "http://127.0.0.1:9",
             "functions": [FINE_TOOL, {"type": "function", "function": {"name": "search", "parameters": parameters}}]}
    response = client.post("/v1/jobs", json={**SPEC, "tools": tools})
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "tools", "functions", 1, "function"] and message in error["msg"], error
    assert client.get("/v1/jobs").json() == [], "a rejected spec creates no job"
    tools["functions"][1]["function"]["parameters"] = {"type": "object", "properties": {"q": {"type": "string"}},
                                                       "required": ["q"]}
    assert client.post("/v1/jobs", json={**SPEC, "tools": tools}).status_code == 201


def test_a_stored_job_with_an_unknown_verifier_fails_at_load_before_any_worker() -> None:
    """A job stored before the submission check (an older controller) fails the same way when it loads its data."""
    spec = JobSpec(**{**SPEC, "reward": {"verifiers": [{"name": "mathh"}]}})
    with pytest.raises(JobInputError, match="unknown verifier 'mathh'"):
        load_job_data(spec)  # before the model path, which does not exist, is read


def test_cross_field_checks(client: TestClient) -> None:
    response = client.post("/v1/jobs", json={**SPEC, "algorithm": {"loss": {"alpha": 3, "beta": 2}}})
    assert response.status_code == 422 and "alpha" in response.text
    response = client.post("/v1/jobs", json={**SPEC, "algorithm": {"group_size": 64},
                                             "scheduler": {"pool_capacity": 16}})
    assert response.status_code == 422 and "pool_capacity" in response.text
    response = client.post("/v1/jobs", json={**SPEC, "trainer": {"warmup_steps": 3}})
    assert response.status_code == 422 and "trainer.warmup_steps" in response.text
    response = client.post("/v1/jobs", json={**SPEC, "dataset": {"train_path": "/d.parquet", "format": "csv"}})
    assert ["body", "dataset", "format"] in [e["loc"] for e in response.json()["detail"]]
    response = client.post("/v1/jobs", json={**SPEC, "resources": {"trainer": {"memory": "lots"}}})
    assert response.status_code == 422 and ["body", "resources", "trainer", "memory"] in [
        e["loc"] for e in response.json()["detail"]]


def test_cancel_pending_and_actions_on_ended_jobs(client: TestClient) -> None:
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    assert client.post(f"/v1/jobs/{job_id}/resume").status_code == 409, "resume needs a paused job"
    assert client.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "CANCELLED"
    assert client.post(f"/v1/jobs/{job_id}/pause").status_code == 409


def test_a_job_s_rollout_pool_is_resized_by_patch_and_nothing_else_is(client: TestClient, redis_url: str) -> None:
    job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
    resized = client.patch(f"/v1/jobs/{job_id}", json={"resources": {"rollout": {"replicas": 3}}})
    assert resized.status_code == 200, resized.text
    assert resized.json()["spec"]["resources"]["rollout"]["replicas"] == 3
    assert client.get(f"/v1/jobs/{job_id}").json()["spec"]["resources"]["rollout"]["replicas"] == 3
    assert JobStore(redis.Redis.from_url(redis_url)).requested_replicas(job_id) == 3, "for the runner"
    for body, loc in (({"resources": {"rollout": {"replicas": 0}}}, ["body", "resources", "rollout", "replicas"]),
                      ({"steps": 5, "resources": {"rollout": {"replicas": 2}}}, ["body", "steps"]),
                      ({"resources": {"rollout": {"replicas": 2, "cpu": "4"}}},
                       ["body", "resources", "rollout", "cpu"]),
                      ({"resources": {"trainer": {"replicas": 2}, "rollout": {"replicas": 2}}},
                       ["body", "resources", "trainer"])):
        refused = client.patch(f"/v1/jobs/{job_id}", json=body)
        assert refused.status_code == 422 and loc in [e["loc"] for e in refused.json()["detail"]], refused.text
    assert client.get(f"/v1/jobs/{job_id}").json()["spec"]["resources"]["rollout"]["replicas"] == 3
    assert client.patch("/v1/jobs/nope", json={"resources": {"rollout": {"replicas": 2}}}).status_code == 404
    client.post(f"/v1/jobs/{job_id}/cancel")
    ended = client.patch(f"/v1/jobs/{job_id}", json={"resources": {"rollout": {"replicas": 2}}})
    assert ended.status_code == 409 and "CANCELLED" in ended.json()["detail"]


def test_bearer_token(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVERSTEP_API_TOKEN", "s3cret")
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/jobs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/healthz").status_code == 200, "health stays open for probes"


def test_openapi_and_prometheus(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/pause", "/v1/jobs/{job_id}/resume",
                 "/v1/jobs/{job_id}/cancel", "/v1/jobs/{job_id}/metrics", "/healthz", "/metrics"):
        assert path in paths
    assert "everstep_controller_jobs_started_total" in client.get("/metrics").text


def test_job_file_resolves_paths_relative_to_the_yaml(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    job = tmp_path / "sub" / "job.yaml"
    job.write_text("model_path: ../model\ndataset:\n  train_path: data/train.jsonl\n  eval_path: /abs/eval.jsonl\n"
                   "tracking:\n  tensorboard:\n    log_dir: runs/tb\n  wandb:\n    project: p\n")
    spec = load_job_file(job)
    assert spec["model_path"] == str(tmp_path / "model")
    assert spec["tracking"] == {"tensorboard": {"log_dir": str(tmp_path / "sub" / "runs" / "tb")},
                                "wandb": {"project": "p"}}
    assert spec["dataset"]["train_path"] == str(tmp_path / "sub" / "data" / "train.jsonl")
    assert spec["dataset"]["eval_path"] == "/abs/eval.jsonl"


def test_jobs_wait_on_the_queue_and_its_depth_is_exported(redis_url: str, tmp_path: Path) -> None:
    store = JobStore(redis.Redis.from_url(redis_url))
    manager = JobManager(store, SharedLauncher(rollout="127.0.0.1:1", trainer="127.0.0.1:1"), "127.0.0.1:1", tmp_path)
    app = TestClient(create_app(manager, store))
    ids = [app.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(2)]
    assert [e.text("job_id") for e in manager.queue.read("reader", 10)] == ids, "submitted in order, queued once"
    app.post("/v1/jobs", json=SPEC)
    manager._update_gauges()
    text = app.get("/metrics").text
    assert 'everstep_controller_queue_depth_entries{queue="jobs",status="undelivered"} 1.0' in text
    assert 'everstep_controller_queue_depth_entries{queue="jobs",status="pending"} 2.0' in text
    assert 'everstep_controller_jobs{state="PENDING"} 3.0' in text


def test_controller_arguments_pick_the_launcher() -> None:
    from everstep_controller.__main__ import parse_args

    base = ["--redis-url", "redis://x", "--reward", "r:1"]
    assert parse_args([*base, "--rollout", "a:1", "--trainer", "b:1"]).launcher == "shared"
    assert parse_args(base).launcher == "local"
    with pytest.raises(SystemExit):
        parse_args([*base, "--launcher", "shared"])


def test_max_new_tokens_beyond_the_models_positions_is_a_422_naming_it(client: TestClient, tmp_path: Path) -> None:
    """The model's config.json is read at submission: no room for a prompt within its position limit is a 422,
    and nothing is stored."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 512}')
    spec = {**SPEC, "model_path": str(model)}
    refused = client.post("/v1/jobs", json={**spec, "sampling": {"max_new_tokens": 512}})
    assert refused.status_code == 422
    (error,) = refused.json()["detail"]
    assert error["loc"] == ["body", "sampling", "max_new_tokens"] and "max_position_embeddings (512)" in error["msg"]
    assert client.get("/v1/jobs").json() == []
    assert client.post("/v1/jobs", json={**spec, "sampling": {"max_new_tokens": 511}}).status_code == 201


def test_routing_replay_needs_a_model_with_routed_experts(client: TestClient, tiny_model_dirs, tmp_path: Path) -> None:
    """algorithm.routing_replay 'rollout' is refused at submission (and at load) for a dense model, and for one with
    more experts than uint8 ids name; taken for a mixture-of-experts model; 'off' asks nothing of the model."""
    replay = {"routing_replay": "rollout"}
    dense = client.post("/v1/jobs", json={**SPEC, "model_path": str(tiny_model_dirs("qwen3")), "algorithm": replay})
    assert dense.status_code == 422, dense.text
    (error,) = dense.json()["detail"]
    assert error["loc"] == ["body", "algorithm", "routing_replay"]
    assert "needs a mixture-of-experts model; 'qwen3' has no routed experts" in error["msg"]
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        load_job_data(JobSpec(**{**SPEC, "model_path": str(tiny_model_dirs("qwen3")), "algorithm": replay}))

    wide = tmp_path / "wide-moe"
    wide.mkdir()
    (wide / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 300, "num_experts_per_tok": 8, '
                                      '"num_hidden_layers": 2}')
    response = client.post("/v1/jobs", json={**SPEC, "model_path": str(wide), "algorithm": replay})
    assert response.status_code == 422 and "at most 256 experts" in response.text
    assert client.get("/v1/jobs").json() == [], "a rejected spec creates no job"

    moe = client.post("/v1/jobs", json={**SPEC, "model_path": str(tiny_model_dirs("qwen3_moe")), "algorithm": replay})
    assert moe.status_code == 201, moe.text
    assert moe.json()["spec"]["algorithm"]["routing_replay"] == "rollout"
    off = client.post("/v1/jobs", json={**SPEC, "model_path": str(tiny_model_dirs("qwen3"))})
    assert off.status_code == 201 and off.json()["spec"]["algorithm"]["routing_replay"] == "off"


def test_lora_target_modules_are_checked_against_the_models_weights(client: TestClient, tiny_model_dirs) -> None:
    """trainer.lora.target_modules: a 422 names a module the model does not have, and one that names only MoE
    expert projections; names that exist (by suffix, as peft matches) and 'all-linear' are taken. The module names
    come from the safetensors headers: the controller never imports torch."""
    llama = str(tiny_model_dirs("llama"))
    missing = client.post("/v1/jobs", json={**SPEC, "model_path": llama,
                                            "trainer": {"lora": {"rank": 4, "target_modules": ["q_proj", "qkv"]}}})
    assert missing.status_code == 422, missing.text
    (error,) = missing.json()["detail"]
    assert error["loc"] == ["body", "trainer", "lora", "target_modules"]
    assert "has no module 'qkv'" in error["msg"] and "q_proj" in error["msg"]
    experts = client.post("/v1/jobs", json={**SPEC, "model_path": str(tiny_model_dirs("qwen3_moe")),
                                            "trainer": {"lora": {"target_modules": ["gate_proj"]}}})
    assert experts.status_code == 422 and "expert projections" in experts.text, experts.text
    assert client.get("/v1/jobs").json() == []
    for targets in (["self_attn.q_proj", "down_proj"], ["all-linear"]):
        taken = client.post("/v1/jobs", json={**SPEC, "model_path": llama,
                                              "trainer": {"lora": {"rank": 4, "alpha": 8, "target_modules": targets}}})
        assert taken.status_code == 201, taken.text
        assert taken.json()["spec"]["trainer"]["lora"]["target_modules"] == targets


@pytest.mark.parametrize(
    ("patch", "named"),
    [
        ({"algorithm": {"advantage": "dr_grpo", "normalize_std": True}}, ["normalize_std", "dr_grpo"]),
        ({"algorithm": {"loss": {"mode": "cispo", "clip_ratio_c": 3.0}}}, ["clip_ratio_c", "cispo"]),
        ({"algorithm": {"loss": {"clip_cov_ratio": 0.01}}}, ["loss.clip_cov_ratio", "clip_cov"]),
        ({"algorithm": {"loss": {"mode": "gspo", "ppo_kl_coef": 0.5}}}, ["loss.ppo_kl_coef", "kl_cov"]),
        ({"trainer": {"kl_estimator": "k2"}}, ["kl_estimator", "kl_coef"]),
        ({"trainer": {"kl_target": 0.1}}, ["kl_target", "kl_coef"]),
        ({"trainer": {"kl_coef": 0.1, "kl_horizon": 100}}, ["kl_horizon", "kl_target"]),
        ({"trainer": {"kl_in_reward": True}}, ["kl_in_reward", "kl_coef"]),
        ({"trainer": {"lr_schedule": "constant", "min_lr_ratio": 0.1}}, ["min_lr_ratio", "constant"]),
        ({"algorithm": {"advantage": "gae"}}, ["advantage", "rloo"]),
    ],
)
def test_a_mode_that_cannot_combine_with_a_setting_is_a_422_naming_both(client: TestClient, patch: dict,
                                                                         named: list[str]) -> None:
    response = client.post("/v1/jobs", json={**SPEC, **patch})
    assert response.status_code == 422, response.text
    assert all(name in response.text for name in named), response.text
    assert client.get("/v1/jobs").json() == [], "a rejected spec creates no job"


def test_each_estimator_and_loss_mode_is_accepted_as_written(client: TestClient) -> None:
    spec = {**SPEC, "algorithm": {"advantage": "reinforce_plus_plus_baseline",
                                  "loss": {"mode": "kl_cov", "kl_cov_ratio": 0.01, "correction_level": "geometric",
                                           "aggregation": "seq-mean-token-sum-norm"}},
            "trainer": {"lr_schedule": "linear", "min_lr_ratio": 0.1, "kl_coef": 0.01, "kl_estimator": "low_var_kl"}}
    created = client.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    stored = created.json()["spec"]
    assert stored["algorithm"]["advantage"] == "reinforce_plus_plus_baseline"
    assert stored["algorithm"]["loss"]["kl_cov_ratio"] == 0.01 and stored["trainer"]["min_lr_ratio"] == 0.1
