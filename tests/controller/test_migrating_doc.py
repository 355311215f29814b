"""docs/migrating.md and its translated job files (examples/migrating/) stay true to the job spec: both files
load through the CLI's job-file loader into a valid JobSpec, and every everstep field the doc's tables name
is a field of the schema (so the doc cannot drift from it)."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from everstep.rest.job_spec import JobSpec
from everstep.settings.training import Aggregation, Correction, SchedulerMode
from everstep.verifiers import VERIFIER_PARAMS
from everstep_cli.job_file import load_job_file

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "migrating.md"
EXAMPLES = ROOT / "examples" / "migrating"
TRANSLATIONS = ("verl-gsm8k.yaml", "trl-grpo.yaml")


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: itself, a list's items, a union's members."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (list, typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models_in(a)]
    return []


def schema_has(path: str) -> bool:
    """Whether `path` ('a.b', 'reward.verifiers[].name', 'reward.verifiers[].params.max_length') is a field
    of JobSpec. A key under verifier params must be one some verifier reads."""
    model: type[BaseModel] | None = JobSpec
    parts = path.split(".")
    for depth, part in enumerate(parts):
        if model is None:
            return False
        is_list = part.endswith("[]")
        name = part.removesuffix("[]")
        field = model.model_fields.get(name)
        if field is None:
            return False
        annotation = field.annotation
        if is_list != (typing.get_origin(annotation) is list) and (is_list or depth < len(parts) - 1):
            return False  # 'verifiers[]' for a list's items (a list field itself may be named whole)
        if typing.get_origin(annotation) is dict:
            rest = parts[depth + 1:]
            if name == "params":
                known = set().union(*VERIFIER_PARAMS.values())
                return len(rest) <= 1 and all(key in known for key in rest)
            return len(rest) <= 1
        models = _models_in(annotation)
        model = models[0] if len(models) == 1 else None
        if model is None and depth < len(parts) - 1:
            return False
    return True


def _tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of `text`: rows of cells (header first, the |---| row left out)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _mapping_tables() -> dict[str, list[list[str]]]:
    """The field-by-field tables, by source: header 'verl | everstep | translation' and its TRL twin."""
    found = {}
    for table in _tables(DOC.read_text()):
        header = table[0]
        if len(header) == 3 and header[1] == "everstep" and header[2] == "translation":
            found[header[0]] = table[1:]
    return found


def _code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_the_doc_has_a_verl_and_a_trl_table_of_some_size() -> None:
    tables = _mapping_tables()
    assert set(tables) == {"verl", "TRL"}
    assert len(tables["verl"]) >= 30 and len(tables["TRL"]) >= 25


@pytest.mark.parametrize("source", ["verl", "TRL"])
def test_every_everstep_field_in_the_tables_is_a_job_spec_field(source: str) -> None:
    rows = _mapping_tables()[source]
    named = [(row[0], path) for row in rows for path in _code_spans(row[1])]
    assert all(len(row) == 3 and _code_spans(row[1]) for row in rows), "every row names an everstep field"
    missing = [f"{theirs} -> {path}" for theirs, path in named if not schema_has(path)]
    assert not missing, f"docs/migrating.md names fields the job spec lacks: {missing}"


def test_the_sampling_evaluation_and_data_table_names_job_spec_fields_and_all_three() -> None:
    [table] = [t for t in _tables(DOC.read_text()) if t[0] == ["everstep", "verl", "OpenRLHF", "TRL"]
               and any("sampling.min_p" in row[0] for row in t[1:])]  # (the Algorithms table has the same columns)
    fields = [path for row in table[1:] for path in _code_spans(row[0])]
    assert len(table) > 8 and all(len(row) == 4 for row in table[1:])
    assert not [f for f in fields if not schema_has(f)], fields
    for knob in ("sampling.min_p", "sampling.repetition_penalty", "sampling.presence_penalty",
                 "sampling.frequency_penalty", "evaluation.sampling.temperature", "evaluation.sampling.top_p",
                 "evaluation.sampling.max_new_tokens", "dataset.max_prompt_length",
                 "algorithm.mask_truncated_completions"):
        assert knob in fields, knob


def test_the_schema_check_refuses_what_is_not_there() -> None:
    assert schema_has("algorithm.loss.tis_cap") and schema_has("reward.verifiers[].params.cache_length")
    assert schema_has("steps") and schema_has("resources.trainer.gpus")
    for wrong in ("algorithm.loss.kl_coef", "trainer.beta", "reward.verifiers.name", "reward.verifiers[].params.x",
                  "sampling.top_p.x", "scheduler.prompts"):
        assert not schema_has(wrong), wrong


@pytest.mark.parametrize("source_key", [
    "data.train_files", "data.max_response_length", "data.train_batch_size", "rollout.n", "actor.optim.lr",
    "actor.ppo_mini_batch_size", "actor.ppo_epochs", "actor.clip_ratio_low", "actor.clip_ratio_high",
    "actor.use_kl_loss", "actor.kl_loss_coef", "actor.entropy_coeff", "actor.loss_agg_mode",
    "rollout.temperature", "rollout.top_p", "rollout.top_k", "trainer.total_training_steps", "trainer.save_freq",
    "trainer.test_freq", "algorithm.norm_adv_by_std_in_grpo", "rollout.enable_rollout_routing_replay",
])
def test_the_verl_table_covers(source_key: str) -> None:
    assert any(source_key in span for row in _mapping_tables()["verl"] for span in _code_spans(row[0])), source_key


@pytest.mark.parametrize("source_key", [
    "num_generations", "max_completion_length", "beta", "epsilon", "epsilon_high", "learning_rate",
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_iterations",
    "temperature", "top_p", "top_k", "loss_type", "scale_rewards", "vllm_importance_sampling_correction",
    "vllm_importance_sampling_cap", "save_steps", "eval_steps", "max_steps", "seed",
])
def test_the_trl_table_covers(source_key: str) -> None:
    assert any(span == source_key for row in _mapping_tables()["TRL"] for span in _code_spans(row[0])), source_key


def test_the_trl_beta_is_the_kl_coefficient_not_icepops() -> None:
    row = next(r for r in _mapping_tables()["TRL"] if _code_spans(r[0]) == ["beta"])
    assert _code_spans(row[1]) == ["trainer.kl_coef"]


def test_the_loss_and_correction_tables_name_real_values() -> None:
    text = DOC.read_text()
    aggregation = next(t for t in _tables(text) if t[0][-1] == "everstep `algorithm.loss.aggregation`")
    ours = {span for row in aggregation[1:] for span in _code_spans(row[-1])[:1]}
    assert ours == {a.value for a in Aggregation}
    correction = next(t for t in _tables(text) if t[0][:2] == ["everstep", "weight"])
    named = {_code_spans(row[0])[0] for row in correction[1:]}
    assert named == {c.value for c in Correction}
    assert all(schema_has(f"algorithm.loss.{option}") for row in correction[1:]
               for option in re.findall(r"`(\w+): ", row[0]))


def test_the_doc_links_files_that_exist() -> None:
    for link in re.findall(r"\]\(([^)#]+)\)", DOC.read_text()):
        assert (DOC.parent / link).resolve().exists(), link
    for name in TRANSLATIONS:
        assert f"examples/migrating/{name}" in DOC.read_text()


@pytest.mark.parametrize("name", TRANSLATIONS)
def test_the_translation_is_a_valid_job_spec(name: str) -> None:
    spec = JobSpec.model_validate(load_job_file(EXAMPLES / name))
    assert Path(spec.model_path).is_absolute() and Path(spec.dataset.train_path).is_absolute()
    # a verl/TRL step is one finished batch: the synchronous scheduler, with the correction named explicitly
    assert spec.scheduler.mode == SchedulerMode.sync
    assert spec.algorithm.loss.correction == Correction.tis
    assert not spec.algorithm.drop_zero_signal_groups


def test_the_verl_translation_keeps_the_recipe() -> None:
    spec = JobSpec.model_validate(load_job_file(EXAMPLES / "verl-gsm8k.yaml"))
    assert spec.dataset.answer_field == "reward_model.ground_truth"
    assert (spec.scheduler.prompts_per_iteration, spec.algorithm.group_size) == (1024, 5)  # train_batch_size, n
    assert spec.trainer.num_minibatches == 1024 // 256  # train_batch_size / ppo_mini_batch_size
    assert spec.trainer.kl_coef == 0.001 and spec.algorithm.loss.tis_cap == 2.0
    assert spec.steps == 15 * (7473 // 1024)  # total_epochs x GSM8K train rows // train_batch_size


def test_the_trl_translation_keeps_the_config() -> None:
    spec = JobSpec.model_validate(load_job_file(EXAMPLES / "trl-grpo.yaml"))
    per_device, processes, accumulation, per_generation, generations, iterations = 8, 8, 4, 8, 8, 1
    assert spec.scheduler.prompts_per_iteration == per_device * processes * per_generation // generations
    assert spec.trainer.num_minibatches == per_generation // accumulation
    assert spec.trainer.ppo_epochs == iterations
    optimizer_steps_per_step = spec.trainer.num_minibatches * spec.trainer.ppo_epochs
    assert spec.steps == 1000 // optimizer_steps_per_step  # max_steps
    assert spec.checkpoint.interval == 100 // optimizer_steps_per_step  # save_steps
    assert spec.evaluation.every == 50 // optimizer_steps_per_step  # eval_steps
    assert spec.trainer.kl_coef == 0.0 and spec.algorithm.loss.beta == 5.0  # TRL's beta is the KL coefficient
    assert (spec.algorithm.loss.clip_low, spec.algorithm.loss.clip_high) == (0.2, 0.28)
