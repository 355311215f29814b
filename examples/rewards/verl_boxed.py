"""A verl-style reward function (custom_reward_function.path/name): one call per response.

The demo model writes its answer in \\boxed{...}; the score is 1 when that equals the row's answer. The dict's
other keys are reported with the score (the step's `reward_metrics`).
"""

import re

_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    boxed = _BOXED.findall(solution_str)
    answer = boxed[-1] if boxed else None
    return {"score": 1.0 if answer == str(ground_truth).strip() else 0.0, "boxed": 1.0 if boxed else 0.0}
