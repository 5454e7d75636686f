"""What a test sees the trainer train: a `GRPOCallback` that keeps a record of every micro-batch (`on_micro_batch`,
the event users have for it; `grpo_async/callbacks.py`), instead of a `GRPOTrainer` subclass that overrides
`compute_loss` to look. Observation only: nothing of the trainer is replaced.

Example:
    >>> trainer, seen = recorded(model=path, reward_funcs=reward, args=args, train_dataset=ds)  # doctest: +SKIP
    >>> trainer.train()  # doctest: +SKIP
    >>> seen.records[0]["advantages"]  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from grpo_async import GRPOTrainer
from grpo_async.callbacks import GRPOCallback


def tensors(micro_batch, state, processing_class) -> dict[str, Any]:
    """The default record: a detached CPU copy of every field of the micro-batch (tensors copied, the rest as is)."""
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in micro_batch.items()}


class MicroBatches(GRPOCallback):
    """Keeps `record(micro_batch, state, processing_class)` for every micro-batch this process trains, in order, in
    `records`; `events`, when given, also gets `("train", <the record's "rows">)` (a test's order of events)."""

    def __init__(self, record: Callable[..., Any] = tensors, events: list | None = None):
        self.record = record
        self.records: list[Any] = []
        self.events = events

    def on_micro_batch(self, args, state, control, micro_batch=None, processing_class=None, **kwargs):
        entry = self.record(micro_batch, state, processing_class)
        self.records.append(entry)
        if self.events is not None:
            self.events.append(("train", entry["rows"]))


def recorded(*args, record: Callable[..., Any] = tensors, events: list | None = None, **kwargs):
    """`GRPOTrainer(*args, **kwargs)` with a `MicroBatches` callback added to its `callbacks`; returns both."""
    seen = MicroBatches(record, events)
    kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), seen]
    return GRPOTrainer(*args, **kwargs), seen
