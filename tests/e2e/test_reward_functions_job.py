"""The user's reward functions end to end: files written here (no file the project ships), submitted with
`everstep submit` (which sends their source; the files are gone before the job runs), scored by the reward
service of `everstep up` in its isolated workers, training the shipped demo model. A function that raises on
some rows and returns junk on others leaves those rows unscorable, reported with the exception's text, and the
job completes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from stack_jobs import ENDED, UpStack, everstep_up

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo-model"

VERL_STYLE = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    boxed = re.findall(r"\\\\boxed\\{\\s*([^{}]*?)\\s*\\}", solution_str)
    return {"score": 1.0 if boxed and boxed[-1] == ground_truth else 0.0, "boxed": float(bool(boxed))}
'''

TRL_STYLE = '''
import re

async def boxed_reward(prompts, completions, answer, **kwargs):
    out = []
    for completion, expected in zip(completions, answer):
        boxed = re.findall(r"\\\\boxed\\{\\s*([^{}]*?)\\s*\\}", completion)
        out.append(1.0 if boxed and boxed[-1] == expected else 0.0)
    return out
'''

BAD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth.endswith("7"):
        raise ValueError("no rule for sevens")
    if ground_truth.endswith("3"):
        return "three"
    return 1.0 if ground_truth in solution_str else 0.0
'''


def _job(tmp_path: Path, name: str, functions: dict[str, tuple[str, str]]) -> Path:
    """A job file in its own folder, with each function's file beside it (relative paths)."""
    folder = tmp_path / name
    folder.mkdir()
    entries = []
    for file, (source, function) in functions.items():
        (folder / file).write_text(source)
        entries.append({"path": file, "name": function, "weight": 1.0 / len(functions)})
    spec = {
        "name": name, "model_path": str(DEMO), "dataset": {"train_path": str(DEMO / "train.jsonl")},
        "reward": {"functions": entries}, "algorithm": {"group_size": 8},
        "sampling": {"temperature": 1.0, "max_new_tokens": 200},
        "scheduler": {"mode": "c3po", "token_budget": 4096, "pool_capacity": 128, "retention": 2},
        "trainer": {"learning_rate": 3e-4}, "steps": 2, "seed": 3,
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _submit(stack: UpStack, job_file: Path) -> str:
    submitted = stack.everstep("submit", str(job_file), "--url", stack.url)
    assert submitted.returncode == 0, submitted.stderr
    for file in job_file.parent.iterdir():  # the job runs the source it was submitted with
        file.unlink()
    return submitted.stdout.strip().splitlines()[-1]


def _wait(api: httpx.Client, job_id: str, timeout_seconds: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_seconds
    while (job := api.get(f"/v1/jobs/{job_id}").json())["state"] not in ENDED:
        assert time.monotonic() < deadline, f"job still {job['state']} at step {job['step']}"
        time.sleep(1)
    return job


@pytest.mark.slow
def test_verl_and_trl_functions_train_and_a_bad_one_leaves_rows_unscorable(tmp_path: Path) -> None:
    with everstep_up(tmp_path / "home") as stack:
        api = httpx.Client(base_url=stack.url, timeout=30)
        good = _submit(stack, _job(tmp_path, "functions", {"verl_reward.py": (VERL_STYLE, "compute_score"),
                                                           "trl_reward.py": (TRL_STYLE, "boxed_reward")}))
        bad = _submit(stack, _job(tmp_path, "bad-function", {"bad_reward.py": (BAD, "compute_score")}))

        job = _wait(api, good)
        assert job["state"] == "SUCCEEDED", job["error"]
        assert "def compute_score" in job["spec"]["reward"]["functions"][0]["source"], "shipped with the job"
        history = api.get(f"/v1/jobs/{good}/metrics").json()
        assert [m["step"] for m in history] == [1, 2]
        assert sum(m["num_samples_trained"] for m in history) > 0, history
        assert all(0.0 <= m["reward_mean"] <= 1.0 for m in history)
        scored = [m for m in history if m["num_samples_scored"]]
        assert scored and all(0.0 <= m["reward_metrics"]["function:verl_reward.compute_score/boxed"] <= 1.0
                              for m in scored), "the dict's other keys are reported"
        assert not job["dataset"]["unscorable"]

        job = _wait(api, bad)
        assert job["state"] == "SUCCEEDED", job["error"]
        unscorable = job["dataset"]["unscorable"]
        assert unscorable, "rows whose function failed are listed"
        assert {u["kind"] for u in unscorable} == {"function_error"}
        reasons = " | ".join(u["reason"] for u in unscorable)
        assert "ValueError: no rule for sevens" in reasons or "'three', not a finite number" in reasons, reasons
        metrics = api.get(f"/v1/jobs/{bad}/metrics").json()
        assert [m["step"] for m in metrics] == [1, 2]
        assert sum(m["num_groups_unscorable"] for m in metrics) > 0
