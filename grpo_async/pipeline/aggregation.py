"""LCM batch aggregation (seed 000): buffer micro-batches, compute each stage in its own chunks, split back.

The rollout, ref-logps and old-logps stages each have a micro-batch size. Micro-batches from the data iterator are
buffered until they hold at least `service_target_bs = lcm(rollout, ref_logps, old_logps)` rows (or the end forces
a flush), merged into one batch, repeated row-wise (`sample_repeat`, e.g. G completions per prompt), computed stage
by stage in chunks of that stage's size, and cut back along the original micro-batch boundaries. Because the merged
row count is a multiple of every stage size, no stage gets a short chunk; only a forced flush may leave one.

A *batch* follows `distribute.py`: a dict whose tensors share dim 0 (rows) and whose lists have one item per row;
other values are carried unchanged. Example with stage sizes rollout = 2, ref_logps = 3, old_logps = 6, micro-batches
a (2 rows), b (3 rows), c (1 row) and `sample_repeat = 2`:

```txt
iterator ─▶ a (2 rows) ─▶ buffer [a]          rows 2 < 6
         ─▶ b (3 rows) ─▶ buffer [a, b]       rows 5 < 6
         ─▶ c (1 row)  ─▶ buffer [a, b, c]    rows 6 ≥ 6 = lcm(2, 3, 6) ─▶ take() → merged, sizes [2, 3, 1]

merge           a0 a1 b0 b1 b2 c0                               6 rows
repeat ×2       a0 a0 a1 a1 b0 b0 b1 b1 b2 b2 c0 c0             12 rows
rollout   (2)   |a0 a0|a1 a1|b0 b0|b1 b1|b2 b2|c0 c0|           6 chunks
ref_logps (3)   |a0 a0 a1|a1 b0 b0|b1 b1 b2|b2 c0 c0|           4 chunks
old_logps (6)   |a0 a0 a1 a1 b0 b0|b1 b1 b2 b2 c0 c0|           2 chunks
split_back      [a0 a0 a1 a1] [b0 b0 b1 b1 b2 b2] [c0 c0]       4, 6, 2 rows = sizes × 2
reuse μ = 2     "consecutive" (seed 000): a a b b c c    ·    "epoch" (default): a b c | a b c
```
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from numbers import Integral
from typing import Any

import torch

from .distribute import _is_row_value, num_rows, select_rows

STAGES = ("rollout", "ref_logps", "old_logps")


# ---------------------------------------------------------------------------------------------- sizes
def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def lcm(*sizes: int) -> int:
    """Least common multiple of positive ints: `lcm(4, 6, 8) = 24`.

    Args:
        *sizes (`int`):
            At least one positive int.

    Raises:
        `ValueError`: no sizes, or a size that is not a positive int (the message names it and its position).
    """
    if not sizes:
        raise ValueError("lcm() needs at least one size, got none")
    return math.lcm(*(_positive_int(f"lcm() sizes[{i}]", s) for i, s in enumerate(sizes)))


def service_target_bs(rollout: int, ref_logps: int, old_logps: int) -> int:
    """Rows the buffer collects before a computation: `lcm(rollout, ref_logps, old_logps)`.

    Args:
        rollout (`int`):
            Micro-batch size (rows) of the rollout (generation) stage.
        ref_logps (`int`):
            Micro-batch size of the reference-model logps stage.
        old_logps (`int`):
            Micro-batch size of the old-policy logps stage.
    """
    return math.lcm(*(_positive_int(n, v) for n, v in zip(STAGES, (rollout, ref_logps, old_logps))))


def sizes_that_fit(generation_batch_size: int, rollout: int, ref_logps: int, old_logps: int) -> dict[str, list[int]]:
    """For each stage, the sizes `v` that line up with `generation_batch_size` if only that stage changes.

    `v` (in `1..generation_batch_size`) fits when `lcm(v, other two) <= generation_batch_size` and
    `generation_batch_size % lcm(v, other two) == 0`. A stage whose two partners already do not divide the
    generation batch gets an empty list.

    Example: `sizes_that_fit(16, 4, 6, 8)` → `{"rollout": [], "ref_logps": [1, 2, 4, 8, 16], "old_logps": []}`
    (the partners of rollout have lcm(6, 8) = 24 and of old_logps lcm(4, 6) = 12, neither divides 16).

    Args:
        generation_batch_size (`int`):
            Rows of one generation round.
        rollout (`int`), ref_logps (`int`), old_logps (`int`):
            The current stage micro-batch sizes.

    Returns:
        `dict[str, list[int]]`: stage name (`"rollout"`, `"ref_logps"`, `"old_logps"`) → fitting sizes, ascending.
    """
    gbs = _positive_int("generation_batch_size", generation_batch_size)
    current = dict(zip(STAGES, (_positive_int(n, v) for n, v in zip(STAGES, (rollout, ref_logps, old_logps)))))
    out = {}
    for stage in STAGES:
        partners = math.lcm(*(v for s, v in current.items() if s != stage))
        out[stage] = [v for v in range(1, gbs + 1) if (m := math.lcm(v, partners)) <= gbs and gbs % m == 0]
    return out


def check_stage_sizes(generation_batch_size: int, rollout: int, ref_logps: int, old_logps: int) -> int:
    """Return `service_target_bs`, or raise if it does not divide `generation_batch_size`.

    Args:
        generation_batch_size (`int`):
            Rows of one generation round.
        rollout (`int`), ref_logps (`int`), old_logps (`int`):
            The stage micro-batch sizes.

    Raises:
        `ValueError`: the message gives the LCM, the generation batch size and, per stage, the sizes that would fit
            with the other two unchanged (see [`sizes_that_fit`]).
    """
    gbs = _positive_int("generation_batch_size", generation_batch_size)
    target = service_target_bs(rollout, ref_logps, old_logps)
    if gbs % target == 0:
        return target
    fits = sizes_that_fit(gbs, rollout, ref_logps, old_logps)
    hint = "; ".join(f"{stage}: {fits[stage] if fits[stage] else 'none'}" for stage in STAGES)
    if not any(fits.values()):
        hint += " (no single stage change is enough: change several, or the generation batch size)"
    raise ValueError(
        f"service_target_bs = lcm(rollout={rollout}, ref_logps={ref_logps}, old_logps={old_logps}) = {target} "
        f"does not divide generation_batch_size={gbs}; sizes that would fit with the other two unchanged: {hint}"
    )


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


# ---------------------------------------------------------------------------------------------- row values
def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # e.g. objects whose == is not a bool
        return False


def _cat_rows(tensors: list[torch.Tensor], key: str, pad_value: Any = 0, left: bool = False) -> torch.Tensor:
    """`torch.cat` along dim 0; tensors of rank >= 2 with different dim-1 widths are first padded to the widest."""
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{key!r}: cannot concatenate 0-dim tensors along rows")
    if len({t.dim() for t in tensors}) > 1:
        raise ValueError(f"{key!r}: tensors of different ranks {[t.dim() for t in tensors]}")
    if tensors[0].dim() >= 2:
        if len({tuple(t.shape[2:]) for t in tensors}) > 1:
            raise ValueError(
                f"{key!r}: trailing dims differ {[tuple(t.shape) for t in tensors]}; only dim 1 is padded"
            )
        width = max(t.size(1) for t in tensors)
        padded = []
        for t in tensors:
            if t.size(1) < width:
                full = t.new_full((t.size(0), width, *t.shape[2:]), pad_value)  # [b, T_max, ...]
                if left:
                    full[:, width - t.size(1) :] = t
                else:
                    full[:, : t.size(1)] = t
                t = full
            padded.append(t)
        tensors = padded
    return torch.cat(tensors, dim=0)  # [Σb, ...]


def merge(
    batches: list[dict[str, Any]],
    *,
    pad_values: Mapping[str, Any] | None = None,
    left_padded: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Concatenate batches row-wise (`merge` of seed 000's buffer).

    Row-aligned tensors are concatenated along dim 0 (`[b_i, T_i] → [Σb_i, max T_i]`: a narrower tensor is padded in
    dim 1 with its pad value, on the right unless its key is in `left_padded`), row-aligned lists are concatenated,
    and any other value must be equal in every batch and is carried once.

    Example: `{"ids": [[1, 2, 3], [4, 5, 6]]}` and `{"ids": [[7, 8, 9, 10, 11]]}` → `ids` of shape `[3, 5]` with
    rows `[1, 2, 3, 0, 0]`, `[4, 5, 6, 0, 0]`, `[7, 8, 9, 10, 11]`.

    Args:
        batches (`list[dict[str, Any]]`):
            Non-empty list of batches with the same keys.
        pad_values (`Mapping[str, Any]`, *optional*, defaults to `None`):
            Pad value per key (e.g. `{"completion_ids": pad_token_id}`); keys not listed are padded with 0.
        left_padded (`Iterable[str]`, *optional*, defaults to `None`):
            Keys padded on the left (e.g. `{"prompt_ids", "prompt_mask"}`); others are padded on the right.

    Raises:
        `ValueError`: no batches, different keys, a non-row value that differs between batches, a key that is
            row-aligned in some batches only (and differs), a key mixing tensors and lists, or shapes that cannot be
            padded together. The message names the key.
    """
    if not batches:
        raise ValueError("merge() needs at least one batch, got an empty list")
    pad_values = dict(pad_values or {})
    left_padded = set(left_padded or ())
    keys = list(batches[0])
    for i, b in enumerate(batches[1:], start=1):
        if set(b) != set(keys):
            raise ValueError(f"batch {i} has keys {sorted(b)}, batch 0 has {sorted(keys)}")
    rows = [num_rows(b) for b in batches]
    out: dict[str, Any] = {}
    for k in keys:
        values = [b[k] for b in batches]
        is_row = [_is_row_value(v, n) for v, n in zip(values, rows)]
        if not all(is_row):
            if not all(_same(values[0], v) for v in values[1:]):
                where = "is row-aligned in some batches only and" if any(is_row) else "is not row-aligned and"
                raise ValueError(f"{k!r} {where} differs between batches; non-row values must be equal to merge")
            out[k] = values[0]
        elif all(isinstance(v, torch.Tensor) for v in values):
            out[k] = _cat_rows(values, k, pad_values.get(k, 0), k in left_padded)
        elif all(isinstance(v, list) for v in values):
            out[k] = [x for v in values for x in v]
        else:
            raise ValueError(f"{k!r} mixes tensors and lists across batches")
    return out


