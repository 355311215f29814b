"""SIGTERM in the middle of scoring: a code item whose program runs for a minute in a real sandbox. The reward
service exits within SIGTERM_STOP_SECONDS (what the chart's terminationGracePeriodSeconds is checked against in
tests/deploy), and the caller's Score stream ends with an error (the controller scores the item again)."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import httpx
import pytest
from test_code_sandbox import code_item, fenced

from everstep.v1 import reward_pb2, reward_pb2_grpc
from everstep_reward.server import SIGTERM_STOP_SECONDS


def _inflight(sandbox_url: str) -> float:
    for line in httpx.get(sandbox_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("everstep_sandbox_inflight_requests "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.faults  # make test-faults: a service killed mid-call (~10 s)
@pytest.mark.slow
def test_sigterm_mid_scoring_stops_the_reward_service_within_its_bound(service_process) -> None:
    sandbox = service_process("sandbox", "--workers", "1")
    reward = service_process("reward", "--math-workers", "1", "--sandbox-endpoint", sandbox.grpc_address)
    slow = code_item("slow", fenced("python", "import time\ntime.sleep(60)\nprint(2)\n"), "python",
                     tests=[reward_pb2.CodeTest(stdin="", expected_stdout="2\n")],
                     params={"run_timeout_seconds": 90})
    outcome: list[object] = []
    with grpc.insecure_channel(reward.grpc_address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)

        def score() -> None:
            try:
                outcome.append(list(stub.Score(reward_pb2.ScoreRequest(items=[slow]), timeout=120)))
            except grpc.RpcError as e:
                outcome.append(e)

        caller = threading.Thread(target=score)
        caller.start()
        deadline = time.monotonic() + 30
        while _inflight(sandbox.http_url) < 1:
            assert time.monotonic() < deadline and not outcome, f"the item never reached the sandbox: {outcome}"
            time.sleep(0.05)
        time.sleep(0.5)  # the program is running
        start = time.monotonic()
        reward.process.send_signal(signal.SIGTERM)
        reward.process.wait(timeout=SIGTERM_STOP_SECONDS + 30)
        stopped = time.monotonic() - start
        caller.join(timeout=30)
    print(f"reward stopped {stopped:.2f} s after SIGTERM")
    assert stopped < SIGTERM_STOP_SECONDS, f"the reward service took {stopped:.1f} s to stop\n{reward.log()}"
    assert reward.process.returncode == 0, reward.log()
    assert len(outcome) == 1 and isinstance(outcome[0], grpc.RpcError), f"the item is not reported scored: {outcome}"
