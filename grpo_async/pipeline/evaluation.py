"""TRL's `eval_loss` of `GRPOTrainer.evaluate()`: the GRPO loss of the eval completions, as TRL's `prediction_step`.

```txt
eval batch (per_device_eval_batch_size × processes rows)  ─▶  shares of per_device_eval_batch_size rows
  every process computes every share (same forward passes, same order: sharded models stay in step)
  loss per share: no gradient accumulation, π_old = π (ratio 1), the KL term when beta > 0
eval_loss = Σ loss(share) × rows(share) / Σ rows(share)          (averaged over rows, as Trainer.evaluation_loop)
```
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..algo.loss import LossContext
from ..algo.objective import PolicyObjective, SingleProcess
from .types import MicroBatch


def eval_chunk_prompts(a) -> int:
    """Prompts generated and scored together by `evaluate` (`a`: a `GRPOConfig`), in whole groups of
    `num_generations_eval` completions: as many rows as a training round or TRL's global eval batch
    (`per_device_eval_batch_size × processes`), whichever is larger. The results do not depend on it; larger calls are
    what keeps a vLLM engine busy (TRL's default eval batch of 8 rows with G = 8 would be one prompt per call)."""
    rows = max(a.generation_batch_size, a.per_device_eval_batch_size * a.world_size)
    return max(1, rows // (a.num_generations_eval or a.num_generations))


@torch.no_grad()
def eval_loss(
    config,
    model: nn.Module,
    batches: list[MicroBatch],
    objective_state: dict,
    ref_logps: Callable | None,
    device: torch.device,
    num_processes: int,
    model_config,
) -> float:
    """TRL's `eval_loss` of `batches` (the eval batches `RoundProducer.evaluate` returned).

    Args:
        config (`GRPOConfig`): the loss settings, `per_device_eval_batch_size`, `temperature`, `padding_free`,
            `share_prompt_prefix`.
        model (`nn.Module`): the policy as trained (wrapped); put in eval mode for the passes, then restored.
        batches (`list[MicroBatch]`): `[R]` rows each, without logps.
        objective_state (`dict`): the training objective's `state_dict()` (the entropy coefficient it has now).
        ref_logps (`LogpsFn`, *optional*): the reference scorer when `beta > 0`.
        device (`torch.device`), num_processes (`int`): this process's device; the processes training.
        model_config: the unwrapped model's config (MoE: the load-balancing loss).
    """
    a = config
    objective = PolicyObjective.from_config(a, model_config, SingleProcess())  # its own adaptive state
    objective.load_state_dict(objective_state)
    total, rows, was_training = 0.0, 0, model.training
    model.eval()
    try:
        for batch in batches:
            ctx = LossContext(
                max_completion_length=a.max_completion_length,
                num_items_in_batch=batch.num_items_in_batch,  # the whole eval batch's loss tokens (dapo, ...)
                num_processes=num_processes,
            )
            for lo in range(0, len(batch), a.per_device_eval_batch_size):
                part = batch.select(slice(lo, lo + a.per_device_eval_batch_size))
                if ref_logps is not None:
                    T = part.completion_ids.size(1)
                    ids = torch.cat([part.prompt_ids, part.completion_ids], dim=1)  # [b, P+T]
                    mask = torch.cat([part.prompt_mask, part.completion_mask], dim=1)  # [b, P+T]
                    vis = {} if part.vision is None else {"vision": part.vision}  # a VLM: the rows' images
                    part.ref_logps = ref_logps(ids, mask, T, **vis)  # [b, T]
                out = objective.forward_loss(  # the training step's forward and loss (a share holds whole groups)
                    model,
                    part.to(device),
                    ctx,
                    temperature=a.temperature,
                    padding_free=a.padding_free,
                    share_prefix=a.share_prompt_prefix,
                    end_of_window=False,
                )
                total, rows = total + out.loss.item() * len(part), rows + len(part)
    finally:
        model.train(was_training)
    return total / max(rows, 1)


class Evaluator:
    """What `GRPOTrainer.evaluate()` reports for one eval set, TRL's way: the main process generates
    `num_generations_eval` completions per prompt on the weights the sampler holds (published by the trainer first)
    in TRL's eval batches (`per_device_eval_batch_size × processes` rows, rounded up to whole groups) and scores
    them; every process receives them and computes `eval_loss` (`eval_loss`, above).

    Args:
        config (`GRPOConfig`): the eval batch size, `num_generations_eval` and what `eval_loss` reads.
        producer (`RoundProducer`): generates and scores (`RoundProducer.evaluate`).
        collectives (`AcceleratorCollectives`): `is_main`, `broadcast`, `num_processes`.
        ref_logps (`LogpsFn`, *optional*): the reference scorer when `beta > 0`.
        device (`torch.device`): this process's.
        chunk_prompts (`int`): prompts generated at a time (`eval_chunk_prompts`).
    """

    def __init__(self, config, producer, collectives, ref_logps: Callable | None, device, chunk_prompts: int):
        self.config, self.producer, self.collectives = config, producer, collectives
        self.ref_logps, self.device, self.chunk_prompts = ref_logps, device, chunk_prompts

    def __call__(self, dataset, model: nn.Module, objective_state: dict, model_config) -> dict[str, float]:
        """The eval set's metrics, unprefixed: `loss`, `reward`, `reward_std`, `rewards/<func>`, ..."""
        generated = None
        if self.collectives.is_main:
            rows = self.config.per_device_eval_batch_size * self.collectives.num_processes  # TRL's eval batch,
            rows = math.lcm(rows, self.config.num_generations_eval or self.config.num_generations)  # whole groups
            generated = self.producer.evaluate(dataset, self.chunk_prompts, rows)
        metrics, batches = self.collectives.broadcast(generated)
        n = self.collectives.num_processes
        loss = eval_loss(self.config, model, batches, objective_state, self.ref_logps, self.device, n, model_config)
        return {"loss": loss, **metrics}  # TRL's eval_loss: metric_for_best_model="loss"