def repeat_rows(batch: dict[str, Any], times: int) -> dict[str, Any]:
    """Repeat each row `times` times consecutively (seed 000's `sample_repeat`): rows `[a, b]` ×2 → `[a, a, b, b]`.

    Args:
        batch (`dict[str, Any]`):
            Batch of `B` rows.
        times (`int`):
            Copies of each row, >= 1.

    Returns:
        `dict[str, Any]`: batch of `B × times` rows; non-row values unchanged.
    """
    times = _positive_int("times", times)
    n = num_rows(batch)
    out = {}
    for k, v in batch.items():
        if not _is_row_value(v, n):
            out[k] = v
        elif isinstance(v, torch.Tensor):
            out[k] = v.repeat_interleave(times, dim=0)  # [B, ...] → [B*times, ...]
        else:
            out[k] = [x for x in v for _ in range(times)]
    return out


def split_back(batch: dict[str, Any], sizes: list[int], repeat: int = 1) -> list[dict[str, Any]]:
    """Cut a merged (and possibly repeated) batch back into the micro-batches it was merged from.

    Piece `i` holds rows `[o_i · repeat, (o_i + sizes[i]) · repeat)` with `o_i = sizes[0] + … + sizes[i-1]`:
    sizes `[2, 3, 1]`, repeat 4 → pieces of 8, 12 and 4 rows.

    Args:
        batch (`dict[str, Any]`):
            Batch of `sum(sizes) × repeat` rows.
        sizes (`list[int]`):
            Rows of each original micro-batch (before the repeat), each >= 0.
        repeat (`int`, *optional*, defaults to `1`):
            The `times` given to [`repeat_rows`].

    Raises:
        `ValueError`: `sum(sizes) × repeat` differs from the rows of `batch`, or a bad size / repeat.
    """
    repeat = _positive_int("repeat", repeat)
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, Integral) or s < 0:
            raise ValueError(f"sizes[{i}] must be an int >= 0, got {s!r}")
    n = num_rows(batch)
    if sum(sizes) * repeat != n:
        raise ValueError(
            f"sizes {list(sizes)} sum to {sum(sizes)}, × repeat={repeat} = {sum(sizes) * repeat} rows, "
            f"but the batch has {n} rows"
        )
    pieces, offset = [], 0
    for s in sizes:
        pieces.append(select_rows(batch, slice(offset * repeat, (offset + s) * repeat)))
        offset += s
    return pieces


