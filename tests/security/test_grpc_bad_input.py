"""Oversized and malformed gRPC messages sent to real service processes: each is refused with a clean
status (RESOURCE_EXHAUSTED, INTERNAL), and the service keeps serving the next good call."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from everstep.transport.channels import message_size_options
from everstep.v1 import reward_pb2, reward_pb2_grpc, sandbox_pb2, sandbox_pb2_grpc

LIMIT_BYTES = 64 * 1024  # the knob under test: --grpc-max-message-bytes
GARBAGE = [
    b"\xff\xff\xff\xff",  # a field tag whose varint never ends
    b"\x0a\xff\xff\xff\xff\x0f",  # field 1, length-delimited, 4 GiB long, in a 6-byte message
]


def _score(channel: grpc.Channel, item: reward_pb2.RewardItem) -> list[reward_pb2.ScoreResult]:
    return list(reward_pb2_grpc.RewardStub(channel).Score(reward_pb2.ScoreRequest(items=[item]), timeout=60))


def _math_item(item_id: str, response: str) -> reward_pb2.RewardItem:
    return reward_pb2.RewardItem(id=item_id, response=response,
                                 verifiers=[reward_pb2.VerifierSpec(name="math", weight=1.0, answer="4")])


def _reward_calls(channel: grpc.Channel) -> tuple[Callable[[], object], Callable[[bytes], object], Callable[[], None]]:
    raw = channel.unary_stream("/everstep.v1.Reward/Score")  # bytes in, bytes out: no protobuf client-side

    def good() -> None:
        (result,) = _score(channel, _math_item("good", "\\boxed{4}"))
        assert result.reward == 1.0 and not result.error

    return (lambda: _score(channel, _math_item("big", "x" * LIMIT_BYTES)),
            lambda payload: list(raw(payload, timeout=10)), good)


def _sandbox_calls(channel: grpc.Channel) -> tuple[Callable[[], object], Callable[[bytes], object], Callable[[], None]]:
    stub = sandbox_pb2_grpc.SandboxStub(channel)
    raw = channel.unary_unary("/everstep.v1.Sandbox/RunCode")

    def good() -> None:
        reply = stub.RunCode(sandbox_pb2.RunCodeRequest(code="print(6 * 7)", language="python"), timeout=60)
        assert reply.status == "Success" and reply.run_result.stdout == "42\n", reply

    return (lambda: stub.RunCode(sandbox_pb2.RunCodeRequest(code="#" * LIMIT_BYTES, language="python"), timeout=60),
            lambda payload: raw(payload, timeout=10), good)


@pytest.mark.parametrize("service", ["reward", "sandbox"])
def test_oversized_and_garbage_messages_get_a_clean_status(service: str, service_process) -> None:
    extra = ("--math-workers", "1") if service == "reward" else ("--workers", "1")
    process = service_process(service, *extra, "--grpc-max-message-bytes", str(LIMIT_BYTES))
    # the client may send far more than the server takes: the server's limit is what is tested
    with grpc.insecure_channel(process.grpc_address, options=message_size_options(16 * LIMIT_BYTES)) as channel:
        oversized, garbage, good = (_reward_calls if service == "reward" else _sandbox_calls)(channel)
        good()
        with pytest.raises(grpc.RpcError) as refused:
            oversized()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        assert str(LIMIT_BYTES) in refused.value.details()  # names the limit it broke
        for payload in GARBAGE:
            with pytest.raises(grpc.RpcError) as malformed:
                garbage(payload)
            assert malformed.value.code() == grpc.StatusCode.INTERNAL, malformed.value.details()
            assert "deserializ" in malformed.value.details().lower()
        good()  # still serving, on the same connection
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert process.process.poll() is None, process.log()
