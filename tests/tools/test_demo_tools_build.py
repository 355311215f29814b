"""The tools demo builder (`python -m everstep_tools.demo.tools --quick`): a real, tiny build whose warm-start
traces are token for token the conversations transformers renders, and whose build.json verifies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from everstep.model_manifest import verify_manifest
from everstep.tools.calls import FORMATS, ParsedCall, format_for_template
from everstep_tools.demo.tools.__main__ import main
from everstep_tools.demo.tools.build import TOOLS, ToolsBuildConfig, _examples, _Renderer
from everstep_tools.demo.tools.task import Problem, TaskConfig, call_text, split_train_eval


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tools") / "model"
    main(["--out", str(out), "--quick"])
    return out


def test_the_quick_build_writes_a_verified_folder_with_disjoint_data(built: Path) -> None:
    manifest = verify_manifest(built)
    assert manifest.command == f"python -m everstep_tools.demo.tools --out {built} --quick"
    rows = {name: [json.loads(line) for line in (built / name).read_text().splitlines()]
            for name in ("train.jsonl", "eval.jsonl")}
    assert not {r["prompt"] for r in rows["train.jsonl"]} & {r["prompt"] for r in rows["eval.jsonl"]}
    for row in rows["eval.jsonl"]:
        left, right = (int(w.strip("?")) for w in row["prompt"].split()[2::2])
        assert int(row["answer"]) == left * right


def test_a_tool_trace_is_the_conversation_transformers_renders_token_for_token(built: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert format_for_template(tokenizer.chat_template) == "hermes"
    problem = Problem(347, 61)
    renderer = _Renderer(tokenizer)
    call = call_text(problem)
    parsed = FORMATS["hermes"].parse(call)
    assert parsed == [ParsedCall("python", {"code": "print(347 * 61)"})]
    messages = [{"role": "user", "content": problem.prompt},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "python", "arguments": {"code": "print(347 * 61)"}}}]},
                {"role": "tool", "name": "python", "content": "21167\n"}]
    whole = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert renderer.after_reply(problem) == whole
    # prompt, the model's call and end of turn, then the reply: the ids the engine holds are the whole text's
    pieces = (tokenizer(renderer.prompt(problem)).input_ids + tokenizer(call, add_special_tokens=False).input_ids
              + [tokenizer.eos_token_id] + tokenizer(whole[len(renderer.prompt(problem) + call) + len("<|im_end|>"):],
                                                     add_special_tokens=False).input_ids)
    assert pieces == tokenizer(whole, add_special_tokens=False).input_ids


def test_the_mix_has_tool_traces_in_about_the_given_share() -> None:
    train, _ = split_train_eval(400, 4, seed=0, config=TaskConfig())

    class Plain:  # a renderer stand-in: the share does not depend on the text
        def prompt(self, p: Problem) -> str:
            return p.prompt

        def after_reply(self, p: Problem) -> str:
            return p.prompt + " reply"

    examples = _examples(Plain(), train, 0.15, random.Random(0))  # type: ignore[arg-type]
    calls = sum(completion.startswith("<tool_call>") for _, completion in examples)
    assert 0.08 < calls / len(train) < 0.22
    assert sum(prompt.endswith(" reply") for prompt, _ in examples) == calls


def test_bad_settings_name_their_field() -> None:
    with pytest.raises(ValueError, match="tool_use_probability"):
        ToolsBuildConfig(tool_use_probability=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        ToolsBuildConfig(vocab_size=100)
