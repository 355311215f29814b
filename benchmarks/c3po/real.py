"""The same job run synchronously and with C3PO++, on real generation, side by side.

Real parts throughout: a Redis server, the reward service (math verifier), and the controller's own
job manager and runner (streams, scorers, per-step commits) driving a real rollout engine and
trainer over gRPC. With `workers="fresh"` each run gets its own rollout and trainer processes from
the local launcher (same conditions for both); `workers="shared"` starts one pair and reuses it
(faster to start, for small checks).

Both runs use the same model, dataset, seed and engine capacity (Omega = prompts x group size for
C3PO++, one batch of the same size for the baseline) and end once `trained_samples` samples were
trained (`max_trained_samples`). The token budget Phi defaults to what a synchronous iteration
generated on average (prompts x group size x its mean response length), so an iteration of either
mode trains about as many samples. Times are the sums of the per-step metrics (no start-up, no
evaluation), compared per trained sample.

Rewards. `reward_ratio` compares the mean reward of the samples each run trained in its last 20% of
steps. Under C3PO++ those samples are not a fair draw from the policy: an iteration trains what
finished first (short responses) and carries the long ones over or purges them, so when reward
depends on length the trained samples' reward is biased, and a few steps' samples are noisy. With
`eval_dataset` set, both jobs also run the controller's held-out evaluation (spec.evaluation: avg@k
at the training temperature, no greedy) before training and after it, on the same rows:
`reward_ratio_eval` is c3po's final held-out reward over sync's, each over `eval_prompts` x
`eval_samples_per_prompt` fresh samples of the final policy, with a standard error (binomial, an
upper bound for rewards in [0, 1]). The two step-0 evaluations measure the same base model: their
ratio shows the evaluation's own noise.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis

from everstep.processes import ManagedProcess, free_port, spawn, stop_processes, wait_grpc_serving
from everstep.rest.job_record import TERMINAL_STATES
from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import Evaluation, StepMetrics
from everstep_cli.local_stack import redis_server_binary
from everstep_controller.launchers.base import Launcher
from everstep_controller.launchers.local import LocalLauncher
from everstep_controller.launchers.shared import SharedLauncher
from everstep_controller.run.manager import JobManager
from everstep_controller.store.job_store import JobStore


@dataclass(frozen=True, kw_only=True)
class RealConfig:
    model: str
    dataset: str
    group_size: int = 8
    prompts_per_iteration: int = 32
    trained_samples: int = 2560
    max_new_tokens: int = 200
    token_budget: int = 0  # 0: measured on the synchronous run
    retention: int = 2
    learning_rate: float = 3e-4
    temperature: float = 1.0
    seed: int = 0
    workers: str = "fresh"  # or "shared"
    threads_per_worker: int = 0
    keep_zero_signal_groups: bool = False  # train groups whose rewards are all equal (a random model's are)
    overlap: int = 0  # > 0: a third run, c3po with scheduler.overlap, as many steps as the c3po run took
    answer_field: str = "answer"  # the row field of the reference answer
    verifiers: tuple[tuple[str, float], ...] = (("math", 1.0),)  # (name, weight) of the reward's verifiers
    micro_batch_tokens: int = 16384
    packing: bool = False
    tools: dict[str, Any] | None = None  # the job spec's `tools` section (multi-turn rollouts)
    verifier_params: dict[str, dict[str, Any]] | None = None  # verifier name -> its `params`
    eval_dataset: str = ""  # held-out rows: both jobs are evaluated before and after training ('': not evaluated)
    eval_prompts: int = 128  # rows of eval_dataset evaluated (spec.evaluation.num_prompts)
    eval_samples_per_prompt: int = 8  # k of avg@k (spec.evaluation.samples_per_prompt)

    @property
    def max_steps(self) -> int:
        """A bound on steps (a run that trains too little per step ends there and says so)."""
        per_step = self.prompts_per_iteration * self.group_size
        return 4 * -(-self.trained_samples // per_step) + 5


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _spec(config: RealConfig, mode: str, budget: int, checkpoint_dir: Path, *, overlap: int = 0,
          steps: int = 0) -> JobSpec:
    """steps: run exactly this many (and no trained-samples bound: with overlap, a step's trained samples are
    known only after the next step started)."""
    name = f"{mode}-overlap{overlap}" if overlap else mode
    return JobSpec.model_validate({
        "name": f"c3po-benchmark-{name}", "model_path": config.model,
        "dataset": {"train_path": config.dataset, "answer_field": config.answer_field,
                    **({"eval_path": config.eval_dataset} if config.eval_dataset else {})},
        **({"evaluation": {"every": 0, "num_prompts": config.eval_prompts,
                           "samples_per_prompt": config.eval_samples_per_prompt, "greedy": False}}
           if config.eval_dataset else {}),
        "reward": {"verifiers": [{"name": verifier, "weight": weight,
                                  **({"params": config.verifier_params[verifier]}
                                     if config.verifier_params and verifier in config.verifier_params else {})}
                                 for verifier, weight in config.verifiers]},
        **({"tools": config.tools} if config.tools else {}),
        "algorithm": {"group_size": config.group_size,
                      "drop_zero_signal_groups": not config.keep_zero_signal_groups},
        "sampling": {"temperature": config.temperature, "max_new_tokens": config.max_new_tokens},
        "scheduler": {"mode": mode, "token_budget": max(1, budget), "retention": config.retention,
                      "pool_capacity": config.prompts_per_iteration * config.group_size,
                      "prompts_per_iteration": config.prompts_per_iteration, "overlap": overlap},
        "trainer": {"learning_rate": config.learning_rate, "micro_batch_tokens": config.micro_batch_tokens,
                    "packing": config.packing},
        "checkpoint": {"dir": str(checkpoint_dir / name)},
        "steps": steps or config.max_steps, "max_trained_samples": 0 if steps else config.trained_samples,
        "seed": config.seed,
    })


class _Services:
    """Redis, the reward service and (workers="shared") one rollout engine and trainer."""

    def __init__(self, root: Path, config: RealConfig) -> None:
        self.root, self.config = root, config
        self.processes: list[ManagedProcess] = []

    def __enter__(self) -> _Services:
        try:
            port = free_port()
            self.processes.append(spawn("redis", ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.root),
                                                  "--save", "", "--appendonly", "no"], self.root / "redis.log",
                                        executable=redis_server_binary()))
            self.redis_url = f"redis://127.0.0.1:{port}/0"
            self.reward = self._service("reward", [])
            c = self.config
            if c.workers == "shared":
                threads = ["--num-threads", str(c.threads_per_worker)] if c.threads_per_worker else []
                pool = c.prompts_per_iteration * c.group_size
                self.rollout = self._service("rollout", ["--max-running", str(pool), "--max-seq-len", "1024", *threads])
                self.trainer = self._service("trainer", [])
            for process in self.processes[1:]:
                wait_grpc_serving(process, 600)
            client = redis.Redis.from_url(self.redis_url)
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        except BaseException:
            stop_processes(self.processes)
            raise
        return self

    def _service(self, name: str, extra: list[str]) -> ManagedProcess:
        http_port, grpc_port = free_port(), free_port()
        process = spawn(name, ["-m", f"everstep_{name}", "--host", "127.0.0.1", "--port", str(http_port),
                               "--grpc-port", str(grpc_port), *extra], self.root / f"{name}.log",
                        http_port=http_port, grpc_port=grpc_port)
        self.processes.append(process)
        return process

    def launcher(self) -> Launcher:
        if self.config.workers == "shared":
            return SharedLauncher(rollout=self.rollout.grpc_address, trainer=self.trainer.grpc_address)
        return LocalLauncher(work_dir=self.root / "workers", max_jobs=1,
                             threads_per_worker=self.config.threads_per_worker)

    def __exit__(self, *exc: object) -> None:
        stop_processes(self.processes)


@dataclass(frozen=True)
class _JobRun:
    history: list[StepMetrics]
    wall_seconds: float
    """From submission to the job's end (evaluations included)."""
    evaluation: dict[str, Evaluation]
    """By step (str), as the job record holds it: step 0 (the base model) and the last step."""


