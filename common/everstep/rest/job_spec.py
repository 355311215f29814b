"""The job spec: what a user submits (YAML for the CLI, JSON over REST).

It composes the algorithm, sampling, scheduler and trainer sections of `everstep.settings.training`, where those
settings are declared (field, default, check, description) once for the controller, the trainer and the
engine; the sections only the controller reads live here. docs/job-spec.md is generated from this
schema (`python -m everstep_controller.spec.docs`). Paths are taken as given by the REST API;
the CLI resolves relative paths against the directory of the YAML file before submitting.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, JsonValue, field_validator, model_validator

from everstep.rest.tracking_spec import TrackingSpec
from everstep.reward_functions import part_name
from everstep.settings.tools import ToolSettings
from everstep.settings.training import (
    AlgorithmSettings,
    SamplingSettings,
    SchedulerMode,
    SchedulerSettings,
    TrainerSettings,
)
from everstep.settings.training import Section as _Section
from everstep.verifiers import VERIFIER_PARAMS


class DatasetFormat(StrEnum):
    auto = "auto"
    jsonl = "jsonl"
    parquet = "parquet"


DatasetPaths = str | list[str]
"""A dataset file, or a non-empty list of files and glob patterns (`data.dataset.dataset_paths` expands it)."""


class DatasetSpec(_Section):
    """Where prompts come from: JSONL or Parquet rows with a prompt and an answer or tests.

    Every *_field is a column name or a dotted path into nested columns (`reward_model.ground_truth`: the
    `ground_truth` of the struct column `reward_model`); a name that is itself a column is taken as it is.
    A field named other than by its default that no row has, a prompt field no row has, or neither an
    answer nor a tests field, is rejected at submission (422 naming the field) when the file can be read
    then, else fails the job. verl's and TRL's files: docs/controller.md, "Datasets". Rows without a
    prompt, with neither an answer nor tests, with malformed tests or naming a verifier the job does not
    have are skipped, counted and listed in the job record (`dataset`).
    """

    train_path: DatasetPaths = Field(
        description="JSONL or Parquet file of training rows, or a list of files and glob patterns (as verl's "
                    "data.train_files): the files' rows in order, each pattern's matches sorted by name. A pattern "
                    "that matches nothing is refused at submission (422 naming it) when its folder exists, else "
                    "fails the job.")
    eval_path: DatasetPaths | None = Field(
        default=None, description="Held-out rows for evaluation, as train_path (a file, or a list of files and "
                                  "glob patterns); none: no evaluation."
    )
    format: DatasetFormat = Field(
        default=DatasetFormat.auto,
        description="Format of every dataset file; 'auto': each file's from its name (.jsonl/.json/.ndjson, "
                    ".parquet/.pq).",
    )
    prompt_field: str = Field(
        default="prompt", min_length=1,
        description="Row field holding the prompt: a string, or a list of {role, content} messages (prompt.format).",
    )
    answer_field: str = Field(
        default="answer", min_length=1,
        description="Row field holding the reference answer (a string or number); verl: 'reward_model.ground_truth', "
                    "TRL: 'answer' or 'solution'.",
    )
    tests_field: str = Field(
        default="tests",
        description="Row field holding a list of code tests, or a JSON string of one. Each test is a stdin/stdout "
                    "case {stdin, expected_stdout} (or {input, output}) or a function-call case {arguments: list "
                    "or object, expected: JSON}; a row's tests are all of one form.",
    )
    function_name_field: str = Field(
        default="function_name",
        description="Row field naming the function that function-call tests call ('name' or 'Class.method').",
    )
    language_field: str = Field(
        default="language",
        description="Row field holding the sandbox language of the row's code (e.g. 'python'); missing: "
                    "reward.verifiers[].language.",
    )
    verifiers_field: str = Field(
        default="verifiers",
        description="Row field listing the names of the job's verifiers that apply to the row (e.g. ['code']); "
                    "missing: all of them. A name the job does not list makes the row skipped.",
    )
    max_prompt_length: int | None = Field(
        default=None, ge=1,
        description="Longest prompt, in tokens after the chat template: longer rows (train and eval) are skipped, "
                    "counted and listed in the job record like other skipped rows (verl's filter_overlong_prompts). "
                    "None: only the model's positions less max_new_tokens limit it.",
    )


    @field_validator("train_path", "eval_path")
    @classmethod
    def _paths_named(cls, value: DatasetPaths | None) -> DatasetPaths | None:
        if isinstance(value, list) and (not value or not all(value)):
            raise ValueError("a list of dataset files needs at least one entry, and no empty one")
        return value


class PromptFormat(StrEnum):
    auto = "auto"
    raw = "raw"
    chat = "chat"


class PromptSpec(_Section):
    """How a row's prompt becomes the model's input: the model's chat template, or the text as it is.

    A row's prompt is a string (one user message) or a list of {role, content} messages. The controller
    renders the template as transformers' apply_chat_template(messages, add_generation_prompt=True) does and
    tokenizes the result without adding special tokens (docs/controller.md, "Prompts").
    """

    format: PromptFormat = Field(
        default=PromptFormat.auto,
        description="'chat': render the model's chat template (chat_template.jinja, or chat_template in "
                    "tokenizer_config.json; a model without one is an error); 'raw': tokenize the prompt string as "
                    "it is (rows of messages are skipped); 'auto': 'chat' when the model has a chat template, "
                    "else 'raw'.",
    )
    system: str | None = Field(
        default=None, min_length=1,
        description="System message put before every row's messages, unless the row has a system message of its "
                    "own (the row's wins). Needs a chat template.",
    )

    @model_validator(mode="after")
    def _system_needs_chat(self) -> PromptSpec:
        if self.system is not None and self.format == PromptFormat.raw:
            raise ValueError("prompt.system needs a chat template; prompt.format is 'raw'")
        return self


class VerifierWeight(_Section):
    """One verifier, its weight and its options."""

    name: str = Field(min_length=1, description=f"Verifier name: {', '.join(map(repr, VERIFIER_PARAMS))}; another "
                                                "is refused at submission (422 naming it).")
    weight: float = Field(default=1.0, allow_inf_nan=False,
                          description="Weight of this verifier's score in the reward.")
    params: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="Options of this verifier, sent with every item as VerifierSpec.params (keys per verifier in "
                    "docs/reward.md, e.g. code: reward_mode, run_timeout_seconds; length: max_length, cache_length). "
                    "A key the verifier does not read is refused at submission (422 naming it); the values are "
                    "the reward service's to check: a bad one fails the job with an error naming it.",
    )
    language: str | None = Field(
        default=None, min_length=1,
        description="code only: sandbox language (e.g. 'python', 'cpp') of rows that name none in "
                    "dataset.language_field.",
    )

    @model_validator(mode="after")
    def _language_for_code_only(self) -> VerifierWeight:
        if self.language is not None and self.name != "code":
            raise ValueError(f"language is an option of the code verifier, not of {self.name!r}")
        return self


class RewardFunctionSpec(_Section):
    """A reward function of the user's, from a Python file (docs/reward.md, "Reward functions")."""

    path: str = Field(min_length=1, description="The Python file that defines the function (the CLI reads it relative "
                                                "to the job file; the controller, when `source` is not sent).")
    name: str = Field(default="compute_score", min_length=1,
                      description="The function: verl's compute_score(data_source, solution_str, ground_truth, "
                                  "extra_info) or TRL's f(prompts, completions, **columns), told by its parameters.")
    weight: float = Field(default=1.0, allow_inf_nan=False, description="Weight of its score in the reward.")
    allow_network: bool = Field(default=False,
                                description="The function may use the network; granted only where the reward "
                                            "service's operator allows it (--function-allow-network), else refused.")
    source: str | None = Field(
        default=None,
        description="The file's source. Filled at submission (the CLI sends it; else the controller reads `path`), "
                    "so reward pods need no shared file; a job runs the source it was submitted with.")


