"""TRL 1.16's `environment_factory` as one of our environments (`FactoryEnvironment`).

```python
class Counter:
    def reset(self, **row) -> str | None:      # each rollout: the dataset row's columns; a string is appended
        self.count = 0                          # to the prompt's last message
        return f" Start at {self.count}."

    def increment(self, step: int) -> str:     # public methods are the tools
        \"\"\"Add `step` to the counter.

        Args:
            step: how much to add.
        \"\"\"
        self.count += step
        return str(self.count)

    def get_reward(self) -> float:              # optional: a reward function named "Counter", weight 1
        return float(self.count == 3)

trainer = GRPOTrainer(model, args=args, train_dataset=ds, environment_factory=Counter)   # reward_funcs optional
```

```txt
round: every rollout draws an instance from its environment's pool (created only when all are in use: construct
       once, reset often) ─▶ reset(**row) ─▶ prompt = dataset prompt + observation (+ the tools)
       ─▶ assistant turn ─▶ each <tool_call>{"name": ..., "arguments": {...}}</tool_call> in it runs the instance's
       method; its result is a {"role": "tool"} message (not trained on) ─▶ ... until a turn calls no tool
       ─▶ reward functions get environments=[the instances] (get_reward reads them) ─▶ instances back to the pool
```

The tools are described to the model by the tokenizer's chat template (`apply_chat_template(..., tools=...)`) when
the template renders them; a template that ignores `tools=` (SmolLM2's) gets them in the system message instead
(`tools_system_prompt`: the signature and first docstring line of each, and the `<tool_call>` format). With a dict of
factories each row's `environment` column picks its environment (and only its tools are shown).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import threading
from collections.abc import Callable

from .base import Environment
from .tools import TOOL_CALL, ToolEnv, run_with_timeout, tools_system_prompt

_PROBE_TOOL = "probe_tool_7f3a9c"
_PROBE_RESULT = "probe_result_c41e8b"


def _probe_tool_7f3a9c(value: int) -> int:
    """Probe whether a chat template renders tools.

    Args:
        value: a number.
    """
    return value


_probe_tool_7f3a9c.__name__ = _PROBE_TOOL


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template describes `tools=` to the model (renders their schema)."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=[_probe_tool_7f3a9c], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that rejects tools= renders none
        return False
    return _PROBE_TOOL in text


def check_template_renders_tool_messages(tokenizer) -> None:
    """A tool's result reaches the model as a `{"role": "tool"}` message: the chat template must render it."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "name": "f", "content": _PROBE_RESULT},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:
        raise ValueError(
            f"The chat template cannot render a tool message ({type(e).__name__}: {e}); environment_factory needs a "
            "template that renders a conversation user -> assistant -> tool."
        ) from e
    if _PROBE_RESULT not in text:
        raise ValueError(
            "The chat template drops tool messages, so the model would never see a tool's result; environment_factory "
            "needs a template that renders a conversation user -> assistant -> tool."
        )


def environment_methods(env_class) -> tuple[list[str], bool, bool]:
    """`(tool method names, has reset, has get_reward)` of an environment class, as TRL lists them: the functions
    defined on the class (inherited ones too), public, other than `reset` and `get_reward`."""
    names, has_reset, has_reward = [], False, False
    for name, _ in inspect.getmembers(env_class, predicate=inspect.isfunction):  # the class: no property evaluated
        if name == "reset":
            has_reset = True
        elif name == "get_reward":
            has_reward = True
        elif not name.startswith("_"):
            names.append(name)
    return names, has_reset, has_reward


def trl_tool_calls(text: str) -> list[tuple[str, object]]:
    """The tool calls of an assistant turn as TRL reads them: `(name, arguments)` of each
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in order, missing or `null` arguments read as `{}`. A turn
    with a block that is not a JSON object with a string `name` has none at all: TRL's `parse_response` then falls
    back to the turn's plain text, so the rollout ends there (not a call, not a failure)."""
    calls = []
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return []
        arguments = call.get("arguments")
        calls.append((call["name"], {} if arguments is None else arguments))
    return calls


def trl_tool_turn(
    text: str, tools: dict[str, Callable], timeout: float | None, state: dict
) -> tuple[list[dict], dict]:
    """Run the tool calls of an assistant turn (`trl_tool_calls(text)`) in order as TRL's tool loop does: one
    `{"role": "tool"}` message each, `str(result)`, or `str({"error": str(exception)})` when the call fails (an
    unknown tool: `Tool NAME not found.`). Returns the messages and `state` with its `tool_calls` / `tool_errors`
    counts raised by the calls made and the calls that failed (TRL's `tools/call_frequency`, `failure_frequency`)."""
    calls = trl_tool_calls(text)
    out, failures = [], 0
    for name, arguments in calls:
        try:
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            if not isinstance(arguments, dict):
                raise TypeError(f"{name}() argument after ** must be a mapping, not {type(arguments).__name__}")
            content = str(run_with_timeout(tools[name], arguments, timeout))
        except Exception as e:
            failures += 1
            content = str({"error": str(e)})
        out.append({"role": "tool", "name": name, "content": content})
    return out, {
        **state,
        "tool_calls": state["tool_calls"] + len(calls),
        "tool_errors": state["tool_errors"] + failures,
    }


