"""A job's rollout engine and trainer as its runner talks to them: the clients, and a policy loaded into both."""

from __future__ import annotations

import json
import logging

from everstep.rest.job_spec import JobSpec
from everstep.v1 import trainer_pb2
from everstep_controller.algo.training_batch import trainer_config
from everstep_controller.launchers import WorkerRequest, Workers
from everstep_controller.run.clients import Deadlines, RolloutClient, TrainerClient

__all__ = ["JobWorkers"]

log = logging.getLogger(__name__)


class JobWorkers:
    def __init__(self, record: Workers, spec: JobSpec, request: WorkerRequest, deadlines: Deadlines) -> None:
        """record: the launcher's; request: what the job asked the launcher for (the engine's pool size)."""
        self.record, self.spec, self.request = record, spec, request
        self.rollout = RolloutClient(record.rollout, deadlines)
        self.trainer = TrainerClient(record.trainer, deadlines)

    def load_model(self, model_path: str, *, version: int, start_step: int) -> None:
        """Both load a Hugging Face directory afresh (the trainer with a new optimizer whose schedule
        covers the steps left after `start_step`)."""
        self._load_rollout(model_path, version, start_step)
        self.trainer.load(model_path, trainer_config(self.spec, start_step), version=version)

    def resume_checkpoint(self, path: str, *, version: int, step: int) -> None:
        """The trainer resumes a checkpoint whole (weights, AdamW state, RNG streams, step count); the
        engine loads its weights (LoRA: the base, then the trainer pushes the adapters). RuntimeError when the
        checkpoint is not the one the job recorded."""
        reply = self.trainer.load_checkpoint(path)
        saved = json.loads(reply.data_position) if reply.data_position else {}
        if reply.version != version or saved.get("step", step) != step:
            raise RuntimeError(f"checkpoint {path} holds version {reply.version} of step {saved.get('step')}; "
                               f"the job recorded version {version}, step {step}")
        if self.spec.trainer.lora is None:
            self._load_rollout(path, version, step)
            return
        # A LoRA checkpoint holds adapters: the engine loads the base and gets the adapters pushed.
        self._load_rollout(self.spec.model_path, version, step)
        self.push_weights()

    def save_checkpoint(self, path: str, *, job_id: str, step: int) -> None:
        self.trainer.save_checkpoint(path, data_position=json.dumps({"job_id": job_id, "step": step}))

    def sync_rollout(self, version: int) -> None:
        """Brings the engine to the trainer's `version` with nothing in flight: the sequences a dead runner
        left decoding are drained; an engine that restarted (or missed a push) gets the trainer's weights."""
        status = self.rollout.status()
        if status.model_path and status.version == version:
            self.rollout.drain()
            return
        self._load_rollout(self.spec.model_path, 0, version)
        pushed = self.push_weights().version
        if pushed != version:
            raise RuntimeError(f"the trainer holds version {pushed}, the job's progress {version}")
        log.info("rollout engine at %s given the trainer's weights (version %d)", self.record.rollout, version)

    def push_weights(self) -> trainer_pb2.PushWeightsResponse:
        return self.trainer.push_weights([self.record.rollout])

    def close(self) -> None:
        self.rollout.close()
        self.trainer.close()

    def _load_rollout(self, model_path: str, version: int, step: int) -> None:
        self.rollout.load(model_path, dtype=self.spec.sampling.dtype, version=version, seed=self.spec.seed + step,
                          max_running=self.request.max_running, max_seq_len=self.request.max_seq_len,
                          quantization=self.spec.sampling.quantization)
