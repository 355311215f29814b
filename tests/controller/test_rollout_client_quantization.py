"""The controller's rollout client sends the job's quantization and checks what the engine reports."""

from __future__ import annotations

from everstep.settings.quantization import Quantization
from everstep.v1 import rollout_pb2
from everstep_controller.run.clients import Deadlines, RolloutClient


def test_load_sends_the_quantization_and_the_engine_reports_it(service_process, tiny_model_dir):
    service = service_process("rollout")  # the server's own setting: none
    client = RolloutClient(service.grpc_address, Deadlines(rollout_seconds=60))
    try:
        for quantization in (Quantization.int8_tensor, Quantization.none):
            reply = client.load(str(tiny_model_dir), dtype="float32", version=0, seed=0, max_running=2,
                                max_seq_len=64, quantization=quantization)
            assert reply.quantization == rollout_pb2.Quantization.Value(
                "QUANTIZATION_" + quantization.value.upper().replace("-", "_"))
            assert client.status().quantization == reply.quantization
    finally:
        client.close()
