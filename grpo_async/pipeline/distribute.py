"""Row-wise helpers for a generation round: pad, slice per process, trim, shuffle, split into GA buffers.

A *round* is a dict whose tensors share dim 0 (`R` rows = prompts × G) and whose lists have `R` items; other
values (scalars, dicts) are carried unchanged. Seed 003 §5.7–§6:

```
global round R rows ──slice(rank)──▶ L = R / N rows ──shuffle──▶ split into steps_per_generation buffers
rank 0: rows [0, L)     rank 1: rows [L, 2L)     ...
```
"""

from __future__ import annotations

from typing import Any

import torch


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


def num_rows(batch: dict[str, Any]) -> int:
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return v.size(0)
    raise ValueError("round has no row tensors")


def _is_row_value(v, n: int) -> bool:
    return (isinstance(v, torch.Tensor) and v.dim() > 0 and v.size(0) == n) or (isinstance(v, list) and len(v) == n)


def select_rows(batch: dict[str, Any], index) -> dict[str, Any]:
    """Rows `index` (a slice or a 1-D index tensor) of every row-aligned value."""
    n = num_rows(batch)
    out = {}
    for k, v in batch.items():
        if not _is_row_value(v, n):
            out[k] = v
        elif isinstance(v, torch.Tensor):
            out[k] = v[index]
        elif isinstance(index, slice):
            out[k] = v[index]
        else:
            out[k] = [v[i] for i in index.tolist()]
    return out


def process_slice(total_rows: int, num_processes: int, process_index: int) -> slice:
    """Rows of `process_index`: `[i·L, (i+1)·L)` with `L = total_rows / num_processes` (must divide)."""
    if total_rows % num_processes != 0:
        raise ValueError(f"round of {total_rows} rows cannot be split evenly over {num_processes} processes")
    local = total_rows // num_processes
    if local == 0:
        raise RuntimeError(f"process {process_index} would receive no rows (round of {total_rows} rows)")
    return slice(process_index * local, (process_index + 1) * local)


def trim_padding(batch: dict[str, Any]) -> dict[str, Any]:
    """Drop prompt columns that are padding in every row (left) and completion columns likewise (right)."""
    out = dict(batch)
    pm = batch["prompt_mask"]  # [L, P]
    keep_from = int((pm.sum(0) > 0).nonzero().min()) if pm.any() else pm.size(1)
    for k in ("prompt_ids", "prompt_mask"):
        out[k] = batch[k][:, keep_from:]
    cm = batch["completion_mask"]  # [L, T]
    keep_to = int((cm.sum(0) > 0).nonzero().max()) + 1 if cm.any() else 1
    for k, v in batch.items():
        if not k.startswith("prompt_") and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == cm.shape:
            out[k] = v[:, :keep_to]
    return out


def shuffle_rows(batch: dict[str, Any], generator: torch.Generator | None = None) -> dict[str, Any]:
    perm = torch.randperm(num_rows(batch), generator=generator)
    return select_rows(batch, perm)


def split_rows(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """Split into `parts` equal consecutive chunks (gradient-accumulation buffers)."""
    n = num_rows(batch)
    if n % parts != 0:
        raise ValueError(f"{n} rows cannot be split into {parts} equal buffers")
    size = n // parts
    return [select_rows(batch, slice(i * size, (i + 1) * size)) for i in range(parts)]
