"""A job's prompts: the training rows, the held-out rows, and the report of what was left out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from everstep.rest.job_record import DatasetReport
from everstep.rest.job_spec import JobSpec
from everstep.settings import tools as tool_settings
from everstep.settings.tools import ToolSettings
from everstep.tools.calls import format_for_template
from everstep.v1 import common_pb2
from everstep_controller.data.dataset import LoadedDataset, PromptRow, RowFields, load_prompt_rows, load_tokenizer
from everstep_controller.data.dataset_columns import check_dataset_fields
from everstep_controller.data.prompt_rendering import load_prompt_encoder
from everstep_controller.spec.model_limits import check_routing_replay, max_prompt_tokens
from everstep_controller.spec.submission_checks import check_verifiers

__all__ = ["JobData", "load_job_data"]


@dataclass(frozen=True)
class JobData:
    train: LoadedDataset
    eval_rows: list[PromptRow]
    tokenizer: Tokenizer | None = None
    """The model's tokenizer (decodes the samples shown per step)."""
    tools: ToolSettings | None = None
    tool_call_format: str = ""
    """The format the job's chat template writes tool calls in (`everstep.tools.calls.FORMATS`)."""

    def tool_config(self, sandbox_address: str) -> common_pb2.ToolConfig | None:
        """What every Generate request of the job carries (None: no tools)."""
        if self.tools is None:
            return None
        return tool_settings.to_proto(self.tools, sandbox_address=sandbox_address, call_format=self.tool_call_format)

    def report(self, unscorable: list[dict[str, Any]]) -> DatasetReport:
        """The job record's dataset report; `unscorable`: the rows listed by an earlier runner of the job."""
        return DatasetReport(num_rows=len(self.train.rows), num_skipped=self.train.num_skipped,
                             skipped=[{"row": s.index, "reason": s.reason} for s in self.train.skipped],
                             unscorable=unscorable)


def load_job_data(spec: JobSpec) -> JobData:
    check_verifiers(spec)  # as at submission: a job stored before that check fails here, before any worker
    if not Path(spec.model_path).is_dir():
        raise FileNotFoundError(f"model_path {spec.model_path!r} is not a directory")
    check_routing_replay(spec)  # as at submission: a model written after it must have experts to replay
    tokenizer = load_tokenizer(spec.model_path)
    encoder = load_prompt_encoder(spec.model_path, tokenizer, spec.prompt, spec.tools)
    call_format = ""
    if spec.tools is not None:
        assert encoder.template is not None  # load_prompt_encoder refuses tools without one
        call_format = format_for_template(encoder.template.source) or ""
    d = spec.dataset
    check_dataset_fields(d)  # as at submission (data.file_checks): a field the file lacks fails the job
    fields = RowFields(prompt=d.prompt_field, answer=d.answer_field, tests=d.tests_field,
                       function_name=d.function_name_field, language=d.language_field, verifiers=d.verifiers_field)
    names = [v.name for v in spec.reward.verifiers]
    longest = max_prompt_tokens(spec)  # a row whose prompt + max_new_tokens passes the model's positions is skipped
    train = load_prompt_rows(d.train_path, encoder, fields=fields, file_format=d.format.value, verifier_names=names,
                             max_prompt_tokens=longest, max_prompt_length=d.max_prompt_length)
    eval_rows: list[PromptRow] = []
    if d.eval_path:
        held_out = load_prompt_rows(d.eval_path, encoder, fields=fields, file_format=d.format.value,
                                    verifier_names=names, max_prompt_tokens=longest, setting="eval_path",
                                    max_prompt_length=d.max_prompt_length)
        eval_rows = held_out.rows[: spec.evaluation.num_prompts]
    return JobData(train, eval_rows, tokenizer, spec.tools, call_format)
