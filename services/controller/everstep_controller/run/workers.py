"""A job's rollout engines and trainer as its runner talks to them: the clients, and a policy loaded into all.

The pool changes between iterations (`change_pool`): an engine lost mid-iteration (`lost`, reported by the
iteration's `PoolStream`) gets no more work nor weight pushes until the launcher has replaced it, and the engines a
resize starts or the replacements load the model and take the trainer's current weights before they get work.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from everstep.rest.job_record import EngineInfo, EngineState
from everstep.rest.job_spec import JobSpec
from everstep.v1 import common_pb2, trainer_pb2
from everstep_controller.algo.training_batch import trainer_config
from everstep_controller.launchers import WorkerRequest, Workers
from everstep_controller.run.clients import Deadlines, RolloutClient, ServiceUnavailable, TrainerClient
from everstep_controller.run.engine_pool import EngineStats, PoolStream

__all__ = ["JobWorkers", "without_model"]

log = logging.getLogger(__name__)


def without_model(engines: list[RolloutClient]) -> list[RolloutClient]:
    """The engines that hold no model (`GetStatus`): started anew since they last loaded one."""
    return [e for e in engines if not e.status().model_path]


class JobWorkers:
    def __init__(self, record: Workers, spec: JobSpec, request: WorkerRequest, deadlines: Deadlines) -> None:
        """record: the launcher's; request: what the job asked the launcher for (each engine's batch size)."""
        self.record, self.spec, self.request, self.deadlines = record, spec, request, deadlines
        self.engines = [RolloutClient(address, deadlines) for address in record.rollouts]
        self.trainer = TrainerClient(record.trainer, deadlines)
        self.engine_stats = {address: EngineStats(address) for address in record.rollouts}
        self.engine_versions = dict.fromkeys(record.rollouts, -1)
        """Each engine's policy version, as the runner last loaded or pushed it (-1: not yet)."""
        self.lost: dict[str, ServiceUnavailable] = {}
        """Engines whose stream failed mid-iteration, not replaced yet: no work, no weight push."""

    @property
    def live_engines(self) -> list[RolloutClient]:
        return [e for e in self.engines if e.address not in self.lost]

    def generate(self, tools: common_pb2.ToolConfig | None = None) -> PoolStream:
        """One Generate stream per live engine of the pool (`engine_pool.PoolStream`); an engine it loses is
        marked `lost`."""
        return PoolStream(self.live_engines, tools, on_lost=self.lost.__setitem__)

    def change_pool(self, record: Workers, version: int) -> None:
        """The launcher's new record after a replacement or a resize (the same trainer): the clients of engines gone
        are closed, the new engines load the model and take the trainer's `version` (`_bring_to`). An engine at an
        address the pool had is new too when it holds no model (`without_model`): a launcher whose engines keep their
        address (Kubernetes: each engine's Service) starts anew there any engine whose pod changed, lost or not."""
        kept = [e for e in self.engines if e.address in record.rollouts and e.address not in self.lost]
        started_anew = {e.address for e in without_model(kept)}
        kept = [e for e in kept if e.address not in started_anew]
        for engine in self.engines:
            if engine not in kept:
                engine.close()
        by_address = {e.address: e for e in kept}
        new = [RolloutClient(a, self.deadlines) for a in record.rollouts if a not in by_address]
        by_address.update({e.address: e for e in new})
        self.record, self.lost = record, {}
        self.engines = [by_address[a] for a in record.rollouts]
        self.engine_stats = {a: self.engine_stats.get(a) or EngineStats(a) for a in record.rollouts}
        self.engine_versions = {a: self.engine_versions.get(a, -1) for a in record.rollouts}
        if new:
            self._bring_to(new, version)

    def _bring_to(self, engines: list[RolloutClient], version: int) -> None:
        """Engines without the job's weights load the model, then one push of the trainer's weights to the whole
        live pool (the same set of endpoints as every step's push, so a broadcast group is not formed twice);
        RuntimeError when the trainer holds another version than `version`."""
        self._each(engines, lambda engine: self._load_engine(engine, self.spec.model_path, 0, version))
        pushed = self.push_weights().version
        if pushed != version:
            raise RuntimeError(f"the trainer holds version {pushed}, the job's progress {version}")
        log.info("rollout engine(s) at %s given the trainer's weights (version %d)",
                 ", ".join(e.address for e in engines), version)

    def load_model(self, model_path: str, *, version: int, start_step: int) -> None:
        """Every engine and the trainer load a Hugging Face directory afresh (the trainer with a new optimizer
        whose schedule covers the steps left after `start_step`)."""
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
        """Brings every engine to the trainer's `version` with nothing in flight: the sequences a dead runner
        left decoding are drained; engines that restarted (or missed a push) get the trainer's weights (`_bring_to`)."""
        stale = []
        for engine in self.engines:
            status = engine.status()
            if status.model_path and status.version == version:
                engine.drain()
                self.engine_versions[engine.address] = version
            else:
                stale.append(engine)
        if stale:
            self._bring_to(stale, version)

    def push_weights(self) -> trainer_pb2.PushWeightsResponse:
        """The trainer's weights to every live engine of the pool in one push (one shared-memory segment per host,
        one broadcast group across hosts); every one is at the pushed version when it returns."""
        live = [e.address for e in self.live_engines]
        reply = self.trainer.push_weights(live)
        self.engine_versions.update(dict.fromkeys(live, reply.version))
        return reply

    def count_rollout(self, engine_tokens: dict[str, int], finished: dict[str, int]) -> dict[str, int]:
        """Adds a rollout phase's decoded tokens and finished rollouts to each engine's totals; returns each
        engine's tokens of the phase."""
        phase = {}
        for address, stats in self.engine_stats.items():
            phase[address] = engine_tokens.get(address, 0)
            stats.tokens_generated += phase[address]
            stats.sequences_finished += finished.get(address, 0)
        return phase

    def engine_infos(self, version: int) -> list[EngineInfo]:
        """The pool as the job record shows it: each engine's state against the job's policy `version`."""

        def state(address: str) -> EngineState:
            if address in self.lost:
                return EngineState.lost
            return EngineState.serving if self.engine_versions.get(address, -1) == version else EngineState.behind

        return [EngineInfo(address=a, weight_version=self.engine_versions.get(a, -1), state=state(a),
                           tokens_generated=s.tokens_generated, sequences_finished=s.sequences_finished)
                for a, s in self.engine_stats.items()]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.trainer.close()

    def _load_rollout(self, model_path: str, version: int, step: int) -> None:
        self._each(self.engines, lambda engine: self._load_engine(engine, model_path, version, step))

    def _load_engine(self, engine: RolloutClient, model_path: str, version: int, step: int) -> None:
        engine.load(model_path, dtype=self.spec.sampling.dtype, version=version, seed=self.spec.seed + step,
                    max_running=self.request.max_running, max_seq_len=self.request.max_seq_len,
                    quantization=self.spec.sampling.quantization)
        self.engine_versions[engine.address] = version

    @staticmethod
    def _each(engines: list[RolloutClient], call: Callable[[RolloutClient], None]) -> None:
        """`call` on every engine at once (the first error raised once all are done)."""
        if len(engines) == 1:
            call(engines[0])
            return
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            for future in [pool.submit(call, engine) for engine in engines]:
                future.result()
