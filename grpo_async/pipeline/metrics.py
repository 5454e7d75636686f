"""Metric windows: what the trainer logs of the values gathered since the last log."""

from __future__ import annotations


def window_summary(window: dict[str, list[float]]) -> dict[str, float]:
    """One value per metric over a logging window: the extreme for `*_max`/`*/max` (and `async/pending`) and
    `*_min`/`*/min` keys, the mean otherwise.

    >>> window_summary({"reward": [0.0, 1.0], "async/staleness_max": [0.0, 2.0], "empty": []})
    {'reward': 0.5, 'async/staleness_max': 2.0}
    """
    out = {}
    for key, values in window.items():
        if not values:
            continue
        if key.endswith(("/max", "_max")) or key == "async/pending":
            out[key] = max(values)
        elif key.endswith(("/min", "_min")):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def loss_metrics(out, batch, version: int, reduce, gather) -> dict[str, float]:
    """What one micro-batch's loss reports, over every process: KL and clipped fractions (means over trained tokens)
    and staleness (`version` − the policy version that sampled each row: min / mean / max).

    Args:
        out (`grpo_async.algo.loss.LossOutput`): the loss's per-token terms `[B, T]`.
        batch (`MicroBatch`): the micro-batch (`loss_mask [B, T]`, `policy_version [B]`).
        version (`int`): the policy version being trained.
        reduce (`Callable`): sum over processes; gather (`Callable`): concatenation over processes.
    """
    import torch

    mask = batch.loss_mask.float()  # [B, T]

    def masked_mean(x):
        totals = reduce(torch.stack([(x * mask).sum(), mask.sum()]).float())
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    m = {}
    if out.per_token_kl is not None:
        m["kl"] = masked_mean(out.per_token_kl.detach())
    low, high = out.is_low_clipped.float(), out.is_high_clipped.float()
    m["clip_ratio/low_mean"] = masked_mean(low)
    m["clip_ratio/high_mean"] = masked_mean(high)
    m["clip_ratio/region_mean"] = masked_mean(torch.maximum(low, high))
    stale = gather((version - batch.policy_version.to(mask.device)).float())  # [B·N]
    m["async/staleness"] = stale.mean().item()
    m["async/staleness_max"] = stale.max().item()
    m["async/staleness_min"] = stale.min().item()
    return m
