"""benchmarks.gpu_check: the whole run on CPU at the tiny size (same code paths as the H200 run), and its parts."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("benchmarks.gpu_check")


# As on the GPU machine: torch and transformers, but no grpc, no protobuf and no everstep stubs.
_WITHOUT_GRPC = """
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("grpc", "google") or name.startswith("everstep.v1"):
            raise ModuleNotFoundError(f"blocked as on the GPU machine: {name}", name=name)  # as absence is
sys.meta_path.insert(0, Block())
sys.argv[0] = "benchmarks.gpu_check"
runpy.run_module("benchmarks.gpu_check", run_name="__main__", alter_sys=True)
"""


def _run(*args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.run([sys.executable, "-c", _WITHOUT_GRPC, *args], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=timeout)
    lines = process.stdout.strip().splitlines()
    assert lines, f"no stdout; stderr:\n{process.stderr[-4000:]}"
    return process, json.loads(lines[-1])


def _finite(*values: float) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


@pytest.mark.slow
def test_tiny_cpu_run_reports_every_part(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # The budget of the GPU run (210 s) bounds its parts by fractions; a loaded 2-core CPU gets more room.
    process, report = _run("--size", "tiny", "--device", "cpu", "--time-budget-seconds", "450", "--out", str(out))
    parts = report["parts"]
    failed = {name: part.get("error") for name, part in parts.items() if not part.get("ok")}
    assert not failed, f"{failed}\n{process.stderr[-4000:]}"
    assert process.returncode == 0 and report["ok"] is True
    assert list(parts) == ["model", "throughput", "mismatch", "train_step", "weight_push", "broadcast", "lora_push",
                           "rl"]
    assert json.loads((out / "gpu_check.json").read_text()) == report
    assert report["transformers"] and report["torch"] and report["time_budget_seconds"] == 450

    model = parts["model"]
    assert 10_000 < model["num_parameters"] < 1_000_000 and model["vocab_size"] == 54

    throughput = parts["throughput"]
    assert throughput["tokens_per_s"] > 0 and throughput["decode_tokens_per_s"] > 0
    # EOS ignored and not truncated: every sequence ran exactly to its long-tailed length.
    assert not throughput["truncated"]
    assert throughput["finish_reasons"] == {"LENGTH": throughput["num_prompts"]}
    assert throughput["num_tokens"] == throughput["max_new_tokens"]["sum"]
    assert throughput["max_new_tokens"]["max"] > 2 * throughput["max_new_tokens"]["median"]  # a long tail
    assert 1 < throughput["mean_running"] <= throughput["max_running"]

    mismatch = parts["mismatch"]
    assert mismatch["num_tokens"] > 0 and mismatch["engine_dtype"] == "bfloat16"
    assert _finite(mismatch["mismatch_kl"], mismatch["logp_diff_max"], mismatch["logp_diff_abs_mean"])
    # bf16 engine vs float32 trainer on the same weights: close, but not bit-identical.
    assert 0 <= mismatch["mismatch_kl"] < 1e-2 and 0 < mismatch["logp_diff_max"] < 0.5

    train = parts["train_step"]
    assert _finite(train["loss"], train["policy_loss"], train["grad_norm"], train["seconds"])
    assert train["grad_norm"] > 0 and train["num_tokens"] > 0 and train["version"] == 1
    assert train["loss_difference"] < 1e-4  # train_step's loss at ratio 1 is policy_loss on the same batch

    push = parts["weight_push"]
    assert push["transport"] == "cpu_shared_memory" and push["verified"] is True
    assert push["mismatched_tensors"] == [] and push["num_tensors"] > 0
    assert push["changed_tensors"] > 0  # the engine process really received the trained weights
    assert push["num_bytes"] >= 4 * model["num_parameters"]
    assert push["gb_per_s"] >= 0 and push["seconds"] > 0 and push["num_pushes"] == 3

    broadcast = parts["broadcast"]  # the gloo group on CPU (nccl on two GPUs)
    assert broadcast["backend"] == "gloo" and broadcast["verified"] is True and broadcast["mismatched_tensors"] == []
    assert broadcast["num_tensors"] == push["num_tensors"] and broadcast["num_bytes"] > 0

    lora = parts["lora_push"]
    assert lora["verified"] is True and lora["mismatched_tensors"] == [] and lora["num_pushes"] == 4
    assert lora["transport"] == "cpu_shared_memory" and lora["num_adapted_modules"] > 0
    assert 0 < lora["adapter_bytes"] < lora["full_bytes"] and lora["adapter_seconds"] > 0

    rl = parts["rl"]
    assert len(rl["steps"]) == 2 and len(rl["reward_per_step"]) == 2
    assert all(0.0 <= r <= 1.0 for r in rl["reward_per_step"])
    assert [s["version"] for s in rl["steps"]] == [1, 2]
    assert all(_finite(s["loss"], s["mismatch_kl"]) for s in rl["steps"])
    assert rl["warm_start"]["steps"] == 10 and rl["warm_start"]["final_loss"] < rl["warm_start"]["first_loss"]


@pytest.mark.skipif(sys.platform != "linux", reason="checks the no-GPU message on the CPU-only machine")
def test_cuda_without_gpu_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    process, report = _run("--size", "tiny", "--device", "cuda", timeout=120)
    assert process.returncode == 2 and report["ok"] is False
    assert "cuda" in report["error"] and report["parts"] == {}


def test_watchdog_leaves_the_report_so_far_in_out(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # The whole tiny run takes far longer than 3 s (the suite's own run of it: ~20 s), so the watchdog fires.
    process, report = _run("--size", "tiny", "--device", "cpu", "--watchdog-seconds", "3", "--out", str(out),
                           timeout=120)
    assert process.returncode == 3 and report["ok"] is False and "watchdog" in report["error"]
    assert json.loads((out / "gpu_check.json").read_text()) == report


def test_the_engines_import_without_grpc_and_protobuf() -> None:
    """The GPU machine has neither: the engines import the tool loop's modules (grpc, protobuf) only at the first
    request with tools (the tools merge had made every engine import them, and the check's throughput part fail)."""
    code = _WITHOUT_GRPC.split("sys.argv[0]")[0] + (
        "import everstep_rollout.engine.torch_engine, everstep_rollout.engine.sglang_engine\n"
        "print('imported')\n")
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0 and "imported" in process.stdout, process.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="checks the message without sglang")
def test_sglang_tools_part_runs_only_when_asked_and_names_its_environment() -> None:
    """The optional part is not in a default run (test_tiny_cpu_run_reports_every_part lists the parts); asked for
    without sglang, it fails saying where sglang is; an unknown part is refused."""
    process, report = _run("--size", "tiny", "--device", "cpu", "--parts", "sglang_tools", timeout=120)
    assert process.returncode == 1 and list(report["parts"]) == ["sglang_tools"]
    part = report["parts"]["sglang_tools"]
    assert part["ok"] is False and "needs sglang" in part["error"] and "sglang-venv" in part["error"]
    refused = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--parts", "model,nope"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--parts: unknown part(s) ['nope']" in refused.stderr


