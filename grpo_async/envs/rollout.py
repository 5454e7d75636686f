"""Multi-turn rollouts: the model and an environment take turns; one token sequence per rollout.

For G rollouts of each prompt (prompt-major, like single-turn generation):

```txt
turn 0      backend.generate(unique prompt ids, n=G)                     every rollout's first assistant turn
            ▼ append the sampled ids (env_mask 1, sampler logprobs)
            is_completed? max_turns? budget spent? → done
env turn    env_response(messages, state) → new messages; their tokens are the chat template's rendering of the
            conversation with them minus its rendering without them (checked: the latter must be a prefix of the
            former), plus any end-of-turn tokens the template puts after an assistant message that the model did
            not sample (e.g. a newline after the EOS)        ▶ append (env_mask 0, logprob 0)
turn t      backend.generate([prompt + completion so far], n=1), all live rollouts of the turn in one call per
            remaining budget
```

The model's own tokens are never re-tokenized: what is trained is exactly what was sampled. A rollout ends when the
environment says so, after `max_turns` assistant turns (`finish_reason="max_turns"`), or when its completion
(model and environment tokens) reaches `max_completion_length` (`finish_reason="length"`: environment tokens that
do not fit are cut). An assistant turn cut at the environment's `max_tokens_per_turn` ends like any other turn.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..generation.base import Completion, SamplingConfig
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
            },
        )


def template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template (the trainer tokenizes prompts the same
    way: render to text, then tokenize without adding special tokens)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
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


def env_turn_ids(tokenizer, messages: list[dict], new_messages: list[dict], sampled: list[int], turn: int):
    """Token ids the environment's `new_messages` add after the assistant turn that ends `messages` (whose sampled
    ids are `sampled`), including the generation prompt for the next assistant turn. Raises
    `ChatTemplatePrefixError` when the template is not prefix-consistent."""
    head = template_ids(tokenizer, messages[:-1], add_generation_prompt=True)
    before = template_ids(tokenizer, messages, add_generation_prompt=False)
    after = template_ids(tokenizer, messages + new_messages, add_generation_prompt=True)
    _check_prefix(tokenizer, head, before, turn, "adding the assistant's message")
    _check_prefix(tokenizer, before, after, turn, "adding the environment's messages")
    return _unsampled_turn_end(before[len(head) :], sampled) + after[len(before) :]


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
    conversations = [copy.deepcopy(prompts[i // G]) for i in range(R)]
    live = list(range(R))
    turn = 0
    while live:
        # one generate call per distinct remaining budget (turn 0: the unique prompts with n = G)
        outputs: dict[int, Completion] = {}
        if turn == 0:
            s = copy.copy(sampling)
            s.n, s.max_tokens = G, min(per_turn, max_completion_length)
            for i, c in enumerate(backend.generate(prompt_ids, s)):
                outputs[i] = c
        else:
            by_budget: dict[int, list[int]] = {}
            for i in live:
                room = max_completion_length - len(results[i].completion_ids)
                by_budget.setdefault(min(per_turn, room), []).append(i)
            for budget, idx in sorted(by_budget.items()):
                s = copy.copy(sampling)
                s.n, s.max_tokens = 1, budget
                inputs = [prompt_ids[i // G] + results[i].completion_ids for i in idx]
                for i, c in zip(idx, backend.generate(inputs, s), strict=True):
                    outputs[i] = c
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
                ids = env_turn_ids(tokenizer, conversations[i], new, sampled, turn)
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
    return results
