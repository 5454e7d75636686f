"""The bundled demo task: a generated dataset a tiny model learns from scratch in minutes on 2 CPU cores.

Each prompt asks for one letter, e.g. `"Say b"` (chat format). The reward is the fraction of characters of the
completion that are that letter, so a random model scores about 1/100 and a model that learned the task scores
close to 1. A second reward, `ends_cleanly`, pays 0.1 for a completion whose token ids end with exactly one EOS and
hold no other special token (no `<pad>` sprinkled in the answer), i.e. it stopped on its own before the limit.

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


def make_ends_cleanly(eos_token_id: int, special_ids, bonus: float = 0.1):
    """A reward function named `ends_cleanly`: `bonus` when the completion's token ids are non-empty text followed by
    exactly one `eos_token_id` at the end, with no other special token (`special_ids`) anywhere; else 0.

    Args:
        eos_token_id (`int`): the token that ends a completion.
        special_ids (iterable of `int`): every special token id of the tokenizer (pad, bos, chat markers, ...).
        bonus (`float`, *optional*, defaults to 0.1): the reward of a clean ending.
    """
    special = frozenset(int(i) for i in special_ids) | {int(eos_token_id)}

    def ends_cleanly(prompts, completions, completion_ids, **kwargs) -> list[float]:
        out = []
        for ids in completion_ids:
            ids = [int(i) for i in ids]
            clean = len(ids) >= 2 and ids[-1] == eos_token_id and not any(i in special for i in ids[:-1])
            out.append(bonus if clean else 0.0)
        return out

    ends_cleanly.__doc__ = f"{bonus} for text then exactly one EOS (id {eos_token_id}) and no other special token."
    return ends_cleanly


def make_ends_cleanly_for(tokenizer, bonus: float = 0.1):
    """`make_ends_cleanly` with the EOS and special-token ids of a `transformers` tokenizer."""
    return make_ends_cleanly(tokenizer.eos_token_id, tokenizer.all_special_ids, bonus)


def _tiny_tokenizer_ids() -> tuple[int, list[int]]:
    from .testing import SPECIAL_TOKENS

    return SPECIAL_TOKENS.index("<|end|>"), list(range(len(SPECIAL_TOKENS)))


#: `ends_cleanly` for the tiny model's character tokenizer (`grpo_async.testing`): EOS `<|end|>`, specials ids 0–6
ends_cleanly = make_ends_cleanly(*_tiny_tokenizer_ids())
