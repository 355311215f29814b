"""The torch engine's scheduler on its own: plain sequences, no model, no torch (what it decides, step by step)."""

from __future__ import annotations

import ast
import concurrent.futures
from pathlib import Path
from types import SimpleNamespace

import everstep_rollout
from everstep_rollout.engine.scheduler import ScheduledSequence, Scheduler, SlotMove
from everstep_rollout.engine.tool_turns import ToolTurns
from everstep_rollout.sequence import FinishReason, GenerationRequest, SamplingOptions

EOS = 2


def sequence(name: str, prompt: list[int], *, max_new_tokens: int = 0, stop: tuple[str, ...] = ()) -> ScheduledSequence:
    request = GenerationRequest(id=name, prompt_ids=prompt,
                                sampling=SamplingOptions(max_new_tokens=max_new_tokens, stop=stop))
    return ScheduledSequence(request=request, token_ids=list(prompt), output_ids=[], output_logprobs=[],
                             output_versions=[], stop_window=4)


def scheduler(num_slots: int = 2, *, max_seq_len: int = 32, prefill_max_tokens: int = 64,
              share: bool = False) -> Scheduler[ScheduledSequence]:
    turns = ToolTurns(sandbox_endpoint="", tokenizer=None, eos_token_ids=[EOS])
    return Scheduler(num_slots=num_slots, max_seq_len=max_seq_len, prefill_max_tokens=prefill_max_tokens,
                     share_prompt_prefill=share, turns=turns, decode_text=lambda ids: "".join(chr(96 + t) for t in ids))


def test_admits_lowest_slots_first_and_moves_the_highest_down_when_one_leaves():
    s = scheduler(num_slots=3)
    a, b, c, d = (sequence(n, [1, 5, 6]) for n in "abcd")
    for seq in (a, b, c, d):
        assert s.add(seq) is None
    plan = s.schedule()
    assert [q.slot for q in (a, b, c)] == [0, 1, 2] and d.slot == -1 and s.num_queued == 1
    assert plan.prefill == [a, b, c] and plan.decode == [a, b, c] and plan.moves == []
    finished = s.update_from_output(plan.decode, [EOS, 7, 8], [0.0] * 3, version=0)
    assert finished == [(a, FinishReason.STOP)] and a.slot == -1
    plan = s.schedule()  # d takes the freed slot 0: nothing to move
    assert d.slot == 0 and plan.moves == [] and plan.prefill == [d]
    s.update_from_output(plan.decode, [7, EOS, 9], [0.0] * 3, version=0)  # b leaves slot 1
    plan = s.schedule()
    assert plan.moves == [SlotMove(src=2, dst=1, length=len(c.token_ids) - 1)] and c.slot == 1
    assert plan.decode == [d, c] and plan.prefill == []


def test_prefill_chunks_shortest_first_within_the_token_budget_and_one_token_prompts_have_no_row():
    s = scheduler(num_slots=4, prefill_max_tokens=8)
    long, short, middle = sequence("l", [1] * 7), sequence("s", [1, 2]), sequence("m", [1] * 4)
    single = sequence("o", [1])
    for seq in (long, short, middle, single):
        s.add(seq)
    plan = s.schedule()
    assert plan.prefill_chunks == [[short, middle], [long]]  # 2 x 3 padded tokens fit 8; 3 x 6 would not
    assert plan.prefill == [long, short, middle, single] and plan.num_prefilled == 4


def test_equal_fresh_prompts_admitted_together_are_prefilled_once():
    s = scheduler(num_slots=4, share=True)
    copies = [sequence(f"g{i}", [1, 5, 6, 7]) for i in range(3)]
    other = sequence("x", [1, 9])
    for seq in (*copies, other):
        s.add(seq)
    plan = s.schedule()
    assert plan.sharers == {copies[0]: copies[1:]} and plan.prefill == [copies[0], other]
    assert plan.num_prefilled == 4 and plan.decode == [*copies, other]


def test_finishes_on_eos_stop_string_and_length():
    s = scheduler(num_slots=3, max_seq_len=32)
    eos, stop, length = sequence("e", [1]), sequence("s", [1], stop=("cd",)), sequence("l", [1], max_new_tokens=2)
    for seq in (eos, stop, length):
        s.add(seq)
    plan = s.schedule()
    assert s.update_from_output(plan.decode, [EOS, 3, 5], [-0.5] * 3, version=4) == [(eos, FinishReason.STOP)]
    assert eos.output_ids == [EOS] and eos.output_versions == [4] and eos.output_logprobs == [-0.5]
    plan = s.schedule()  # `length` moved down into the slot `eos` left
    assert plan.decode == [length, stop] and plan.moves == [SlotMove(src=2, dst=0, length=1)]
    assert s.update_from_output(plan.decode, [0, 4], [0.0] * 2, version=4) == [
        (length, FinishReason.LENGTH), (stop, FinishReason.STOP)]  # "c" + "d" is the stop string
    assert not s.live and s.length_reached(length)
    assert s.add(sequence("full", [1] * 32)) == FinishReason.LENGTH  # nothing left to generate


def test_paused_sequences_keep_their_slot_until_a_queued_one_needs_it():
    s = scheduler(num_slots=1)
    paused, waiting = sequence("p", [1, 5]), sequence("w", [1, 6])
    s.add(paused)
    s.schedule()
    paused.tools = SimpleNamespace(pending=concurrent.futures.Future())  # a tool-session stand-in: calls running
    plan = s.schedule()
    assert plan.waiting_for_tools and plan.decode == [] and s.num_paused == 1
    s.add(waiting)
    plan = s.schedule()
    assert paused.slot == -1 and waiting.slot == 0 and s.num_tool_evictions == 1 and plan.decode == [waiting]
    assert s.num_running == 1 and s.num_queued == 0 and len(s.live) == 2
    assert s.drain() == [paused, waiting] and paused.tools.pending is None and not s.live


def test_the_scheduler_imports_no_torch():
    """Plain Python: its module and the rollout modules it imports name neither torch nor transformers."""
    root = Path(everstep_rollout.__file__).parent
    seen, todo = set(), ["engine.scheduler"]
    while todo:
        name = todo.pop()
        seen.add(name)
        tree = ast.parse((root / f"{name.replace('.', '/')}.py").read_text())
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for module in modules:
                assert module.split(".")[0] not in ("torch", "transformers"), f"{name} imports {module}"
                inner = module.removeprefix("everstep_rollout.")
                if inner != module and inner not in seen and (root / f"{inner.replace('.', '/')}.py").exists():
                    todo.append(inner)
    assert {"engine.scheduler", "engine.tool_turns", "sequence", "routing"} <= seen
