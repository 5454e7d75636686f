"""Rows of a generation round: each stage's chunks, each process's share, the reuse order, padding.

Pure functions of ints, lists and (for `pad`) tensors. The rollout, ref-logps and old-logps stages each run in chunks
of their own micro-batch size over the rows of a round (`GRPOConfig` checks at construction that each size divides
the rows its stage sees, so every chunk is full); each process scores and trains its own slice of the round.
Example with rollout = 2, ref_logps = 3, old_logps = 6 over a 12-row round (micro-batches a, b), one process:

```txt
round           a0 a0 a1 a1 a2 a2 b0 b0 b1 b1 b2 b2            12 rows
rollout   (2)   |a0 a0|a1 a1|a2 a2|b0 b0|b1 b1|b2 b2|           chunk_slices(12, 2): 6 chunks
ref_logps (3)   |a0 a0 a1|a1 a2 a2|b0 b0 b1|b1 b2 b2|           chunk_slices(12, 3): 4 chunks
old_logps (6)   |a0 a0 a1 a1 a2 a2|b0 b0 b1 b1 b2 b2|           chunk_slices(12, 6): 2 chunks
reuse μ = 2     "consecutive": a a b b    ·    "epoch" (default): a b | a b
```
With N processes, process i holds rows `process_slice(R, N, i)` = `[i·L, (i+1)·L)`, `L = R / N`.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Integral
from typing import Any

import torch


# ---------------------------------------------------------------------------------------------- sizes
def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def chunk_slices(total: int, size: int) -> list[slice]:
    """Consecutive slices of `size` rows covering `range(total)`; the last is shorter iff `total % size != 0`.

    Example: `chunk_slices(10, 4)` → `[slice(0, 4), slice(4, 8), slice(8, 10)]`; `chunk_slices(0, 4)` → `[]`.

    Args:
        total (`int`):
            Rows to cover, >= 0.
        size (`int`):
            Rows per chunk, > 0.
    """
    if isinstance(total, bool) or not isinstance(total, Integral) or total < 0:
        raise ValueError(f"total must be an int >= 0, got {total!r}")
    size = _positive_int("size", size)
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


# ---------------------------------------------------------------------------------------------- reuse order
def _epoch(items: list, num_iterations: int) -> list:
    return [x for _ in range(num_iterations) for x in items]


def _consecutive(items: list, num_iterations: int) -> list:
    return [x for x in items for _ in range(num_iterations)]


_REUSE_ORDERS: dict[str, Callable[[list, int], list]] = {"epoch": _epoch, "consecutive": _consecutive}
#: valid `order` names of [`reuse_order`]
REUSE_ORDERS = tuple(_REUSE_ORDERS)


def reuse_order(items: list, num_iterations: int, order: str = "epoch") -> list:
    """The order in which `num_iterations` (μ) passes train `items`.

    `"epoch"`: the whole list μ times, `[a, b]`, μ = 2 → `[a, b, a, b]`; `"consecutive"` (a a b b): each item μ
    times in a row → `[a, a, b, b]`.

    Args:
        items (`list`):
            Micro-batches (or anything) in production order.
        num_iterations (`int`):
            μ, >= 1.
        order (`str`, *optional*, defaults to `"epoch"`):
            One of [`REUSE_ORDERS`].
    """
    if order not in _REUSE_ORDERS:
        raise ValueError(f"order must be one of {REUSE_ORDERS}, got {order!r}")
    return _REUSE_ORDERS[order](list(items), _positive_int("num_iterations", num_iterations))


# ---------------------------------------------------------------------------------------------- padding, shares
def pad(seqs: list[list], value, side: str = "right", dtype=torch.long) -> torch.Tensor:
    """Stack ragged rows into `[R, max_len]`, padding on `side` with `value`."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), value, dtype=dtype)
    for i, s in enumerate(seqs):
        if len(s):
            t = torch.as_tensor(s, dtype=dtype)
            if side == "right":
                out[i, : len(s)] = t
            else:
                out[i, width - len(s) :] = t
    return out


def process_slice(total_rows: int, num_processes: int, process_index: int) -> slice:
    """Rows of `process_index`: `[i·L, (i+1)·L)` with `L = total_rows / num_processes` (must divide)."""
    if total_rows % num_processes != 0:
        raise ValueError(f"round of {total_rows} rows cannot be split evenly over {num_processes} processes")
    local = total_rows // num_processes
    if local == 0:
        raise RuntimeError(f"process {process_index} would receive no rows (round of {total_rows} rows)")
    return slice(process_index * local, (process_index + 1) * local)