def apply_in_chunks(
    fn: Callable[[dict[str, Any]], torch.Tensor | dict[str, Any]],
    batch: dict[str, Any],
    size: int,
    *,
    pad_value: Any = 0,
    pad_values: Mapping[str, Any] | None = None,
    left_padded: Iterable[str] | None = None,
) -> tuple[torch.Tensor | dict[str, Any], int]:
    """Run one stage in chunks of `size` rows (seed 000's `_rollout_by_micro`, `_ref_logps_by_micro`, ...).

    `fn` is called on each `select_rows(batch, s)` for `s` in `chunk_slices(num_rows(batch), size)`, and the results
    are concatenated along dim 0: tensors `[b, T_i, ...] → [B, max T_i, ...]` (padded in dim 1 with `pad_value` on
    the right), dicts of row values as in [`merge`].

    Args:
        fn (`Callable[[dict], torch.Tensor | dict]`):
            Computes one chunk; returns a tensor with rows in dim 0, or a batch dict.
        batch (`dict[str, Any]`):
            Batch of `B > 0` rows.
        size (`int`):
            The stage's micro-batch size; the last chunk is shorter iff `B % size != 0`.
        pad_value (`Any`, *optional*, defaults to `0`):
            Dim-1 pad value when `fn` returns tensors of different widths.
        pad_values (`Mapping[str, Any]`, *optional*, defaults to `None`):
            Per-key pad values when `fn` returns dicts (see [`merge`]).
        left_padded (`Iterable[str]`, *optional*, defaults to `None`):
            Keys padded on the left when `fn` returns dicts (see [`merge`]).

    Returns:
        `tuple[torch.Tensor | dict, int]`: the concatenated result and the number of chunks (calls to `fn`).
    """
    n = num_rows(batch)
    if n == 0:
        raise ValueError("batch has no rows; apply_in_chunks needs at least one")
    results = [fn(select_rows(batch, s)) for s in chunk_slices(n, size)]
    if all(isinstance(r, torch.Tensor) for r in results):
        return _cat_rows(results, "fn result", pad_value), len(results)  # [B, ...]
    if all(isinstance(r, dict) for r in results):
        return merge(results, pad_values=pad_values, left_padded=left_padded), len(results)
    raise ValueError(
        f"fn must return tensors or dicts in every chunk, got {sorted({type(r).__name__ for r in results})}"
    )


