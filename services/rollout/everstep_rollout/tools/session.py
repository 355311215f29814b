"""One sequence's tool loop: at each end of turn, parse the turn's tool calls, run them off the engine thread, and
turn their replies into the tokens that follow the turn (`everstep.tools.turns`), within the job's limits.

A trajectory's state lives in `everstep.v1.ToolTrajectory` so that a partial rollout carries it to any engine. A
partial drained while its tool ran ends with the unanswered call; the engine that continues it runs the call again
(`resume`), so http environments get each step's `call_index` and must answer a repeated index as before.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from everstep.settings.tools import ToolSettings
from everstep.tools.calls import FORMATS, MalformedCall, ParsedCall
from everstep.tools.schemas import arguments_problem
from everstep.tools.turns import ToolTemplateError, tool_reply_text
from everstep.v1 import common_pb2
from everstep_rollout.tools.environments import ToolEnvironmentClient, ToolOutcome

__all__ = ["ToolSession", "TurnEnd"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnEnd:
    """What follows a model turn: the tokens to append (the replies), or the end of the trajectory."""

    reply_ids: list[int] = field(default_factory=list)
    finished: bool = False


class ToolSession:
    """Not thread safe: the engine thread calls it; only `_run_calls` runs on a tool thread."""

    def __init__(self, settings: ToolSettings, client: ToolEnvironmentClient, tokenizer: Any,
                 trajectory: common_pb2.ToolTrajectory, *, turn_start: int, call_format: str = "hermes") -> None:
        self.settings = settings
        self.trajectory = trajectory
        self.turn_start = turn_start
        """Index in the output of the current model turn's first token."""
        self._client = client
        self._tokenizer = tokenizer
        self._format = FORMATS[call_format]
        self._tools = {t.function.name: t.function for t in settings.offered()}
        self._tools_json = [t.model_dump() for t in settings.offered()]
        self.pending: Future[list[ToolOutcome]] | None = None
        self._calls: list[ParsedCall | MalformedCall] = []
        self._eot = ""

    # -- the engine thread ----------------------------------------------------------------------------------------

    def end_turn(self, output_ids: list[int], submit: Any, *, counted: bool = True) -> bool:
        """The model ended a turn (its last output token is an end-of-turn token). True: its tool calls were
        submitted (`pending`) and the sequence waits for them; False: the trajectory is over."""
        if counted:
            self.trajectory.num_turns += 1
        turn = output_ids[self.turn_start:-1]
        self._eot = self._tokenizer.convert_ids_to_tokens(output_ids[-1])
        self.trajectory.final_text = self._tokenizer.decode(turn, skip_special_tokens=True)
        calls = self._format.parse(self._tokenizer.decode(turn, skip_special_tokens=False))
        if not calls or self.trajectory.num_turns >= self.settings.max_turns:
            return False
        self._calls = calls
        self.pending = submit(self._run_calls, calls)
        return True

    def take_reply(self, output_ids: list[int]) -> TurnEnd:
        """The pending calls' replies (the future is done): the tokens to append, or finished when the environment
        ended the episode. Records every call in the trajectory."""
        assert self.pending is not None and self.pending.done()
        outcomes = self.pending.result()
        self.pending = None
        replies = []
        for call, outcome in zip(self._calls, outcomes, strict=True):
            reply, truncated = self._truncate(outcome.reply)
            replies.append(reply)
            self.trajectory.calls.add(
                turn=self.trajectory.num_turns, name=call.name if isinstance(call, ParsedCall) else "",
                arguments_json=call.arguments_json if isinstance(call, ParsedCall) else call.text, reply=reply,
                error=outcome.error, seconds=outcome.seconds, truncated=truncated)
            if outcome.reward is not None:
                self.trajectory.env_reward += outcome.reward
        if any(o.done for o in outcomes):
            return TurnEnd(finished=True)
        try:
            text = tool_reply_text(self._render, self._calls, replies, self._eot)
        except ToolTemplateError as e:
            log.warning("trajectory ended: %s", e)
            return TurnEnd(finished=True)
        reply_ids = self._tokenizer.encode(text, add_special_tokens=False)
        self.turn_start = len(output_ids) + len(reply_ids)
        return TurnEnd(reply_ids=reply_ids)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(messages, tools=self._tools_json, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt,
                                                   chat_template=self.settings.chat_template)

    def _truncate(self, reply: str) -> tuple[str, bool]:
        limit = self.settings.max_tool_reply_tokens
        # cut the text where its limit-th token ends (not a decode of the kept ids: that may not give the text back)
        offsets = self._tokenizer(reply, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) <= limit:
            return reply, False
        return f"{reply[: offsets[limit - 1][1]]}\n[truncated: {len(offsets) - limit} more tokens]", True

    # -- a tool thread --------------------------------------------------------------------------------------------

    def _run_calls(self, calls: list[ParsedCall | MalformedCall]) -> list[ToolOutcome]:
        outcomes = []
        for call in calls:
            start = time.perf_counter()
            outcome = self._run_one(call)
            outcomes.append(ToolOutcome(reply=outcome.reply, error=outcome.error, done=outcome.done,
                                        reward=outcome.reward, seconds=time.perf_counter() - start))
            if outcome.done:
                break
        while len(outcomes) < len(calls):  # after the environment ended the episode
            outcomes.append(ToolOutcome(reply="error: the episode is over", error=common_pb2.TOOL_ERROR_KIND_LIMIT))
        return outcomes

    def _run_one(self, call: ParsedCall | MalformedCall) -> ToolOutcome:
        if isinstance(call, MalformedCall):
            return ToolOutcome(reply=f"error: {call.reason}", error=common_pb2.TOOL_ERROR_KIND_MALFORMED)
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolOutcome(reply=f"error: unknown tool {call.name!r}; the tools are {sorted(self._tools)}",
                               error=common_pb2.TOOL_ERROR_KIND_UNKNOWN_TOOL)
        problem = arguments_problem(tool.parameters, call.arguments)
        if problem is not None:
            return ToolOutcome(reply=f"error: {call.name}: {problem}", error=common_pb2.TOOL_ERROR_KIND_BAD_ARGUMENTS)
        if self.trajectory.num_tool_calls >= self.settings.max_tool_calls:
            return ToolOutcome(reply=f"error: no more tool calls (at most {self.settings.max_tool_calls})",
                               error=common_pb2.TOOL_ERROR_KIND_LIMIT)
        outcome = self._client.run(call, self.trajectory)
        self.trajectory.num_tool_calls += 1
        return outcome

    def snapshot(self) -> common_pb2.ToolTrajectory:
        """A copy of the state: a tool thread may still write the trajectory (a drained call's reset)."""
        copy = common_pb2.ToolTrajectory()
        copy.CopyFrom(self.trajectory)
        return copy

    def close(self, submit: Any) -> None:
        """The trajectory finished: let the environment forget it (off the engine thread)."""
        if self.trajectory.env_session:
            submit(self._client.close, self.trajectory)