def _run_job(manager: JobManager, store: JobStore, spec: JobSpec) -> _JobRun:
    """The job's metrics rows, wall seconds and evaluations."""
    started = time.monotonic()
    job_id = manager.submit(spec).id
    last_step = -1
    while (record := store.get(job_id)).state not in TERMINAL_STATES:
        if record.step != last_step and record.metrics:
            m = record.metrics
            _log(f"  {spec.scheduler.mode.value} step {record.step}: {m.num_trained_samples_total} trained, "
                 f"reward {m.reward_mean:.3f}, rollout {m.rollout_seconds:.1f}s, iteration {m.iteration_seconds:.1f}s")
            last_step = record.step
        time.sleep(0.2)
    if record.state.value != "SUCCEEDED":
        raise RuntimeError(f"{spec.name} ended {record.state.value}: {record.error}")
    return _JobRun(store.metrics(job_id), time.monotonic() - started, dict(record.evaluation))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _eval_summary(evaluation: Evaluation) -> dict[str, Any]:
    num_samples = evaluation.num_prompts * evaluation.k - evaluation.num_unscored
    reward = evaluation.accuracy or 0.0
    return {"step": evaluation.step, "reward": round(reward, 4), "num_samples": num_samples,
            "standard_error": round(_binomial_se(reward, num_samples), 4)}


