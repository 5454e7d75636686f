"""Multi-turn rollouts: the model and an environment take turns; one token sequence per rollout.

For G rollouts of each prompt (prompt-major, like single-turn generation):

```txt
turn 0      backend.generate(unique prompt ids, n=G)                     every rollout's first assistant turn
            (an environment with `prompt_messages` / `chat_template_kwargs` may give each rollout its own prompt:
            the rollouts of a prompt whose prompts render identically share one call, n = how many they are)
            ▼ append the sampled ids (env_mask 1, sampler logprobs)
            is_completed? max_turns? budget spent? → done
env turn    env_response(messages, state) → new messages; their tokens are the chat template's rendering of the
            conversation with them minus its rendering without them (checked: the latter must be a prefix of the
            former), plus any end-of-turn tokens the template puts after an assistant message that the model did
            not sample (e.g. a newline after the EOS)        ▶ append (env_mask 0, logprob 0)
            (a template that renders the last assistant turn differently from a past one only around the model's
            tokens, as Qwen3's empty <think></think>: what follows the turn's end-of-turn token, as TRL takes it)
turn t      backend.generate([prompt + completion so far], n=1), all live rollouts of the turn in one call, at
            the largest token budget left; each is cut at its own (TRL's tool loop does the same)
```

The model's own tokens are never re-tokenized: what is trained is exactly what was sampled. A rollout ends when the
environment says so, after `max_turns` assistant turns (`finish_reason="max_turns"`), or when its completion
(model and environment tokens) reaches `max_completion_length` (`finish_reason="length"`: environment tokens that
do not fit are cut). An assistant turn cut at the environment's `max_tokens_per_turn` ends like any other turn.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

from ..generation.base import Completion, SamplingConfig, derive_seed
from .base import check_env_messages


class ChatTemplatePrefixError(ValueError):
    """The chat template renders earlier turns differently once later messages are added."""


@dataclass
class RolloutResult:
    """One multi-turn rollout. `env_mask[i]` is 1 for a sampled token, 0 for one the environment/template wrote."""

    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the completion's messages (assistant and environment)
    prompt: list[dict] = field(default_factory=list)  # the rollout's prompt messages (as the environment set them)
    prompt_ids: list[int] = field(default_factory=list)  # their token ids: what the completion continues
    columns: dict = field(default_factory=dict)  # extra reward-function columns (`reward_columns(state)`)
    state: dict = field(default_factory=dict)
    turns: int = 0  # assistant turns
    clipped_turns: int = 0  # assistant turns cut by a token limit (max_tokens_per_turn or the completion's room)
    finish_reason: str = "stop"

    def to_completion(self) -> Completion:
        return Completion(
            completion_ids=self.completion_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            extra={
                "messages": self.messages,
                "env_mask": self.env_mask,
                "turns": self.turns,
                "clipped_turns": self.clipped_turns,
                "state": self.state,
                "prompt": self.prompt,
                "prompt_ids": self.prompt_ids,
                "columns": self.columns,
            },
        )


def template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, **template_kwargs) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template (the trainer tokenizes prompts the same
    way: render to text, then tokenize without adding special tokens); `template_kwargs` (e.g. `tools=[...]`) go to
    `apply_chat_template`."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _check_prefix(tokenizer, shorter: list[int], longer: list[int], turn: int, what: str) -> None:
    if longer[: len(shorter)] == shorter:
        return
    pos = next((i for i, (a, b) in enumerate(zip(shorter, longer)) if a != b), min(len(shorter), len(longer)))
    before = tokenizer.decode(shorter[max(0, pos - 20) : pos + 20])
    after = tokenizer.decode(longer[max(0, pos - 20) : pos + 20])
    raise ChatTemplatePrefixError(
        f"turn {turn}: the chat template is not prefix-consistent: {what} changes token {pos} of the conversation "
        f"rendered before it ({before!r} became {after!r}). Multi-turn rollouts append tokens, so earlier messages "
        "must render identically whatever follows them; use a chat template that does not rewrite earlier turns "
        "(templates that drop <think> from past assistant turns, or that place a system prompt depending on the "
        "last message, break this)."
    )


def _unsampled_turn_end(assistant_part: list[int], sampled: list[int]) -> list[int]:
    """Template tokens that follow the assistant's content which the model did not sample (a newline after the EOS,
    or the end-of-turn token when a stop string ended the turn)."""
    if assistant_part[: len(sampled)] == sampled:
        return assistant_part[len(sampled) :]
    if sampled and sampled[-1] in assistant_part:  # non-canonical sampling: align on the last sampled token
        last = len(assistant_part) - 1 - assistant_part[::-1].index(sampled[-1])
        return assistant_part[last + 1 :]
    return []


def env_turn_ids(
    tokenizer, messages: list[dict], new_messages: list[dict], sampled: list[int], turn: int, **template_kwargs
):
    """Token ids the environment's `new_messages` add after the assistant turn that ends `messages` (whose sampled
    ids are `sampled`), including the generation prompt for the next assistant turn. Raises
    `ChatTemplatePrefixError` when the template is not prefix-consistent."""
    head = template_ids(tokenizer, messages[:-1], True, **template_kwargs)
    before = template_ids(tokenizer, messages, False, **template_kwargs)
    after = template_ids(tokenizer, messages + new_messages, True, **template_kwargs)
    _check_prefix(tokenizer, head, before, turn, "adding the assistant's message")
    if after[: len(before)] != before:
        tail = _after_past_turn(tokenizer, messages, before[len(head) :], after, sampled, template_kwargs)
        if tail is not None:
            return tail
    _check_prefix(tokenizer, before, after, turn, "adding the environment's messages")
    return _unsampled_turn_end(before[len(head) :], sampled) + after[len(before) :]


def _after_past_turn(tokenizer, messages, assistant_part, after, sampled, template_kwargs) -> list[int] | None:
    """The environment's tokens when the template renders the conversation's last assistant message differently from
    a past one only in what it writes around the model's tokens (Qwen3 writes an empty `<think></think>` block into
    the last assistant turn only, so that turn changes once the environment's messages follow it): what follows the
    turn's end-of-turn token in `after`, as TRL's tool loop aligns its tool suffix on it. Only when every earlier
    message renders identically (`messages[:-1]` is a prefix of `after`), the sampled turn ended with a special token
    (its end-of-turn, which the assistant's decoded text cannot contain) and the past turn still ends with the
    sampled text (a template that rewrites the model's own words stays an error); `None` otherwise (the caller
    raises)."""
    if not sampled or sampled[-1] not in set(tokenizer.all_special_ids):
        return None
    end = sampled[-1]
    history = template_ids(tokenizer, messages[:-1], False, **template_kwargs)
    if after[: len(history)] != history:
        return None
    turn_ends = [i for i, t in enumerate(after) if t == end and i >= len(history)]
    k = assistant_part.count(end)  # the assistant's turn holds k of them (1: its end-of-turn)
    if k < 1 or len(turn_ends) < k:
        return None
    past_turn = after[len(history) : turn_ends[k - 1] + 1]
    if not tokenizer.decode(past_turn).endswith(tokenizer.decode(sampled)):
        return None
    return after[turn_ends[k - 1] + 1 :]


def run_rollouts(
    backend,
    tokenizer,
    env,
    prompts: list[list[dict]],
    prompt_ids: list[list[int]],
    rows: list[dict],
    sampling: SamplingConfig,
    num_generations: int,
    max_completion_length: int,
    tokenize: Callable[[list[dict], dict], list[int]] | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[RolloutResult]:
    """Run `len(prompts) × num_generations` rollouts (prompt-major, rows aligned) to completion.

    Args:
        backend: a `GenerationBackend` (hf, vllm, vllm_server, openai).
        tokenizer: its chat template renders the conversation; `decode` gives the assistant's message text.
        env: an environment (`grpo_async.envs.base`).
        prompts (`list[list[dict]]`): the unique prompts, as chat messages.
        prompt_ids (`list[list[int]]`): their token ids (as the trainer tokenized and truncated them).
        rows (`list[dict]`): one dataset row per rollout (`len(prompts) × G`), for `env.initial_state`.
        sampling (`SamplingConfig`): sampling parameters; `n` and `max_tokens` are set per call.
        num_generations (`int`): G.
        max_completion_length (`int`): most completion tokens (model and environment) of a rollout.
        tokenize (`Callable[[messages, template_kwargs], list[int]]`, *optional*): token ids of a rollout's prompt
            that the environment changed (`prompt_messages`, `chat_template_kwargs`); default: the chat template,
            untruncated.
    """
    G = num_generations
    per_turn = getattr(env, "max_tokens_per_turn", None) or max_completion_length
    if len(rows) != len(prompts) * G or len(prompt_ids) != len(prompts):
        raise ValueError(
            f"run_rollouts: {len(prompts)} prompts, {len(prompt_ids)} prompt_ids and {len(rows)} rows "
            f"(expected {len(prompts)} × G={G} rows)"
        )
    for p in prompts:
        if not (isinstance(p, list) and all(isinstance(m, dict) and "role" in m for m in p)):
            raise TypeError(
                f"multi-turn environments need conversational prompts (lists of chat messages), got {p!r:.100}"
            )
    R = len(rows)
    results = [RolloutResult(state=env.initial_state(rows[i])) for i in range(R)]
    template_kwargs = _rollout_prompts(env, results, prompts, prompt_ids, G, tokenizer, tokenize, chat_template_kwargs)
    conversations = [copy.deepcopy(r.prompt) for r in results]
    live = list(range(R))
    turn = 0
    while live:
        # turn 0: each prompt once, n = its rollouts (one call per group size); later turns: one call
        outputs: dict[int, Completion] = {}
        if turn == 0:
            for call, (size, groups) in enumerate(_turn0_groups(results, G).items()):
                s = _call_sampling(sampling, turn, call)
                s.n, s.max_tokens = size, min(per_turn, max_completion_length)
                completions = backend.generate([results[g[0]].prompt_ids for g in groups], s)
                for i, c in zip([i for g in groups for i in g], completions, strict=True):
                    outputs[i] = c
        else:  # every live rollout in one call at the largest room left, each cut at its own (as TRL's tool loop)
            budgets = [min(per_turn, max_completion_length - len(results[i].completion_ids)) for i in live]
            s = _call_sampling(sampling, turn, 0)
            s.n, s.max_tokens = 1, max(budgets)
            inputs = [results[i].prompt_ids + results[i].completion_ids for i in live]
            for i, c, budget in zip(live, backend.generate(inputs, s), budgets, strict=True):
                outputs[i] = _cut(c, budget)
        turn += 1
        still = []
        for i in live:
            r, c = results[i], outputs[i]
            sampled = list(c.completion_ids)
            r.completion_ids += sampled
            r.logprobs += list(c.logprobs)
            r.env_mask += [1] * len(sampled)
            r.turns = turn
            r.clipped_turns += c.finish_reason == "length"
            text = tokenizer.decode(sampled, skip_special_tokens=True)
            message = {"role": "assistant", "content": text}
            r.messages.append(message)
            conversations[i].append(message)
            if len(r.completion_ids) >= max_completion_length:
                r.finish_reason = "length"
            elif env.is_completed(conversations[i], r.state):
                r.finish_reason = "stop"
            elif turn >= env.max_turns:
                r.finish_reason = "max_turns"
            else:
                new, r.state = env.env_response(conversations[i], r.state)
                new = check_env_messages(env, new, turn)
                ids = env_turn_ids(tokenizer, conversations[i], new, sampled, turn, **template_kwargs[i])
                room = max_completion_length - len(r.completion_ids)
                r.messages += new
                conversations[i] += new
                if len(ids) >= room:  # no room left for another assistant turn
                    ids, r.finish_reason = ids[:room], "length"
                r.completion_ids += ids
                r.logprobs += [0.0] * len(ids)
                r.env_mask += [0] * len(ids)
                if r.finish_reason != "length":
                    still.append(i)
        live = still
    columns = getattr(env, "reward_columns", None)
    for r in results:
        r.columns = dict(columns(r.state)) if columns is not None else {}
    return results


def _cut(c: Completion, budget: int) -> Completion:
    """`c` cut to its first `budget` tokens (`finish_reason="length"`) when it is longer; the per-token fields a
    multi-turn rollout does not keep (`versions`, `sampling_mask`, `routed_experts`) are dropped then."""
    if len(c.completion_ids) <= budget:
        return c
    return Completion(list(c.completion_ids[:budget]), list(c.logprobs[:budget]), "length", c.text, dict(c.extra))


def _call_sampling(sampling: SamplingConfig, turn: int, call: int) -> SamplingConfig:
    """A copy of `sampling` for generate call `call` of assistant turn `turn`: a seeded round's first call keeps its
    seed (single-turn numbering: completion k samples with seed + k), every other call gets its own seed derived from
    (seed, turn, call), so a rollout's turns do not reuse a seed and the same round samples the same turns."""
    s = copy.copy(sampling)
    if s.seed is not None and (turn, call) != (0, 0):
        s.seed = derive_seed(sampling.seed, turn, call)
    return s


def _rollout_prompts(env, results, prompts, prompt_ids, G, tokenizer, tokenize, chat_template_kwargs=None) -> list:
    """Set each rollout's prompt messages and ids: the dataset's, or what the environment's optional
    `prompt_messages(messages, state)` and `chat_template_kwargs(state)` make of them. Returns each rollout's
    template kwargs: the run's `chat_template_kwargs` (`GRPOConfig.chat_template_kwargs`, already applied to
    `prompt_ids`), then the environment's."""
    reprompt = getattr(env, "prompt_messages", None)
    kwargs_of = getattr(env, "chat_template_kwargs", None)
    if tokenize is None:
        tokenize = lambda messages, kw: template_ids(tokenizer, messages, True, **kw)  # noqa: E731
    cache: dict[str, list[int]] = {}
    out = []
    for i, r in enumerate(results):
        base = prompts[i // G]
        messages = reprompt(copy.deepcopy(base), r.state) if reprompt is not None else base
        own = dict(kwargs_of(r.state) or {}) if kwargs_of is not None else {}
        if messages is not base and not (
            isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)
        ):
            raise TypeError(f"{type(env).__name__}.prompt_messages returned {messages!r:.200}; expected chat messages")
        r.prompt = copy.deepcopy(messages)
        kwargs = {**(chat_template_kwargs or {}), **own}
        if messages == base and not own:
            r.prompt_ids = list(prompt_ids[i // G])
        else:
            key = repr((messages, sorted(kwargs.items())))
            if key not in cache:
                cache[key] = list(tokenize(messages, kwargs))
            r.prompt_ids = list(cache[key])
        out.append(kwargs)
    return out


def _turn0_groups(results: list[RolloutResult], G: int) -> dict[int, list[list[int]]]:
    """Rollouts generated together at turn 0: those of one dataset prompt with the same prompt ids, by group size
    (each size is one generate call, n = the size)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(results):
        groups.setdefault((i // G, tuple(r.prompt_ids)), []).append(i)
    by_size: dict[int, list[list[int]]] = {}
    for g in groups.values():
        by_size.setdefault(len(g), []).append(g)
    return dict(sorted(by_size.items(), reverse=True))


ROLLOUT_FUNC_KEYS = ("prompt_ids", "completion_ids", "logprobs")


def _rollout_list(output: dict, key: str, n: int) -> list:
    value = output[key]
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):  # a tensor / array
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
        raise ValueError(
            f"rollout_func returned {got} for {key!r} but was given {n} prompts; return one entry per prompt (the "
            "prompts hold num_generations copies of each, one per completion)"
        )
    return list(value)


def _token_row(value, what: str, cast, allow=None) -> list:
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"rollout_func: {what} is a {type(value).__name__}, not a list")
    out = []
    for j, v in enumerate(value):
        if v is None or isinstance(v, (str, bytes)) or (allow is not None and v not in allow):
            raise ValueError(f"rollout_func: {what}[{j}] is {v!r}" + (f"; expected one of {allow}" if allow else ""))
        out.append(cast(v))
    return out


def run_rollout_func(rollout_func: Callable[[list], dict], prompts: list, stop_ids: set[int]) -> list[Completion]:
    """Completions from a TRL-style rollout function: `rollout_func(prompts)` (the trainer binds its second argument)
    generates one completion per prompt given (the round's rows: `num_generations` adjacent copies of each prompt, as
    TRL passes a process's rows) and returns a dict with `prompt_ids`, `completion_ids`, `logprobs` (the sampler's
    per-token log-probabilities, temperature applied), optionally `env_mask` (1: a sampled token, 0: one the rollout
    wrote, not trained on), and any other fields: reward-function columns (a list: one value per completion; anything
    else: the same value for all). A completion that does not end with an EOS / pad token (`stop_ids`) counts as
    truncated, as in TRL."""
    n = len(prompts)
    output = rollout_func(copy.deepcopy(prompts))
    if not isinstance(output, dict):
        raise TypeError(f"rollout_func must return a dict, got {type(output).__name__}")
    missing = sorted(set(ROLLOUT_FUNC_KEYS) - output.keys())
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    prompt_ids, completion_ids, logprobs = (_rollout_list(output, k, n) for k in ROLLOUT_FUNC_KEYS)
    env_mask = _rollout_list(output, "env_mask", n) if "env_mask" in output else None
    columns = {}
    for key, value in output.items():
        if key in ROLLOUT_FUNC_KEYS or key == "env_mask":
            continue
        columns[key] = _rollout_list(output, key, n) if isinstance(value, (list, tuple)) else [value] * n
    completions = []
    for i in range(n):
        ids = _token_row(completion_ids[i], f"completion_ids[{i}]", int)
        logps = _token_row(logprobs[i], f"logprobs[{i}]", float)
        if len(logps) != len(ids):
            raise ValueError(
                f"rollout_func: logprobs[{i}] has {len(logps)} values for {len(ids)} completion_ids[{i}]; give the "
                "sampler's log-probability of each completion token"
            )
        extra = {"prompt_ids": _token_row(prompt_ids[i], f"prompt_ids[{i}]", int)}
        if not extra["prompt_ids"]:
            raise ValueError(f"rollout_func: prompt_ids[{i}] is empty")
        if env_mask is not None:
            extra["env_mask"] = _token_row(env_mask[i], f"env_mask[{i}]", int, allow=(0, 1))
            if len(extra["env_mask"]) != len(ids):
                raise ValueError(
                    f"rollout_func: env_mask[{i}] has {len(extra['env_mask'])} values for {len(ids)} "
                    f"completion_ids[{i}]; give one per completion token"
                )
        extra["columns"] = {key: values[i] for key, values in columns.items()}
        finish = "stop" if ids and ids[-1] in stop_ids else "length"
        completions.append(Completion(ids, logps, finish, extra=extra))
    return completions
