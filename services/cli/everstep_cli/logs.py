"""`everstep logs JOB`: a job's per-step history as readable lines, optionally following it to its end.

One line per training step (from GET /v1/jobs/{id}/metrics): reward, samples trained, the key statistics
of the trainer when the step trained a batch; and one line per held-out evaluation (the job record's
`evaluation`), after the step it was measured at ("step 0": the base model).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from everstep.rest.job_record import TERMINAL_STATES
from everstep_cli.rest_client import ControllerClient

# trainer statistics shown when present: (field, label, format)
_TRAIN_STATS = (("loss", "loss", "{:.4g}"), ("grad_norm", "grad_norm", "{:.3g}"),
                ("masked_fraction", "masked", "{:.3f}"), ("mismatch_kl", "kl", "{:.2e}"),
                ("entropy", "entropy", "{:.3f}"), ("learning_rate", "lr", "{:.2e}"))


def step_line(row: dict[str, Any], steps: int) -> str:
    """One metrics row as a line: step, reward, trained samples, staleness, tokens/s, trainer statistics."""
    parts = [f"step {row['step']:>4}/{steps}", f"reward {row['reward_mean']:.3f}",
             f"trained {row['num_samples_trained']} ({row['num_trained_samples_total']} total)",
             f"groups {row['num_groups_trained']}", f"staleness {row['staleness_mean']:.2f}",
             f"tok/s {row['tokens_per_s']:.0f}", f"{row['iteration_seconds']:.1f}s"]
    parts += [f"{label} {fmt.format(row[name])}" for name, label, fmt in _TRAIN_STATS if row.get(name) is not None]
    return "  ".join(parts)


def eval_line(evaluation: dict[str, Any]) -> str:
    accuracy = evaluation.get("accuracy")
    text = (f"eval {evaluation['step']:>4}  accuracy {'n/a' if accuracy is None else f'{accuracy:.3f}'} "
            f"(avg@{evaluation['k']}, {evaluation['num_prompts']} prompts)")
    k = evaluation["k"]
    for name, label in (("pass_at_k", f"pass@{k}"), ("maj_at_k", f"maj@{k}"), ("greedy_accuracy", "greedy")):
        if evaluation.get(name) is not None:
            text += f"  {label} {evaluation[name]:.3f}"
    return text


def print_logs(client: ControllerClient, job_id: str, *, follow: bool = False, poll_seconds: float = 1.0,
               out: TextIO | None = None) -> dict[str, Any]:
    """Prints the job's history; with `follow`, keeps printing new steps and evaluations until the job
    ends, then its final state. Returns the last job record read."""
    out = out or sys.stdout
    printed_steps: set[int] = set()
    printed_evals: set[str] = set()
    while True:
        record = client.job(job_id)  # first: a step committed after it is printed on the next round
        rows = client.metrics(job_id)
        evaluations = record.get("evaluation") or {}
        last = not follow or record["state"] in TERMINAL_STATES  # then every evaluation is printed
        steps = record["spec"]["steps"]
        lines: list[tuple[int, int, str]] = []
        for row in rows:
            if row["step"] not in printed_steps:
                printed_steps.add(row["step"])
                lines.append((row["step"], 0, step_line(row, steps)))
        for key, evaluation in evaluations.items():
            if key not in printed_evals and (last or int(key) == 0 or int(key) in printed_steps):
                printed_evals.add(key)
                lines.append((int(key), 1, eval_line(evaluation)))
        for _, _, line in sorted(lines):
            print(line, file=out, flush=True)
        if last:
            break
        time.sleep(poll_seconds)
    if follow:
        error = f": {record['error']}" if record.get("error") else ""
        print(f"job {job_id} {record['state']} at step {record['step']}/{steps}{error}", file=out, flush=True)
    return record
