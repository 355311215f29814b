"""Two reward services and two sandboxes, each pair behind one target: every replica gets work from one
client, and losing one of each mid-run loses nothing.

The client is the controller's own: a job's scorer pool (`ScorerPool` over a `RewardClient`, in this process,
storing scores in a real Redis). It dials `ipv4:127.0.0.1:R1,127.0.0.1:R2`, and both reward services dial
`ipv4:127.0.0.1:S1,127.0.0.1:S2`; all of them spread calls round robin (`everstep.transport.balanced_channel`).
Every item is a code test that a sandbox runs (half the programs right, half wrong; each runs 0.3 s). The first
batch shows that each of the four processes received work (their Prometheus counters). In the second, both
sandboxes are stopped (SIGSTOP) at a moment the first reward service has items in flight, so that its Score call
cannot finish; then that reward service and the first sandbox are killed (SIGKILL) and the other sandbox resumes.
The cut calls are asked for again and land on the survivors: every item is scored, each with the score its
program earns.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from fault_helpers import Service, metric_value, wait_until

from everstep.processes import ManagedProcess, kill_processes
from everstep.rest.job_spec import JobSpec
from everstep.v1 import common_pb2, reward_pb2
from everstep_controller.run.backoff import Backoff
from everstep_controller.run.clients import RewardClient
from everstep_controller.run.scoring import ScorerPool
from everstep_controller.store.job_store import JobStore
from everstep_controller.store.progress_store import ProgressStore

pytestmark = pytest.mark.faults

# each run lasts a while, so that calls are in flight when the services die
RIGHT = "import time\nx = int(input())\ntime.sleep(0.3)\nprint(2 * x)\n"
WRONG = "import time\nx = int(input())\ntime.sleep(0.3)\nprint(x + 1)\n"


def _target(services: list[Service]) -> str:
    return "ipv4:" + ",".join(service.address for service in services)


def _item(sample_id: str, prompt_index: int, sequence: common_pb2.Sequence) -> reward_pb2.RewardItem:
    """Prompt `k` asks to double k + 2; the response's program does, or prints k + 3."""
    x = prompt_index + 2
    spec = reward_pb2.VerifierSpec(name="code", weight=1.0, language="python",
                                   tests=[reward_pb2.CodeTest(stdin=f"{x}\n", expected_stdout=f"{2 * x}\n")])
    return reward_pb2.RewardItem(id=sample_id, response=sequence.output_text, verifiers=[spec])


def _submit(pool: ScorerPool, prefix: str, count: int) -> dict[str, float]:
    """Submits `count` rollouts; returns the reward each should get."""
    expected = {}
    for k in range(count):
        sample_id, right = f"{prefix}{k}", k % 2 == 0
        text = f"```python\n{RIGHT if right else WRONG}```"
        pool.submit(sample_id, k, common_pb2.Sequence(id=sample_id, prompt_ids=[1], output_ids=[2], output_text=text))
        expected[sample_id] = 1.0 if right else 0.0
    return expected


def _check_scores(pool: ScorerPool, expected: dict[str, float]) -> None:
    pool.wait_scored(list(expected), timeout_seconds=180)
    scored = pool.scored(list(expected))
    assert {s: (v.reward, v.error) for s, v in scored.items()} == {s: (r, "") for s, r in expected.items()}


def _code_items(reward: Service) -> float:
    return metric_value(reward.metrics(), "everstep_reward_items_total", verifier="code")


def _sandbox_requests(sandbox: Service) -> float:
    return metric_value(sandbox.metrics(), "everstep_sandbox_requests_total", language="python")


def _stop_when(processes: list[ManagedProcess], wanted: Callable[[], bool], attempts: int = 400) -> None:
    """Stops every process (SIGSTOP) at a moment `wanted()` holds, and leaves them stopped."""
    for _ in range(attempts):
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline and not wanted():
            time.sleep(0.002)
        for process in processes:
            os.kill(process.pid, signal.SIGSTOP)
        if wanted():
            return
        for process in processes:
            os.kill(process.pid, signal.SIGCONT)
    pytest.fail("the wanted moment never came")


@pytest.fixture
def sandboxes(services: Callable[..., Service]) -> list[Service]:
    return [services("sandbox", "--workers", "2") for _ in range(2)]


@pytest.fixture
def rewards(services: Callable[..., Service], sandboxes: list[Service]) -> list[Service]:
    return [services("reward", "--math-workers", "1", "--sandbox-endpoint", _target(sandboxes)) for _ in range(2)]


@pytest.fixture
def pool(redis_url: str, rewards: list[Service]) -> Iterator[ScorerPool]:
    store = JobStore(redis.Redis.from_url(redis_url))
    job_id = store.create(JobSpec(model_path="/m", dataset={"train_path": "/d.jsonl"})).id
    pool = ScorerPool(job_id, ProgressStore(store), RewardClient(_target(rewards), timeout_seconds=60), _item,
                      num_workers=2, batch_size=4, score_attempts=50,
                      backoff=Backoff(initial_seconds=0.1, max_seconds=0.5)).start()
    yield pool
    pool.stop(cancel=pool.reward.close)


def test_every_replica_gets_work_and_losing_one_of_each_loses_nothing(
        pool: ScorerPool, rewards: list[Service], sandboxes: list[Service], caplog: pytest.LogCaptureFixture) -> None:
    _check_scores(pool, _submit(pool, "a", 24))
    assert all(_code_items(reward) > 0 for reward in rewards), [_code_items(reward) for reward in rewards]
    assert all(_sandbox_requests(sandbox) > 0 for sandbox in sandboxes), [_sandbox_requests(s) for s in sandboxes]
    assert pool.last_error is None

    survivor, survivor_sandbox = _code_items(rewards[1]), _sandbox_requests(sandboxes[1])
    expected = _submit(pool, "b", 32)
    # the first reward service's Score call cannot finish (no sandbox answers) when it is killed
    _stop_when([s.process for s in sandboxes],
               lambda: metric_value(rewards[0].metrics(), "everstep_reward_inflight_items") > 0)
    kill_processes([rewards[0].process, sandboxes[0].process])
    os.kill(sandboxes[1].process.pid, signal.SIGCONT)

    _check_scores(pool, expected)
    cut = [r.getMessage() for r in caplog.records if "failed Score: UNAVAILABLE" in r.getMessage()]
    assert cut, "the killed reward service's call failed and was asked for again"
    assert _code_items(rewards[1]) > survivor and _sandbox_requests(sandboxes[1]) > survivor_sandbox
    wait_until(lambda: pool.depth().in_flight == 0, "nothing left in flight", timeout_seconds=10)
