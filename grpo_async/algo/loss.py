"""GRPO-family per-token losses and their reductions (TRL 1.16 semantics). Pure functions of tensors.

Shapes: `B` completions in the micro-batch, `T` completion tokens (right-padded).

```
ratio  = exp(logp - old_logp)                                        # [B, T]
pg     = -min(ratio · A, clip(ratio, 1-ε_low, 1+ε_high) · A)         # [B, T]
kl     = exp(ref - logp) - (ref - logp) - 1          (k3, if β > 0)  # [B, T]
loss_t = pg + β · kl                                                 # [B, T]
loss   = REDUCTIONS[loss_type](loss_t, mask) / accumulation normaliser
```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class LossContext:
    """Scalars the reductions need (never the whole config).

    Args:
        grad_accum_steps: micro-batches per optimizer step (1 in eval).
        max_completion_length: `dr_grpo` divides by `B · max_completion_length`.
        num_items_in_batch: loss tokens in the whole generation round across all processes (`dapo`).
        num_processes: training processes.
        steps_per_generation: micro-steps one generation round is split into.
    """

    grad_accum_steps: int = 1
    max_completion_length: int = 1
    num_items_in_batch: float | torch.Tensor | None = None
    num_processes: int = 1
    steps_per_generation: int = 1


def _seq_mean_then_mean(x: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    # grpo: average each sequence over its own tokens, then over sequences
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ctx.grad_accum_steps


def _token_mean(x: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    # bnpo: average over all tokens of the micro-batch
    return (x * mask).sum() / mask.sum().clamp(min=1.0) / ctx.grad_accum_steps


def _fixed_length(x: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    # dr_grpo: sum over tokens / (B · max_completion_length)
    return (x * mask).sum() / (x.size(0) * ctx.max_completion_length) / ctx.grad_accum_steps


def _global_token_mean(x: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    # dapo: sum over tokens / (tokens of the whole round per process, rescaled to one accumulation window)
    if ctx.num_items_in_batch is None:
        raise ValueError("loss_type='dapo' needs num_items_in_batch (loss tokens of the generation round)")
    n = torch.as_tensor(ctx.num_items_in_batch, dtype=x.dtype, device=x.device).clamp(min=1.0)
    normaliser = n / ctx.num_processes * ctx.grad_accum_steps / ctx.steps_per_generation
    return (x * mask).sum() / normaliser


REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, LossContext], torch.Tensor]] = {
    "grpo": _seq_mean_then_mean,
    "bnpo": _token_mean,
    "dr_grpo": _fixed_length,
    "dapo": _global_token_mean,
}
LOSS_TYPES = tuple(REDUCTIONS)


@dataclass
class LossOutput:
    loss: torch.Tensor  # [] scaled for gradient accumulation
    per_token_loss: torch.Tensor  # [B, T]
    ratio: torch.Tensor  # [B, T] exp(logp - old_logp)
    per_token_kl: torch.Tensor | None  # [B, T]
    is_low_clipped: torch.Tensor  # [B, T] bool
    is_high_clipped: torch.Tensor  # [B, T] bool


def k3_kl(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π_θ || π_ref), per token: `exp(r - p) - (r - p) - 1`. [B, T] → [B, T]."""
    d = ref_per_token_logps - per_token_logps
    return torch.exp(d) - d - 1


def grpo_loss(
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    importance_weights: torch.Tensor | None = None,
    ctx: LossContext | None = None,
) -> LossOutput:
    """Clipped-surrogate GRPO loss.

    Args:
        per_token_logps (`[B, T]`): log π_θ of the completion tokens (with gradient).
        advantages (`[B]` or `[B, T]`): one advantage per completion (or per token).
        mask (`[B, T]`): 1 for tokens that are trained on (the loss mask, not the attention mask).
        loss_type (`str`): key of `REDUCTIONS`.
        old_per_token_logps (`[B, T]`, *optional*): log π_old; `None` means π_old = π_θ (detached), ratio = 1.
        ref_per_token_logps (`[B, T]`, *optional*): log π_ref, required when `beta > 0`.
        importance_weights (`[B, T]` or `[B, 1]`, *optional*): off-policy correction multiplied into the loss.
        ctx (`LossContext`): normalisation scalars.
    """
    if loss_type not in REDUCTIONS:
        raise ValueError(f"Unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")
    ctx = ctx or LossContext()
    mask = mask.to(per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # [B, 1]
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    ratio = torch.exp(per_token_logps - old)  # [B, T]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # [B, T]
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)  # [B, T]
    if importance_weights is not None:
        per_token_loss = per_token_loss * importance_weights
    per_token_kl = None
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta > 0 needs ref_per_token_logps")
        per_token_kl = k3_kl(per_token_logps, ref_per_token_logps)  # [B, T]
        per_token_loss = per_token_loss + beta * per_token_kl
    loss = REDUCTIONS[loss_type](per_token_loss, mask, ctx)
    return LossOutput(
        loss=loss,
        per_token_loss=per_token_loss,
        ratio=ratio,
        per_token_kl=per_token_kl,
        is_low_clipped=(ratio < 1 - epsilon_low) & (advantages < 0),
        is_high_clipped=(ratio > 1 + epsilon_high) & (advantages > 0),
    )


# ---------------------------------------------------------------------------------------------- importance sampling
def _token_level(diff: torch.Tensor) -> torch.Tensor:
    return diff  # [B, T]


def _sequence_level(diff: torch.Tensor) -> torch.Tensor:
    return diff.sum(dim=-1, keepdim=True)  # [B, T] → [B, 1]


def _truncate(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    return torch.clamp(ratio, min=clip_min, max=clip_max)


def _mask(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


#: mode → (level of the ratio, what happens outside [clip_min, clip_max]); TRL 1.16's vLLM IS correction modes
IS_MODES: dict[str, tuple[Callable, Callable]] = {
    "token_truncate": (_token_level, _truncate),
    "token_mask": (_token_level, _mask),
    "sequence_truncate": (_sequence_level, _truncate),
    "sequence_mask": (_sequence_level, _mask),
}


def importance_sampling_weights(
    old_per_token_logps: torch.Tensor,
    sampler_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights π_old / π_sampler that correct for sampling with another policy (a stale or differently
    computed one: async rounds, vLLM kernels), the same math as TRL 1.16's vLLM importance-sampling correction.

    Per token `d = (log π_old − log π_sampler) · mask` (NaN sampler logprobs count as `d = 0`); token modes use
    `exp(d)` per token `[B, T]`, sequence modes `exp(Σ_t d)` per completion `[B, 1]`. `*_truncate` clips the ratio
    to `[clip_min, clip_max]`; `*_mask` sets ratios outside it to 0 (that token / sequence is not trained).

    Example: d = [[0.1, 0.2]], clip_max = 1.2 → token_truncate [[1.105, 1.2]], token_mask [[1.105, 0]],
    sequence_truncate [[1.2]], sequence_mask [[0]] (exp(0.3) = 1.35 > 1.2).

    Returns:
        `(weights, per_token_logps_diff)`: weights `[B, T]` or `[B, 1]`, and `d` `[B, T]` for metrics.
    """
    if mode not in IS_MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}; choose one of {tuple(IS_MODES)}")
    diff = (old_per_token_logps - sampler_per_token_logps) * mask  # [B, T]
    diff = torch.nan_to_num(diff, nan=0.0)
    level, bound = IS_MODES[mode]
    return bound(torch.exp(level(diff)), clip_min, clip_max), diff