def test_transformers_floor(gpu_check: ModuleType) -> None:
    assert gpu_check.transformers_floor_error("4.56.0") is None
    assert gpu_check.transformers_floor_error("5.0.0.dev0") is None
    message = gpu_check.transformers_floor_error("4.55.2")
    assert message is not None and "4.55.2" in message and "4.56" in message and "dtype" in message


def test_old_transformers_stops_at_once_and_says_why(gpu_check: ModuleType, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    monkeypatch.setattr(transformers, "__version__", "4.45.0")
    assert gpu_check.main(["--size", "tiny", "--device", "cpu", "--out", str(tmp_path)]) == 2
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["transformers"] == "4.45.0" and "older than 4.56" in saved["error"] and saved["parts"] == {}


def test_report_is_saved_after_every_part(gpu_check: ModuleType) -> None:
    class PartsStandIn:
        deadline = gpu_check.Deadline(60)

        def part_first(self) -> dict:
            return {"value": 1}

        def part_second(self) -> dict:
            raise ValueError("boom")

    report: dict = {"parts": {}}
    saved: list[list[str]] = []
    gpu_check.run_parts(PartsStandIn(), report, parts=("first", "second"),
                        after_part=lambda: saved.append(list(report["parts"])))
    assert saved == [["first"], ["first", "second"]]


def test_one_failing_part_is_recorded_and_the_rest_run(gpu_check: ModuleType) -> None:
    class PartsStandIn:
        deadline = gpu_check.Deadline(60)

        def part_first(self) -> dict:
            raise ValueError("boom")

        def part_second(self) -> dict:
            return {"value": 1}

    report: dict = {"parts": {}}
    gpu_check.run_parts(PartsStandIn(), report, parts=("first", "second"))
    assert report["parts"]["first"]["ok"] is False and report["parts"]["first"]["error"] == "ValueError: boom"
    assert report["parts"]["second"]["ok"] is True and report["parts"]["second"]["value"] == 1


def test_spent_budget_skips_parts(gpu_check: ModuleType) -> None:
    class PartsStandIn:
        deadline = gpu_check.Deadline(0)

        def part_first(self) -> dict:
            raise AssertionError("must not run")

    report: dict = {"parts": {}}
    gpu_check.run_parts(PartsStandIn(), report, parts=("first",))
    assert report["parts"]["first"]["ok"] is False and "time budget" in report["parts"]["first"]["error"]


def test_deadline_part_never_passes_the_end(gpu_check: ModuleType) -> None:
    import time

    deadline = gpu_check.Deadline(10)
    assert deadline.part(0.5) <= time.monotonic() + 5.01
    assert deadline.part(5.0) <= deadline.start + 10.01


def test_long_tailed_lengths(gpu_check: ModuleType) -> None:
    lengths = gpu_check.long_tailed_lengths(2000, median=128, cap=1024, seed=2)
    assert lengths == gpu_check.long_tailed_lengths(2000, median=128, cap=1024, seed=2)
    assert min(lengths) >= 1 and max(lengths) == 1024
    assert 110 <= sorted(lengths)[1000] <= 150
    assert sum(lengths) / len(lengths) > 128  # right-skewed: the mean sits above the median


def test_grpo_advantages(gpu_check: ModuleType) -> None:
    advantages = gpu_check.grpo_advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], group_size=4)
    assert advantages[4:] == [0.0] * 4  # a group that agrees teaches nothing
    assert abs(sum(advantages[:4])) < 1e-9 and advantages[0] > 0 > advantages[1]
    assert advantages[0] == pytest.approx(3 ** 0.5, rel=1e-4)


def test_weight_checksums_see_a_change_of_one_value_or_of_order(gpu_check: ModuleType) -> None:
    import torch

    weight = torch.randn(8, 16)
    base = gpu_check.weight_checksums({"w": weight}, torch.bfloat16)["w"]
    assert gpu_check.weight_checksums({"w": weight.clone()}, torch.bfloat16)["w"] == base
    changed = weight.clone()
    changed[3, 5] += 0.5
    assert gpu_check.weight_checksums({"w": changed}, torch.bfloat16)["w"] != base
    assert gpu_check.weight_checksums({"w": weight.flip(0)}, torch.bfloat16)["w"] != base


def test_documented_gpu_command_keeps_its_results(gpu_check: ModuleType) -> None:
    """The command docs/gpu.md and the module give writes into "$OUT" (what the device machine brings back),
    with `common` on the path for the torch-only everstep.tensors.cuda_ipc."""
    doc = (REPO / "docs" / "gpu.md").read_text()
    for text in (doc, gpu_check.__doc__ or ""):
        assert ("PYTHONPATH=common:services/rollout:services/trainer:tools python -m benchmarks.gpu_check "
                "--device cuda") in text
        assert '--out "$OUT"' in text and "--out OUT" not in text
