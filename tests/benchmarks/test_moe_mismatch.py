"""benchmarks.mismatch.moe at a tiny size: a tiny random Qwen3-MoE with the demo task's prompts, nine arms (a float32
control, a bfloat16 engine with none / TIS / IcePop / R3 / R3 + IcePop, R3 + IcePop in [0.5, 2], at sequence
level and as a mask alone), one process; and the refusals of --model."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
from conftest import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
ARMS = ["fp32-none", "bf16-none", "bf16-tis", "bf16-icepop", "bf16-r3", "bf16-r3-icepop", "bf16-r3-icepop-b2",
        "bf16-r3-seq", "bf16-r3-mask"]


@pytest.fixture(scope="module")
def tiny_moe_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-MoE (it cannot learn the task) with the demo task's train.jsonl and eval.jsonl."""
    from everstep_tools.demo.task import split_train_eval, write_problems

    out = make_tiny_model(tmp_path_factory.mktemp("tiny-moe-demo"), architecture="qwen3_moe")
    train, held_out = split_train_eval(16, 4, seed=0)
    write_problems(out / "train.jsonl", train)
    write_problems(out / "eval.jsonl", held_out)
    return out


def test_every_arm_runs_and_only_the_r3_arms_replay_the_routes_they_send(
        tiny_moe_demo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import torch

    from everstep_trainer.step.trainer import PolicyTrainer

    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.mismatch.moe")
    torch.set_num_threads(1)
    trainers: list[dict] = []  # per trainer, in the order the harness builds them (seed by seed, arm by arm)
    original_init, original_step = PolicyTrainer.__init__, PolicyTrainer.train_step

    def init(self, model_dir, config, *args, **kwargs):
        original_init(self, model_dir, config, *args, **kwargs)
        if config.learning_rate > 0:
            trainers.append({"trainer": self, "replay": str(config.routing_replay), "routes": [],
                             "loss": (str(config.correction), config.beta, str(config.correction_level))})

    def train_step(self, samples, *args, **kwargs):
        record = next(t for t in trainers if t["trainer"] is self)
        record["routes"].append(all(len(s.routed_experts) > 0 for s in samples))
        return original_step(self, samples, *args, **kwargs)

    monkeypatch.setattr(PolicyTrainer, "__init__", init)
    monkeypatch.setattr(PolicyTrainer, "train_step", train_step)
    out = tmp_path / "out"
    benchmark.main(["--model", str(tiny_moe_demo), "--steps", "2", "--seeds", "1", "--prompts-per-step", "2",
                    "--group-size", "3", "--max-new-tokens", "12", "--eval-prompts", "2", "--eval-every", "1",
                    "--out", str(out), "--num-threads", "1"])

    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(summary) == ARMS
    # Every arm sends the engine's routes; only the R3 arms' trainers replay them.
    assert [(t["replay"].split(".")[-1], t["routes"]) for t in trainers] == [
        ("rollout" if "r3" in arm else "off", [True, True]) for arm in ARMS]
    losses = {arm: tuple(v.split(".")[-1] if isinstance(v, str) else v for v in t["loss"])
              for arm, t in zip(ARMS, trainers, strict=True)}
    assert losses["bf16-r3-icepop"] == ("icepop", 5.0, "token")
    assert losses["bf16-r3-icepop-b2"] == ("icepop", 2.0, "token")
    assert losses["bf16-r3-seq"] == ("icepop", 5.0, "sequence")
    assert losses["bf16-r3"] == ("none", 5.0, "token")
    assert losses["bf16-r3-mask"] == ("icepop", 5.0, "token")
    for arm, result in summary.items():
        for key in ("masked_fraction_mean", "mismatch_kl_first", "mismatch_kl_last", "routing_disagreement_mean",
                    "initial_accuracy", "reward_last", "logp_diff_max_max", "grad_norm_max", "seconds"):
            assert math.isfinite(result[key]), (arm, key)
        for key in ("final_accuracy", "final_greedy", "late_accuracy"):
            assert set(result[key]) == {"mean", "std"} and 0.0 <= result[key]["mean"] <= 1.0, (arm, key)
        assert 0.0 <= result["routing_disagreement_mean"] <= 1.0 and result["num_seeds"] == 1
    # The float32 engine routes and computes as the trainer does; the bfloat16 engine does not.
    assert summary["fp32-none"]["routing_disagreement_mean"] == 0.0
    assert summary["fp32-none"]["mismatch_kl_first"] < 1e-9
    assert summary["bf16-none"]["mismatch_kl_first"] > 1e-8
    # Same first batch in every bf16 arm: replaying the engine's routes does not widen the gap.
    assert summary["bf16-r3"]["mismatch_kl_first"] <= summary["bf16-none"]["mismatch_kl_first"]
    assert summary["bf16-none"]["mismatch_kl_first"] == summary["bf16-icepop"]["mismatch_kl_first"]

    report = json.loads((out / "moe_mismatch.json").read_text())
    assert report["summary"] == summary and [a["name"] for a in report["arms"]] == ARMS
    assert benchmark.main(["--summarize", str(out / "moe_mismatch.json")]) == summary
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert (out / "moe_mismatch.png").read_bytes()[:4] == b"\x89PNG"


def test_the_arms_follow_the_quantization() -> None:
    from benchmarks.mismatch.moe import arms

    int8 = arms("int8")
    assert [a.name for a in int8] == ["fp32-none", "int8-none", "int8-tis", "int8-icepop", "int8-r3", "int8-r3-icepop",
                                      "int8-r3-icepop-b2", "int8-r3-seq", "int8-r3-mask"]
    assert [a.name for a in int8 if a.mask_only] == ["int8-r3-mask"]
    assert {(a.dtype, a.quantization) for a in int8[1:]} == {("float32", "int8")}
    assert {(a.dtype, a.quantization) for a in arms("none")[1:]} == {("bfloat16", "none")}


def test_a_missing_or_dense_model_is_refused_naming_model(tmp_path: Path, tiny_model_dirs, monkeypatch,
                                                          capsys) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    benchmark = importlib.import_module("benchmarks.mismatch.moe")
    with pytest.raises(SystemExit, match="--model .*no model there"):
        benchmark.main(["--model", str(tmp_path / "absent"), "--num-threads", "1"])
    with pytest.raises(SystemExit, match="--model .*not an MoE model"):
        benchmark.main(["--model", str(tiny_model_dirs("llama")), "--num-threads", "1"])
    with pytest.raises(SystemExit, match="examples/demo-moe-model"):
        benchmark.check_moe_model(tmp_path / "absent")


def test_the_mask_only_ablation_weighs_kept_tokens_one_and_is_undone_on_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from everstep_trainer.step.losses import policy

    monkeypatch.syspath_prepend(str(REPO))
    icepop = importlib.import_module("benchmarks.mismatch.icepop")
    old = torch.log(torch.tensor([[1.0, 3.0, 0.2, 9.0]]))  # k = 1, 3, 0.2, 9 against rollout_logp 0
    rollout = torch.zeros_like(old)

    def weight(correction: str) -> list[float]:
        return policy.mismatch_weight(old, rollout, correction=correction, alpha=0.5, beta=5.0).flatten().tolist()

    assert weight("icepop") == pytest.approx([1.0, 3.0, 0.0, 0.0])
    with icepop.mask_only_icepop():
        assert weight("icepop") == [1.0, 1.0, 0.0, 0.0]
        assert weight("tis") == pytest.approx([1.0, 2.0, 0.2, 2.0]), "only IcePop's weight changes"
    assert weight("icepop") == pytest.approx([1.0, 3.0, 0.0, 0.0])
