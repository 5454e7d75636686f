"""`RoundJoiner`: the rounds every rank generated for its own rows, joined into the round one process would have made.

With an engine on every rank (the `hf` backend and in-process vLLM with several training processes,
`build.generates_on_every_rank`), process i generates and scores rows `[i·L, (i+1)·L)` of round r with its own engine
(L = R / N, whole groups: a prompt's G completions stay on one rank); the scheduler gathers the N parts on every rank
(`collectives.gather`, on the trainer thread) and joins them here. Advantages are computed over the joined rewards, so
they equal the single-process computation for every `scale_rewards` (`"batch"` normalises over the whole round) and
`multi_objective_aggregation`:

```txt
rank 0: rows [0, L)   engine 0 → completions, rewards [L, F] ─┐  gather           join (every rank)
rank 1: rows [L, 2L)  engine 1 → completions, rewards [L, F] ─┴────────▶ [R] rows, rewards [R, F] → advantages [R]
                                                                          → the consumer keeps rows [i·L, (i+1)·L)
```
Example (G = 2, two ranks, one prompt each, `scale_rewards="batch"`): rewards [1, 0] and [1, 1] → the round's
rewards [1, 0, 1, 1], group means [0.5, 0.5, 1, 1], batch std 0.5 → advantages [1, -1, 0, 0] (rank 1 alone would
give [0, 0] and rank 0 alone [0.707, -0.707]).

Metrics: the reward and length metrics are recomputed over the joined rows (exactly the single-process values); the
others combine the ranks' values: counts summed, extremes taken, timings the slowest rank's, the rest averaged over
the ranks (every rank has L rows, so a per-row mean is exact; the means of `completions/*_terminated_length` and of
`log_metric` values are means of the ranks' means).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..algo.advantages import aggregate_advantages, combine_rewards, group_std_is_zero, nanstd
from ..algo.router_replay import pad_routing
from ..algo.vision import VisionRows
from .metrics import ROUND_TOKENS
from .types import MicroBatch, Round

#: metrics summed over the ranks (counts over rows)
SUMMED = ("prompts/truncated", "chunks/rollout", ROUND_TOKENS)


@dataclass
class JoinSettings:
    """What joining needs of the config and the producer (no config object below the trainer)."""

    num_generations: int  # G
    scale_rewards: str
    multi_objective_aggregation: str
    pad_token_id: int


class RoundJoiner:
    """Joins the ranks' parts of a round (`__call__(parts) -> Round`).

    Args:
        settings (`JoinSettings`).
        reward_weights (`Callable[[], torch.Tensor]`): the reward weights `[F]` now (the producer's: a user may set
            `trainer.reward_weights` between rounds).
        reward_names (`Callable[[], list[str]]`): the reward functions' names now.
    """

    def __init__(
        self,
        settings: JoinSettings,
        reward_weights: Callable[[], torch.Tensor],
        reward_names: Callable[[], list[str]],
    ):
        self.s = settings
        self.reward_weights, self.reward_names = reward_weights, reward_names

    def __call__(self, parts: list[Round]) -> Round:
        """`parts[i]`: rank i's round of its rows `[L]` (`RoundProducer` on `RoundRequest(first_row=i·L)`). Returns
        the `[R]` round, `R = N·L`, with advantages over the joined rewards."""
        G = self.s.num_generations
        first = parts[0]
        for i, p in enumerate(parts):
            if p.round_id != first.round_id:
                raise RuntimeError(f"joining round {first.round_id}: rank {i} sent round {p.round_id}")
            if p.rewards_per_func is None:
                raise RuntimeError(f"joining round {first.round_id}: rank {i}'s part has no rewards_per_func")
            if len(p.batch) != len(first.batch) or len(p.batch) % G:
                raise RuntimeError(
                    f"joining round {first.round_id}: rank {i} has {len(p.batch)} rows, rank 0 {len(first.batch)}; "
                    f"every rank must hold the same number of whole groups of {G}"
                )
        rewards_per_func = torch.cat([p.rewards_per_func for p in parts])  # [R, F]
        advantages = aggregate_advantages(
            rewards_per_func, self.reward_weights(), G, self.s.scale_rewards, self.s.multi_objective_aggregation
        )  # [R]
        # rows keep their `row_index` (rank i's part holds rows [i·L, (i+1)·L) of the round; a stream-mode group its
        # request's rows)
        batch = dataclasses.replace(cat_batches([p.batch for p in parts], self.s.pad_token_id), advantages=advantages)
        rewards = combine_rewards(rewards_per_func, self.reward_weights())  # [R]
        return Round(
            first.round_id,
            min(p.policy_version for p in parts),  # the oldest weights any row was sampled with
            batch,
            self._metrics(parts, batch, rewards, rewards_per_func),
            self._samples(parts, advantages),
            generation_time=max(p.generation_time for p in parts),  # the slowest rank
            rewards_per_func=rewards_per_func,
        )

    def _metrics(self, parts: list[Round], batch: MicroBatch, rewards, rewards_per_func) -> dict[str, float]:
        m: dict[str, float] = {}
        for key in dict.fromkeys(k for p in parts for k in p.metrics):  # every key, first-seen order
            values = [p.metrics[key] for p in parts if key in p.metrics]
            if key in SUMMED:
                m[key] = float(sum(values))
            elif key.startswith("timing/"):
                m[key] = float(max(values))
            elif key.endswith(("max_length", "/max")):
                m[key] = float(max(values))
            elif key.endswith(("min_length", "/min")):
                m[key] = float(min(values))
            else:
                m[key] = float(sum(values) / len(values))
        lengths = batch.completion_mask.sum(1).float()  # [R]
        m.update(
            {
                "completions/mean_length": lengths.mean().item(),
                "completions/min_length": lengths.min().item(),
                "completions/max_length": lengths.max().item(),
                "reward": torch.nanmean(rewards).item(),
                "reward_std": nanstd(rewards).item(),
                "frac_reward_zero_std": group_std_is_zero(rewards, self.s.num_generations).float().mean().item(),
            }
        )
        for i, name in enumerate(self.reward_names()):
            m[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
            m[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
        return m

    @staticmethod
    def _samples(parts: list[Round], advantages: torch.Tensor) -> dict:
        """The completions table of the joined round: the parts' columns in rank order."""
        out: dict = {"round": parts[0].round_id}
        for key in ("prompt", "completion", "reward", "policy_version", "images"):
            out[key] = [v for p in parts for v in p.samples.get(key, [])]
        if not out["images"]:  # a text model's rounds (or log_multimodal off)
            del out["images"]
        for key in ("rewards", "extra"):  # column name → one value per row
            names = dict.fromkeys(n for p in parts for n in p.samples.get(key, {}))
            out[key] = {n: [v for p in parts for v in p.samples.get(key, {}).get(n, [])] for n in names}
        out["advantage"] = advantages.tolist()
        return out


