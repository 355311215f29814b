"""The KL term in the reward (trainer.kl_in_reward, adaptive coefficient) through `everstep up` on the demo model
(examples/demo-model) for two steps: the trainer's ReferenceKl sums reach the controller, which subtracts them
(times the coefficient) from the scores before GRPO; the metrics rows report the reward's KL, its coefficient and
the mean penalty apart from the raw reward mean, and each sample its penalty; a spec asking for the KL in the reward
without a coefficient is refused at submission."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from stack_jobs import everstep_up, run_job

DEMO_MODEL = Path(__file__).resolve().parents[2] / "examples" / "demo-model"
KL_COEF, KL_TARGET, KL_HORIZON, GROUP_SIZE, PROMPTS = 0.5, 1e-3, 16, 4, 4


def _grpo(rewards: list[float]) -> list[float]:
    """(R_i - mean) / (population std + 1e-6), from the formula."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


@pytest.mark.slow
def test_the_kl_penalty_is_taken_off_the_rewards_before_the_advantages(tmp_path: Path) -> None:
    spec = {
        "name": "kl-in-reward", "model_path": str(DEMO_MODEL),
        "dataset": {"train_path": str(DEMO_MODEL / "train.jsonl")},
        "algorithm": {"group_size": GROUP_SIZE, "drop_zero_signal_groups": False},
        "sampling": {"temperature": 1.0, "max_new_tokens": 48},
        "scheduler": {"mode": "sync", "prompts_per_iteration": PROMPTS},
        "trainer": {"learning_rate": 1e-3, "kl_coef": KL_COEF, "kl_in_reward": True, "kl_target": KL_TARGET,
                    "kl_horizon": KL_HORIZON},
        "steps": 2, "seed": 1,
    }
    with everstep_up(tmp_path / "home") as stack:
        api = httpx.Client(base_url=stack.url, timeout=30)
        refused = api.post("/v1/jobs", json={**spec, "trainer": {"kl_in_reward": True}})
        assert refused.status_code == 422 and "kl_in_reward" in refused.text and "kl_coef" in refused.text

        job = run_job(api, spec, timeout_seconds=600)
        assert job["state"] == "SUCCEEDED", job["error"]
        first, second = api.get(f"/v1/jobs/{job['id']}/metrics").json()
        for row in (first, second):
            assert (row["reference_kl"], row["kl_coef"]) == (0.0, 0.0), "no KL term in the loss"
            assert row["num_samples_trained"] == GROUP_SIZE * PROMPTS
        # step 1 samples with the reference itself: no KL, and the adaptive coefficient shrinks by its most
        assert (first["reward_kl"], first["reward_kl_penalty_mean"], first["reward_kl_coef"]) == (0.0, 0.0, KL_COEF)
        shrunk = KL_COEF * (1 - 0.2 * min(1, GROUP_SIZE * PROMPTS / KL_HORIZON))
        assert second["reward_kl_coef"] == pytest.approx(shrunk, rel=1e-12)
        assert second["reward_kl"] > 0 and second["reward_kl_penalty_mean"] > 0
        assert first["reward_kl_seconds"] > 0 and second["reward_kl_seconds"] > 0

        samples = api.get(f"/v1/jobs/{job['id']}/samples", params={"step": 2}).json()
        groups: dict[str, list[dict]] = defaultdict(list)
        for sample in samples:
            groups[sample["group_id"]].append(sample)
        assert sorted(len(g) for g in groups.values()) == [GROUP_SIZE] * PROMPTS
        assert sum(s["kl_penalty"] for s in samples) / len(samples) == pytest.approx(
            second["reward_kl_penalty_mean"], rel=1e-9)
        moved = 0.0
        for members in groups.values():
            penalised = _grpo([s["reward"] - s["kl_penalty"] for s in members])
            assert [s["advantage"] for s in members] == pytest.approx(penalised, rel=1e-6, abs=1e-9)
            moved = max(moved, *(abs(a - b) for a, b in zip(penalised, _grpo([s["reward"] for s in members]),
                                                            strict=True)))
        assert moved > 1e-3, "the penalty changed the advantages GRPO gives the scores alone"
        exported = httpx.get(f"{stack.url}/metrics", timeout=10).text
        assert f'everstep_controller_reward_kl_penalty_mean{{job_id="{job["id"]}"}}' in exported
