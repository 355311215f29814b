"""Each advantage estimator, paired with each policy-loss mode, trains the demo model (examples/demo-model) for two
steps through `everstep up`: the job's choice reaches the controller's batch and the trainer's loss."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from stack_jobs import everstep_up, run_job

DEMO_MODEL = Path(__file__).resolve().parents[2] / "examples" / "demo-model"

ARMS = [  # every estimator once, every loss mode once, and the options that go with some of them
    {"advantage": "grpo", "loss": {"mode": "ppo", "clip_ratio_c": 3.0}},
    {"advantage": "dr_grpo", "loss": {"mode": "gspo", "clip_low": 3e-4, "clip_high": 4e-4,
                                      "aggregation": "seq-mean-token-sum-norm"}},
    {"advantage": "rloo", "loss": {"mode": "cispo", "correction_level": "sequence", "correction": "tis"}},
    {"advantage": "reinforce_plus_plus", "loss": {"mode": "clip_cov", "clip_cov_ratio": 0.05}},
    {"advantage": "reinforce_plus_plus_baseline", "loss": {"mode": "kl_cov", "correction_level": "geometric",
                                                           "aggregation": "seq-mean-token-sum"}},
]


@pytest.mark.slow
def test_each_estimator_and_loss_mode_trains_the_demo_model_through_the_stack(tmp_path: Path) -> None:
    with everstep_up(tmp_path / "home") as stack:
        api = httpx.Client(base_url=stack.url, timeout=30)
        for arm in ARMS:
            spec = {
                "name": f"algos-{arm['advantage']}-{arm['loss']['mode']}",
                "model_path": str(DEMO_MODEL),
                "dataset": {"train_path": str(DEMO_MODEL / "train.jsonl")},
                "algorithm": {"group_size": 4, "drop_zero_signal_groups": False, **arm},
                "sampling": {"temperature": 1.0, "max_new_tokens": 48},
                "scheduler": {"mode": "sync", "prompts_per_iteration": 4},
                "trainer": {"learning_rate": 3e-4, "lr_schedule": "linear", "min_lr_ratio": 0.5},
                "steps": 2,
                "seed": 1,
            }
            job = run_job(api, spec, timeout_seconds=600)
            assert job["state"] == "SUCCEEDED", (arm, job["error"])
            assert job["spec"]["algorithm"]["advantage"] == arm["advantage"]
            history = api.get(f"/v1/jobs/{job['id']}/metrics").json()
            assert [m["step"] for m in history] == [1, 2], arm
            assert all(m["num_samples_trained"] == 16 for m in history), (arm, history)
            assert history[-1]["policy_version"] == 2, (arm, history)
            # linear from 3e-4 to half of it over the job's two steps: the schedule reached the trainer
            assert [m["learning_rate"] for m in history] == pytest.approx([3e-4, 2.25e-4]), arm
