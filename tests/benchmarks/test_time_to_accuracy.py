"""benchmarks.time_to_accuracy: the clock and summary logic, and the everstep arms at tiny size on real services."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ("--steps", "2", "--eval-every", "1", "--eval-prompts", "8", "--prompts-per-step", "4", "--token-budget", "256",
        "--pool-capacity", "32", "--max-new-tokens", "32")


@pytest.fixture
def tta(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("benchmarks.time_to_accuracy.cli")


def _run(out: Path, *args: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    process = subprocess.run([sys.executable, "-m", "benchmarks.time_to_accuracy", "--out", str(out), *args], cwd=REPO,
                             env=env, capture_output=True, text=True, timeout=timeout)
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


def test_everstep_clock_leaves_evaluations_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    everstep = importlib.import_module("benchmarks.time_to_accuracy.everstep_arm")
    # eval 0 seen at 10; steps 1, 2 committed at 14, 18; eval 2 takes 3 s (seen at 21); step 3 at 25, eval 3 at 27
    step_seen = {1: 14.0, 2: 18.0, 3: 25.0}
    eval_seen = {0: 10.0, 2: 21.0, 3: 27.0}
    assert everstep._train_seconds(2, step_seen, eval_seen) == pytest.approx(8.0)
    assert everstep._train_seconds(3, step_seen, eval_seen) == pytest.approx(25.0 - 10.0 - 3.0)
    evaluations = {s: everstep.Evaluation(step=s, accuracy=0.1 * s, greedy_accuracy=None, k=4, num_prompts=8,
                                          num_unscored=0) for s in eval_seen}
    curve, eval_seconds = everstep._curve(evaluations, step_seen, eval_seen)
    assert [(p.step, p.seconds) for p in curve] == [(0, 0.0), (2, 8.0), (3, 12.0)]
    assert eval_seconds == pytest.approx(5.0), "step 0's evaluation starts the clock and is not counted"


def test_summary_gives_seconds_to_target_and_speedup_against_trl(tta: ModuleType) -> None:
    config_module = importlib.import_module("benchmarks.time_to_accuracy.config")
    Arm, ArmRun, CurvePoint = config_module.Arm, config_module.ArmRun, config_module.CurvePoint

    def run(arm, points):
        curve = [CurvePoint(seconds=s, step=i, accuracy=a, greedy_accuracy=a) for i, (s, a) in enumerate(points)]
        return ArmRun(arm=arm, curve=curve, train_seconds=points[-1][0], total_seconds=points[-1][0] + 5,
                      eval_seconds=1.0)

    config = config_module.TtaConfig(model="m", train_path="t", eval_path="e", arms=(Arm.trl, Arm.c3po))
    runs = [run(Arm.trl, [(0, 0.1), (50, 0.3), (100, 0.4)]), run(Arm.c3po, [(0, 0.1), (10, 0.45), (30, 0.5)]),
            run(Arm.trl, [(0, 0.1), (60, 0.2), (120, 0.4)]), run(Arm.c3po, [(0, 0.1), (20, 0.3), (40, 0.41)])]
    summary = tta.summarize(config, runs, None)
    assert summary["target_accuracy"] == 0.4 and summary["target_source"] == "trl's final avg@4"
    trl, c3po = summary["arms"]["trl"], summary["arms"]["c3po"]
    assert trl["seconds_to_target"] == 110 and trl["speedup_vs_trl"] == 1.0  # median of 100 and 120
    assert c3po["seconds_to_target"] == 25 and c3po["reached_target"] == 2  # median of 10 and 40
    assert c3po["speedup_vs_trl"] == round(110 / 25, 3)
    assert c3po["final_accuracy"] == pytest.approx(0.455)
    assert c3po["seconds_per_step"] == pytest.approx(17.5)  # median of 30 s and 40 s over 2 steps
    unreachable = tta.summarize(config, runs, 0.9)["arms"]["c3po"]
    assert unreachable["seconds_to_target"] is None and unreachable["speedup_vs_trl"] is None
    # Every new best of TRL's first run: 0.3 at step 1, 0.4 at step 2; seconds are medians over the runs.
    first, second = summary["milestones"]
    assert (first["accuracy"], first["reference_step"], second["accuracy"]) == (0.3, 1, 0.4)
    assert first["seconds"] == {"trl": 85, "c3po": 15}  # trl: 50 and 120; c3po: 10 and 20
    assert first["speedup_vs_trl"] == {"trl": 1.0, "c3po": round(85 / 15, 3)}
    assert second["seconds"]["c3po"] == 25
    # an arm whose step-0 evaluation already reached the target (0 s): equal to itself, no ratio against others
    assert (tta.speedup(0.0, 0.0), tta.speedup(10.0, 0.0), tta.speedup(0.0, 5.0), tta.speedup(10.0, 4.0)) == (
        1.0, None, 0.0, 2.5)


def test_a_saved_result_is_summarized_again(tta: ModuleType, tmp_path: Path) -> None:
    config_module = importlib.import_module("benchmarks.time_to_accuracy.config")
    Arm, ArmRun, CurvePoint = config_module.Arm, config_module.ArmRun, config_module.CurvePoint
    config = config_module.TtaConfig(model="m", train_path="t", eval_path="e", arms=(Arm.trl, Arm.sync))
    runs = [ArmRun(arm=arm, curve=[CurvePoint(seconds=0, step=0, accuracy=0.1, greedy_accuracy=0.1),
                                   CurvePoint(seconds=s, step=1, accuracy=0.5, greedy_accuracy=0.4)],
                   train_seconds=s, total_seconds=s + 1, eval_seconds=0.5) for arm, s in ((Arm.trl, 40), (Arm.sync, 8))]
    saved = tmp_path / "result.json"
    saved.write_text(json.dumps({"summary": {}, "runs": [r.to_json() for r in runs], "config": config.to_json()}))
    again = tta.resummarize(saved, 0.3)
    assert again["target_source"] == "--target" and again["arms"]["sync"]["speedup_vs_trl"] == 5.0


@pytest.mark.slow
def test_everstep_arms_at_tiny_size(tmp_path: Path) -> None:
    result = _run(tmp_path, "--arms", "sync,c3po,overlap", *TINY, timeout=300)
    runs = {run["arm"]: run for run in result["runs"]}
    assert set(runs) == {"sync", "c3po", "overlap"}
    for run in runs.values():
        assert [p["step"] for p in run["curve"]] == [0, 1, 2], "evaluations before training and after every step"
        seconds = [p["seconds"] for p in run["curve"]]
        assert seconds[0] == 0.0 and seconds == sorted(seconds) and seconds[-1] > 0
        assert all(0.0 <= p["accuracy"] <= 1.0 and 0.0 <= p["greedy_accuracy"] <= 1.0 for p in run["curve"])
        assert run["total_seconds"] > run["train_seconds"] == seconds[-1]
        assert run["details"]["trained_samples"] > 0
    assert runs["sync"]["details"]["staleness_max"] == 0
    summary = result["summary"]
    assert summary["target_source"] == "sync's final avg@4"
    assert summary["target_accuracy"] == pytest.approx(runs["sync"]["curve"][-1]["accuracy"], abs=1e-4)
    assert summary["arms"]["sync"]["seconds_to_target"] is not None
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 0
    assert json.loads((tmp_path / "result.json").read_text())["summary"] == summary


@pytest.mark.slow
def test_trl_arm_at_tiny_size(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="optional benchmark dependency: pip install -r benchmarks/requirements-trl.txt")
    result = _run(tmp_path, "--arms", "trl", *TINY[:6], "--prompts-per-step", "8", "--max-new-tokens", "32",
                  timeout=300)
    (run,) = result["runs"]
    assert run["arm"] == "trl" and [p["step"] for p in run["curve"]] == [0, 1, 2]
    assert run["details"]["trained_samples"] == 2 * 8 * 8
    # as many optimizer steps per generation round as the everstep arms (the demo job's num_minibatches: 2);
    # TRL counts its steps_per_generation in per-device batches (64 samples / 32 per optimizer step here)
    assert run["details"]["optimizer_steps_per_generation"] == 2 and run["details"]["trl_steps_per_generation"] == 2
    assert result["summary"]["arms"]["trl"]["speedup_vs_trl"] == 1.0


def test_everstep_arms_take_the_optimizer_steps_per_step(tmp_path: Path,
                                                                              tta: ModuleType) -> None:
    config_module = importlib.import_module("benchmarks.time_to_accuracy.config")
    args = tta.parse_args(["--num-minibatches", "2", "--arms", "trl,c3po"])
    config = tta.config_from_args(args)
    assert config.num_minibatches == 2
    for arm in (config_module.Arm.sync, config_module.Arm.c3po, config_module.Arm.overlap):
        spec = config_module.job_spec(config, arm, tmp_path)
        assert spec["trainer"]["num_minibatches"] == 2 and spec["trainer"]["learning_rate"] == config.learning_rate
    ones = tta.config_from_args(tta.parse_args(["--num-minibatches", "1"]))
    assert config_module.job_spec(ones, config_module.Arm.c3po, tmp_path)["trainer"]["num_minibatches"] == 1
    # by default the everstep arms run the demo job's own setting
    default = tta.config_from_args(tta.parse_args([]))
    demo = config_module.load_job_file(config_module.DEMO_SPEC)
    assert default.num_minibatches is None
    assert (config_module.job_spec(default, config_module.Arm.overlap, tmp_path)["trainer"].get("num_minibatches")
            == demo["trainer"].get("num_minibatches"))
    # a result saved before the setting existed is still read
    saved = config.to_json()
    del saved["num_minibatches"]
    assert config_module.TtaConfig(**{**saved, "arms": tuple(config_module.Arm(a) for a in saved["arms"])}
                                   ).num_minibatches is None


# --- the real-model comparison: settings from the job spec, the TRL arms' parity, runs.jsonl ------------------------

SMOLLM2 = ("--model", "outputs/smollm2-135m-instruct")  # the directory need not exist to resolve the settings


def _modules(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    monkeypatch.syspath_prepend(str(REPO))
    return (importlib.import_module("benchmarks.time_to_accuracy.cli"),
            importlib.import_module("benchmarks.time_to_accuracy.config"))


def test_a_real_model_takes_its_settings_from_the_smollm2_spec(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    tta, cfg = _modules(monkeypatch)
    config = tta.config_from_args(tta.parse_args([*SMOLLM2]))
    full = cfg.load_job_file(REPO / "examples" / "smollm2-full.yaml")
    lora = cfg.load_job_file(REPO / "examples" / "smollm2-lora.yaml")
    assert config.spec == str(REPO / "examples" / "smollm2-full.yaml") and config.settings_from == "spec"
    assert [a.value for a in config.arms] == ["full", "lora", "trl", "trl-lora"]
    assert (config.train_path, config.eval_path) == (full["dataset"]["train_path"], full["dataset"]["eval_path"])
    assert (config.steps, config.group_size, config.learning_rate, config.temperature, config.max_new_tokens) == (
        full["steps"], full["algorithm"]["group_size"], full["trainer"]["learning_rate"],
        full["sampling"]["temperature"], full["sampling"]["max_new_tokens"])
    assert config.num_minibatches == full["trainer"]["num_minibatches"] == 2
    assert config.prompts_per_step == full["scheduler"]["prompts_per_iteration"]
    assert (config.eval_every, config.eval_prompts, config.eval_samples) == (4, 32, 4)
    assert config.lora.to_spec() == {"rank": 16, "alpha": 32.0, "dropout": 0.0,
                                     "target_modules": lora["trainer"]["lora"].get(
                                         "target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])}
    assert config.lora_learning_rate == lora["trainer"]["learning_rate"]
    assert config.overrides == (), "nothing was flagged"
    # each arm's job: full without adapters at the full spec's rate, lora with them at the LoRA spec's rate,
    # and each TRL arm handed its everstep counterpart's job
    jobs = {arm: cfg.job_spec(config, arm, tmp_path) for arm in config.arms}
    assert "lora" not in jobs[cfg.Arm.full]["trainer"] and jobs[cfg.Arm.full]["trainer"]["learning_rate"] == 2e-5
    lora_trainer = jobs[cfg.Arm.lora]["trainer"]
    assert lora_trainer["lora"]["rank"] == 16 and lora_trainer["learning_rate"] == 5e-4
    assert jobs[cfg.Arm.trl]["trainer"] == jobs[cfg.Arm.full]["trainer"]
    assert jobs[cfg.Arm.trl_lora]["trainer"] == jobs[cfg.Arm.lora]["trainer"]
    for job in jobs.values():
        assert job["scheduler"] == {"mode": "sync", "prompts_per_iteration": 8} and job["steps"] == 8
        assert job["sampling"]["max_new_tokens"] == 24 and job["dataset"]["answer_field"] == "reward_model.ground_truth"


def test_flags_that_disagree_with_the_spec_win_and_are_recorded(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    tta, cfg = _modules(monkeypatch)
    config = tta.config_from_args(tta.parse_args([
        *SMOLLM2, "--learning-rate", "1e-5", "--max-new-tokens", "24", "--steps", "12", "--lora-rank", "8",
        "--lora-target-modules", "all-linear", "--lora-learning-rate", "3e-4", "--arms", "lora,trl-lora"]))
    recorded = {o.setting: (o.spec_value, o.flag_value) for o in config.overrides}
    assert recorded == {"learning_rate": (2e-5, 1e-5), "steps": (8, 12), "lora.rank": (16, 8),
                        "lora.target_modules": (["q_proj", "k_proj", "v_proj", "o_proj"], ["all-linear"]),
                        "lora_learning_rate": (5e-4, 3e-4)}, "max_new_tokens equals the spec's: not an override"
    assert config.learning_rate == 1e-5 and config.steps == 12
    job = cfg.job_spec(config, cfg.Arm.trl_lora, tmp_path)
    assert job["trainer"]["lora"] == {"rank": 8, "alpha": 32.0, "dropout": 0.0, "target_modules": ["all-linear"]}
    assert job["trainer"]["learning_rate"] == 3e-4 and job["steps"] == 12
    saved = cfg.TtaConfig.from_json(json.loads(json.dumps(config.to_json())))
    assert saved == config, "the overrides and the LoRA survive result.json"
    with pytest.raises(ValueError, match="rank"):
        tta.config_from_args(tta.parse_args([*SMOLLM2, "--lora-rank", "0"]))
    with pytest.raises(ValueError, match="--lora-spec .*no trainer.lora"):
        tta.config_from_args(tta.parse_args([*SMOLLM2, "--lora-spec", str(REPO / "examples" / "smollm2-full.yaml")]))


def test_the_demo_model_keeps_its_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    tta, cfg = _modules(monkeypatch)
    config = tta.config_from_args(tta.parse_args([]))
    assert config.settings_from == "demo defaults" and config.spec == str(cfg.DEMO_SPEC)
    assert [a.value for a in config.arms] == ["trl", "sync", "c3po", "overlap"]
    assert (config.steps, config.eval_every, config.eval_prompts, config.prompts_per_step, config.max_new_tokens,
            config.learning_rate, config.num_minibatches) == (30, 5, 200, 64, 200, 5e-4, None)
    assert config.train_path.endswith("demo-model/train.jsonl") and config.overrides == ()
    quick = tta.config_from_args(tta.parse_args(["--quick", "--eval-prompts", "20"]))
    assert (quick.steps, quick.eval_every, quick.eval_prompts) == (6, 3, 20)


def test_trl_arms_take_everstep_optimizer_steps_and_schedule(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tta, cfg = _modules(monkeypatch)
    trl = importlib.import_module("benchmarks.time_to_accuracy.trl_arm")
    optim = importlib.import_module("everstep_trainer.step.optim")
    for argv in ([*SMOLLM2], [*SMOLLM2, "--num-minibatches", "4", "--steps", "10"], [], ["--num-minibatches", "1"]):
        config = tta.config_from_args(tta.parse_args(argv))
        for arm in (cfg.Arm.trl, cfg.Arm.trl_lora):
            job = cfg.JobSpec.model_validate(cfg.job_spec(config, arm, tmp_path))
            m = job.trainer.num_minibatches
            batching = trl.trl_batching(config, job)
            kwargs = trl.grpo_config_kwargs(config, job, str(tmp_path))
            # equal optimizer steps per generation round: TRL's steps_per_generation counts per-device batches,
            # gradient_accumulation_steps of them make one optimizer step
            assert batching.steps_per_generation // kwargs["gradient_accumulation_steps"] == m == (
                config.num_minibatches or 2)
            assert kwargs["generation_batch_size"] == config.prompts_per_step * config.group_size
            assert kwargs["max_steps"] == job.steps * m and kwargs["num_iterations"] == 1
            assert kwargs["lr_scheduler_type"] == "cosine" and kwargs["warmup_steps"] == 0
            assert kwargs["learning_rate"] == (config.lora_learning_rate if arm.uses_lora else config.learning_rate)
            factor = trl.lr_factor(job)
            rates = [factor(t) for t in range(job.steps * m)]
            everstep = [optim.learning_rate_at(s, learning_rate=1.0, total_steps=job.steps) for s in range(job.steps)]
            assert rates == [r for r in everstep for _ in range(m)], "one rate per round, everstep's"
            assert rates[0] == 1.0 and 0 < rates[-1] < 0.1 and rates == sorted(rates, reverse=True)
        if argv == [*SMOLLM2]:  # 8 prompts x 8 = 64 completions: each optimizer step's share is one batch
            assert batching.steps_per_generation == 2 and kwargs["gradient_accumulation_steps"] == 1
    warm = cfg.JobSpec.model_validate({**cfg.job_spec(config, cfg.Arm.trl, tmp_path), "steps": 6,
                                       "trainer": {"learning_rate": 1e-3, "warmup_steps": 2, "num_minibatches": 2}})
    factor = trl.lr_factor(warm)
    assert [round(factor(t), 4) for t in range(12)] == [
        round(optim.learning_rate_at(t // 2, learning_rate=1.0, warmup_steps=2, total_steps=6), 4) for t in range(12)]
    assert trl.grpo_config_kwargs(config, warm, "o")["warmup_steps"] == 4  # transformers counts optimizer steps
    schedule = cfg.lr_schedule_of(warm, implementation="x")
    assert (schedule.kind, schedule.warmup_steps, schedule.decay_steps) == ("cosine", 2, 6)
    assert schedule.optimizer_steps == 12
    lora = cfg.JobSpec.model_validate(cfg.job_spec(tta.config_from_args(tta.parse_args([*SMOLLM2])), cfg.Arm.trl_lora,
                                                   tmp_path)).trainer.lora
    assert trl.lora_config_kwargs(lora) == {"r": 16, "lora_alpha": 32.0, "lora_dropout": 0.0, "bias": "none",
                                            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                                            "task_type": "CAUSAL_LM"}


def test_trl_derives_the_steps_per_generation_we_expect(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="optional benchmark dependency: pip install -r benchmarks/requirements-trl.txt")
    from trl import GRPOConfig

    tta, cfg = _modules(monkeypatch)
    trl = importlib.import_module("benchmarks.time_to_accuracy.trl_arm")
    for argv in ([*SMOLLM2], []):
        config = tta.config_from_args(tta.parse_args(argv))
        job = cfg.JobSpec.model_validate(cfg.job_spec(config, cfg.Arm.trl, tmp_path))
        args = GRPOConfig(**trl.grpo_config_kwargs(config, job, str(tmp_path / "o")))
        assert args.steps_per_generation == trl.trl_batching(config, job).steps_per_generation
        assert args.steps_per_generation // args.gradient_accumulation_steps == job.trainer.num_minibatches


def _fake_run(cfg: ModuleType, arm, final: float, seconds: float):
    points = [cfg.CurvePoint(seconds=0.0, step=0, accuracy=0.1, greedy_accuracy=0.1),
              cfg.CurvePoint(seconds=seconds, step=1, accuracy=final, greedy_accuracy=final)]
    return cfg.ArmRun(arm=arm, curve=points, train_seconds=seconds, total_seconds=seconds + 1, eval_seconds=0.1)


def test_runs_jsonl_gets_each_run_as_it_finishes_and_is_summarized(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    tta, cfg = _modules(monkeypatch)
    run_module = importlib.import_module("benchmarks.time_to_accuracy.run")
    config = tta.config_from_args(tta.parse_args([*SMOLLM2]))
    path = tmp_path / "runs.jsonl"
    path.write_text('{"config": {}}\n')  # an earlier benchmark's: kept, not overwritten
    log = run_module.RunLog(path, config)
    assert len(list(tmp_path.glob("runs-*.jsonl"))) == 1
    assert len(path.read_text().splitlines()) == 1
    log.append(_fake_run(cfg, cfg.Arm.full, 0.6, 10.0))
    assert len(path.read_text().splitlines()) == 2, "written at once, not at the end"
    log.append(_fake_run(cfg, cfg.Arm.trl, 0.5, 40.0))
    log.append(_fake_run(cfg, cfg.Arm.trl_lora, 0.55, 30.0))
    with path.open("a") as f:
        f.write('{"run": {"arm": "lo')  # killed while writing the lora arm's line
    saved_config, runs = run_module.read_runs(path)
    assert saved_config == config and [r.arm.value for r in runs] == ["full", "trl", "trl-lora"]
    for source in (path, tmp_path):  # the file, or the folder without result.json
        summary = tta.resummarize(source, None)
        assert summary["missing_arms"] == ["lora"]
        assert summary["target_source"] == "trl-lora's final avg@4" and summary["target_accuracy"] == 0.55
        assert summary["arms"]["full"]["speedup_vs"] == {"trl": None, "trl-lora": 3.0}
        assert summary["arms"]["trl"]["seconds_to_target"] is None


def test_run_arms_records_each_run_and_concurrent_runs_the_sides_together(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    import threading

    tta, cfg = _modules(monkeypatch)
    run_module = importlib.import_module("benchmarks.time_to_accuracy.run")
    everstep = importlib.import_module("benchmarks.time_to_accuracy.everstep_arm")

    class Stack:
        def down(self) -> None:
            pass

    class State:
        def address(self, name: str) -> str:
            return "reward:1"

    trl_started = threading.Event()

    def fake_everstep(state, config, arm, root):
        if config.concurrent:  # side by side: the TRL arm starts while this one runs
            assert trl_started.wait(10), "the TRL arm did not start beside the everstep arm"
        return _fake_run(cfg, arm, 0.5, 5.0)

    def fake_trl(config, arm, root, address, tag):
        trl_started.set()
        return _fake_run(cfg, arm, 0.5, 9.0)

    monkeypatch.setattr(everstep, "start_stack", lambda root, config: (Stack(), State()))
    monkeypatch.setattr(everstep, "run_everstep_arm", fake_everstep)
    monkeypatch.setattr(run_module, "run_trl", fake_trl)
    for concurrent in (False, True):
        trl_started.clear()
        argv = [*SMOLLM2, "--arms", "full,lora,trl", "--repeats", "2", *(["--concurrent"] if concurrent else [])]
        config = tta.config_from_args(tta.parse_args(argv))
        recorded: list = []
        runs = run_module.run_arms(config, tmp_path, recorded.append)
        assert recorded == runs and len(runs) == 6
        if not concurrent:
            assert [r.arm.value for r in runs] == ["full", "lora", "trl"] * 2


@pytest.mark.slow
def test_lora_arms_side_by_side_at_tiny_size(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="optional benchmark dependency: pip install -r benchmarks/requirements-trl.txt")
    result = _run(tmp_path, "--arms", "lora,trl-lora", "--concurrent", "--lora-rank", "4", "--lora-alpha", "8",
                  "--steps", "2", "--eval-every", "1", "--eval-prompts", "8", "--prompts-per-step", "8",
                  "--max-new-tokens", "32", timeout=120)
    runs = {run["arm"]: run for run in result["runs"]}
    assert set(runs) == {"lora", "trl-lora"}
    peak = result["config"]["lora_learning_rate"]
    # everstep's trainer: one rate per step, cosine to 0 over 2 steps; TRL: the same rate for both optimizer steps
    assert runs["lora"]["lr_schedule"]["observed"] == pytest.approx([peak, peak / 2])
    assert runs["trl-lora"]["lr_schedule"]["observed"] == pytest.approx([peak, peak, peak / 2, peak / 2])
    details = runs["trl-lora"]["details"]
    assert details["peft_lora_config"]["r"] == 4 and details["peft_lora_config"]["lora_alpha"] == 8
    assert details["trl_steps_per_generation"] == details["optimizer_steps_per_generation"] == 2
    assert [p["step"] for p in runs["trl-lora"]["curve"]] == [0, 1, 2]
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 3 and {json.loads(line)["run"]["arm"] for line in lines[1:]} == set(runs)


def test_trl_gets_each_prompt_in_the_form_that_gives_everstep_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    trl = importlib.import_module("benchmarks.time_to_accuracy.trl_arm")
    dataset = importlib.import_module("everstep_controller.data.dataset")
    chat = importlib.import_module("everstep_controller.data.chat_template")

    class Tokenizer:  # ids: one per character; the chat template wraps "<role>content" and ends with "A"
        chat_template = "t"

        def __call__(self, text: str) -> dict:
            return {"input_ids": [ord(c) for c in text]}

        def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
            assert add_generation_prompt and tokenize and return_dict
            return {"input_ids": [ord(c) for m in messages for c in f"<{m['role']}>{m['content']}"] + [ord("A")]}

    tokenizer = Tokenizer()
    ids = lambda text: tuple(ord(c) for c in text)  # noqa: E731
    messages = (chat.ChatMessage(role="user", content="2+2?"),)
    chat_row = dataset.PromptRow(index=0, prompt="2+2?", answer="4", prompt_ids=ids("<user>2+2?A"), messages=messages)
    assert trl.trl_prompts([chat_row], tokenizer, None) == [[{"role": "user", "content": "2+2?"}]]
    system_row = dataset.PromptRow(index=1, prompt="2+2?", answer="4", prompt_ids=ids("<system>S<user>2+2?A"))
    assert trl.trl_prompts([system_row], tokenizer, "S") == [[{"role": "system", "content": "S"},
                                                               {"role": "user", "content": "2+2?"}]]
    raw_row = dataset.PromptRow(index=2, prompt="2+2=", answer="4", prompt_ids=ids("2+2="))
    assert trl.trl_prompts([raw_row], tokenizer, None) == ["2+2="]
    with pytest.raises(ValueError, match="mix"):
        trl.trl_prompts([chat_row, raw_row], tokenizer, None)
    other = dataset.PromptRow(index=3, prompt="2+2=", answer="4", prompt_ids=ids("2+2= "))
    with pytest.raises(ValueError, match="row 3: .*not see the same prompts"):
        trl.trl_prompts([other], tokenizer, None)
    assert trl.completion_text([{"role": "assistant", "content": "4"}]) == "4" and trl.completion_text("4") == "4"
