"""Staleness in one place: how stale a row is, which rows the guard drops, and the pacer that keeps the generator from
starting rows that would be too stale by the time they are trained.

One clock: the policy version is the optimizer step that produced the weights (`Trainer.state.global_step`). A row's
version `v` is its oldest token's (`MicroBatch.policy_version`); trained at version `s` its staleness is `s − v`.

```txt
row sampled from v ──▶ trained in a round starting at s:  staleness s − v   (async/staleness: at each micro-batch)
guard (RoundConsumer): s − v > limit ─▶ loss mask zeroed, async/dropped_stale
pacer (the generators): start rows only if s_j − published ≤ limit, j = the round they can earliest land in
```
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def staleness(version, policy_version: torch.Tensor) -> torch.Tensor:
    """Policy versions each row lags when trained at `version` (an int, or a tensor broadcasting against it):
    `version − policy_version` `[B]`. Example: staleness(5, tensor([5, 3])) → tensor([0, 2])."""
    return version - policy_version


def too_stale(step: int, policy_version: torch.Tensor, limit: int | None) -> torch.Tensor:
    """`[B]` bool: the rows a round starting at `step` must not train (`staleness > limit`; none when `limit` is
    None). Example: too_stale(5, tensor([5, 3, 2]), 2) → tensor([False, False, True])."""
    if limit is None:
        return torch.zeros(policy_version.shape, dtype=torch.bool)
    return staleness(step, policy_version) > limit


@dataclass(frozen=True)
class PaceClock:
    """The trainer's clock as the pacer last saw it (replaced whole at each round boundary: readers in other threads
    see one consistent snapshot)."""

    round: int  # the round that started training at `step` (the anchor)
    next_round: int  # the next round the generator assembles (the anchor, or later if it was fetched already)
    step: int  # its policy version: `Trainer.state.global_step` when it started
    micro_step: int  # its first epoch micro-step
    published: int  # the version the sampler holds (published at that boundary)


class StalenessPacer:
    """The staleness clock of the pipeline: which rows may start generating now without lagging more than `limit`
    policy versions when their round starts training.

    One owner: the scheduler (trainer thread) `advance`s it at every round boundary, after the publish, with the
    trainer's own step (`Trainer.state.global_step`, the policy version) and the version the sampler now holds; the
    generator threads only read it (`lag`, `allows`).

    The step round `j` starts training at is known from the anchor round `r` (started at step `s_r`, epoch
    micro-step `m_r`): a round is `E = steps_per_generation × num_iterations` micro-steps, an optimizer step ends
    every `GA` micro-steps, so `s_j = s_r + ⌊(m_r + (j − r)·E) / GA⌋ − ⌊m_r / GA⌋`. Exact within an epoch; across
    an epoch's end a shorter last accumulation window is one step more than this counts (the bound is then one
    version permissive; the consumer's drop guard catches what that makes stale).

    Args:
        limit (`int`): most policy versions a row may lag when its round starts training.
        micro_steps_per_round (`int`): E.
        gradient_accumulation_steps (`int`): GA.
    """

    def __init__(self, limit: int, micro_steps_per_round: int, gradient_accumulation_steps: int):
        self.limit = limit
        self.E, self.GA = micro_steps_per_round, gradient_accumulation_steps
        self.clock: PaceClock | None = None  # None until the first boundary: nothing is generated before it

    def advance(self, round_id: int, next_round: int, step: int, micro_step: int, published: int) -> None:
        """Round `round_id` starts training at `step` (epoch micro-step `micro_step`); the sampler holds `published`;
        the generator's next round to assemble is `next_round`."""
        self.clock = PaceClock(round_id, next_round, step, micro_step, published)

    def step_at(self, round_id: int, clock: PaceClock | None = None) -> int:
        """The policy version round `round_id` (≥ the anchor) starts training at."""
        c = clock or self.clock
        m = c.micro_step
        return c.step + (m + (round_id - c.round) * self.E) // self.GA - m // self.GA

    def lag(self, round_id: int) -> int:
        """Policy versions rows started now would lag when trained in round `round_id`: `s_j − published` (rows
        started now sample from `published` or newer weights, so this is their staleness at most)."""
        c = self.clock
        return self.step_at(round_id, c) - c.published

    def allows(self, round_id: int) -> bool:
        """Whether rows started now may be trained in round `round_id` within the limit (always, before the first
        boundary)."""
        return self.clock is None or self.lag(round_id) <= self.limit
