"""Prometheus metrics of the controller (names: everstep_controller_<what>_<unit>).

The series labelled by `job_id` (`PER_JOB`) live as long as the job runs here: the manager removes
them `--finished-job-series-seconds` (`ControllerSettings.finished_job_series_seconds`, 300 s) after the
job ended (SUCCEEDED, FAILED, CANCELLED; so that Prometheus scrapes the final values, the last evaluation
included), and at once when the runner stopped without ending the job (another controller took it over,
Redis gone, a shutdown): a controller that no longer runs a job exports none of its series. A PAUSED job
keeps them.
"""

from __future__ import annotations

import contextlib
import threading
import time

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from everstep.rest.step_metrics import StepMetrics

JOBS = Gauge("everstep_controller_jobs", "Jobs by state.", ["state"])
JOBS_STARTED = Counter("everstep_controller_jobs_started_total", "Jobs whose runner started.")
DATASET_ROWS_SKIPPED = Counter("everstep_controller_dataset_rows_skipped_total",
                               "Dataset rows left out at load (no prompt, neither answer nor tests, malformed "
                               "tests, an unknown verifier), reported.")
UNSCORABLE_SAMPLES = Counter("everstep_controller_unscorable_samples_total",
                             "Training samples whose reward failed for their row's data, by the reward service's "
                             "error kind; their groups are left out of training.", ["kind"])
UNSCORABLE_GROUPS = Counter("everstep_controller_unscorable_groups_total",
                            "Groups left out of training because a member's row could not be scored.")
REWARD_RETRIES = Counter("everstep_controller_reward_retries_total",
                         "Rewards asked for again after a transient error, by error kind (timeout, "
                         "sandbox_unavailable, sandbox_error, worker_crashed).", ["kind"])
STEP = Gauge("everstep_controller_job_step", "Training steps completed.", ["job_id"])
POLICY_VERSION = Gauge("everstep_controller_policy_version", "Policy version the job's engines run.", ["job_id"])
REWARD_MEAN = Gauge("everstep_controller_reward_mean", "Mean reward of the samples scored in the latest step.",
                    ["job_id"])
REWARD_KL_PENALTY = Gauge("everstep_controller_reward_kl_penalty_mean",
                          "trainer.kl_in_reward: mean KL penalty subtracted from the rewards of the latest step "
                          "(reward_mean is before it).", ["job_id"])
REWARD_KL_COEF = Gauge("everstep_controller_reward_kl_coef",
                       "trainer.kl_in_reward: the coefficient of the latest step's KL penalty.", ["job_id"])
EVAL_ACCURACY = Gauge("everstep_controller_eval_accuracy_ratio",
                      "Held-out accuracy (kind: sampled (avg@k), greedy, pass_at_k or maj_at_k).",
                      ["job_id", "kind"])
# the job's rollout throughput is rate(_rollout_tokens_total) / rate(_rollout_seconds_total): counters, not a
# gauge of the latest step's quotient (which a scrape between two steps would miss)
ROLLOUT_TOKENS = Counter("everstep_controller_rollout_tokens_total",
                         "Output tokens generated in the job's rollout phases.", ["job_id"])
ROLLOUT_SECONDS = Counter("everstep_controller_rollout_seconds_total",
                          "Wall seconds of the job's rollout phases.", ["job_id"])
ITERATION_SECONDS = Histogram("everstep_controller_iteration_seconds", "Wall time of one C3PO++ iteration.",
                              buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800))
PHASE_SECONDS = Histogram("everstep_controller_phase_seconds", "Time per iteration phase.", ["phase"],
                          buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 1200))
TOKENS_PER_ITERATION = Histogram("everstep_controller_tokens_per_iteration", "Output tokens generated per iteration.",
                                 buckets=(1e2, 1e3, 1e4, 3e4, 1e5, 3e5, 1e6, 1e7))
GENERATED_TOKENS = Counter("everstep_controller_generated_tokens_total", "Output tokens generated for training.")
PARTIAL_BUFFER = Gauge("everstep_controller_partial_buffer_size", "Unfinished rollouts carried to the next iteration.",
                       ["job_id"])
