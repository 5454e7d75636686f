"""`AcceleratorCollectives`: the pipeline's one way across the training processes.

The scheduler gathers every process's rows and broadcasts the main process's round (Python objects); the consumer
sums metrics and gathers per-row values, the objective (`algo.objective.Collectives`) reduces and gathers the
entropies of every process's tokens, the loss metrics sum and gather their terms (tensors). All of it goes through
this one object, built by the trainer on its `accelerate.Accelerator`; with one process every call is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object


class AcceleratorCollectives:
    """The pipeline's one way across the training processes (accelerate): Python objects (rows, rounds) and tensors
    (metric sums); identity with one process.

    Args:
        accelerator (`accelerate.Accelerator`): the trainer's.
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def num_processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def process_index(self) -> int:
        return self.accelerator.process_index

    def gather(self, items: list) -> list:
        """Every process's `items`, in rank order, on every process."""
        return gather_object(items)

    def broadcast(self, obj: Any) -> Any:
        """The main process's `obj`, on every process."""
        return broadcast_object_list([obj], from_process=0)[0]

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the processes (computed on this process's device, returned on `t`'s)."""
        return self.accelerator.reduce(t.to(self.accelerator.device), reduction="sum").to(t.device)

    def gather_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Every process's `t` concatenated along dim 0, in rank order (returned on `t`'s device)."""
        return self.accelerator.gather(t.to(self.accelerator.device)).to(t.device)

    def pad_across_processes(self, t: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        """`t` padded with `pad_index` along `dim` to the longest process's length (returned on `t`'s device)."""
        out = self.accelerator.pad_across_processes(t.to(self.accelerator.device), dim=dim, pad_index=pad_index)
        return out.to(t.device)
