"""`everstep demo`: the main job in one command.

Builds the demo model if absent (in a subprocess: the trainer package owns it), brings the
local stack up, submits the demo spec over REST, follows it, writes a plot, the per-step
metrics and a summary into the output folder, and brings the stack down.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from everstep_controller.follow import follow_job
from everstep_controller.job_file import load_job_file
from everstep_controller.local_stack import LocalStack, free_port
from everstep_controller.rest_client import ControllerClient
from everstep_controller.step_metrics import Evaluation, StepMetrics

log = logging.getLogger(__name__)


def ensure_demo_model(model_path: Path) -> None:
    if (model_path / "config.json").exists():
        return
    print(f"building the demo model in {model_path} (one time, about 10 minutes on 2 cores)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "everstep_trainer.demo", "--out", str(model_path)], check=True)


def run_demo(spec_path: Path, out: Path, *, port: int = 0) -> dict[str, Any]:
    started = time.monotonic()
    spec = load_job_file(spec_path)
    ensure_demo_model(Path(spec["model_path"]))
    out.mkdir(parents=True, exist_ok=True)
    stack = LocalStack(out / "stack")
    print("starting the local stack", file=sys.stderr)
    state = stack.up(port=port or free_port())
    try:
        client = ControllerClient(state.controller_url)
        job_started = time.monotonic()
        job_id = client.submit(spec)["id"]
        record = follow_job(client, job_id)
        job_seconds = time.monotonic() - job_started
        history = client.metrics(job_id)
    finally:
        stack.down()
    if record["state"] != "SUCCEEDED":
        raise RuntimeError(f"demo job {job_id} ended {record['state']}: {record.get('error')}; "
                           f"logs in {out / 'stack' / 'logs'}")
    evaluation = {int(step): Evaluation.model_validate(e) for step, e in record["evaluation"].items()}
    base, final = evaluation[0], evaluation[record["spec"]["steps"]]
    steps = [StepMetrics.model_validate(m) for m in history]
    first, last = steps[: max(1, len(steps) // 5)], steps[-max(1, len(steps) // 5):]
    summary = {
        "job_id": job_id,
        "base_accuracy": base.accuracy,
        "final_accuracy": final.accuracy,
        "base_greedy_accuracy": base.greedy_accuracy,
        "final_greedy_accuracy": final.greedy_accuracy,
        "eval_samples_per_prompt": final.k,
        "eval_prompts": final.num_prompts,
        "steps": record["step"],
        "reward_first_steps": _mean([m.reward_mean for m in first]),
        "reward_last_steps": _mean([m.reward_mean for m in last]),
        "response_tokens_first_steps": _mean([_response_tokens(m) for m in first]),
        "response_tokens_last_steps": _mean([_response_tokens(m) for m in last]),
        "job_seconds": round(job_seconds, 1),
        "wall_seconds": round(time.monotonic() - started, 1),
        "plot": str(out / "demo.png"),
    }
    (out / "metrics.json").write_text(json.dumps(history, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_demo(steps, evaluation, out / "demo.png")
    return summary


def plot_demo(history: list[StepMetrics], evaluation: dict[int, Evaluation], path: Path) -> None:
    """evaluation: by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([m.step for m in history], [m.reward_mean for m in history], label="training reward (mean)")
    steps = sorted(evaluation)
    ax.plot(steps, [evaluation[s].accuracy for s in steps], "o-",
            label=f"held-out accuracy avg@{evaluation[steps[-1]].k}")
    if evaluation[steps[-1]].greedy_accuracy is not None:
        ax.plot(steps, [evaluation[s].greedy_accuracy for s in steps], "s--", label="held-out greedy")
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    lengths = ax.twinx()  # RL on the demo model learns to show its work: solutions get longer
    lengths.plot([m.step for m in history], [_response_tokens(m) for m in history], ":", color="gray",
                 label="response tokens (mean)")
    lengths.set_ylabel("response tokens")
    lengths.set_ylim(bottom=0)
    ax.set_title("everstep demo: GRPO + IcePop with C3PO++ rollouts")
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = lengths.get_legend_handles_labels()
    ax.legend(handles + more_handles, labels + more_labels, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _response_tokens(metrics: StepMetrics) -> float:
    """Mean length of the rollouts that finished in a step."""
    return metrics.finished_tokens / max(1, metrics.num_finished_rollouts)
