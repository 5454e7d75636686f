"""Built-in reward functions, TRL's calling convention (see `grpo_async.rewards`).

- `math_reward`: 1.0 when the completion's answer equals the gold answer mathematically (the `math-verify` library:
  `1/2`, `0.5` and `\\frac{1}{2}` agree), 0.0 otherwise, `None` when the gold answer cannot be parsed (like TRL's
  `accuracy_reward`). The answer is the `<answer>…</answer>` or `####` segment, else an anchored LaTeX answer
  (`\\boxed{…}`, "final answer is $…$"); an expression elsewhere in the text is not an answer (restating "27 + 82"
  is not "109"). The gold answer comes from a `solution` or `answer` column; a GSM8K answer's final `#### 72` is
  used alone.
- `format_reward` / `make_format_reward(pattern)`: 1.0 when the completion matches a regex, default
  `<think>…</think><answer>…</answer>`.
- `length_penalty(target_length, scale)`: `-scale · max(0, n − target_length) / target_length` for a completion of
  n tokens: 0 up to the target, −scale at twice it.

A completion is a string (standard format) or a list of messages (conversational; multi-turn environments add
tool turns): the text scored is the last assistant message's content.

Example: gold `#### 72`, completion `<think>48/2 = 24, 48 + 24 = 72</think><answer>72</answer>` →
`math_reward = 1.0`, `format_reward = 1.0`.
"""

from __future__ import annotations

import logging
import re
import threading

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
DEFAULT_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
#: a completion that is nothing but a number ("2", "-0.5", "3/4", "$7$."): an answer as it stands
PLAIN_NUMBER = re.compile(r"^\s*\$?-?\d+(?:[./]\d+)?\$?\.?\s*$")


def completion_text(completion) -> str:
    """The text a reward scores: the string itself, or the content of the last assistant message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion:
        assistant = [m for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        message = (assistant or list(completion))[-1]
        return str(message.get("content") or "")
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


def extract_answer(text: str) -> str:
    """The part of a completion that holds the answer: the last `<answer>…</answer>` block, else what follows the
    last `####` (GSM8K style), else the whole text."""
    tags = ANSWER_TAG.findall(text)
    if tags:
        return tags[-1]
    if "####" in text:
        return text.rsplit("####", 1)[1]
    return text


def _predicted_answer(text: str, parse, timeout):
    """What the completion answers: an explicit answer segment (`<answer>…</answer>`, GSM8K's `####`) or a completion
    that is just a number, parsed as it stands; else only an *anchored* LaTeX answer (`\\boxed{…}` first, or a "final
    answer is" phrase), as TRL's `accuracy_reward` does. Never an expression found anywhere in the text:
    "27 + 82 = \\boxed{}" restates the question, and math-verify would evaluate "27 + 82" and find it equal to 109."""
    from math_verify import LatexExtractionConfig

    if ANSWER_TAG.search(text) or "####" in text or PLAIN_NUMBER.match(text):
        return parse(extract_answer(text).strip(), parsing_timeout=timeout)
    anchored = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=False)]
    return parse(text, extraction_config=anchored, parsing_timeout=timeout)


def math_reward(
    prompts=None, completions=None, completion_ids=None, solution=None, answer=None, **kwargs
) -> list[float | None]:
    """1.0 / 0.0 for a correct / wrong answer (math-verify), `None` when the gold answer does not parse.

    Reads the gold answer from the `solution` column, or from `answer` (GSM8K); one of them is required.
    """
    try:
        from math_verify import parse, verify
    except ImportError as e:  # pragma: no cover - install_requires has it
        raise ImportError("math_reward needs the math-verify package: pip install math-verify") from e
    gold_column = solution if solution is not None else answer
    if gold_column is None:
        raise ValueError("math_reward needs a `solution` or `answer` dataset column with the gold answers")
    if completions is None or len(gold_column) != len(completions):
        raise ValueError(
            f"math_reward got {len(gold_column)} gold answers for "
            f"{0 if completions is None else len(completions)} completions"
        )
    # math-verify times out with signal.alarm, which only works in the main thread (rewards run in the generator
    # thread): there the limit is off, and GRPOConfig.reward_timeout bounds the whole call instead.
    main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (5, 5) if main else (None, None)
    if not main:
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    out: list[float | None] = []
    for completion, gold in zip(completions, gold_column, strict=True):
        gold_text = str(gold)
        if "####" in gold_text:
            gold_text = gold_text.rsplit("####", 1)[1]
        gold_parsed = parse(gold_text.strip(), parsing_timeout=parse_timeout)
        if not gold_parsed:
            out.append(None)
            continue
        predicted = _predicted_answer(completion_text(completion), parse, parse_timeout)
        out.append(float(bool(predicted) and verify(gold_parsed, predicted, timeout_seconds=verify_timeout)))
    return out


def make_format_reward(pattern: str = DEFAULT_FORMAT, reward: float = 1.0, name: str = "format_reward"):
    """A reward function paying `reward` when the completion text matches `pattern` (`re.DOTALL`, `re.match`),
    0.0 otherwise."""
    regex = re.compile(pattern, re.DOTALL)

    def format_reward(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
        return [reward if regex.match(completion_text(c)) else 0.0 for c in completions]

    format_reward.__name__ = format_reward.__qualname__ = name
    format_reward.pattern = pattern
    return format_reward


#: `<think>…</think><answer>…</answer>` → 1.0
format_reward = make_format_reward()


def length_penalty(target_length: int, scale: float = 1.0, name: str = "length_penalty"):
    """A reward function: `-scale · max(0, n − target_length) / target_length` for a completion of n tokens
    (`completion_ids`; for multi-turn completions the model's own and the environment's tokens together)."""
    if not isinstance(target_length, int) or target_length <= 0:
        raise ValueError(f"length_penalty: target_length must be an int > 0, got {target_length!r}")
    if scale < 0:
        raise ValueError(f"length_penalty: scale must be >= 0, got {scale!r}")

    def penalty(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
        if completion_ids is None:
            raise ValueError("length_penalty needs completion_ids")
        over = [max(0, len(ids) - target_length) for ids in completion_ids]
        return [-scale * n / target_length if n else 0.0 for n in over]

    penalty.__name__ = penalty.__qualname__ = name
    return penalty