def _binomial_se(mean: float, n: int) -> float:
    """Standard error of a mean of n rewards in [0, 1] (exact for 0/1 rewards, an upper bound otherwise)."""
    return math.sqrt(max(0.0, mean * (1 - mean)) / n) if n else 0.0


def _ratio(numerator: dict[str, Any], denominator: dict[str, Any]) -> tuple[float | None, float | None]:
    """numerator / denominator of two evaluation summaries, and its standard error (delta method)."""
    a, b = numerator["reward"], denominator["reward"]
    if not b:
        return None, None
    ratio = a / b
    relative = math.hypot(numerator["standard_error"] / a if a else 0.0, denominator["standard_error"] / b)
    return round(ratio, 3), round(ratio * relative, 3)


def _summary(run: _JobRun) -> dict[str, Any]:
    history, wall_seconds = run.history, run.wall_seconds
    last = history[-max(1, round(len(history) * 0.2)):]
    trained = sum(m.num_samples_trained for m in history)
    evaluations = sorted(run.evaluation.values(), key=lambda e: e.step)
    return {
        "steps": len(history),
        "trained_samples": trained,
        "rollout_seconds": round(sum(m.rollout_seconds for m in history), 2),
        "e2e_seconds": round(sum(m.iteration_seconds for m in history), 2),
        "wall_seconds": round(wall_seconds, 2),
        "train_seconds": round(sum(m.train_seconds + m.weight_push_seconds for m in history), 2),
        "generated_tokens": sum(m.generated_tokens for m in history),
        "mean_response_tokens": round(sum(m.finished_tokens for m in history)
                                      / max(1, sum(m.num_finished_rollouts for m in history)), 2),
        "reward_last_20pct": round(_mean([m.reward_mean for m in last]), 4),
        # every trained sample, weighted by the samples of each step
        "reward_trained": round(sum(m.reward_mean * m.num_samples_trained for m in history) / max(1, trained), 4),
        **({"eval_before": _eval_summary(evaluations[0]), "eval_after": _eval_summary(evaluations[-1])}
           if len(evaluations) >= 2 else {}),
        "purged_samples": sum(m.num_samples_purged for m in history),
        "dropped_groups": sum(m.num_groups_dropped for m in history),
        "max_staleness": max(m.staleness_max for m in history),
        **({"turns_per_sample": round(_mean([m.turns_per_sample for m in history
                                             if m.turns_per_sample is not None]), 3),
            "num_tool_calls": sum(m.num_tool_calls or 0 for m in history)}
           if any(m.turns_per_sample is not None for m in history) else {}),
    }


