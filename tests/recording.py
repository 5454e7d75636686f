"""What the trainer trained, observed through the product's own event (`grpo_async.GRPOCallback.on_micro_batch`)
instead of a trainer subclass: the tests' one micro-batch recorder."""

from __future__ import annotations

from grpo_async import GRPOCallback, GRPOTrainer


class MicroBatches(GRPOCallback):
    """Keeps every micro-batch this process trained: `seen`, one `{field: tensor}` (CPU copies) per micro-batch."""

    def __init__(self):
        self.seen: list[dict] = []

    def on_micro_batch(self, args, state, control, micro_batch=None, **kwargs):
        self.seen.append({n: v.detach().cpu().clone() for n, v in micro_batch.tensors().items()})


def recorded_trainer(*args, callbacks=None, **kwargs) -> tuple[GRPOTrainer, list[dict]]:
    """`GRPOTrainer(*args, **kwargs)` with a `MicroBatches` among its callbacks; returns it and the recorder's list."""
    recorder = MicroBatches()
    trainer = GRPOTrainer(*args, callbacks=[*(callbacks or []), recorder], **kwargs)
    return trainer, recorder.seen
