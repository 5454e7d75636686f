"""`GRPOCallback`: a `transformers.TrainerCallback` with one more event, `on_micro_batch`, called with each micro-batch
the trainer is about to train, so what is trained can be inspected without subclassing the trainer.

```txt
training_step ─▶ _prepare_inputs ─▶ scheduler.next_micro_batch ─▶ on_micro_batch(args, state, control, micro_batch)
                                                                 ─▶ compute_loss(micro_batch)
```

The `micro_batch` is the `grpo_async.pipeline.types.MicroBatch` of this process, on the training device, after the
consumer filled `old_logps`, `ref_logps` and `is_weights`: `completion_ids [B, T]`, `loss_mask [B, T]`,
`advantages [B]`, `policy_version [B]` (the weights that sampled the row), `round_id [B]` and `row_index [B]` (the
row's identity: the same pair is never trained twice), `rollout_logps [B, T]`. Read it; a callback that changes it
changes what is trained. The other keyword arguments are those of every `TrainerCallback` event (`model`,
`processing_class`, `optimizer`, `lr_scheduler`, `train_dataloader`, `eval_dataloader`).

Example:
    >>> class Lengths(GRPOCallback):
    ...     def __init__(self):
    ...         self.lengths = []
    ...     def on_micro_batch(self, args, state, control, micro_batch=None, **kwargs):
    ...         self.lengths += micro_batch.completion_mask.sum(1).tolist()
    >>> # GRPOTrainer(..., callbacks=[Lengths()])
"""

from __future__ import annotations

from transformers import TrainerCallback


class GRPOCallback(TrainerCallback):
    """A `TrainerCallback` that also receives `on_micro_batch` (see the module docstring)."""

    def on_micro_batch(self, args, state, control, micro_batch=None, **kwargs):
        """Called on every process with the micro-batch it is about to train (`micro_batch`, a `MicroBatch`)."""


def notify_micro_batch(handler, args, state, control, micro_batch) -> None:
    """Call `on_micro_batch` of every callback of `handler` (a Trainer's `callback_handler`) that has one: a
    `GRPOCallback`, or any callback defining the method (transformers' own `call_event` would call it on every
    callback, and its base class has none)."""
    objects = {  # what transformers' `CallbackHandler.call_event` hands every event
        "model": handler.model,
        "processing_class": handler.processing_class,
        "optimizer": handler.optimizer,
        "lr_scheduler": handler.lr_scheduler,
        "train_dataloader": handler.train_dataloader,
        "eval_dataloader": handler.eval_dataloader,
    }
    for callback in handler.callbacks:
        event = getattr(callback, "on_micro_batch", None)
        if event is not None:
            event(args, state, control, micro_batch=micro_batch, **objects)