def run_real(config: RealConfig) -> dict[str, Any]:
    for path in (config.model, config.dataset):
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} does not exist (the demo model is shipped in examples/demo-model; "
                                    "python -m everstep_tools.demo --out DIR builds one)")
    with tempfile.TemporaryDirectory(prefix="c3po-bench-") as tmp, _Services(Path(tmp), config) as services:
        store = JobStore(redis.Redis.from_url(services.redis_url))
        manager = JobManager(store, services.launcher(), services.reward.grpc_address, Path(tmp) / "data",
                             max_jobs=1, poll_seconds=0.1)
        manager.start()
        try:
            _log(f"sync: {config.prompts_per_iteration} prompts x {config.group_size} per step, until "
                 f"{config.trained_samples} samples are trained")
            sync = _summary(_run_job(manager, store, _spec(config, "sync", 1, Path(tmp))))
            budget = config.token_budget or round(config.prompts_per_iteration * config.group_size
                                                  * sync["mean_response_tokens"])
            _log(f"c3po: pool {config.prompts_per_iteration * config.group_size}, token budget {budget}")
            c3po = _summary(_run_job(manager, store, _spec(config, "c3po", budget, Path(tmp))))
            overlapped = None
            if config.overlap:
                _log(f"c3po with overlap {config.overlap}: {c3po['steps']} steps")
                overlapped = _summary(_run_job(manager, store, _spec(config, "c3po", budget, Path(tmp),
                                                                     overlap=config.overlap, steps=c3po["steps"])))
        finally:
            manager.stop()

    def per_sample(run: dict[str, Any], key: str) -> float:
        return run[key] / max(1, run["trained_samples"])

    evaluated = "eval_after" in sync and "eval_after" in c3po
    if config.eval_dataset and not evaluated:
        raise RuntimeError("a job ended without its evaluations before and after training")
    eval_ratio, eval_ratio_se = _ratio(c3po["eval_after"], sync["eval_after"]) if evaluated else (None, None)
    base_ratio, base_ratio_se = _ratio(c3po["eval_before"], sync["eval_before"]) if evaluated else (None, None)
    return {
        "benchmark": "c3po", "simulate": False,
        "rollout_speedup": round(per_sample(sync, "rollout_seconds") / per_sample(c3po, "rollout_seconds"), 3),
        "e2e_speedup": round(per_sample(sync, "e2e_seconds") / per_sample(c3po, "e2e_seconds"), 3),
        "reward_sync": sync["reward_last_20pct"], "reward_c3po": c3po["reward_last_20pct"],
        "reward_ratio": round(c3po["reward_last_20pct"] / sync["reward_last_20pct"], 3)
        if sync["reward_last_20pct"] else None,
        "reward_ratio_trained": round(c3po["reward_trained"] / sync["reward_trained"], 3)
        if sync["reward_trained"] else None,
        **({"reward_ratio_eval": eval_ratio, "reward_ratio_eval_se": eval_ratio_se,
            "base_reward_ratio_eval": base_ratio, "base_reward_ratio_eval_se": base_ratio_se} if evaluated else {}),
        "reached_trained_samples": min(sync["trained_samples"], c3po["trained_samples"]) >= config.trained_samples,
        "token_budget": budget, "sync": sync, "c3po": c3po, "config": asdict(config),
        # with overlap the steps' iteration_seconds overlap: its end-to-end speedup is by wall time (the job's,
        # from submission to end), against the sync and c3po runs' own wall times
        **({"c3po_overlap": overlapped,
            "wall_speedup_c3po": round(per_sample(sync, "wall_seconds") / per_sample(c3po, "wall_seconds"), 3),
            "wall_speedup_overlap": round(per_sample(sync, "wall_seconds") / per_sample(overlapped, "wall_seconds"),
                                          3),
            "reward_overlap": overlapped["reward_last_20pct"]} if overlapped else {}),
    }
