"""benchmarks.multi_turn at tiny sizes: both parts run on real processes (the calculator environment; Redis, the
reward service, a rollout engine and a trainer) and the last line is the JSON summary with its headline fields."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_multi_turn_benchmark_reports_its_three_figures(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.run(
        [sys.executable, "-m", "benchmarks.multi_turn", "--tool-latency", "0.05", "--num-sequences", "6",
         "--max-running", "3", "--repeats", "1", "--max-turns", "3", "--max-new-tokens", "160", "--group-size", "2",
         "--prompts-per-iteration", "2", "--trained-samples", "8", "--eval-prompts", "3", "--eval-samples-per-prompt",
         "2", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == result
    for field in ("concurrent_vs_serial_ratio", "c3po_rollout_speedup"):
        assert isinstance(result[field], float) and result[field] > 0, (field, result[field])
    # the reward ratio is the final policies' held-out reward, c3po's over sync's: both jobs were evaluated before and
    # after training on 3 x 2 fresh samples (none unscored). At this size either reward may be 0, and with sync's at
    # 0 there is no ratio. The trained samples' ratio (last 20% of steps) is kept beside it.
    c3po_run = result["c3po"]
    for mode in ("sync", "c3po"):
        before, after = c3po_run[mode]["eval_before"], c3po_run[mode]["eval_after"]
        assert before["step"] == 0 and after["step"] == c3po_run[mode]["steps"], (mode, before, after)
        assert before["num_samples"] == after["num_samples"] == 6
        assert 0 <= after["reward"] <= 1 and after["standard_error"] >= 0
    sync_after, c3po_after = c3po_run["sync"]["eval_after"]["reward"], c3po_run["c3po"]["eval_after"]["reward"]
    if sync_after:
        assert result["c3po_reward_ratio"] == round(c3po_after / sync_after, 3) >= 0
        assert result["c3po_reward_ratio_se"] >= 0
    else:
        assert result["c3po_reward_ratio"] is None
    if c3po_run["reward_sync"]:
        assert result["reward_ratio_last_20pct"] == round(c3po_run["reward_c3po"] / c3po_run["reward_sync"], 3) >= 0
    loop = result["loop"]
    # every mode wrote exactly the same seeded tokens (the engine with 3 slots for 6 sequences, the serial loops in
    # two static batches), and the trajectories did call the tool
    assert loop["same_sequences"] is True
    assert sorted(r["mode"] for r in loop["runs"]) == ["concurrent", "step_sync", "turn_sync"]
    assert all(r["tool_calls"] > 0 and r["tool_tokens"] > 0 and r["tool_errors"] == 0 for r in loop["runs"])
    assert len({(r["model_tokens"], r["turns"], r["tool_calls"]) for r in loop["runs"]}) == 1
    c3po = result["c3po"]
    assert c3po["reached_trained_samples"] is True
    assert c3po["sync"]["num_tool_calls"] > 0 and c3po["c3po"]["num_tool_calls"] > 0


def _pair(seed: int, sync: float, c3po: float, speedup: float) -> dict:
    def run(reward: float) -> dict:
        evaluation = {"reward": reward, "standard_error": 0.01}
        return {"eval_before": {"reward": 0.5, "standard_error": 0.01}, "eval_after": evaluation, "max_staleness": 0}

    return {"config": {"seed": seed}, "rollout_speedup": speedup, "e2e_speedup": speedup, "reward_ratio_eval": 0.0,
            "sync": run(sync), "c3po": run(c3po)}


def test_pairs_give_a_median_speedup_a_pooled_ratio_and_a_verdict() -> None:
    from benchmarks.multi_turn import reward_verdict, summarize_pairs

    summary = summarize_pairs([_pair(1, 0.70, 0.70, 1.2), _pair(2, 0.60, 0.63, 2.0), _pair(3, 0.80, 0.77, 1.5)])
    assert summary["rollout_speedup_median"] == 1.5 and summary["num_pairs"] == 3
    assert summary["reward_ratio"] == 1.0 and summary["base_reward_ratio"] == 1.0
    # the pairs' spread (residuals 0, 0.03, -0.03 around a ratio of 1) is above the evaluations' binomial error
    assert summary["reward_ratio_se"] == round(math.sqrt(0.0018 / 2 / 3) / 0.7, 3)
    assert summary["reward_verdict"] == "holds"
    assert [p["seed"] for p in summary["per_pair"]] == [1, 2, 3]
    assert reward_verdict(0.9, 0.03) == "loses" and reward_verdict(0.95, 0.031) == "undecided"
    assert reward_verdict(0.96, 0.025) == "holds"
    # one pair: the evaluations' binomial error alone
    single = summarize_pairs([_pair(1, 0.5, 0.5, 1.0)])
    assert single["reward_ratio_se"] == round(math.hypot(0.01 / 0.5, 0.01 / 0.5), 3)
