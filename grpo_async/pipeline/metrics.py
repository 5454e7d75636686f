"""Metric windows: what the trainer logs of the values gathered since the last log."""

from __future__ import annotations

from collections import defaultdict

from .staleness import staleness

#: a round's metric that is not logged as it is: the prompt + completion tokens of the round (every rank's rows);
#: the trainer adds it to `state.num_input_tokens_seen` and logs that running total as TRL's `num_tokens`
ROUND_TOKENS = "round_tokens"


def terminated_length_metrics(lengths: list[float], truncated: list[bool]) -> dict[str, float]:
    """TRL 1.16's `completions/{mean,min,max}_terminated_length`: the lengths of the completions that ended on their
    own (not cut by a token limit); all three are 0 when every completion was cut (as TRL).

    >>> terminated_length_metrics([3.0, 8.0, 5.0], [False, True, False])
    {'completions/mean_terminated_length': 4.0, 'completions/min_terminated_length': 3.0, \
'completions/max_terminated_length': 5.0}
    >>> terminated_length_metrics([8.0], [True])["completions/max_terminated_length"]
    0.0
    """
    if len(lengths) != len(truncated):
        raise ValueError(f"terminated_length_metrics: {len(lengths)} lengths but {len(truncated)} truncated flags")
    ended = [float(n) for n, cut in zip(lengths, truncated, strict=True) if not cut] or [0.0]
    return {
        "completions/mean_terminated_length": sum(ended) / len(ended),
        "completions/min_terminated_length": min(ended),
        "completions/max_terminated_length": max(ended),
    }


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


def importance_sampling_metrics(stats, ratios) -> dict[str, float]:
    """TRL's `sampling/importance_sampling_ratio/{min,mean,max}` and `sampling/logp_diff/{mean,max}`, with
    `sampling/kl` (k3 estimate of KL(sampler ‖ π_old) over the sampled tokens) and `sampling/masked_fraction` (the
    tokens, or completions in sequence modes, whose ratio fell outside the clip range: zeroed by `*_mask` modes,
    clipped by `*_truncate` ones), from every process's `algo.loss.importance_sampling_stats`: `stats [N, 6]`,
    `ratios [N, 4]`."""
    n_tokens = stats[:, 1].sum().clamp(min=1)
    return {
        "sampling/logp_diff/mean": (stats[:, 0].sum() / n_tokens).item(),
        "sampling/logp_diff/max": stats[:, 2].max().item(),
        "sampling/kl": (stats[:, 3].sum() / n_tokens).item(),
        "sampling/masked_fraction": (stats[:, 4].sum() / stats[:, 5].sum().clamp(min=1)).item(),
        "sampling/importance_sampling_ratio/min": ratios[:, 0].min().item(),
        "sampling/importance_sampling_ratio/mean": (ratios[:, 1].sum() / ratios[:, 2].sum()).item(),
        "sampling/importance_sampling_ratio/max": ratios[:, 3].max().item(),
    }


