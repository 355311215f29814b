"""Redis killed (SIGKILL) under running and queued jobs, and restarted from its append-only file.

Redis fsyncs every write before acknowledging it (`appendfsync always`, as `everstep up` runs
it). While it is down the controller's commands wait and retry; a job submitted meanwhile is
answered once it is stored. After the restart every job completes, the running one in the same
runner (no resume), and everything the API had acknowledged before the crash is still there,
unchanged: the jobs (the queued ones still queued), their step counts and their per-step metrics.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fault_helpers import Controllers, RedisServer, arithmetic_rows, tiny_job, wait_job, write_rows

pytestmark = pytest.mark.faults

STEPS = 20


def test_jobs_continue_after_a_redis_crash_and_nothing_acknowledged_is_lost(
        controllers: Controllers, redis_server: RedisServer, tiny_model_dir: Path, tmp_path: Path) -> None:
    controllers.start("--max-jobs", "1")  # the second job waits in the queue while the first runs
    api = controllers.api
    train = write_rows(tmp_path / "train.jsonl", arithmetic_rows(8))
    running = api.post("/v1/jobs", json=tiny_job("running", tiny_model_dir, train, steps=STEPS)).json()["id"]
    wait_job(api, running, lambda j: j["step"] >= 2)
    queued = api.post("/v1/jobs", json=tiny_job("queued", tiny_model_dir, train, steps=2)).json()["id"]

    acknowledged = {job_id: (api.get(f"/v1/jobs/{job_id}").json(), api.get(f"/v1/jobs/{job_id}/metrics").json())
                    for job_id in (running, queued)}
    redis_server.kill()
    assert acknowledged[running][0]["step"] < STEPS, "the crash comes in the middle of the job"
    assert acknowledged[queued][0]["state"] == "PENDING"

    submitted: dict[str, object] = {}  # a job submitted while Redis is down is answered once it is stored
    thread = threading.Thread(target=lambda: submitted.update(
        response=controllers.api.post("/v1/jobs", json=tiny_job("late", tiny_model_dir, train, steps=2))))
    thread.start()
    time.sleep(3)
    assert "response" not in submitted, "no answer while nothing can be stored"
    redis_server.start()
    thread.join(timeout=60)
    assert submitted["response"].status_code == 201
    late = submitted["response"].json()["id"]

    for job_id, (record, history) in acknowledged.items():
        now = api.get(f"/v1/jobs/{job_id}").json()
        assert now["step"] >= record["step"] and now["spec"] == record["spec"]
        assert api.get(f"/v1/jobs/{job_id}/metrics").json()[: len(history)] == history, "acknowledged steps kept"
    for job_id in (queued, late):  # stored and still queued; cancelled so as not to spend time on them
        assert api.get(f"/v1/jobs/{job_id}").json()["state"] == "PENDING"
        assert api.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "CANCELLED"
    wait_job(api, running, lambda j: j["state"] == "SUCCEEDED")
    assert [m["step"] for m in api.get(f"/v1/jobs/{running}/metrics").json()] == list(range(1, STEPS + 1))
    assert api.get(f"/v1/jobs/{running}").json()["resumes"] == [], "the running job went on in its runner"
