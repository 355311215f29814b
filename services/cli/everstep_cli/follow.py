"""Follows a job with a progress bar until it ends."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

from everstep.rest.job_record import TERMINAL_STATES
from everstep.rest.step_metrics import Evaluation, StepMetrics
from everstep_cli.rest_client import ControllerClient


def follow_job(client: ControllerClient, job_id: str, poll_seconds: float = 1.0) -> dict[str, Any]:
    """Shows step, reward, accuracy and tokens/s; returns the final job record."""
    record = client.job(job_id)
    total = record["spec"]["steps"]
    with tqdm(total=total, desc=f"job {job_id}", unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
        while True:
            bar.update(record["step"] - bar.n)
            latest = StepMetrics.model_validate(record["metrics"]) if record.get("metrics") else None
            evaluation = record.get("evaluation") or {}
            last_eval = Evaluation.model_validate(evaluation[max(evaluation, key=int)]) if evaluation else None
            bar.set_postfix(state=record["state"], reward=f"{latest.reward_mean if latest else 0:.3f}",
                            acc=f"{(last_eval.accuracy if last_eval else None) or 0:.3f}",
                            **({"pass_k": f"{last_eval.pass_at_k:.3f}"} if last_eval and last_eval.pass_at_k is not None
                               else {}),
                            tok_s=f"{latest.tokens_per_s if latest else 0:.0f}", refresh=False)
            bar.refresh()
            if record["state"] in TERMINAL_STATES:
                return record
            time.sleep(poll_seconds)
            record = client.job(job_id)