RETENTION = Histogram("everstep_controller_retention_iterations", "Carry-overs of each carried rollout.",
                      buckets=(0, 1, 2, 3, 4, 6, 8, 16))
PURGED = Counter("everstep_controller_purged_samples_total", "Rollouts purged by the retention limit.")
DROPPED_GROUPS = Counter("everstep_controller_dropped_groups_total", "Groups with fewer than two surviving members.")
ZERO_SIGNAL_GROUPS = Counter("everstep_controller_zero_signal_groups_total",
                             "Groups left out of training because all rewards were equal.")
TRAINED_SAMPLES = Counter("everstep_controller_trained_samples_total", "Samples sent to the trainer.")
RESUMES = Counter("everstep_controller_job_resumes_total",
                  "Jobs continued by a new runner, by where from: live-workers, checkpoint, start-over.", ["source"])
WORKER_FAILURES = Counter("everstep_controller_worker_failures_total",
                          "Calls that failed for a cause a restart or retry may fix (down, killed, past their "
                          "deadline), by service; each is followed by a restart of the worker or a retry.",
                          ["service"])
RECLAIMED = Counter("everstep_controller_reclaimed_entries_total",
                    "Queue entries taken over from a consumer that stopped (XAUTOCLAIM).", ["queue"])
DUPLICATE_DELIVERIES = Counter("everstep_controller_duplicate_deliveries_total",
                               "Queue entries delivered again whose work was already stored (skipped).", ["queue"])
QUEUE_DEPTH = Gauge("everstep_controller_queue_depth_entries",
                    "Entries of a work queue: undelivered, or delivered and pending acknowledgement. "
                    "queue=jobs: submitted jobs; queue=rollouts: finished rollouts awaiting scores.",
                    ["queue", "status"])
TRACKER_FAILURES = Counter("everstep_controller_tracker_failures_total",
                           "Calls to an experiment tracker (the job's tracking section) that failed, by backend "
                           "(tensorboard, wandb, mlflow) and operation (open, log_step, log_evaluation, rewind, "
                           "close); the job goes on.", ["backend", "operation"])
STALENESS = Histogram("everstep_controller_staleness_versions", "Policy versions behind, per trained token.",
                      buckets=(0, 1, 2, 3, 4, 8, 16))


