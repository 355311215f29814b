"""The demo model shipped in examples/demo-model: its build.json matches its files, `everstep demo` uses it
as it is (checked, never built or written), and the demo plot shows held-out accuracy only where measured."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from step_rows import eval_row, step_row

from everstep.model_manifest import MANIFEST_NAME, verify_manifest
from everstep_cli.cli import build_parser
from everstep_cli.demo import REBUILD_DIR, demo_figure, ensure_demo_model, use_demo_model
from everstep_cli.job_file import load_job_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHIPPED = EXAMPLES / "demo-model"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "train.jsonl", "eval.jsonl", "warm_start.json"}


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_the_recorded_sha256s_match_the_shipped_files() -> None:
    manifest = verify_manifest(SHIPPED)
    assert set(manifest.files) == MODEL_FILES
    assert {p.name for p in SHIPPED.iterdir()} == MODEL_FILES | {MANIFEST_NAME}
    assert manifest.command == "python -m everstep_tools.demo --out examples/demo-model"
    assert {"python", "torch", "transformers", "torch_num_threads"} <= manifest.environment.keys()
    assert manifest.settings["seed"] == 0


def test_the_demo_spec_runs_on_the_shipped_model_and_its_data() -> None:
    spec = load_job_file(EXAMPLES / "demo.yaml")
    assert Path(spec["model_path"]) == SHIPPED
    assert Path(spec["dataset"]["train_path"]) == SHIPPED / "train.jsonl"
    assert Path(spec["dataset"]["eval_path"]) == SHIPPED / "eval.jsonl"
    assert spec["evaluation"]["every"] > 0 and spec["steps"] % spec["evaluation"]["every"] == 0


def test_ensure_demo_model_uses_the_shipped_model_without_building_or_writing() -> None:
    before = _tree(SHIPPED)
    started = time.monotonic()
    ensure_demo_model(SHIPPED)
    assert time.monotonic() - started < 5  # a build takes minutes
    assert _tree(SHIPPED) == before
    assert not SHIPPED.with_name(SHIPPED.name + ".partial").exists()


@pytest.mark.parametrize(("damage", "message"), [("changed", "eval.jsonl differs from its recorded sha256"),
                                                  ("missing", "eval.jsonl is missing")])
def test_a_damaged_copy_is_refused_by_file_name_and_not_rebuilt(tmp_path: Path, damage: str, message: str) -> None:
    copy = tmp_path / "demo-model"
    shutil.copytree(SHIPPED, copy)
    if damage == "changed":
        with (copy / "eval.jsonl").open("a") as f:
            f.write("\n")
    else:
        (copy / "eval.jsonl").unlink()
    before = _tree(copy)
    with pytest.raises(ValueError, match=message) as caught:
        ensure_demo_model(copy)
    assert "everstep demo --rebuild" in str(caught.value)
    assert _tree(copy) == before
    assert not (tmp_path / "demo-model.partial").exists()


def test_demo_rebuild_is_an_option_and_builds_outside_the_shipped_folder() -> None:
    assert build_parser().parse_args(["demo", "--rebuild"]).rebuild
    assert not build_parser().parse_args(["demo"]).rebuild
    assert Path("outputs/demo-model") == REBUILD_DIR  # ignored by git (.gitignore: /outputs/)


def test_a_rebuilt_model_takes_the_spec_model_and_its_data_files(tmp_path: Path) -> None:
    spec = load_job_file(EXAMPLES / "demo.yaml")
    spec["dataset"]["eval_path"] = str(tmp_path / "mine.jsonl")  # not from the model folder: kept
    rebuilt = tmp_path / "outputs" / "demo-model"
    moved = use_demo_model(spec, rebuilt)
    assert moved["model_path"] == str(rebuilt)
    assert moved["dataset"]["train_path"] == str(rebuilt / "train.jsonl")
    assert moved["dataset"]["eval_path"] == str(tmp_path / "mine.jsonl")
    assert spec["model_path"] == str(SHIPPED)  # the loaded spec itself is left as it was


def test_the_plot_marks_held_out_accuracy_only_at_the_evaluated_steps() -> None:
    history = [step_row(s).model_copy(update={"reward_mean": 0.1 + s / 100, "finished_tokens": 300,
                                              "num_finished_rollouts": 10}) for s in range(1, 31)]
    evaluation = {s: eval_row(s).model_copy(update={"accuracy": 0.1 + s / 100, "greedy_accuracy": 0.2, "k": 4})
                  for s in (0, 10, 20, 30)}
    fig = demo_figure(history, evaluation)
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    accuracy = [line for label, line in lines.items() if label.startswith("held-out")]
    assert len(accuracy) == 2
    for line in accuracy:
        assert list(line.get_xdata()) == [0, 10, 20, 30]
        assert line.get_linestyle() == "None" and line.get_marker() not in (None, "None", "")
    assert "steps 0, 10, 20, 30" in " ".join(lines)
    assert lines["training reward (mean)"].get_linestyle() == "-"
    # pass@k and maj@k where they were measured (a record from before them has none)
    evaluation = {s: e.model_copy(update={"pass_at_k": 0.5, "maj_at_k": 0.25} if s else {})
                  for s, e in evaluation.items()}
    lines = {line.get_label(): line for ax in demo_figure(history, evaluation).axes for line in ax.get_lines()}
    assert list(lines["held-out pass@4"].get_xdata()) == [10, 20, 30]
    assert list(lines["held-out maj@4"].get_ydata()) == [0.25] * 3
