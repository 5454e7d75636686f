"""Grouped advantages (seed 003 §5.5), TRL 1.16 `GRPOTrainer` semantics. Pure functions of tensors.

Shapes: `B` rows = prompts × G, `G` generations per prompt, `F` reward functions.
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")
#: how several reward functions become one advantage (TRL 1.16 `multi_objective_aggregation`)
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs (NaN when fewer than 2 values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var)
    return std.squeeze(dim) if dim is not None else std.reshape(())


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over reward functions; a row where every function returned None (NaN) stays NaN.

    rewards_per_func: `[B, F]`, weights: `[F]` → `[B]`.
    """
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # [B]
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)  # [B]
    rewards[unscorable] = torch.nan
    return rewards


def compute_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards (`torch.Tensor` of shape `[B]`): one reward per completion, the G completions of a prompt
            consecutive. NaN marks an unscorable completion: it is left out of its group's statistics and its
            advantage is 0.
        num_generations (`int`): G; `B` must be a multiple of it.
        scale_rewards (`str`, *optional*, defaults to `"group"`): `"group"` divides by the group's unbiased std,
            `"batch"` by the whole batch's, `"none"` does not divide.

    Returns:
        `torch.Tensor` of shape `[B]`: `(r - group mean) / (std + 1e-4)` (no division for `"none"`).

    Example: rewards `[1, 0, 1, 1]`, G = 2 → group means `[0.5, 1]`, group stds `[0.7071, 0]` →
    `[0.7070, -0.7070, 0, 0]`.
    """
    if rewards.dim() != 1:
        raise ValueError(f"compute_advantages: rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"compute_advantages: {rewards.numel()} rewards are not a multiple of num_generations={num_generations}"
        )
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)  # [B/G, G]
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)  # [B]
    advantages = rewards - mean  # [B]
    if scale_rewards == "group":
        std = (
            nanstd(grouped, dim=1).repeat_interleave(num_generations)
            if num_generations > 1
            else torch.zeros_like(rewards)
        )
        advantages = advantages / (std + 1e-4)
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def normalize_then_sum_advantages(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int
) -> torch.Tensor:
    """GDPO advantages (TRL's `multi_objective_aggregation="normalize_then_sum"`): each reward function normalised
    within its group, the weighted sum, then normalised over the whole batch. `scale_rewards` does not apply (as in
    TRL).

    Args:
        rewards_per_func (`torch.Tensor` of shape `[B, F]`): the G completions of a prompt consecutive; NaN = the
            function returned None. A NaN is left out of its function's group statistics and out of the sum; a row
            where every function returned None is left out of the batch statistics and gets advantage 0.
        weights (`torch.Tensor` of shape `[F]`).
        num_generations (`int`): G; `B` must be a multiple of it.

    Returns:
        `torch.Tensor` of shape `[B]`: with `z_f = (r_f - group mean_f) / (group std_f + 1e-4)` and `s = Σ_f w_f z_f`,
        `(s - batch mean(s)) / (batch std(s) + 1e-4)`.

    Example: one function, rewards `[1, 0, 1, 1]`, G = 2 → z `[0.7070, -0.7070, 0, 0]` → batch mean 0, std 0.5773 →
    `[1.2245, -1.2245, 0, 0]`.
    """
    if rewards_per_func.dim() != 2 or rewards_per_func.size(1) != weights.numel():
        raise ValueError(
            f"normalize_then_sum_advantages: rewards_per_func must be [B, F={weights.numel()}], got shape "
            f"{tuple(rewards_per_func.shape)}"
        )
    B, F = rewards_per_func.shape
    if num_generations < 1 or B % num_generations != 0:
        raise ValueError(
            f"normalize_then_sum_advantages: {B} rows are not a multiple of num_generations={num_generations}"
        )
    rewards_per_func = rewards_per_func.float()
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # [B]
    grouped = rewards_per_func.view(-1, num_generations, F)  # [B/G, G, F]
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # [B/G, 1, F]
    std = nanstd(grouped, dim=1).unsqueeze(1) if num_generations > 1 else torch.zeros_like(mean)  # [B/G, 1, F]
    z = ((grouped - mean) / (std + 1e-4)).view(B, F)  # [B, F]
    summed = (z * weights.to(z).unsqueeze(0)).nansum(dim=1)  # [B]
    summed[unscorable] = torch.nan
    batch_std = nanstd(summed).expand_as(summed) if B > 1 else torch.zeros_like(summed)  # [B]
    advantages = (summed - torch.nanmean(summed)) / (batch_std + 1e-4)  # [B]
    return torch.nan_to_num(advantages, nan=0.0)


def aggregate_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Advantages `[B]` of `rewards_per_func` `[B, F]` the way `aggregation` says: `"sum_then_normalize"` (weighted
    sum, then `compute_advantages` with `scale_rewards`) or `"normalize_then_sum"` (`normalize_then_sum_advantages`,
    `scale_rewards` unused)."""
    if aggregation == "sum_then_normalize":
        return compute_advantages(combine_rewards(rewards_per_func, weights), num_generations, scale_rewards)
    if aggregation == "normalize_then_sum":
        return normalize_then_sum_advantages(rewards_per_func, weights, num_generations)
    raise ValueError(f"multi_objective_aggregation must be one of {MULTI_OBJECTIVE_AGGREGATIONS}, got {aggregation!r}")


def group_std_is_zero(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """`[B]` booleans: the completion's group has zero reward spread (it carries no learning signal)."""
    std = nanstd(rewards.float().view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    return torch.isclose(std, torch.zeros_like(std))
