"""Row helpers of a generation round: pad ragged token lists, and each process's slice of the round's rows.

```txt
global round R rows ──process_slice(rank)──▶ L = R / N rows
rank 0: rows [0, L)     rank 1: rows [L, 2L)     ...
```
"""

from __future__ import annotations

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


def process_slice(total_rows: int, num_processes: int, process_index: int) -> slice:
    """Rows of `process_index`: `[i·L, (i+1)·L)` with `L = total_rows / num_processes` (must divide)."""
    if total_rows % num_processes != 0:
        raise ValueError(f"round of {total_rows} rows cannot be split evenly over {num_processes} processes")
    local = total_rows // num_processes
    if local == 0:
        raise RuntimeError(f"process {process_index} would receive no rows (round of {total_rows} rows)")
    return slice(process_index * local, (process_index + 1) * local)
