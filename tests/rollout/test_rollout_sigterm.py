"""SIGTERM in the middle of a Generate stream: the rollout server exits within SIGTERM_STOP_SECONDS (what the
chart's terminationGracePeriodSeconds is checked against in tests/deploy), and the caller's stream ends with an
error rather than hanging (the controller resubmits unfinished sequences elsewhere)."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from test_rollout_server import LONG, Streamer, seqs, wait_until_decoding

from everstep.v1 import rollout_pb2, rollout_pb2_grpc
from everstep_rollout.__main__ import SIGTERM_STOP_SECONDS


@pytest.mark.faults  # make test-faults: a service killed mid-call (~10 s)
@pytest.mark.slow
def test_sigterm_mid_generate_stops_the_server_within_its_bound(service_process, tiny_model_dir) -> None:
    service = service_process("rollout", "--model", str(tiny_model_dir), "--max-running", "4")
    with grpc.insecure_channel(service.grpc_address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        stream = Streamer(stub)
        stream.requests.put(rollout_pb2.GenerateRequest(sequences=seqs("s", 1000), sampling=LONG))
        wait_until_decoding(stub)
        assert stub.GetStatus(rollout_pb2.GetStatusRequest()).running > 0, "a Generate is under way"
        start = time.monotonic()
        service.process.send_signal(signal.SIGTERM)
        service.process.wait(timeout=SIGTERM_STOP_SECONDS + 20)
        stopped = time.monotonic() - start
        stream.close()
    print(f"rollout stopped {stopped:.2f} s after SIGTERM")
    assert stopped < SIGTERM_STOP_SECONDS, f"the rollout server took {stopped:.1f} s to stop"
    assert service.process.returncode == 0, service.log()
    assert len(stream.received) < 1000, "the stream was cut short, not served to the end (minutes of work)"
