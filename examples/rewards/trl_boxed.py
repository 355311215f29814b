"""A TRL-style reward function (GRPOTrainer's reward_funcs): lists in, one score per completion out.

Columns come as keyword arguments (`answer`, also as `ground_truth`); **kwargs takes the rest. `None` means
"does not apply to this completion". An `async def` works the same way.
"""

import re

_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")


def boxed_answer_reward(prompts, completions, answer, **kwargs):
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        boxed = _BOXED.findall(completion)
        rewards.append(1.0 if boxed and boxed[-1] == str(expected).strip() else 0.0)
    return rewards