# ---------------------------------------------------------------------------------------------- buffer
class MicroBatchBuffer:
    """Seed 000's buffer: collect micro-batches until they hold `target` rows, then hand them over merged.

    ```python
    buf = MicroBatchBuffer(service_target_bs(2, 3, 6))  # target 6
    buf.add(a)  # 2 rows → ready() False
    buf.add(b)  # 5 rows → ready() False
    buf.add(c)  # 6 rows → ready() True
    merged, sizes = buf.take()  # sizes [2, 3, 1]; the buffer is empty again
    ```

    Args:
        target (`int`):
            Rows that make the buffer ready (`service_target_bs`).
        pad_values (`Mapping[str, Any]`, *optional*, defaults to `None`):
            Passed to [`merge`].
        left_padded (`Iterable[str]`, *optional*, defaults to `None`):
            Passed to [`merge`].

    Attributes:
        batches (`list[dict]`): the buffered micro-batches, in arrival order.
        sizes (`list[int]`): their row counts (`buf_sizes` in seed 000), used by [`split_back`].
    """

    def __init__(
        self,
        target: int,
        *,
        pad_values: Mapping[str, Any] | None = None,
        left_padded: Iterable[str] | None = None,
    ) -> None:
        self.target = _positive_int("target", target)
        self.pad_values = dict(pad_values or {})
        self.left_padded = set(left_padded or ())
        self.batches: list[dict[str, Any]] = []
        self.sizes: list[int] = []

    @property
    def rows(self) -> int:
        """Rows buffered (`buf_B` in seed 000)."""
        return sum(self.sizes)

    def __len__(self) -> int:
        return len(self.batches)

    def add(self, batch: dict[str, Any]) -> None:
        """Buffer one micro-batch and record its row count."""
        n = num_rows(batch)
        if n == 0:
            raise ValueError("batch has no rows; the buffer only takes non-empty micro-batches")
        self.batches.append(batch)
        self.sizes.append(n)

    def ready(self, force: bool = False) -> bool:
        """`True` when `rows >= target`, or when `force` and the buffer is not empty."""
        return bool(self.batches) and (force or self.rows >= self.target)

    def take(self, force: bool = False) -> tuple[dict[str, Any], list[int]] | None:
        """`(merged, sizes)` and empty the buffer when `ready(force)`, else `None` (the buffer is kept)."""
        if not self.ready(force):
            return None
        merged = merge(self.batches, pad_values=self.pad_values, left_padded=self.left_padded)
        sizes = self.sizes
        self.batches, self.sizes = [], []
        return merged, sizes


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

    `"epoch"`: the whole list μ times, `[a, b]`, μ = 2 → `[a, b, a, b]`; `"consecutive"` (seed 000's `batch_repeat`,
    order a a b b): each item μ times in a row → `[a, a, b, b]`.

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
