"""Training groups left out because the reward service could not score their row's data.

Each such sample is counted (`everstep_controller_unscorable_samples_total{kind}`), each row is
logged once per runner, and the first rows are listed with the cause in the job record's dataset
report (`dataset.unscorable`), so a user can fix the data.
"""

from __future__ import annotations

import logging

from everstep.rest.job_record import DatasetReport
from everstep_controller.data.dataset import MAX_REPORTED_SKIPS
from everstep_controller.data.reward_errors import describe, row_error
from everstep_controller.run import metrics
from everstep_controller.store.progress_store import ScoredSample

log = logging.getLogger(__name__)


class UnscorableRows:
    def __init__(self, job_id: str, report: DatasetReport) -> None:
        """report: the job's dataset report, with the rows listed by an earlier runner of the job."""
        self.job_id = job_id
        self.report = report
        self._logged: set[int] = set()

    def note(self, groups: dict[str, dict[str, ScoredSample]], row_of_group: dict[str, int]) -> bool:
        """groups: group id -> its members whose row could not be scored. True when `report` changed."""
        changed = False
        for group_id, members in groups.items():
            errors = {sample_id: row_error(member.part_errors) for sample_id, member in members.items()}
            for error in errors.values():
                metrics.UNSCORABLE_SAMPLES.labels(kind=error.label if error else "unknown").inc()
            row = row_of_group[group_id]
            if row in self._logged:
                continue
            self._logged.add(row)
            sample_id, error = next(iter(errors.items()))
            member = members[sample_id]
            log.warning("job %s: dataset row %d cannot be scored, group %s left out of training: %s", self.job_id,
                        row, group_id, describe(sample_id, member.part_errors, member.error))
            listed = {entry["row"] for entry in self.report.unscorable}
            if error is not None and row not in listed and len(listed) < MAX_REPORTED_SKIPS:
                entry = {"row": row, "verifier": error.verifier, "kind": error.label, "reason": error.message}
                self.report = self.report.model_copy(update={"unscorable": [*self.report.unscorable, entry]})
                changed = True
        return changed
