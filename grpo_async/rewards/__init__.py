"""Reward functions: TRL's calling convention, checked and timed.

A reward function is `f(prompts, completions, completion_ids, **columns) -> list[float | None]`, one value per
completion; dataset columns arrive as keyword lists aligned with the completions. `None` means "not applicable"
(NaN): a completion every function returns None for is unscorable and gets advantage 0. `async def` functions run
concurrently.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Sequence

import torch

RewardFunc = Callable[..., list]


def reward_func_name(func: RewardFunc) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def prepare_reward_funcs(reward_funcs) -> tuple[list[RewardFunc], list[str]]:
    """Normalise to a list of callables and their (unique) names; raise on anything else."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty: give at least one reward function")
    names = []
    for i, f in enumerate(funcs):
        if not callable(f):
            raise TypeError(
                f"reward_funcs[{i}] is a {type(f).__name__}, not a callable "
                "f(prompts, completions, completion_ids, **kwargs) -> list[float | None]"
            )
        name = reward_func_name(f)
        names.append(name if name not in names else f"{name}_{i}")
    return funcs, names


def score_completions(
    funcs: Sequence[RewardFunc],
    names: Sequence[str],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
) -> torch.Tensor:
    """Call every reward function once on the whole round. Returns `[B, F]` float32 with NaN for `None`."""
    n = len(completions)
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    results: list = [None] * len(funcs)
    coros = {}
    for i, (f, name) in enumerate(zip(funcs, names, strict=True)):
        if inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(type(f).__call__):
            coros[i] = f(**kwargs)
            continue
        try:
            results[i] = f(**kwargs)
        except Exception as e:
            raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
    if coros:

        async def _all():
            return await asyncio.gather(*coros.values(), return_exceptions=True)

        for i, out in zip(coros, asyncio.run(_all()), strict=True):
            if isinstance(out, BaseException):
                raise RuntimeError(f"reward function {names[i]!r} raised {type(out).__name__}: {out}") from out
            results[i] = out
    table = torch.empty(n, len(funcs), dtype=torch.float32)
    for i, (out, name) in enumerate(zip(results, names, strict=True)):
        if not isinstance(out, (list, tuple)) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            raise ValueError(f"reward function {name!r} returned {got} for {n} completions; return one per completion")
        for j, v in enumerate(out):
            if v is None:
                table[j, i] = math.nan
                continue
            try:
                table[j, i] = float(v)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"reward function {name!r} returned {v!r} at index {j}; expected a number or None"
                ) from e
    return table
