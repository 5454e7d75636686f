"""Token-budget micro-batches (`GRPOConfig.token_budget`, TRL's async name; per device): each forward pass of a stage
holds as many consecutive rows as fit in the budget of token positions, instead of a fixed row count. A pass's
positions are those of its packed `[K, W]` (`algo.packing.packed_positions`: bins as long as its longest row,
first-fit-decreasing), filler included, so the budget bounds what the forward runs, not only its real tokens.

```txt
rows (real tokens):   120  90  200  60  60  30      budget 256
slices:             [120  90] [200] [60  60  30]     (consecutive rows; a row never splits)
packed:             [120][90]  [200] [60][60][30]    2 × 120 = 240, 200, 3 × 60 = 180 positions ≤ 256
```
Counting real tokens alone let filler through: `bench/memory.py`'s long-tailed rows cut at 2,048 real tokens ran
passes of 4 × 605 = 2,420 and 5 × 479 = 2,395 positions, and the step's peak rose with them (1.06× to 1.17× the
budget's bound). The training micro-batch (one gradient-accumulation step) is cut the same way, each slice forward
and backward in turn, so its loss keeps the normaliser of the loss type over the whole micro-batch
(`LossContext.micro_batch_rows`, `micro_batch_tokens`): the gradients equal those of the micro-batch in one pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from .packing import packed_positions


def budget_slices(tokens_per_row: list[int], budget: int) -> list[slice]:
    """Consecutive runs of rows, each as long as its packed positions (`algo.packing.packed_positions`, filler
    included) stay within `budget` (greedy, in order).

    Example: tokens [120, 90, 200, 60, 60, 30], budget 256 → [slice(0, 2), slice(2, 3), slice(3, 6)]. Tokens
    [10, 6, 6, 6], budget 28: all four hold 28 real tokens but pack into 4 × 10 = 40 positions, so
    [slice(0, 2), slice(2, 4)] (2 × 10 = 20 and 2 × 6 = 12).
    A row longer than the budget is an error naming `token_budget`.
    """
    if budget < 1:
        raise ValueError(f"GRPOConfig.token_budget={budget}: must be a number of tokens >= 1")
    for i, n in enumerate(tokens_per_row):
        if n > budget:
            raise ValueError(
                f"GRPOConfig.token_budget={budget}: row {i} holds {n} tokens (prompt + completion) and fits no "
                f"micro-batch; raise token_budget to at least {n} or shorten max_prompt_length / "
                "max_completion_length"
            )
    slices, start = [], 0
    while start < len(tokens_per_row):
        end, used = start, 0  # the most rows whose real tokens fit: positions are never fewer
        while end < len(tokens_per_row) and used + tokens_per_row[end] <= budget:
            used, end = used + tokens_per_row[end], end + 1
        if packed_positions(tokens_per_row[start:end]) > budget:  # filler: the longest prefix that packs within it,
            lo, hi = start + 1, end - 1  # by bisection (one row always fits)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if packed_positions(tokens_per_row[start:mid]) <= budget:
                    lo = mid
                else:
                    hi = mid - 1
            end = lo
        slices.append(slice(start, end))
        start = end
    return slices


def row_tokens(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> list[int]:
    """Real tokens of each row: `[B, P]`, `[B, T]` masks → `[B]` counts."""
    return (prompt_mask.sum(1) + completion_mask.sum(1)).tolist()


def budgeted_loss(
    batch,
    budget: int | None,
    loss_of: Callable[..., torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.Tensor:
    """The loss of a training micro-batch computed slice by slice within `budget` tokens.

    Args:
        batch: a `MicroBatch` (`[B]` rows; `select(slice)` gives a slice of it).
        budget (`int`, *optional*): tokens per forward pass; `None`: the whole micro-batch at once.
        loss_of (`Callable`): `loss_of(part, totals, last)` → the loss of `part` normalised as one part of `batch`
            (`totals = {"micro_batch_rows": B, "micro_batch_tokens": loss tokens of batch}` for `LossContext`,
            `None` when there is one part) and `last` whether `part` ends the micro-batch.
        backward (`Callable`): backpropagates a part's loss (the trainer's `accelerator.backward`).
        no_sync (`Callable`): a context in which a backward pass does not reduce gradients across processes.

    Returns the last part's loss (for the caller to backpropagate) plus the others' values, detached: the value is
    the micro-batch's loss, the gradient of the earlier parts already accumulated.
    """
    if budget is None:
        return loss_of(batch, None, True)
    slices = budget_slices(row_tokens(batch.prompt_mask, batch.completion_mask), budget)
    if len(slices) == 1:
        return loss_of(batch, None, True)
    totals = {"micro_batch_rows": len(batch), "micro_batch_tokens": float(batch.loss_mask.sum())}
    done = None
    for part in slices[:-1]:
        with no_sync():
            loss = loss_of(batch.select(part).trim(), totals, False)
            backward(loss)
        done = loss.detach() if done is None else done + loss.detach()
    return loss_of(batch.select(slices[-1]).trim(), totals, True) + done
