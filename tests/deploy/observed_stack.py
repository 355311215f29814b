"""A local everstep stack watched by a real Prometheus while a short RL job runs.

`observe_short_job` starts the stack (`LocalStack`, as `everstep up` does), a Prometheus server
scraping every service's /metrics each second, submits a 3-step job on the tiny model, scores a
code item through reward -> sandbox and an unscorable item (so the sandbox's and reward's labelled
series exist: a math job alone never creates them), waits for the job, and scrapes every service.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from everstep.v1 import reward_pb2, reward_pb2_grpc
from everstep_cli.local_stack import LocalStack, StackState, free_port

SCRAPE_INTERVAL_SECONDS = 1
JOB_TIMEOUT_SECONDS = 240


@dataclass
class ObservedStack:
    prometheus_url: str
    job_id: str
    exported: dict[str, set[str]]
    """Sample names (e.g. everstep_x_total, everstep_y_bucket) each service's /metrics showed."""
    texts: dict[str, str]
    """Each service's /metrics page as scraped (the exposition format), for promtool."""

    def exported_names(self) -> set[str]:
        return set().union(*self.exported.values())


def _job_rows() -> list[dict[str, str]]:
    # only words of the tiny tokenizer: numbers below 40, '+', '='
    return [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(1, 13) for b in range(1, 13)]


def _write_datasets(root: Path) -> tuple[Path, Path]:
    rows = _job_rows()
    train, held_out = root / "train.jsonl", root / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    return train, held_out


@contextmanager
def _prometheus(state: StackState, root: Path) -> Iterator[str]:
    targets = {p.name: f"127.0.0.1:{p.http_port}" for p in state.processes if p.http_port}
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_SECONDS}s", "scrape_timeout": "900ms"},
        "scrape_configs": [{"job_name": f"everstep-{name}",
                            "static_configs": [{"targets": [target]}]} for name, target in targets.items()],
    }
    (root / "prometheus.yml").write_text(json.dumps(config))
    port = free_port()
    log = (root / "prometheus.log").open("w")
    process = subprocess.Popen(
        ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(root / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        log.close()


def _score_side_items(state: StackState) -> None:
    """A code item (reward -> sandbox) and an item missing its answer (a reward error)."""
    items = [
        reward_pb2.RewardItem(id="code", response="```python\nprint(int(input()) * 2)\n```", verifiers=[
            reward_pb2.VerifierSpec(name="code", weight=1.0, language="python",
                                    tests=[reward_pb2.CodeTest(stdin="21\n", expected_stdout="42\n")])]),
        reward_pb2.RewardItem(id="no-answer", response="7",
                              verifiers=[reward_pb2.VerifierSpec(name="math", weight=1.0)]),
    ]
    with grpc.insecure_channel(state.address("reward")) as channel:
        results = list(reward_pb2_grpc.RewardStub(channel).Score(reward_pb2.ScoreRequest(items=items), timeout=60))
    # whether the program passed is the sandbox's business (tests/sandbox); here only the metrics count
    by_id = {r.id: r for r in results}
    assert set(by_id) == {"code", "no-answer"}
    assert by_id["no-answer"].parts[0].error, by_id["no-answer"]


def _scrape(state: StackState) -> tuple[dict[str, set[str]], dict[str, str]]:
    exported, texts = {}, {}
    for process in state.processes:
        if not process.http_port:
            continue
        text = httpx.get(f"http://127.0.0.1:{process.http_port}/metrics", timeout=10).text
        texts[process.name] = text
        exported[process.name] = {sample.name for family in text_string_to_metric_families(text)
                                  for sample in family.samples}
    return exported, texts


@contextmanager
def observe_short_job(model_dir: Path, root: Path) -> Iterator[ObservedStack]:
    train, held_out = _write_datasets(root)
    stack = LocalStack(root / "stack")
    state = stack.up(port=free_port())
    try:
        with _prometheus(state, root) as prometheus_url:
            api = httpx.Client(base_url=state.controller_url, timeout=30)
            spec = {
                "name": "observed", "model_path": str(model_dir), "steps": 3, "seed": 0,
                "dataset": {"train_path": str(train), "eval_path": str(held_out)},
                # a random model scores 0 everywhere: keep its zero-signal groups so the trainer trains
                "algorithm": {"group_size": 4, "drop_zero_signal_groups": False}, "sampling": {"max_new_tokens": 40},
                "scheduler": {"token_budget": 800, "pool_capacity": 64},
                "evaluation": {"num_prompts": 8, "samples_per_prompt": 2},
            }
            created = api.post("/v1/jobs", json=spec)
            assert created.status_code == 201, created.text
            job_id = created.json()["id"]
            _score_side_items(state)
            deadline = time.monotonic() + JOB_TIMEOUT_SECONDS
            while (job := api.get(f"/v1/jobs/{job_id}").json())["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                assert time.monotonic() < deadline, f"job still {job['state']} at step {job['step']}"
                time.sleep(0.5)
            assert job["state"] == "SUCCEEDED", job["error"]
            time.sleep(3 * SCRAPE_INTERVAL_SECONDS)  # the final values are scraped
            yield ObservedStack(prometheus_url, job_id, *_scrape(state))
    finally:
        stack.down()
