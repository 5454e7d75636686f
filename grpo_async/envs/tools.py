"""`ToolEnv`: the model calls Python functions; each result comes back as a `tool` message.

Tool-call format (the assistant writes it anywhere in its turn; the first one is run):

```txt
<tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>
```

The result (or `error: ...` when the call is malformed, names an unknown tool, raises or runs longer than
`tool_timeout` seconds) is returned as `{"role": "tool", "name": <tool>, "content": <str(result)>}`. A turn without a
tool call completes the rollout. Per-rollout state counts `tool_calls` and `tool_errors`; reward functions can read
neither directly, but the completion messages (the `completions` they receive) include the tool turns.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import re
import threading
from collections.abc import Callable

from .base import Environment

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolCallError(ValueError):
    """The assistant's tool call cannot be run (shown to the model as the tool's answer)."""


def parse_tool_call(text: str) -> tuple[str, dict] | None:
    """`(name, arguments)` of the first `<tool_call>{...}</tool_call>` in `text`, `None` when there is none; raises
    `ToolCallError` when there is one but it is not `{"name": str, "arguments": {...}}` JSON."""
    match = TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolCallError('a tool call is {"name": "<tool>", "arguments": {...}}')
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolCallError(f"the arguments of {call['name']!r} must be a JSON object")
    return call["name"], arguments


def parse_tool_calls(text: str) -> list[tuple[str, dict] | ToolCallError]:
    """Every `<tool_call>{...}</tool_call>` of `text` in order: `(name, arguments)`, or the `ToolCallError` saying why
    that one cannot be run (an empty list: no tool call)."""
    calls = []
    for match in TOOL_CALL.finditer(text):
        try:
            calls.append(parse_tool_call(match.group(0)))
        except ToolCallError as e:
            calls.append(e)
    return calls


def tool_metrics(states: list) -> dict[str, float]:
    """TRL's `tools/call_frequency` (tool calls per completion) and `tools/failure_frequency` (failed calls per call,
    0 without calls) over a round's rollouts, from their final states' `tool_calls` / `tool_errors` counts (`ToolEnv`,
    `TRLToolEnv`, `FactoryEnvironment`); empty when a rollout's environment does not count them."""
    if not states or not all(isinstance(s, dict) and "tool_calls" in s and "tool_errors" in s for s in states):
        return {}
    calls = sum(s["tool_calls"] for s in states)
    failures = sum(s["tool_errors"] for s in states)
    return {"tools/call_frequency": calls / len(states), "tools/failure_frequency": failures / calls if calls else 0.0}


def tools_system_prompt(tools: dict[str, Callable]) -> str:
    """A description of `tools` (name → callable) and of the call format, for a system message."""
    lines = ["You can call these tools:"]
    for name, fn in tools.items():
        doc = (inspect.getdoc(fn) or "").split("\n")[0]
        try:
            signature = inspect.signature(fn, eval_str=True)
        except (NameError, TypeError, ValueError):
            signature = inspect.signature(fn)
        lines.append(f"- {name}{signature}: {doc}")
    lines.append('Call one with <tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>.')
    return "\n".join(lines)


def run_with_timeout(fn: Callable, kwargs: dict, timeout: float | None):
    """`fn(**kwargs)` (awaited when it is `async def`) in a daemon thread; `TimeoutError` after `timeout` seconds
    (the thread cannot be stopped and is abandoned)."""
    box: dict = {}
    done = threading.Event()

    def run():
        try:
            out = fn(**kwargs)
            box["out"] = asyncio.run(out) if inspect.isawaitable(out) else out
        except BaseException as e:
            box["err"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    if not done.wait(timeout):
        raise TimeoutError(f"did not return within {timeout:g} s")
    if "err" in box:
        raise box["err"]
    return box["out"]


class ToolEnv(Environment):
    """Multi-turn tool use with Python callables.

    Args:
        tools (`list[callable]` or `dict[str, callable]`): the tools, by function name (list) or by the given names.
        max_turns (`int`, *optional*, defaults to 4): most assistant turns (so at most `max_turns - 1` tool calls).
        tool_timeout (`float`, *optional*, defaults to 10): seconds a tool call may run; `None` no limit.
        max_tokens_per_turn (`int`, *optional*): most tokens of one assistant turn.
    """

    def __init__(
        self, tools, max_turns: int = 4, tool_timeout: float | None = 10.0, max_tokens_per_turn: int | None = None
    ):
        if callable(tools):
            tools = [tools]
        if isinstance(tools, dict):
            registry = dict(tools)
        else:
            registry = {getattr(t, "__name__", type(t).__name__): t for t in tools}
        if not registry:
            raise ValueError("ToolEnv needs at least one tool")
        for name, fn in registry.items():
            if not callable(fn):
                raise TypeError(f"ToolEnv: tool {name!r} is a {type(fn).__name__}, not a callable")
        if tool_timeout is not None and not tool_timeout > 0:
            raise ValueError(f"ToolEnv: tool_timeout must be > 0 seconds or None, got {tool_timeout!r}")
        self.tools = registry
        self.tool_timeout = tool_timeout
        super().__init__(max_turns, max_tokens_per_turn)

    def initial_state(self, row: dict) -> dict:
        return {"tool_calls": 0, "tool_errors": 0}

    def is_completed(self, messages: list[dict], state: dict) -> bool:
        return TOOL_CALL.search(messages[-1]["content"]) is None

    def call(self, name: str, arguments: dict) -> str:
        """Run one tool call; raises `ToolCallError` for an unknown tool, bad arguments, an error or a timeout."""
        fn = self.tools.get(name)
        if fn is None:
            raise ToolCallError(f"unknown tool {name!r}; available: {sorted(self.tools)}")
        try:
            return str(run_with_timeout(fn, arguments, self.tool_timeout))
        except TimeoutError as e:
            raise ToolCallError(f"{name} {e}") from None
        except Exception as e:
            raise ToolCallError(f"{name} raised {type(e).__name__}: {e}") from None

    def env_response(self, messages: list[dict], state: dict) -> tuple[list[dict], dict]:
        state = dict(state)
        state["tool_calls"] += 1
        name = "?"
        try:
            parsed = parse_tool_call(messages[-1]["content"])
            if parsed is None:  # is_completed said so; only reached when called directly
                raise ToolCallError("no <tool_call> in the last message")
            name = parsed[0]
            content = self.call(*parsed)
        except ToolCallError as e:
            state["tool_errors"] += 1
            content = f"error: {e}"
        return [{"role": "tool", "name": name, "content": content}], state

    def system_prompt(self) -> str:
        """A description of the tools and the call format, for the dataset's system message."""
        return tools_system_prompt(self.tools)


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses), e.g. "3 * (4 + 5)" → "27"."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            right = ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    value = ev(ast.parse(str(expression), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