class RewardSpec(_Section):
    """How responses are scored: a weighted sum of verifier and reward-function scores."""

    verifiers: list[VerifierWeight] = Field(
        default_factory=lambda: [VerifierWeight(name="math", weight=1.0)],
        description="Verifiers applied to every row (or to those a row lists in dataset.verifiers_field), with "
                    "weights and options. Default: math, unless `functions` are given (then none).",
    )
    functions: list[RewardFunctionSpec] = Field(
        default_factory=list,
        description="The user's reward functions, each {path, name, weight}, beside or instead of the verifiers; "
                    "applied to every row.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_default_verifier_beside_functions(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("functions") and "verifiers" not in data:
            return {**data, "verifiers": []}
        return data

    @model_validator(mode="after")
    def _names_unique(self) -> RewardSpec:
        if not self.verifiers and not self.functions:
            raise ValueError("reward needs a verifier or a function (reward.verifiers, reward.functions)")
        names = [v.name for v in self.verifiers]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"each verifier may appear once (rows select verifiers by name); repeated: {repeated}")
        parts = [part_name(f.path, f.name) for f in self.functions]
        repeated = sorted({n for n in parts if parts.count(n) > 1})
        if repeated:
            raise ValueError(f"each function's file stem and name must differ (results name them so): {repeated}")
        return self


class EvaluationSampling(_Section):
    """How evaluation samples its k answers per prompt (verl's val_kwargs); each unset field is sampling's."""

    temperature: float | None = Field(default=None, gt=0, allow_inf_nan=False,
                                      description="Sampling temperature; none: sampling.temperature.")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus threshold; none: sampling.top_p.")
    max_new_tokens: int | None = Field(default=None, ge=1,
                                       description="Longest answer, in tokens; none: sampling.max_new_tokens.")


