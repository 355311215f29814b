"""An everstep arm of `benchmarks.time_to_accuracy`: the job submitted over REST to a real local stack.

The stack is `everstep up`'s (`LocalStack`: Redis, sandbox, reward, controller) with the local
launcher, so each job gets its own rollout engine and trainer sized to it (`--threads-per-worker`
torch threads each). The job's evaluations come from its REST record. Their times come from
polling the record: a step counts as done when the record first shows it, an evaluation when the
record first holds it; an evaluation's duration (from its step's commit to its appearance) is left
out of the training seconds, so every arm's clock counts training alone. The error is at most
one poll interval per event.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.time_to_accuracy.config import Arm, ArmRun, CurvePoint, TtaConfig, job_spec, lr_schedule_of
from everstep.rest.job_record import TERMINAL_STATES
from everstep.rest.job_spec import JobSpec
from everstep.rest.step_metrics import Evaluation, StepMetrics
from everstep_cli.local_stack import LocalStack, StackState, free_port
from everstep_cli.rest_client import ControllerClient

EVERSTEP_SCHEDULE = ("everstep trainer: learning_rate_at(train step, warmup_steps, total_steps = the job's steps) "
                     "(services/trainer/everstep_trainer/step/optim.py), set once per step before its num_minibatches "
                     "x ppo_epochs optimizer steps (PolicyTrainer.train_step)")


def start_stack(root: Path, config: TtaConfig) -> tuple[LocalStack, StackState]:
    stack = LocalStack(root / "stack")
    state = stack.up(port=free_port(), launcher="local",
                     controller_args=["--threads-per-worker", str(config.threads_per_worker)])
    return stack, state


def run_everstep_arm(state: StackState, config: TtaConfig, arm: Arm, root: Path) -> ArmRun:
    client = ControllerClient(state.controller_url)
    try:
        started = time.monotonic()
        spec = job_spec(config, arm, root / "checkpoints")
        job_id = client.submit(spec)["id"]
        step_seen: dict[int, float] = {}
        eval_seen: dict[int, float] = {}
        while True:
            record = client.job(job_id)
            now = time.monotonic()
            for step in range(len(step_seen) + 1, record["step"] + 1):
                step_seen[step] = now
                print(f"  {arm.value} step {step}: {now - started:.1f} s since submission", file=sys.stderr,
                      flush=True)
            for step in map(int, record.get("evaluation") or {}):
                eval_seen.setdefault(step, now)
            if record["state"] in TERMINAL_STATES:
                break
            time.sleep(config.poll_seconds)
        total_seconds = time.monotonic() - started
        if record["state"] != "SUCCEEDED":
            raise RuntimeError(f"{arm.value} job {job_id} ended {record['state']}: {record.get('error')}; logs in "
                               f"{root / 'stack' / 'logs'}")
        history = [StepMetrics.model_validate(m) for m in client.metrics(job_id)]
    finally:
        client.close()
    evaluations = {int(s): Evaluation.model_validate(e) for s, e in record["evaluation"].items()}
    curve, eval_seconds = _curve(evaluations, step_seen, eval_seen)
    last = record["step"]
    train_seconds = _train_seconds(last, step_seen, eval_seen)
    print(f"  {arm.value}: {last} steps, {train_seconds:.1f} s of training, final avg@{config.eval_samples} "
          f"{curve[-1].accuracy}, greedy {curve[-1].greedy_accuracy}", file=sys.stderr, flush=True)
    return ArmRun(arm=arm, curve=curve, train_seconds=round(train_seconds, 2), total_seconds=round(total_seconds, 2),
                  eval_seconds=round(eval_seconds, 2), details={"job_id": job_id, **_step_details(history)},
                  lr_schedule=lr_schedule_of(JobSpec.model_validate(spec), implementation=EVERSTEP_SCHEDULE,
                                             observed=[m.learning_rate for m in history
                                                       if m.learning_rate is not None]))


def _eval_duration(step: int, step_seen: dict[int, float], eval_seen: dict[int, float]) -> float:
    """Seconds the evaluation after ``step`` took (0: none); step 0's is not training either, it starts the clock."""
    if step == 0 or step not in eval_seen:
        return 0.0
    return max(0.0, eval_seen[step] - step_seen.get(step, eval_seen[step]))


def _train_seconds(step: int, step_seen: dict[int, float], eval_seen: dict[int, float]) -> float:
    """Training wall seconds until ``step`` was committed: since the step-0 evaluation, earlier evaluations out."""
    if step == 0:
        return 0.0
    paused = sum(_eval_duration(s, step_seen, eval_seen) for s in eval_seen if 0 < s < step)
    return step_seen[step] - eval_seen[0] - paused


def _curve(evaluations: dict[int, Evaluation], step_seen: dict[int, float],
           eval_seen: dict[int, float]) -> tuple[list[CurvePoint], float]:
    curve = [CurvePoint(seconds=round(_train_seconds(s, step_seen, eval_seen), 2), step=s, accuracy=e.accuracy,
                        greedy_accuracy=e.greedy_accuracy) for s, e in sorted(evaluations.items())]
    eval_seconds = sum(_eval_duration(s, step_seen, eval_seen) for s in eval_seen)
    return curve, eval_seconds


def _step_details(history: list[StepMetrics]) -> dict[str, Any]:
    def mean(values: list[float]) -> float:
        return round(sum(values) / len(values), 3) if values else 0.0

    return {
        "trained_samples": sum(m.num_samples_trained for m in history),
        "generated_tokens": sum(m.generated_tokens for m in history),
        "mean_rollout_seconds": mean([m.rollout_seconds for m in history]),
        "mean_train_seconds": mean([m.train_seconds for m in history]),
        "mean_iteration_seconds": mean([m.iteration_seconds for m in history]),
        "staleness_max": max((m.staleness_max for m in history), default=0),
        "reward_first_step": history[0].reward_mean if history else None,
        "reward_last_step": history[-1].reward_mean if history else None,
    }