class TRLToolEnv(ToolEnv):
    """TRL's `tools=` (`GRPOTrainer(..., tools=[...])`): `ToolEnv`'s registry and turns with TRL's tool loop: the tools
    shown through the chat template (`apply_chat_template(..., tools=...)`) when it renders them, every call of a turn
    run (`trl_tool_turn`: TRL's error text, no time limit, as TRL), a malformed call read as plain text
    (`trl_tool_calls`), `state["tool_calls"]` / `state["tool_errors"]` counted per call (TRL's `tools/*` metrics).

    Args:
        tools (`list[callable]`): the tools, by function name.
        max_turns (`int`): most assistant turns (`max_tool_calling_iterations + 1`).
        tokenizer (*optional*): the policy's tokenizer: its chat template shows the tools when it renders `tools=`.
    """

    def __init__(self, tools, max_turns: int, tokenizer=None):
        super().__init__(tools, max_turns=max_turns, tool_timeout=None)
        self.template_tools = tokenizer is not None and template_renders_tools(tokenizer)
        if self.template_tools:  # the schemas come from signatures and docstrings: fail now, not mid-run
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=self._listed(), tokenize=False)

    def _listed(self) -> list[Callable]:
        return list(self.tools.values())

    def chat_template_kwargs(self, state: dict) -> dict:
        return {"tools": self._listed()} if self.template_tools else {}

    def is_completed(self, messages: list[dict], state: dict) -> bool:
        return not trl_tool_calls(messages[-1]["content"])

    def env_response(self, messages: list[dict], state: dict) -> tuple[list[dict], dict]:
        return trl_tool_turn(messages[-1]["content"], self.tools, self.tool_timeout, state)


def _maybe_await(value):
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _env_reward(env_type: type) -> Callable:
    """TRL's reward source of an environment class with `get_reward`: each rollout whose environment is exactly
    that class is scored by its instance's `get_reward()` (sync or async), the others get `None`."""
    if inspect.iscoroutinefunction(env_type.get_reward):

        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is env_type else None for e in environments]

    else:

        def get_reward(environments, **kwargs):
            return [e.get_reward() if type(e) is env_type else None for e in environments]

    get_reward.__name__ = get_reward.__qualname__ = env_type.__name__
    return get_reward


