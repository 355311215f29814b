"""The controller's chat-template rendering (no torch, no transformers) against transformers'
`apply_chat_template` on SmolLM2-135M-Instruct's own tokenizer (49152 BPE tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

from everstep.rest.job_spec import PromptSpec
from everstep_controller.data.chat_template import ChatMessage
from everstep_controller.data.dataset import load_tokenizer
from everstep_controller.data.prompt_rendering import load_prompt_encoder

USER = [{"role": "user", "content": "What is 2 + 3? Answer with a number."}]
WITH_SYSTEM = [{"role": "system", "content": "Think step by step, then put the answer in \\boxed{}."}, *USER]
MULTI_TURN = [*WITH_SYSTEM, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Solve: 12 * 7 = ?"}]


@pytest.mark.parametrize("messages", [USER, WITH_SYSTEM, MULTI_TURN], ids=["user", "system", "multi-turn"])
def test_prompt_ids_equal_transformers_apply_chat_template(smollm2_dir: Path, messages: list[dict]) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm2_dir))
    encoder = load_prompt_encoder(str(smollm2_dir), load_tokenizer(str(smollm2_dir)))
    prompt = tuple(ChatMessage(m["role"], m["content"]) for m in messages)
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(encoder.encode(prompt)) == expected


def test_a_spec_system_message_renders_as_transformers_renders_it(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(smollm2_dir))
    system = "You are a careful math tutor."
    encoder = load_prompt_encoder(str(smollm2_dir), load_tokenizer(str(smollm2_dir)), PromptSpec(system=system))
    expected = reference.apply_chat_template([{"role": "system", "content": system}, *USER],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(encoder.encode(USER[0]["content"])) == expected
    assert reference.decode(expected).startswith("<|im_start|>system\nYou are a careful math tutor.<|im_end|>")