class EvaluationSpec(_Section):
    """Held-out evaluation: avg@k, pass@k and maj@k over k samples per prompt, plus greedy."""

    every: int = Field(default=0, ge=0, description="Evaluate every N steps (0: only before and after).")
    num_prompts: int = Field(default=64, ge=1, description="Held-out prompts evaluated.")
    samples_per_prompt: int = Field(default=4, ge=1, description="k of avg@k, pass@k and maj@k.")
    greedy: bool = Field(default=True, description="Also report greedy accuracy.")
    sampling: EvaluationSampling = Field(
        default_factory=EvaluationSampling,
        description="Temperature, top_p and max_new_tokens of the k samples (the greedy answer keeps only "
                    "max_new_tokens); unset: the training sampling's. The other sampling settings (top_k, min_p, "
                    "penalties, stop) are the training sampling's.",
    )


class CheckpointSpec(_Section):
    """When and where the trainer saves Hugging Face checkpoints."""

    interval: int = Field(default=0, ge=0, description="Save every N steps (0: only at the end).")
    dir: str | None = Field(default=None, description="Where to save; none: the controller's data dir.")


class WorkerResources(_Section):
    """Resources of one per-job worker pod (Kubernetes launcher); none: the chart's PodTemplate value."""

    cpu: str | None = Field(default=None, pattern=r"^[0-9]+(\.[0-9]+)?m?$",
                            description="CPU request and limit, e.g. '8' or '500m'.")
    memory: str | None = Field(default=None, pattern=r"^[0-9]+(\.[0-9]+)?([EPTGMK]i?)?$",
                               description="Memory request and limit, e.g. '64Gi'.")
    gpus: int | None = Field(default=None, ge=0, description="GPUs (limit of the chart's GPU resource name).")
    replicas: int = Field(default=1, ge=1, le=256, description=(
        "rollout: engines in the job's pool (one token budget and capacity for all of them; docs/controller.md). "
        "trainer: trainer nodes, one process group (each node runs a rank per GPU, one on CPU; FSDP2 over all; "
        "docs/trainer.md, Several nodes)."))


class ResourcesSpec(_Section):
    """The job's own workers: how many rollout engines, and the resources of each pod on Kubernetes.

    The local launcher runs every worker as a process on this machine (it honours `replicas` and warns that it
    ignores cpu, memory and gpus); the Kubernetes launcher sets them on the pods.
    """

    rollout: WorkerResources = Field(default_factory=WorkerResources)
    trainer: WorkerResources = Field(default_factory=WorkerResources)


class JobSpec(_Section):
    """One RL job."""

    name: str = Field(default="job", min_length=1, max_length=128, description="Display name.")
    model_path: str = Field(min_length=1, description="Hugging Face model directory (the initial policy).")
    dataset: DatasetSpec
    prompt: PromptSpec = Field(default_factory=PromptSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    tools: ToolSettings | None = Field(
        default=None,
        description="Multi-turn tool use: the tools the model may call between its turns and where they run "
                    "(docs/tools.md). Unset: one prompt, one completion.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    steps: int = Field(default=20, ge=1, description="Training steps (one per scheduler iteration).")
    max_trained_samples: int = Field(
        default=0, ge=0,
        description="End the job after the step at which this many samples were trained (0: run all steps).",
    )
    seed: int = Field(default=0, ge=0, description="Seed for prompt order, sampling and training.")
    deterministic: bool = Field(
        default=False,
        description="Reproducible from the seed: each training sample is sampled with its own seed (from the job's "
                    "seed and its id), so rollouts, rewards and losses do not depend on timing, and a job resumed "
                    "from a checkpoint trains exactly as one never interrupted. Needs scheduler.mode 'sync' (a "
                    "C3PO++ iteration ends when the token budget is reached, which depends on timing).",
    )

    @property
    def max_answer_tokens(self) -> int:
        """The longest answer an engine is asked for: sampling.max_new_tokens, or evaluation's when it is longer
        (and there is an eval set)."""
        evaluation = self.evaluation.sampling.max_new_tokens if self.dataset.eval_path else None
        return max(self.sampling.max_new_tokens, evaluation or 0)

    @model_validator(mode="after")
    def _parts_agree(self) -> JobSpec:
        if self.deterministic and self.scheduler.mode != SchedulerMode.sync:
            raise ValueError("deterministic needs scheduler.mode 'sync': C3PO++ iterations end at a token budget, "
                             "which depends on timing")
        if self.deterministic and self.scheduler.overlap:
            raise ValueError(f"deterministic needs scheduler.overlap 0 (got {self.scheduler.overlap}): with overlap, "
                             "the version that samples a token depends on when the new weights arrive")
        self.scheduler.check_holds_a_group(self.algorithm.group_size)
        if self.tools is not None and self.prompt.format == PromptFormat.raw:
            raise ValueError("tools need prompt.format 'chat' or 'auto': the tools reach the model through its chat "
                             "template")
        if self.trainer.warmup_steps >= self.steps:
            raise ValueError(f"trainer.warmup_steps ({self.trainer.warmup_steps}) must be less than steps "
                             f"({self.steps})")
        return self