def cat_batches(batches: list[MicroBatch], pad_token_id: int) -> MicroBatch:
    """Rows of `batches` in order, one `MicroBatch`: prompts re-padded on the left, completions on the right (each
    part is padded to its own widths). Per-row tensors `[b]` are concatenated; `num_items_in_batch` summed. The
    sampler's kept sets (`sampling_mask [b, T, K]`, `support_known [b]`) may be set in some parts only (a part
    without a cut has none): the others count as "no cut" and "not reported"."""
    first = batches[0]
    names = dict.fromkeys(name for b in batches for name in b.tensors())  # first's order, then any part's
    out = {}
    for name in names:
        parts = [getattr(b, name) for b in batches]
        if any(p is None for p in parts):
            if name not in ("sampling_mask", "support_known"):
                raise ValueError(f"cat_batches: {name} is set in some parts only")
            parts = _fill_missing(name, parts, batches)
        if parts[0].dim() == 1:  # [b]
            out[name] = torch.cat(parts)
            continue
        if parts[0].dim() == 3:  # sampling_mask [b, T, K]
            out[name] = cat_batches_masks(parts)
            continue
        if parts[0].dim() == 4:  # routed_experts [b, T, L, k]
            width = max(p.size(1) for p in parts)
            out[name] = torch.cat([pad_routing(p, width) for p in parts])
            continue
        left = name.startswith("prompt")  # prompts are left-padded, completions right-padded
        value = pad_token_id if name in ("prompt_ids", "completion_ids") else 0
        width = max(p.size(1) for p in parts)
        # each part is padded to its own widest row: padding it further on the same side keeps every row's content
        out[name] = torch.cat(
            [F.pad(p, (width - p.size(1), 0) if left else (0, width - p.size(1)), value=value) for p in parts]
        )  # [R, width]
    vision = VisionRows.cat([b.vision for b in batches], [len(b) for b in batches])  # each row keeps its images
    return dataclasses.replace(
        first, **out, vision=vision, num_items_in_batch=float(sum(b.num_items_in_batch for b in batches))
    )


def _fill_missing(name: str, parts: list, batches: list[MicroBatch]) -> list[torch.Tensor]:
    """`parts` of an optional field with the unset ones filled: `sampling_mask` `[b, T, 0]` (no cut), `support_known`
    all False (not reported)."""
    out = []
    for p, b in zip(parts, batches, strict=True):
        if p is None:
            shape = (len(b), b.completion_ids.size(1), 0) if name == "sampling_mask" else (len(b),)
            p = torch.full(shape, -1, dtype=torch.int32) if name == "sampling_mask" else torch.zeros(shape, dtype=bool)
        out.append(p)
    return out


def cat_batches_masks(parts: list[torch.Tensor]) -> torch.Tensor:
    """`sampling_mask` parts `[b, T_i, K_i]` → `[Σb, max T, max K]`, −1 padded."""
    T, K = max(p.size(1) for p in parts), max(p.size(2) for p in parts)
    return torch.cat([F.pad(p, (0, K - p.size(2), 0, T - p.size(1)), value=-1) for p in parts])
