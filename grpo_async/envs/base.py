"""The multi-turn environment protocol (seed 003 §4.1): the model and an environment take turns in one rollout.

```txt
prompt messages ─▶ assistant turn (sampled, trained) ─▶ env_response (environment's messages, not trained) ─▶
                   assistant turn ─▶ ... until is_completed, max_turns assistant turns, or max_completion_length
```

An environment is any object with these members (subclass `Environment` for the defaults):

- `max_turns` (`int`): the most assistant turns of a rollout.
- `max_tokens_per_turn` (`int | None`, optional): the most tokens of one assistant turn (a turn cut there ends
  normally: the environment answers); `None`: only `max_completion_length` limits it.
- `initial_state(row) -> dict`: per-rollout state from the dataset row (its columns: the answer, a seed, ...). Every
  rollout (each of the G of a prompt) gets its own.
- `is_completed(messages, state) -> bool`: after each assistant turn; `True` ends the rollout.
- `env_response(messages, state) -> (new_messages, state)`: the messages the environment appends (a tool result,
  a user reply), e.g. `[{"role": "tool", "content": "42"}]`.

`messages` is the whole conversation so far (prompt messages first); the last one is the assistant's turn.

Optional members (`FactoryEnvironment`, TRL's `environment_factory`, uses them all):

- `prompt_messages(messages, state) -> messages`: the rollout's own prompt (e.g. an observation appended); rollouts
  of one prompt whose prompts render alike are still generated together.
- `chat_template_kwargs(state) -> dict`: extra `apply_chat_template` arguments for the rollout (e.g. `tools=`).
- `reward_columns(state) -> dict`: values passed to the reward functions for the rollout (e.g. `environments`).
- `release(states)`: called with the rollouts' final states once their rewards are computed.
- `reward_funcs` (`list[callable]`): reward functions the environment brings (weight 1 each, after the trainer's
  `reward_funcs`, which then may be omitted).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EnvironmentProtocol(Protocol):
    max_turns: int

    def initial_state(self, row: dict) -> dict: ...

    def is_completed(self, messages: list[dict], state: dict) -> bool: ...

    def env_response(self, messages: list[dict], state: dict) -> tuple[list[dict], dict]: ...


class Environment:
    """Base class: no state, never completed before `max_turns`; subclasses implement `env_response`."""

    max_turns: int = 4
    max_tokens_per_turn: int | None = None

    def __init__(self, max_turns: int | None = None, max_tokens_per_turn: int | None = None):
        if max_turns is not None:
            self.max_turns = max_turns
        if max_tokens_per_turn is not None:
            self.max_tokens_per_turn = max_tokens_per_turn
        check_environment(self)

    def initial_state(self, row: dict) -> dict[str, Any]:
        return {}

    def is_completed(self, messages: list[dict], state: dict) -> bool:
        return False

    def env_response(self, messages: list[dict], state: dict) -> tuple[list[dict], dict]:
        raise NotImplementedError(f"{type(self).__name__} must implement env_response(messages, state)")


def check_environment(env) -> None:
    """Raise a clear error when `env` lacks a member of the protocol or has an invalid `max_turns`."""
    missing = [m for m in ("initial_state", "is_completed", "env_response") if not callable(getattr(env, m, None))]
    if missing:
        raise TypeError(
            f"environment {type(env).__name__} lacks {missing}; an environment implements initial_state(row), "
            "is_completed(messages, state), env_response(messages, state) and has max_turns (see grpo_async.envs)"
        )
    turns = getattr(env, "max_turns", None)
    if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
        raise ValueError(f"environment {type(env).__name__}: max_turns must be an int >= 1, got {turns!r}")
    per_turn = getattr(env, "max_tokens_per_turn", None)
    if per_turn is not None and (not isinstance(per_turn, int) or isinstance(per_turn, bool) or per_turn < 1):
        raise ValueError(
            f"environment {type(env).__name__}: max_tokens_per_turn must be an int >= 1 or None, got {per_turn!r}"
        )


def check_env_messages(env, messages, turn: int) -> list[dict]:
    """An env_response's messages: a list of `{"role": str, "content": str}` dicts, else a clear error."""
    ok = isinstance(messages, (list, tuple)) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )
    if not ok:
        raise TypeError(
            f"{type(env).__name__}.env_response at turn {turn} returned {messages!r:.200}; it must return "
            "(a list of {'role': str, 'content': str} messages, state)"
        )
    return list(messages)
