"""An example tool environment over HTTP for everstep's multi-turn rollouts (docs/tools.md): a calculator.

The model gets one tool, `calculate(expression)`, which evaluates an arithmetic expression (+ - * / // % ** and
parentheses on numbers), and may end the episode with `submit(answer)`: the environment then says whether the answer
equals the row's `answer` and gives reward 1 or 0.

    python examples/environments/calculator.py --port 8765 [--host 127.0.0.1] [--step-delay-seconds 0.2]

The contract (every body is JSON; every answer is a JSON object):
- POST /reset {"row": {...the dataset row...}} -> {"session": "<id>"}
- POST /step {"session", "call_index", "name", "arguments"} -> {"observation": str, "done": bool, "reward": float|null}
  A step repeated with the same session and call_index (a rollout carried over while its call ran) answers as the
  first time and does not act twice.
- POST /close {"session"} -> {}
An unknown session is a 404; a bad body a 400 with the reason as text.

Standard library only, so that it runs anywhere Python does.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOOLS = [
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Give the final answer; ends the episode.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}},
]

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_EXPONENT = 64


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything else."""
    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        return value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None


class Environment:
    def __init__(self, step_delay_seconds: float = 0.0) -> None:
        self.step_delay_seconds = step_delay_seconds
        self.sessions: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def reset(self, body: dict[str, Any]) -> dict[str, Any]:
        row = body.get("row")
        if not isinstance(row, dict):
            raise ValueError("reset needs {'row': {...}}")
        session = uuid.uuid4().hex
        with self.lock:
            self.sessions[session] = {"answer": str(row.get("answer", "")), "steps": {}}
        return {"session": session}

    def step(self, body: dict[str, Any]) -> dict[str, Any]:
        state = self._session(body)
        index = body.get("call_index")
        if not isinstance(index, int):
            raise ValueError("step needs an integer call_index")
        with self.lock:
            if index in state["steps"]:
                return state["steps"][index]
        time.sleep(self.step_delay_seconds)
        name, arguments = body.get("name"), body.get("arguments") or {}
        if name == "calculate":
            try:
                answer = {"observation": str(evaluate(str(arguments.get("expression", "")))), "done": False,
                          "reward": None}
            except ValueError as e:
                answer = {"observation": f"error: {e}", "done": False, "reward": None}
        elif name == "submit":
            correct = str(arguments.get("answer", "")).strip() == state["answer"]
            answer = {"observation": "correct" if correct else "wrong", "done": True, "reward": float(correct)}
        else:
            answer = {"observation": f"error: unknown tool {name!r}", "done": False, "reward": None}
        with self.lock:
            state["steps"][index] = answer
        return answer

    def close(self, body: dict[str, Any]) -> dict[str, Any]:
        self._session(body)
        with self.lock:
            self.sessions.pop(body["session"], None)
        return {}

    def _session(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            state = self.sessions.get(body.get("session"))
        if state is None:
            raise KeyError(body.get("session"))
        return state


def handler(env: Environment) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            route = {"/reset": env.reset, "/step": env.step, "/close": env.close}.get(self.path)
            if route is None:
                return self._send(404, b"no such route")
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                return self._send(200, json.dumps(route(body)).encode())
            except KeyError as e:
                return self._send(404, f"unknown session {e}".encode())
            except ValueError as e:
                return self._send(400, str(e).encode())

        def _send(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if status == 200 else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

    return Handler


class _Server(ThreadingHTTPServer):
    # the standard library's backlog of 5 resets connections when a rollout engine's trajectories call at once
    request_queue_size = 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--step-delay-seconds", type=float, default=0.0, help="extra latency of every step")
    args = p.parse_args()
    server = _Server((args.host, args.port), handler(Environment(args.step_delay_seconds)))
    print(f"calculator environment on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