class FactoryEnvironment(Environment):
    """TRL's `environment_factory`: one environment instance per rollout, its public methods as tools.

    Args:
        environment_factory (`callable` or `dict[str, callable]`): returns a new environment instance (an object with
            `reset(**row) -> str | None`, tool methods, optionally `get_reward() -> float`); a dict maps the values of
            the dataset's `environment` column to factories.
        tools (`list[callable]`, *optional*): tools offered besides the environment's methods (TRL's `tools=`).
        tokenizer (*optional*): the policy's tokenizer: decides how the tools are shown (see the module docstring).
        max_turns (`int`, *optional*): most assistant turns of a rollout; default unlimited (TRL's
            `max_tool_calling_iterations=None`): `max_completion_length` ends it.
        tool_timeout (`float`, *optional*): seconds a tool call may run (an error message to the model after);
            default no limit, as TRL.
    """

    max_tokens_per_turn = None

    def __init__(
        self,
        environment_factory,
        tools=None,
        tokenizer=None,
        max_turns: int | None = None,
        tool_timeout: float | None = None,
    ):
        self.multi = isinstance(environment_factory, dict)
        self.factories = dict(environment_factory) if self.multi else {None: environment_factory}
        if not self.factories:
            raise ValueError("environment_factory is an empty dict: give at least one environment factory")
        for name, factory in self.factories.items():
            if not callable(factory):
                where = f"environment_factory[{name!r}]" if self.multi else "environment_factory"
                raise TypeError(f"{where} is a {type(factory).__name__}, not a callable returning an environment")
        self.standalone_tools = list(tools or [])
        for t in self.standalone_tools:
            if not callable(t):
                raise TypeError(f"tools: {t!r} is not a callable")
        self.tool_timeout = tool_timeout
        self._lock = threading.Lock()
        self._free: dict = {}  # environment name -> idle instances (the pool), reused in order
        self._methods: dict = {}  # environment name -> tool method names
        self.env_tools: dict = {}  # environment name -> the tools shown with its prompts (the probe's methods)
        self.reward_funcs: list[Callable] = []  # one per environment class with get_reward (TRL: weight 1)
        reward_types: list[type] = []
        for name, factory in self.factories.items():
            instance = factory()  # the probe seeds the pool
            methods, has_reset, has_reward = environment_methods(type(instance))
            if not has_reset:
                raise ValueError(
                    "Each environment instance returned by `environment_factory` must define a callable `reset`."
                )
            self._methods[name] = methods
            self._free[name] = [instance]
            self.env_tools[name] = self.standalone_tools + [getattr(instance, m) for m in methods]
            if has_reward and type(instance) not in reward_types:
                reward_types.append(type(instance))
                self.reward_funcs.append(_env_reward(type(instance)))
        self.template_tools = False
        if tokenizer is not None and any(self.env_tools.values()):
            check_template_renders_tool_messages(tokenizer)
            self.template_tools = template_renders_tools(tokenizer)
            if self.template_tools:  # the schemas come from signatures and docstrings: fail now, not mid-run
                for env_tools in self.env_tools.values():
                    if env_tools:
                        tokenizer.apply_chat_template(
                            [{"role": "user", "content": "hi"}], tools=env_tools, tokenize=False
                        )
        super().__init__(max_turns=max_turns if max_turns is not None else sys.maxsize)

    def __repr__(self) -> str:
        names = [getattr(f, "__name__", repr(f)) for f in self.factories.values()]
        return f"FactoryEnvironment({names if self.multi else names[0]})"

    # ---- the pool --------------------------------------------------------------------------------------------------
    def _acquire(self, name):
        with self._lock:
            free = self._free[name]
            if free:
                return free.pop(0)
        return self.factories[name]()

    def release(self, states: list[dict]) -> None:
        """Give the rollouts' instances back to the pool (after their rewards are computed)."""
        with self._lock:
            for state in states:
                instance = state.pop("environment", None) if isinstance(state, dict) else None
                if instance is not None:
                    self._free[state["environment_name"]].append(instance)

    def environment_name(self, row: dict):
        if not self.multi:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(
                f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self.factories)}."
            )
        return name

    # ---- the environment protocol ----------------------------------------------------------------------------------
    def initial_state(self, row: dict) -> dict:
        name = self.environment_name(row)
        instance = self._acquire(name)
        kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else dict(row)
        try:
            observation = _maybe_await(instance.reset(**kwargs))
        except BaseException:
            self.release([{"environment": instance, "environment_name": name}])
            raise
        if observation is not None and not isinstance(observation, str):
            raise TypeError(
                f"{type(instance).__name__}.reset returned a {type(observation).__name__}; it must return None or a "
                "string (appended to the prompt's last message)"
            )
        return {
            "environment": instance,
            "environment_name": name,
            "observation": observation,
            "tool_calls": 0,
            "tool_errors": 0,
        }

    def tools_of(self, state: dict) -> dict[str, Callable]:
        """The rollout's tools by name: the standalone tools and its own instance's methods."""
        instance = state["environment"]
        tools = {getattr(t, "__name__", type(t).__name__): t for t in self.standalone_tools}
        tools.update({m: getattr(instance, m) for m in self._methods[state["environment_name"]]})
        return tools

    def prompt_messages(self, messages: list[dict], state: dict) -> list[dict]:
        """The rollout's prompt: the observation `reset` returned appended to the last message (as TRL), and the
        tools in the system message when the chat template does not render `tools=`."""
        observation = state.get("observation")
        if observation is not None:
            last = messages[-1]
            if not isinstance(last.get("content"), str):
                raise TypeError("reset() returned a string but the prompt's last message has no text content")
            messages = messages[:-1] + [{**last, "content": last["content"] + observation}]
        tools = self.env_tools[state["environment_name"]]
        if tools and not self.template_tools:
            text = tools_system_prompt({getattr(t, "__name__", type(t).__name__): t for t in tools})
            if messages[0]["role"] == "system" and isinstance(messages[0].get("content"), str):
                messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
            else:
                messages = [{"role": "system", "content": text}] + messages
        return messages

    def chat_template_kwargs(self, state: dict) -> dict:
        tools = self.env_tools[state["environment_name"]]
        return {"tools": tools} if tools and self.template_tools else {}

    def reward_columns(self, state: dict) -> dict:
        return {"environments": state.get("environment")}

    def is_completed(self, messages: list[dict], state: dict) -> bool:
        return not trl_tool_calls(messages[-1]["content"])  # a malformed call is plain text (TRL)

    def env_response(self, messages: list[dict], state: dict) -> tuple[list[dict], dict]:
        """Run every tool call of the assistant's turn, in order, on the rollout's instance; one tool message each
        (`str(result)`, or TRL's `{'error': ...}` text when it fails)."""
        return trl_tool_turn(messages[-1]["content"], self.tools_of(state), self.tool_timeout, state)