def loss_metrics(out, batch, version: int, collectives) -> dict[str, float]:
    """What one micro-batch's loss reports over every process, with TRL 1.16's names: `kl`, `entropy` (means over
    trained tokens), `clip_ratio/{low,high,region}_mean`, `clip_ratio/low_min`, `clip_ratio/high_max` (clipped loss
    types), `cispo_clip_ratio`, `vespo/phi_seq_mean`, `policy_loss` and `entropy_coef` (entropy bonus on),
    `aux_loss` (MoE), and staleness (`version` − the policy version that sampled each row: min / mean / max; per
    trained token, `async/token_staleness`, and `async/tokens_after_weight_load`, the fraction of trained tokens
    sampled with newer weights than their row's first token: in-flight weight updates).

    A sequence-level term (`[B, 1]`) is averaged over sequences, a token-level one (`[B, T]`) over trained tokens.

    Args:
        out (`grpo_async.algo.objective.ObjectiveOutput`): the loss and its terms.
        batch (`MicroBatch`): the micro-batch (`loss_mask [B, T]`, `policy_version [B]`).
        version (`int`): the policy version being trained.
        collectives (`grpo_async.algo.objective.Collectives`): the sum and the concatenation over processes.
    """
    import torch

    mask = batch.loss_mask.float()  # [B, T]

    def masked_mean(x):  # TRL's global_masked_mean
        if x.shape[1] == 1:  # one value per sequence
            local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), dtype=x.dtype, device=x.device)])
        else:
            m = mask.to(x.dtype)
            local = torch.stack([(x * m).sum(), m.sum()])
        totals = collectives.reduce_sum(local)
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def seq_means(x):  # TRL's masked_seq_mean, gathered: [B·N], NaN for rows without trained tokens
        return collectives.gather_tensor(x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1))

    def nan_extreme(x, fn):
        x = x[~torch.isnan(x)]
        return fn(x).item() if x.numel() else float("nan")

    terms = out.terms
    m = {}
    if terms.per_token_kl is not None:
        m["kl"] = masked_mean(terms.per_token_kl.detach())
    if out.entropies is not None:
        m["entropy"] = masked_mean(out.entropies.detach())
    if terms.is_low_clipped is not None:
        low, high = terms.is_low_clipped.float(), terms.is_high_clipped.float()
        m["clip_ratio/low_mean"] = masked_mean(low)
        m["clip_ratio/high_mean"] = masked_mean(high)
        m["clip_ratio/region_mean"] = masked_mean(torch.maximum(low, high))
        m["clip_ratio/low_min"] = nan_extreme(seq_means(low), torch.min)
        m["clip_ratio/high_max"] = nan_extreme(seq_means(high), torch.max)
    elif terms.cispo_clipped is not None:
        m["cispo_clip_ratio"] = masked_mean(terms.cispo_clipped.float())
    elif terms.phi_seq is not None:
        m["vespo/phi_seq_mean"] = masked_mean(terms.phi_seq)
    if out.entropy_bonus:
        m["policy_loss"] = collectives.gather_tensor(terms.policy_loss.reshape(1)).nanmean().item()
    if out.entropy_coef is not None:
        m["entropy_coef"] = out.entropy_coef
    if out.aux_loss is not None:
        m["aux_loss"] = collectives.gather_tensor(out.aux_loss.detach().reshape(1)).mean().item()
    if out.importance_stats is not None:  # the objective weighed the micro-batch (`InForwardImportanceSampling`)
        stats, ratios = (collectives.gather_tensor(t.to(mask.device)).cpu() for t in out.importance_stats)
        m.update(importance_sampling_metrics(stats.view(-1, 6), ratios.view(-1, 4)))
    stale = collectives.gather_tensor(staleness(version, batch.policy_version.to(mask.device)).float())  # [B·N]
    m["async/staleness"] = stale.mean().item()
    m["async/staleness_max"] = stale.max().item()
    m["async/staleness_min"] = stale.min().item()
    if batch.token_version is not None:  # the version of each token's weights (in-flight loads: newer than the row's)
        token_version = batch.token_version.to(mask.device)  # [B, T]
        token_stale = staleness(version, token_version).float()  # [B, T]
        after_load = (token_version > batch.policy_version.to(mask.device)[:, None]).float()  # [B, T]
        local = torch.stack([(token_stale * mask).sum(), (after_load * mask).sum(), mask.sum()])
        totals = collectives.reduce_sum(local)  # one collective for both metrics
        m["async/token_staleness"] = (totals[0] / totals[2].clamp(min=1.0)).item()
        m["async/tokens_after_weight_load"] = (totals[1] / totals[2].clamp(min=1.0)).item()
    return m


class MetricWindows:
    """The trainer's metrics since its last log, per mode (`"train"`, `"eval"`; TRL's `_metrics`), and the timings of
    the `training_step` calls of the optimizer step in progress.

    ```txt
    training_step 1 .. GA of one optimizer step:  [wait for the round][compute]  [wait][compute]  ...
      step_time          = Σ (wait + compute)        (TRL's: the whole training_step calls)
      timing/train_step  = Σ compute                 (and perf/* of the throughput meter over that time)
    ```
    """

    def __init__(self):
        self.windows: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.step_s = self.compute_s = 0.0  # of the optimizer step in progress

    def record(self, key: str, value: float, mode: str = "train") -> None:
        self.windows[mode][key].append(value)

    def record_all(self, metrics: dict[str, float], mode: str = "train") -> None:
        for k, v in metrics.items():
            self.windows[mode][k].append(v)

    def set_total(self, key: str, value: float) -> None:
        """A running total (TRL's `num_tokens`): the window holds its latest value only."""
        self.windows["train"][key] = [float(value)]

    def add_call(self, seconds: float, waited: float) -> None:
        """One `training_step` call took `seconds`, `waited` of them for its round."""
        self.step_s += seconds
        self.compute_s += seconds - waited

    def end_step(self, throughput) -> None:
        """The optimizer step is complete: record its timings (and `throughput.step(compute)`), start the next."""
        self.record("timing/train_step", self.compute_s)
        self.record_all(throughput.step(self.compute_s))  # perf/train_tokens_per_second, ...
        self.record("step_time", self.step_s)
        self.step_s = self.compute_s = 0.0

    def pop(self, mode: str) -> dict[str, float]:
        """The window's summary (`window_summary`, NaN values left out); the window starts again empty."""
        out = {k: v for k, v in window_summary(self.windows[mode]).items() if not (isinstance(v, float) and v != v)}
        self.windows[mode].clear()
        return out