def observe_iteration(job_id: str, record: StepMetrics, retention_ages: list[int], staleness: list[int]) -> None:
    STEP.labels(job_id=job_id).set(record.step)
    POLICY_VERSION.labels(job_id=job_id).set(record.policy_version)
    REWARD_MEAN.labels(job_id=job_id).set(record.reward_mean)
    if record.reward_kl_penalty_mean is not None:
        REWARD_KL_PENALTY.labels(job_id=job_id).set(record.reward_kl_penalty_mean)
        REWARD_KL_COEF.labels(job_id=job_id).set(record.reward_kl_coef or 0.0)
    ROLLOUT_TOKENS.labels(job_id=job_id).inc(record.generated_tokens)
    ROLLOUT_SECONDS.labels(job_id=job_id).inc(record.rollout_seconds)
    PARTIAL_BUFFER.labels(job_id=job_id).set(record.partial_buffer_size)
    ITERATION_SECONDS.observe(record.iteration_seconds)
    for phase, seconds in (("rollout", record.rollout_seconds), ("reward", record.reward_seconds),
                           ("train", record.train_seconds), ("weight_push", record.weight_push_seconds)):
        PHASE_SECONDS.labels(phase=phase).observe(seconds)
    TOKENS_PER_ITERATION.observe(record.generated_tokens)
    GENERATED_TOKENS.inc(record.generated_tokens)
    PURGED.inc(record.num_samples_purged)
    DROPPED_GROUPS.inc(record.num_groups_dropped)
    ZERO_SIGNAL_GROUPS.inc(record.num_groups_zero_signal)
    UNSCORABLE_GROUPS.inc(record.num_groups_unscorable)
    TRAINED_SAMPLES.inc(record.num_samples_trained)
    for age in retention_ages:
        RETENTION.observe(age)
    # one observation per token would be costly at scale; the histogram takes a sample
    for versions_behind in staleness[:: max(1, len(staleness) // 1000)]:
        STALENESS.observe(versions_behind)


TOOL_CALLS = Counter("everstep_controller_tool_calls_total",
                     "Tool calls of the trained samples, by error kind ('none': ran as asked).", ["job_id", "kind"])
TOOL_TURNS = Gauge("everstep_controller_tool_turns_per_sample", "Mean model turns per trained sample, latest step.",
                   ["job_id"])
TOOL_USE_RATE = Gauge("everstep_controller_tool_use_ratio",
                      "Fraction of the latest step's trained samples that called a tool.", ["job_id"])
TOOL_SECONDS = Gauge("everstep_controller_tool_call_seconds",
                     "Mean seconds from a tool call to its reply, latest step.", ["job_id"])


def observe_tools(job_id: str, record: StepMetrics) -> None:
    """The step's tool use (a job with tools: every step; without, nothing)."""
    if record.turns_per_sample is None:
        return
    TOOL_TURNS.labels(job_id=job_id).set(record.turns_per_sample)
    TOOL_USE_RATE.labels(job_id=job_id).set(record.tool_use_rate or 0.0)
    TOOL_SECONDS.labels(job_id=job_id).set(record.tool_seconds_mean or 0.0)
    errors = record.tool_errors or {}
    TOOL_CALLS.labels(job_id=job_id, kind="none").inc((record.num_tool_calls or 0) - sum(errors.values()))
    for kind, count in errors.items():
        TOOL_CALLS.labels(job_id=job_id, kind=kind).inc(count)


ENGINE_TOKENS = Counter("everstep_controller_engine_tokens_total",
                        "Output tokens the model decoded on each rollout engine of the job's pool, in its rollout "
                        "phases (tool replies not counted); rate() of it over the job's is each engine's share.",
                        ["job_id", "engine"])
ENGINE_VERSION = Gauge("everstep_controller_engine_weight_version",
                       "Policy version of the weights each rollout engine of the job's pool holds.",
                       ["job_id", "engine"])


def count_engine_tokens(job_id: str, engine: str, tokens: int, weight_version: int) -> None:
    """One step of one engine of the pool: its decoded tokens and the version it now holds."""
    ENGINE_TOKENS.labels(job_id=job_id, engine=engine).inc(tokens)
    ENGINE_VERSION.labels(job_id=job_id, engine=engine).set(weight_version)


def count_tracker_failure(backend: str, operation: str) -> None:
    TRACKER_FAILURES.labels(backend=backend, operation=operation).inc()


# every metric labelled by job_id, found rather than listed so that a new one cannot be forgotten
PER_JOB: tuple[MetricWrapperBase, ...] = tuple(
    m for m in list(globals().values()) if isinstance(m, MetricWrapperBase) and "job_id" in m._labelnames)

_removal_due: dict[str, float] = {}  # job id -> time.monotonic() at which its series go
_removal_lock = threading.Lock()


def remove_job_series(job_id: str) -> None:
    """Removes every series of `PER_JOB` labelled with this job id (each label combination it used)."""
    with _removal_lock:
        _removal_due.pop(job_id, None)
    for metric in PER_JOB:
        names = metric._labelnames
        keys = {tuple(sample.labels[name] for name in names)
                for family in metric.collect() for sample in family.samples
                if sample.labels.get("job_id") == job_id}
        for key in keys:
            with contextlib.suppress(KeyError):  # removed meanwhile
                metric.remove(*key)


def remove_job_series_later(job_id: str, after_seconds: float, now: float | None = None) -> None:
    """Schedules `remove_job_series` (done by `remove_due_job_series`)."""
    with _removal_lock:
        _removal_due[job_id] = (time.monotonic() if now is None else now) + after_seconds


def keep_job_series(job_id: str) -> None:
    """The job runs here again: its series are no longer due for removal."""
    with _removal_lock:
        _removal_due.pop(job_id, None)


def remove_due_job_series(now: float | None = None) -> list[str]:
    """Removes the series of the jobs whose removal is due; returns those jobs' ids."""
    now = time.monotonic() if now is None else now
    with _removal_lock:
        due = [job_id for job_id, at in _removal_due.items() if at <= now]
    for job_id in due:
        remove_job_series(job_id)
    return due
