"""`RoundConsumer`: a `Round` in, this process's gradient-accumulation micro-batches out.

```txt
Round [R rows, every process] ─▶ slice [L = R / N, this rank] ─▶ stale rows: loss mask zeroed (counted)
   ─▶ old logps (chunks of old_logps_micro_batch_size), ref logps (chunks of ref_logps_micro_batch_size)
   ─▶ IS weights π_old / π_sampler ─▶ shuffle ─▶ steps_per_generation micro-batches [B = L / steps], trimmed
```
The shuffle deals rows, or with `keep_groups` whole groups (rows of one prompt stay consecutive, so a micro-batch's
forward pass shares their prompt: `algo.prefix_sharing.group_permutation`).
Every stage runs only full chunks of exactly its size (the config checks that each size divides L). Example:
L = 12, ref 3, old 6 → ref logps in 4 chunks of 3, old logps in 2 chunks of 6. With `token_budget` each chunk holds
instead as many consecutive rows as fit in that many real tokens (`algo.token_budget`).

Staleness is counted in policy versions (optimizer steps): a row sampled with the weights of step v, trained in a
round that starts at step s, has staleness s − v; rows above `staleness_limit` are never trained.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..algo.loss import importance_sampling_weights
from ..algo.prefix_sharing import group_permutation
from ..algo.throughput import generated_tokens_per_second
from ..algo.token_budget import budget_slices
from ..generation.base import derive_seed
from .rows import process_slice
from .types import MicroBatch, Round

logger = logging.getLogger(__name__)

#: `fn(ids [b, P+T], mask [b, P+T], T) -> logps [b, T]`
LogpsFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class ConsumerSettings:
    steps_per_generation: int
    old_logps_micro_batch_size: int
    ref_logps_micro_batch_size: int
    staleness_limit: int | None  # policy versions; None: never drop
    importance_sampling_correction: bool
    importance_sampling_mode: str
    importance_sampling_clip_min: float | None
    importance_sampling_clip_max: float | None
    seed: int | None = None  # the shuffle within a round: a generator seeded from (seed, round); None: torch's global
    token_budget: int | None = None  # tokens per logps forward pass instead of the stages' row counts (per device)
    keep_groups: bool = False  # shuffle whole groups, not rows (trainer_setup.keep_groups_together says when)


class RoundConsumer:
    """Cuts rounds into this process's micro-batches.

    Args:
        settings (`ConsumerSettings`).
        collectives (`AcceleratorCollectives`, or `algo.objective.SingleProcess()` for one process): this process's
            place (`num_processes`, `process_index`), the sum (`reduce_sum`) and concatenation (`gather_tensor`) over
            the processes.
        old_logps (`LogpsFn`, *optional*): the policy's logps (no grad); `None` when the policy cannot move before the
            round is trained (then π_old = the policy itself).
        ref_logps (`LogpsFn`, *optional*): the reference model's logps; `None` when β = 0.
        log (`Callable[[str, float], None]`): records a metric.
    """

    def __init__(
        self,
        settings: ConsumerSettings,
        *,
        collectives,
        old_logps: LogpsFn | None,
        ref_logps: LogpsFn | None,
        log: Callable[[str, float], None],
    ):
        self.s = settings
        self.collectives = collectives
        self.num_processes, self.process_index = collectives.num_processes, collectives.process_index
        self.old_logps, self.ref_logps = old_logps, ref_logps
        self.log = log

    def __call__(self, rnd: Round, step: int) -> list[MicroBatch]:
        """`step`: the policy version (optimizer step) this round starts training at."""
        R = len(rnd.batch)
        rate = generated_tokens_per_second(float(rnd.batch.completion_mask.sum()), rnd.generation_time)  # the round
        if rate is not None:
            self.log("perf/generated_tokens_per_second", rate)
        local = rnd.batch.select(process_slice(R, self.num_processes, self.process_index))  # [L]
        local = self._drop_stale(local, rnd.round_id, step)
        local = self._add_logps(local)
        if self.s.importance_sampling_correction:
            local = self._add_importance_weights(local)
        shuffler = self._shuffler(rnd.round_id)
        if self.s.keep_groups:
            order = group_permutation(local.prompt_ids, local.prompt_mask, shuffler)  # [L] groups kept together
        else:
            order = torch.randperm(len(local), generator=shuffler)  # [L]
        local = local.select(order)  # within the round
        return [b.trim() for b in local.split(self.s.steps_per_generation)]

    def _shuffler(self, round_id: int) -> torch.Generator | None:
        """The round's own generator: torch's global RNG is shared with the generator thread (and an in-process vLLM
        engine reseeds it), so the micro-batch order would depend on what ran before."""
        if self.s.seed is None:
            return None
        return torch.Generator().manual_seed(derive_seed(self.s.seed, "shuffle", round_id))

    def _drop_stale(self, local: MicroBatch, round_id: int, step: int) -> MicroBatch:
        limit = self.s.staleness_limit
        stale = torch.zeros(len(local), dtype=torch.bool)
        if limit is not None:
            stale = (step - local.policy_version) > limit  # [L]
        loss_mask = local.loss_mask.clone()
        loss_mask[stale] = 0
        counts = self.collectives.reduce_sum(torch.tensor([float(stale.sum()), float(loss_mask.sum())]))
        dropped, items = counts.tolist()
        self.log("async/dropped_stale", dropped)
        if dropped:
            logger.warning(
                "round %d: %d samples older than max_staleness=%s policy versions were not trained",
                round_id,
                int(dropped),
                limit,
            )
            # the loss normaliser counts trained tokens only
            return _replace(local, loss_mask=loss_mask, num_items_in_batch=items)
        return local

    @torch.no_grad()
    def _add_logps(self, local: MicroBatch) -> MicroBatch:
        stages = {"old_logps": (self.s.old_logps_micro_batch_size, self.old_logps)}
        stages["ref_logps"] = (self.s.ref_logps_micro_batch_size, self.ref_logps)
        T = local.completion_ids.size(1)
        ids = torch.cat([local.prompt_ids, local.completion_ids], 1)  # [L, P+T]
        mask = torch.cat([local.prompt_mask, local.completion_mask], 1)  # [L, P+T]
        out = {}
        for name, (size, fn) in stages.items():
            if fn is None:
                continue
            t0 = time.perf_counter()
            parts = self._chunks(ids.size(0), size, mask)
            chunks = [fn(ids[part], mask[part], T) for part in parts]  # each [rows of the part, T]
            out[name] = torch.cat(chunks)  # [L, T]
            self.log(f"timing/{name}", time.perf_counter() - t0)
            self.log(f"chunks/{name}", float(len(chunks)))
        return _replace(local, **out)

    def _chunks(self, L: int, size: int, mask: torch.Tensor) -> list[slice]:
        """The forward passes of a stage: `size` rows each, or with `token_budget` as many consecutive rows as fit
        in it (`algo.token_budget.budget_slices`; mask `[L, P+T]`)."""
        if self.s.token_budget is not None:
            return budget_slices(mask.sum(1).tolist(), self.s.token_budget)
        return [slice(i, i + size) for i in range(0, L, size)]

    def _add_importance_weights(self, local: MicroBatch) -> MicroBatch:
        """`is_weights` = π_old / π_sampler per token or per completion, and metrics over every process's tokens."""
        s = self.s
        mask = local.loss_mask  # [L, T]
        old = local.old_logps if local.old_logps is not None else local.rollout_logps
        weights, diff = importance_sampling_weights(
            old,
            local.rollout_logps,
            mask,
            s.importance_sampling_mode,
            s.importance_sampling_clip_min,
            s.importance_sampling_clip_max,
        )
        on = mask.bool() if weights.size(1) > 1 else mask.any(1, keepdim=True)  # tokens / completions that count
        d, w = diff[mask.bool()].abs().float(), weights[on].float()
        empty = w.numel() == 0  # every token of this process's rows is masked
        stats = torch.tensor([d.sum(), d.numel(), d.max() if d.numel() else 0.0])
        ratios = torch.tensor([math.inf, 0.0, 0.0, -math.inf] if empty else [w.min(), w.sum(), w.numel(), w.max()])
        stats = self.collectives.gather_tensor(stats).view(-1, 3)  # [N, 3]
        ratios = self.collectives.gather_tensor(ratios).view(-1, 4)  # [N, 4]
        self.log("sampling/logp_diff/mean", (stats[:, 0].sum() / stats[:, 1].sum().clamp(min=1)).item())
        self.log("sampling/logp_diff/max", stats[:, 2].max().item())
        self.log("sampling/importance_sampling_ratio/min", ratios[:, 0].min().item())
        self.log("sampling/importance_sampling_ratio/mean", (ratios[:, 1].sum() / ratios[:, 2].sum()).item())
        self.log("sampling/importance_sampling_ratio/max", ratios[:, 3].max().item())
        return _replace(local, is_weights=weights)


def _replace(batch: MicroBatch, **changes) -> MicroBatch:
    import dataclasses

    return dataclasses.replace(batch, **changes)
