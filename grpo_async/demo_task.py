"""The bundled demo task: a generated dataset a tiny model learns from scratch in minutes on 2 CPU cores.

Each prompt asks for one letter, e.g. `"Say b"` (chat format). The reward is the fraction of characters of the
completion that are that letter, so a random model scores about 1/100 and a model that learned the task scores
close to 1. A second reward, `ends_cleanly`, pays 0.1 for a completion that stops with EOS before the limit.

Example: prompt `Say b`, completion `bbxb` → `letter_reward = 0.75`.
"""

from __future__ import annotations

import random

LETTERS = "abcd"


def make_dataset(num_prompts: int = 2048, seed: int = 0, conversational: bool = True):
    """A `datasets.Dataset` with columns `prompt` and `letter` (the answer the reward checks)."""
    from datasets import Dataset

    rng = random.Random(seed)
    letters = [rng.choice(LETTERS) for _ in range(num_prompts)]
    prompts = [[{"role": "user", "content": f"Say {c}"}] if conversational else f"Say {c}:" for c in letters]
    return Dataset.from_dict({"prompt": prompts, "letter": letters})


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def letter_reward(prompts, completions, completion_ids, letter, **kwargs) -> list[float]:
    """Fraction of the completion's characters equal to the requested letter (0 for an empty completion)."""
    out = []
    for completion, target in zip(completions, letter, strict=True):
        text = _text(completion)
        out.append(sum(ch == target for ch in text) / len(text) if text else 0.0)
    return out


def ends_cleanly(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """0.1 when the completion is non-empty and its last token is not a content character (it stopped on EOS)."""
    return [
        0.1 if _text(c) and len(ids) > len(_text(c)) else 0.0
        for c, ids in zip(completions, completion_ids, strict=True)
    ]
