"""Grouped advantages (seed 003 §5.5), TRL 1.16 `GRPOTrainer` semantics. Pure functions of tensors.

Shapes: `B` rows = prompts × G, `G` generations per prompt, `F` reward functions.
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")


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


def group_std_is_zero(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """`[B]` booleans: the completion's group has zero reward spread (it carries no learning signal)."""
    std = nanstd(rewards.float().view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    return torch.isclose(std, torch.zeros_like(std))
