"""Bad job input seen through a real controller's REST API: a missing model path or dataset fails the job
with the cause in GET /v1/jobs/{id}; dataset rows with missing fields are skipped, reported in the job
record (row and field) and counted in /metrics. The workers are unreachable on purpose: data is loaded
and checked before any worker is called."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from tokenizers import Tokenizer, models, pre_tokenizers

from everstep.processes import free_port, is_alive, spawn, stop_processes

SKIPPED_METRIC = re.compile(r"^everstep_controller_dataset_rows_skipped_total (\S+)$", re.MULTILINE)


def _model_dir(out: Path) -> Path:
    """What the controller reads of a model: its tokenizer.json."""
    out.mkdir(parents=True)
    words = ["<unk>", "+", "="] + [str(i) for i in range(10)]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _wait(api: httpx.Client, job_id: str, done: Callable[[dict], bool], timeout_seconds: float = 60) -> dict:
    deadline = time.monotonic() + timeout_seconds
    while not done(job := api.get(f"/v1/jobs/{job_id}").json()):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    return job


def test_missing_model_or_dataset_fails_the_job_and_bad_rows_are_reported(redis_url: str, tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model")
    good = [{"prompt": "1 + 2 =", "answer": "3"}, {"prompt": "2 + 2 =", "answer": 4}]
    bad = [{"prompt": "no answer"}, {"answer": "5"}, {"question": "3 + 3 =", "answer": "6"}, "{not json"]
    mixed = _jsonl(tmp_path / "mixed.jsonl", [good[0], *bad, good[1]])
    all_bad = _jsonl(tmp_path / "all-bad.jsonl", bad)

    port = free_port()
    process = spawn("controller", [
        "-m", "everstep_controller", "--port", str(port), "--redis-url", redis_url, "--reward", "127.0.0.1:1",
        "--launcher", "shared", "--rollout", "127.0.0.1:1", "--trainer", "127.0.0.1:1",
        "--data-dir", str(tmp_path / "data"),
    ], tmp_path / "controller.log", http_port=port, env={"EVERSTEP_API_TOKEN": ""})
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as api:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if api.get("/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert is_alive(process) and time.monotonic() < deadline, Path(process.log_path).read_text()[-3000:]
                time.sleep(0.1)

            def submit(model_path: Path, train_path: Path) -> str:
                created = api.post("/v1/jobs", json={"model_path": str(model_path), "steps": 2,
                                                     "dataset": {"train_path": str(train_path)}})
                assert created.status_code == 201, created.text
                return created.json()["id"]

            # one job at a time (shared workers): each is checked in the order submitted
            no_model = submit(tmp_path / "no-such-model", mixed)
            no_dataset = submit(model, tmp_path / "no-such-dataset.jsonl")
            no_rows = submit(model, all_bad)
            some_rows = submit(model, mixed)

            ended = {job_id: _wait(api, job_id, lambda job: job["state"] == "FAILED")
                     for job_id in (no_model, no_dataset, no_rows)}
            assert "model_path" in ended[no_model]["error"] and "no-such-model" in ended[no_model]["error"]
            assert "no-such-dataset.jsonl" in ended[no_dataset]["error"]
            assert "does not exist" in ended[no_dataset]["error"]
            assert "no usable rows (4 skipped, e.g. row 0" in ended[no_rows]["error"], ended[no_rows]["error"]

            # usable rows go on; the bad ones are listed with their row and the field at fault, and counted
            report = _wait(api, some_rows, lambda job: job["dataset"] is not None)["dataset"]
            assert (report["num_rows"], report["num_skipped"]) == (2, 4)
            reasons = {s["row"]: s["reason"] for s in report["skipped"]}
            assert set(reasons) == {1, 2, 3, 4}
            assert "'answer'" in reasons[1] and "'prompt'" in reasons[2] and "'prompt'" in reasons[3]
            assert "not JSON" in reasons[4]
            (skipped_total,) = SKIPPED_METRIC.findall(api.get("/metrics").text)
            assert float(skipped_total) == 4.0  # the all-bad file's rows failed their job and are not counted
            api.post(f"/v1/jobs/{some_rows}/cancel")
    finally:
        stop_processes([process])
