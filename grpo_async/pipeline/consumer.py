"""`RoundConsumer`: a `Round` in, this process's gradient-accumulation micro-batches out.

```txt
Round [R rows, every process] ─▶ slice [L = R / N, this rank] ─▶ stale rows: loss mask zeroed (counted)
   ─▶ old logps (chunks of old_logps_micro_batch_size) and π_old's mass on the sampler's kept sets, ref logps
   (chunks of ref_logps_micro_batch_size) ─▶ IS weights π_old / π_sampler ─▶ shuffle ─▶ steps_per_generation
   micro-batches [B = L / steps], trimmed
```
Truncated sampling (top-k / top-p / min-p): the sampler's log-probs are normalised over the tokens it kept, the
trainer's over the whole vocabulary. With `support_replay` the consumer puts the sampler's log-probs on the trainer's
support, `rollout_logps += log Σ_{v ∈ S} π_old(v)` (`algo.sampling_support`), before the IS weights, their metrics
and the off-policy mask read them: the kept sets `S` the backend recorded (`MicroBatch.sampling_mask`), or, for rows
whose backend could not report them, the sampler's filter applied to π_old (`ConsumerSettings.truncation`; one
warning says so).
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
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..algo.loss import MICRO_BATCH_NORMALISED_LOSS_TYPES, importance_sampling_stats, importance_sampling_weights
from ..algo.prefix_sharing import group_permutation
from ..algo.sampling_support import TruncationFilter
from ..algo.throughput import generated_tokens_per_second
from ..algo.token_budget import budget_slices
from ..generation.base import derive_seed
from .metrics import importance_sampling_metrics
from .rows import process_slice, reuse_order
from .staleness import too_stale
from .types import MicroBatch, Round

logger = logging.getLogger(__name__)

#: `fn(ids [b, P+T], mask [b, P+T], T) -> logps [b, T]`
LogpsFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
#: `fn(ids [b, P+T], mask [b, P+T], T, support) -> (logps [b, T], log_kept_mass [b, T] or None)`: `support` the
#: sampler's kept sets `[b, T, K]`, a `TruncationFilter` or None (`algo.logprobs.LogpsScorer.scores`)
ScoresFn = Callable[[torch.Tensor, torch.Tensor, int, object], tuple[torch.Tensor, torch.Tensor | None]]


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
    keep_groups: bool = False  # shuffle whole groups, not rows (`keep_groups_together` says when)
    #: put the sampler's log-probs on the trainer's support where it cut the vocabulary (module docstring)
    support_replay: bool = True
    #: the sampler's cut, applied by the trainer to π_old for rows whose kept sets the backend did not report
    truncation: TruncationFilter | None = None
    #: TRL's `pad_to_multiple_of`: the training micro-batches' prompt and completion widths (None: as trimmed)
    pad_to_multiple_of: int | None = None
    #: `GRPOConfig.router_replay`: with rows carrying their sampler's experts, π_old routes them so ("rollout") or
    #: only compares ("record"); either way `routing/mismatch_*` say where the trainer's routers choose otherwise
    router_replay: str = "off"

    @classmethod
    def from_config(cls, a, never_sampled: tuple[int, ...] = (), in_forward: bool = False) -> ConsumerSettings:
        """From a `GRPOConfig`; `never_sampled`: the token ids no backend samples (a vision-language model's image
        placeholders), cut from π_old's support with the sampler's filter (`TruncationFilter.banned`); `in_forward`:
        the training objective weighs the rows itself (`build_pipeline` decides, `InForwardImportanceSampling`)."""
        return cls(
            steps_per_generation=a.steps_per_generation,
            old_logps_micro_batch_size=a.old_logps_micro_batch_size,
            ref_logps_micro_batch_size=a.ref_logps_micro_batch_size,
            staleness_limit=a.staleness_limit,
            # π_old from the training forward: the objective weighs the rows (`InForwardImportanceSampling`)
            importance_sampling_correction=a.importance_sampling_correction and not in_forward,
            importance_sampling_mode=a.importance_sampling_mode,
            importance_sampling_clip_min=a.importance_sampling_clip_min,
            importance_sampling_clip_max=a.importance_sampling_clip_max,
            seed=a.seed,  # the shuffle within a round: its own generator, whatever else draws from torch's global RNG
            token_budget=a.token_budget,  # algo/token_budget.py
            keep_groups=keep_groups_together(a),  # the training forward shares each group's prompt
            support_replay=a.importance_sampling_support_replay,
            truncation=TruncationFilter.from_config(a, never_sampled),  # servers' rows
            pad_to_multiple_of=a.pad_to_multiple_of if isinstance(a.pad_to_multiple_of, int) else None,
            router_replay=getattr(a, "router_replay", "off"),
        )


def keep_groups_together(a) -> bool:
    """Whether the consumer deals a round to micro-batches in whole groups (`share_prompt_prefix`: the training
    forward then computes each prompt once for all its completions) instead of shuffled rows. Only where which rows
    share a micro-batch changes no optimizer step, so a run with sharing on trains exactly as one with it off:

    - every optimizer step accumulates whole passes over rounds (`steps_per_generation = gradient_accumulation_steps`
      with μ = 1 or the "epoch" reuse order, or steps spanning whole rounds), not some micro-batches of a round;
    - the loss type's normaliser is not the micro-batch's own token count (`bnpo`), and nothing else in the loss is a
      statistic of the micro-batch (`top_entropy_quantile < 1`, the entropy bonus's per-micro-batch mean).

    Elsewhere rows are shuffled as before and each micro-batch shares what prompts its rows happen to have in common.
    `a` is a `GRPOConfig`.

    Example: TRL's defaults (dapo, steps_per_generation = gradient_accumulation_steps) → True; `loss_type="bnpo"` or
    `steps_per_generation = 2 × gradient_accumulation_steps` → False.
    """
    if not a.share_prompt_prefix or a.loss_type in MICRO_BATCH_NORMALISED_LOSS_TYPES:
        return False
    if a.top_entropy_quantile < 1.0 or a.entropy_coef != 0.0 or a.use_adaptive_entropy:
        return False
    passes = reuse_order(list(range(a.steps_per_generation)), a.num_iterations, a.reuse_order)  # micro-steps
    window = a.gradient_accumulation_steps
    if window % len(passes) == 0:
        return True  # each optimizer step accumulates whole rounds
    if len(passes) % window:
        return False  # a step would end inside one round and take part of the next
    spg = a.steps_per_generation
    whole_pass = sorted(list(range(spg)) * (window // spg))  # each micro-batch of the round equally often
    steps = [passes[i : i + window] for i in range(0, len(passes), window)]
    return window % spg == 0 and all(sorted(step) == whole_pass for step in steps)


class RoundConsumer:
    """Cuts rounds into this process's micro-batches.

    Args:
        settings (`ConsumerSettings`).
        collectives (`AcceleratorCollectives`, or `algo.objective.SingleProcess()` for one process): this process's
            place (`num_processes`, `process_index`), the sum (`reduce_sum`) and concatenation (`gather_tensor`) over
            the processes.
        old_logps (`ScoresFn`, *optional*): the policy's logps (no grad) and its log-mass on the sampler's kept sets;
            `None` when the policy cannot move before the round is trained (then π_old = the policy itself).
        ref_logps (`LogpsFn`, *optional*): the reference model's logps; `None` when β = 0.
        log (`Callable[[str, float], None]`): records a metric.
    """

    def __init__(
        self,
        settings: ConsumerSettings,
        *,
        collectives,
        old_logps: ScoresFn | None,
        ref_logps: LogpsFn | None,
        log: Callable[[str, float], None],
    ):
        self.s = settings
        self.collectives = collectives
        self.num_processes, self.process_index = collectives.num_processes, collectives.process_index
        self.old_logps, self.ref_logps = old_logps, ref_logps
        self.log = log
        self._warned_filter = False

    def __call__(self, rnd: Round, step: int) -> list[MicroBatch]:
        """`step`: the policy version (optimizer step) this round starts training at."""
        R = len(rnd.batch)
        rate = generated_tokens_per_second(float(rnd.batch.completion_mask.sum()), rnd.generation_time)  # the round
        if rate is not None:
            self.log("perf/generated_tokens_per_second", rate)
        local = rnd.batch.select(process_slice(R, self.num_processes, self.process_index))  # [L]
        local = self._drop_stale(local, rnd.round_id, step)
        local = self._add_logps(local, self._support(local))
        if self.s.importance_sampling_correction:
            local = self._add_importance_weights(local)
        shuffler = self._shuffler(rnd.round_id)
        if self.s.keep_groups:
            order = group_permutation(local.prompt_ids, local.prompt_mask, shuffler)  # [L] groups kept together
        else:
            order = torch.randperm(len(local), generator=shuffler)  # [L]
        local = local.select(order)  # within the round
        return [b.trim().pad_to_multiple(self.s.pad_to_multiple_of) for b in local.split(self.s.steps_per_generation)]

    def _shuffler(self, round_id: int) -> torch.Generator | None:
        """The round's own generator: torch's global RNG is shared with the generator thread (and an in-process vLLM
        engine reseeds it), so the micro-batch order would depend on what ran before."""
        if self.s.seed is None:
            return None
        return torch.Generator().manual_seed(derive_seed(self.s.seed, "shuffle", round_id))

    def _drop_stale(self, local: MicroBatch, round_id: int, step: int) -> MicroBatch:
        limit = self.s.staleness_limit
        stale = too_stale(step, local.policy_version, limit)  # [L]
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

    def _support(self, local: MicroBatch):
        """What π_old's mass is measured on (`score_tokens`' `support`): the recorded kept sets `[L, T, K]` when the
        backend reported every row's, else the sampler's filter (when it cuts), else None (nothing was cut)."""
        s = self.s
        if not (s.support_replay and s.importance_sampling_correction and self.old_logps is not None):
            return None
        known = local.support_known
        if known is not None and bool(known.all()):
            self.log("sampling/support_exact", 1.0)
            return local.sampling_mask  # None: the sampler cut nothing
        if s.truncation is None or not s.truncation.cuts:
            return None
        if not s.truncation.samples_a_cut:  # only the banned tokens: the same set wherever π_old drifts
            self.log("sampling/support_exact", 1.0)
            return s.truncation
        self.log("sampling/support_exact", 0.0)
        if not self._warned_filter:
            self._warned_filter = True
            logger.warning(
                "the generation backend does not report the tokens its sampler kept (%s): the importance-sampling "
                "ratio renormalises pi_old over the trainer's own filter of pi_old instead (exact while pi_old and "
                "the sampler agree, approximate where they drift; sampling/support_exact = 0)",
                s.truncation,
            )
        return s.truncation

    @torch.no_grad()
    def _add_logps(self, local: MicroBatch, support) -> MicroBatch:
        """π_old (with `support`, also its log-mass there, which moves `rollout_logps` onto the trainer's support)
        and π_ref, each in chunks of its stage's size."""
        T = local.completion_ids.size(1)
        ids = torch.cat([local.prompt_ids, local.completion_ids], 1)  # [L, P+T]
        mask = torch.cat([local.prompt_mask, local.completion_mask], 1)  # [L, P+T]
        vision = local.vision  # a vision-language model: each forward pass gets its rows' images
        vis = (lambda part: {}) if vision is None else (lambda part: {"vision": vision.select(part)})  # noqa: E731
        out = {}
        if self.old_logps is not None:
            t0 = time.perf_counter()
            parts = self._chunks(ids.size(0), self.s.old_logps_micro_batch_size, mask)
            sets = lambda part: support[part] if isinstance(support, torch.Tensor) else support  # noqa: E731
            routing = local.routed_experts if self.s.router_replay != "off" else None  # [L, T, layers, k]
            replay = {"replay": self.s.router_replay == "rollout"}
            chunks = [
                self.old_logps(ids[part], mask[part], T, sets(part), **vis(part))
                if routing is None
                else self.old_logps(ids[part], mask[part], T, sets(part), routing=routing[part], **replay, **vis(part))
                for part in parts
            ]  # each (logps [rows, T], mass [rows, T] or None), and with routing its RoutingStats
            out["old_logps"] = torch.cat([c[0] for c in chunks])  # [L, T]
            if routing is not None:
                self._log_routing(sum((c[2].counts for c in chunks), torch.zeros(4, dtype=torch.float64)))
            if support is not None:
                log_kept = torch.cat([c[1] for c in chunks]) * local.completion_mask  # [L, T] ≤ 0
                out["rollout_logps"] = local.rollout_logps + log_kept
                out["support_log_mass"] = log_kept
            self.log("timing/old_logps", time.perf_counter() - t0)
            self.log("chunks/old_logps", float(len(chunks)))
        if self.ref_logps is not None:
            t0 = time.perf_counter()
            parts = self._chunks(ids.size(0), self.s.ref_logps_micro_batch_size, mask)
            chunks = [self.ref_logps(ids[part], mask[part], T, **vis(part)) for part in parts]  # each [rows, T]
            out["ref_logps"] = torch.cat(chunks)  # [L, T]
            self.log("timing/ref_logps", time.perf_counter() - t0)
            self.log("chunks/ref_logps", float(len(chunks)))
        return _replace(local, **out)

    def _log_routing(self, counts: torch.Tensor) -> None:
        """`routing/mismatch_tokens` (completion tokens whose expert set, at one MoE layer or more) and
        `routing/mismatch_pairs` ((token, MoE layer) pairs): where π_old's routers chose other experts than the
        sampler ran, over every process's recorded tokens; with replay on, the experts run are the sampler's anyway
        (these say what replay overrode)."""
        counts = self.collectives.reduce_sum(counts)  # [4]
        self.log("routing/mismatch_tokens", float(counts[0] / counts[1].clamp(min=1)))
        self.log("routing/mismatch_pairs", float(counts[2] / counts[3].clamp(min=1)))

    def _chunks(self, L: int, size: int, mask: torch.Tensor) -> list[slice]:
        """The forward passes of a stage: `size` rows each, or with `token_budget` as many consecutive rows as fit
        in it (`algo.token_budget.budget_slices`; mask `[L, P+T]`)."""
        if self.s.token_budget is not None:
            return budget_slices(mask.sum(1).tolist(), self.s.token_budget)
        return [slice(i, i + size) for i in range(0, L, size)]

    def _add_importance_weights(self, local: MicroBatch) -> MicroBatch:
        """`is_weights` = π_old / π_sampler per token or per completion, and their metrics over every process's
        tokens (`pipeline.metrics.importance_sampling_metrics`)."""
        s = self.s
        mask = local.loss_mask  # [L, T]
        old = local.old_logps if local.old_logps is not None else local.rollout_logps
        clip = (s.importance_sampling_clip_min, s.importance_sampling_clip_max)
        weights, diff = importance_sampling_weights(old, local.rollout_logps, mask, s.importance_sampling_mode, *clip)
        stats, ratios = importance_sampling_stats(weights, diff, mask, s.importance_sampling_mode, *clip)
        stats = self.collectives.gather_tensor(stats).view(-1, 6)  # [N, 6]
        ratios = self.collectives.gather_tensor(ratios).view(-1, 4)  # [N, 4]
        for name, value in importance_sampling_metrics(stats, ratios).items():
            self.log(name, value)
        return _replace(local, is_weights=weights)


def _replace(batch: MicroBatch, **changes) -> MicroBatch:
    import dataclasses

    return dataclasses.replace(batch, **changes)
