"""`everstep status JOB`: a job's record as a short readable summary (`--json` prints the record itself).

Its state and step, the error of a failed job, the latest step's metrics (as `everstep logs` prints a step),
the evaluations, the checkpoints and the latest weights, where its experiment tracking goes, the workers, the
resumes and the dataset report.
"""

from __future__ import annotations

import time
from typing import Any

from everstep_cli.logs import eval_line, step_line

_MAX_CHECKPOINTS = 5  # the latest ones; the record has them all (--json)


def _when(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds)) if seconds else "?"


def _tracking(spec: dict[str, Any]) -> str:
    """Where the job's curves go besides REST (the spec's tracking section)."""
    parts = []
    if spec.get("tensorboard"):
        parts.append(f"tensorboard {spec['tensorboard']['log_dir']}")
    if spec.get("wandb"):
        parts.append(f"wandb project {spec['wandb']['project']} ({spec['wandb'].get('mode', 'offline')})")
    if spec.get("mlflow"):
        parts.append(f"mlflow {spec['mlflow']['tracking_uri']} experiment {spec['mlflow'].get('experiment_name')}")
    return "; ".join(parts)


def summary_lines(record: dict[str, Any]) -> list[str]:
    steps = record["spec"]["steps"]
    lines = [f"job {record['id']} ({record['name']}): {record['state']} at step {record['step']}/{steps}",
             f"  created {_when(record.get('created_at'))}, updated {_when(record.get('updated_at'))}"]
    if record.get("error"):
        lines.append(f"  error: {record['error']}")
    metrics = record.get("metrics")
    lines.append(f"  latest {step_line(metrics, steps)}" if metrics else "  no step completed yet")
    evaluations = sorted((record.get("evaluation") or {}).values(), key=lambda e: e["step"])
    lines += [f"  {eval_line(e)}" for e in evaluations]
    checkpoints = record.get("checkpoints") or []
    if checkpoints:
        shown = checkpoints[-_MAX_CHECKPOINTS:]
        more = f" ({len(checkpoints) - len(shown)} earlier not shown)" if len(checkpoints) > len(shown) else ""
        lines.append(f"  checkpoints{more}:")
        lines += [f"    step {c['step']:>4}  {c['path']}" for c in shown]
    lines.append(f"  latest weights: {record.get('latest_weights') or 'none yet (no checkpoint)'}")
    tracking = _tracking(record["spec"].get("tracking") or {})
    if tracking:
        lines.append(f"  tracking: {tracking}")
    workers = record.get("workers")
    if workers:
        lines.append(f"  workers ({workers['launcher']}): rollout {workers['rollout']}, trainer {workers['trainer']}")
    resumes = record.get("resumes") or []
    if resumes:
        last = resumes[-1]
        reason = f": {last['reason']}" if last.get("reason") else ""
        lines.append(f"  resumed {len(resumes)}x; last from step {last['from_step']} ({last['source']}{reason})")
    dataset = record.get("dataset")
    if dataset:
        unscorable = len(dataset.get("unscorable") or [])
        lines.append(f"  dataset: {dataset['num_rows']} rows, {dataset['num_skipped']} skipped"
                     + (f", {unscorable} found unscorable" if unscorable else ""))
    return lines
