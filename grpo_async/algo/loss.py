"""GRPO-family per-token losses and their reductions (TRL 1.16 semantics). Pure functions of tensors.

Shapes: `B` completions in the micro-batch, `T` completion tokens (right-padded). `[B, T']` is `[B, T]` with
`importance_sampling_level="token"` and `[B, 1]` with `"sequence"` (then it broadcasts over the tokens).

```
log_r  = logp - old_logp                                                        # [B, T]
w      = exp(log_r)  (token)   or   exp(Σ_t log_r·m / Σ_t m)  (sequence)        # [B, T']
policy term, by loss type:
  grpo, bnpo, dr_grpo, dapo, luspo:  -min(min(w, δ)·A, clip(w, 1-ε_low, 1+ε_high)·A)    (δ: two-sided clipping)
  cispo:                             -sg[min(w, ε_high)]·A·logp
  sapo:                              -σ(τ·(w - 1))·4/τ·A          (τ = τ_pos if A > 0 else τ_neg)
  vespo:                             -sg[φ(w_seq)]·A·logp          (φ: gamma weights, `gamma_weights`)
loss_t = policy · off-policy mask [B, 1] · entropy mask [B, T] · IS weights (not vespo) + β·kl·(w if bias-corrected)
loss   = LOSS_SPECS[loss_type].reduce(loss_t, mask), scaled to one accumulation window (one `LossSpec` per type)
```
"""

from __future__ import annotations

import dataclasses
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
        num_items_in_batch: loss tokens in the whole generation round across all processes (`dapo`, `cispo`,
            `vespo`).
        num_processes: training processes.
        steps_per_generation: micro-steps one generation round is split into.
        micro_batch_rows, micro_batch_tokens: rows and loss tokens of the whole micro-batch when the loss is
            computed on one slice of it at a time (`token_budget`, `algo.token_budget`); `None`: the rows given are
            the micro-batch. The per-micro-batch normalisers (`grpo`, `bnpo`, `dr_grpo`, `sapo`, `luspo`) use them,
            so the slices' losses sum to the micro-batch's.
    """

    grad_accum_steps: int = 1
    max_completion_length: int = 1
    num_items_in_batch: float | torch.Tensor | None = None
    num_processes: int = 1
    steps_per_generation: int = 1
    micro_batch_rows: int | None = None
    micro_batch_tokens: float | None = None


@dataclass(frozen=True)
class LossSettings:
    """The loss's knobs, with TRL 1.16's names (`epsilon_low` is TRL's `epsilon`) and defaults."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None  # two-sided clipping: the ratio is capped at δ (INTELLECT-2)
    importance_sampling_level: str = "token"  # "token" or "sequence" (GSPO)
    use_bias_correction_kl: bool = True  # KL term × the ratio w (DeepSeek-V3.2)
    off_policy_mask_threshold: float | None = None  # drop A < 0 sequences whose mean KL(π_sampler‖π) exceeds it
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @classmethod
    def from_config(cls, args) -> LossSettings:
        """The knobs of a `GRPOConfig` (or TRL's: the same field names)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"epsilon_low"}
        return cls(epsilon_low=args.epsilon, **{n: getattr(args, n) for n in names})


# ---------------------------------------------------------------------------------------------- reductions
# Each returns the loss of the micro-batch before gradient accumulation is accounted for, except the global token
# mean, whose normaliser already spans one accumulation window (`LossSpec.per_window`).
def _seq_mean_then_mean(x: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    # grpo, sapo: average each sequence over its own tokens, then over sequences
    per_sequence = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # [B]
    return per_sequence.mean() if ctx.micro_batch_rows is None else per_sequence.sum() / ctx.micro_batch_rows


def _token_mean(x: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    # bnpo: average over all tokens of the micro-batch
    tokens = mask.sum() if ctx.micro_batch_tokens is None else torch.as_tensor(ctx.micro_batch_tokens)
    return (x * mask).sum() / tokens.clamp(min=1.0)


def _fixed_length(x: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    # dr_grpo: sum over tokens / (B · max_completion_length)
    rows = x.size(0) if ctx.micro_batch_rows is None else ctx.micro_batch_rows
    return (x * mask).sum() / (rows * ctx.max_completion_length)


def _global_token_mean(x: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    # dapo, cispo, vespo: sum over tokens / (tokens of the round per process, rescaled to one accumulation window)
    if ctx.num_items_in_batch is None:
        raise ValueError("this loss_type needs num_items_in_batch (loss tokens of the generation round)")
    n = torch.as_tensor(ctx.num_items_in_batch, dtype=x.dtype, device=x.device).clamp(min=1.0)
    normaliser = n / ctx.num_processes * ctx.grad_accum_steps / ctx.steps_per_generation
    return (x * mask).sum() / normaliser


def _seq_sum_then_mean(x: torch.Tensor, mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    # luspo: each sequence's loss summed over its tokens (a [B, 1] loss is scaled by the length), mean over sequences
    per_sequence = (x * mask).sum(-1)  # [B]
    return per_sequence.mean() if ctx.micro_batch_rows is None else per_sequence.sum() / ctx.micro_batch_rows


# ---------------------------------------------------------------------------------------------- per-token terms
def _clipped_surrogate(ratio, advantages, logps, log_ratio, mask, weights, s) -> dict:
    # grpo, bnpo, dr_grpo, dapo, luspo: -min(min(w, δ)·A, clip(w, 1-ε_low, 1+ε_high)·A)
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)  # [B, T']
    if s.delta is not None:
        ratio = torch.clamp(ratio, max=s.delta)
    return {
        "per_token_loss": -torch.min(ratio * advantages, clipped * advantages),  # [B, T']
        "ratio": ratio,
        "is_low_clipped": (ratio < 1 - s.epsilon_low) & (advantages < 0),
        "is_high_clipped": (ratio > 1 + s.epsilon_high) & (advantages > 0),
    }


def _cispo(ratio, advantages, logps, log_ratio, mask, weights, s) -> dict:
    return {
        "per_token_loss": -torch.clamp(ratio, max=s.epsilon_high).detach() * advantages * logps,  # [B, T]
        "cispo_clipped": (ratio > s.epsilon_high) & (advantages > 0),
    }


def _sapo(ratio, advantages, logps, log_ratio, mask, weights, s) -> dict:
    tau = torch.where(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
    return {"per_token_loss": -(torch.sigmoid(tau * (ratio - 1)) * 4 / tau) * advantages}  # [B, T']


def _vespo(ratio, advantages, logps, log_ratio, mask, weights, s) -> dict:
    k = (s.vespo_k_pos, s.vespo_lambda_pos, s.vespo_k_neg, s.vespo_lambda_neg)
    phi_seq = gamma_weights(advantages, log_ratio, mask, weights, *k)  # [B, 1]
    return {"per_token_loss": -phi_seq * advantages * logps, "phi_seq": phi_seq}  # [B, T]


@dataclass(frozen=True)
class LossSpec:
    """One loss type, everything about it in one entry of `LOSS_SPECS` (a new loss type is one entry here).

    - `term(ratio, advantages, logps, log_ratio, mask, importance_weights, settings) -> dict`: the per-token policy
      loss (`"per_token_loss"`), and optionally a changed `"ratio"` and the `LossOutput` metric tensors it defines
      (`is_low_clipped` / `is_high_clipped`, `cispo_clipped`, `phi_seq`).
    - `reduce(per_token_loss, mask, ctx)`: the normaliser (`[B, T] → []`).
    - `per_window`: the normaliser already spans one accumulation window (no division by its steps).
    - `token_summed`: it sums token terms, so a sequence-level ratio weights each sequence by its length (TRL's
      warning).
    - `folds_importance_weights`: the importance-sampling weights enter its term, not multiplied into the loss.
    """

    term: Callable[..., dict]
    reduce: Callable[[torch.Tensor, torch.Tensor, LossContext], torch.Tensor]
    per_window: bool = False
    token_summed: bool = False
    folds_importance_weights: bool = False


LOSS_SPECS: dict[str, LossSpec] = {
    "grpo": LossSpec(_clipped_surrogate, _seq_mean_then_mean),
    "bnpo": LossSpec(_clipped_surrogate, _token_mean, token_summed=True),
    "dr_grpo": LossSpec(_clipped_surrogate, _fixed_length, token_summed=True),
    "dapo": LossSpec(_clipped_surrogate, _global_token_mean, per_window=True, token_summed=True),
    "cispo": LossSpec(_cispo, _global_token_mean, per_window=True, token_summed=True),
    "sapo": LossSpec(_sapo, _seq_mean_then_mean),
    "luspo": LossSpec(_clipped_surrogate, _seq_sum_then_mean),
    "vespo": LossSpec(_vespo, _global_token_mean, per_window=True, folds_importance_weights=True),
}
REDUCTIONS = {name: spec.reduce for name, spec in LOSS_SPECS.items()}
#: loss types whose normaliser is the micro-batch's own token count: which rows share a micro-batch changes the
#: gradient (every other loss type's micro-batch losses sum to the same step loss however the rows are dealt)
MICRO_BATCH_NORMALISED_LOSS_TYPES = tuple(name for name, spec in LOSS_SPECS.items() if spec.reduce is _token_mean)
LOSS_TYPES = tuple(LOSS_SPECS)
#: loss types with the clipped surrogate `-min(w·A, clip(w)·A)` (clip_ratio/* metrics)
CLIPPED_LOSS_TYPES = tuple(name for name, spec in LOSS_SPECS.items() if spec.term is _clipped_surrogate)
#: loss types that sum token terms, so a sequence-level ratio weights each sequence by its length
TOKEN_SUMMED_LOSS_TYPES = tuple(name for name, spec in LOSS_SPECS.items() if spec.token_summed)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def combination_warnings(loss_type: str, importance_sampling_level: str) -> list[str]:
    """TRL 1.16's warnings (its texts, verbatim) about known-bad combinations of `loss_type` and
    `importance_sampling_level`."""
    out = []
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        out.append(
            "When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to mirror the "
            "paper's setup."
        )
    if loss_type == "vespo" and importance_sampling_level != "token":
        out.append(
            "VESPO computes sequence-level importance weights internally. `importance_sampling_level` should be "
            "set to `'token'` (the default)."
        )
    if importance_sampling_level == "sequence" and loss_type in TOKEN_SUMMED_LOSS_TYPES:
        out.append(
            f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums per-token "
            "contributions, which effectively weights each sequence by its completion length instead of "
            "optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'` "
            "(see https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-policy-optimization)."
        )
    return out


@dataclass
class LossOutput:
    loss: torch.Tensor  # [] scaled for gradient accumulation
    policy_loss: torch.Tensor  # [] detached, the reduced loss before gradient-accumulation scaling (TRL's metric)
    per_token_loss: torch.Tensor  # [B, T] (or [B, 1]: a sequence-level loss with nothing per token added)
    ratio: torch.Tensor  # [B, T'] the importance ratio w (after two-sided clipping)
    per_token_kl: torch.Tensor | None  # [B, T] (β > 0; × w when bias-corrected)
    is_low_clipped: torch.Tensor | None = None  # [B, T'] bool (clipped loss types)
    is_high_clipped: torch.Tensor | None = None  # [B, T'] bool (clipped loss types)
    cispo_clipped: torch.Tensor | None = None  # [B, T'] bool (cispo: w > ε_high with A > 0)
    phi_seq: torch.Tensor | None = None  # [B, 1] (vespo: the gamma weights)
    off_policy_mask: torch.Tensor | None = None  # [B, 1] 1 = kept (off_policy_mask_threshold)


def k3_kl(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π_θ || π_ref), per token: `exp(r - p) - (r - p) - 1`. [B, T] → [B, T]."""
    d = ref_per_token_logps - per_token_logps
    return torch.exp(d) - d - 1


def off_policy_mask(
    advantages: torch.Tensor,
    per_token_logps: torch.Tensor,
    rollout_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Off-policy sequence mask (DeepSeek-V3.2, TRL's `get_off_policy_mask`): keep a sequence when A ≥ 0 or its mean
    per-token KL `log π_sampler − log π_θ` over the masked tokens is at most `threshold` (NaN tokens count 0).

    advantages `[B, 1]`, logps `[B, T]`, mask `[B, T]` → `[B, 1]` of 1.0 (kept) / 0.0 (dropped), in `mask`'s dtype.
    """
    kl = torch.nan_to_num(rollout_per_token_logps - per_token_logps.detach(), nan=0.0)  # [B, T]
    avg_seq_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)  # [B, 1]
    return ((advantages >= 0) | (avg_seq_kl <= threshold)).to(dtype=mask.dtype)


@torch.no_grad()
def gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    importance_weights: torch.Tensor | None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's gamma weights φ(w) = e^λ · w^k · e^{−λw} (φ(1) = 1) of the sequence ratio w = Π_t π/π_old (times the
    token-level IS weights π_old/π_sampler when given), computed in log space, without gradient (TRL's
    `get_gamma_weights`). k, λ by the sign of A (A ≥ 0: pos).

    advantages `[B, 1]`, log_ratio `[B, T]` (log π − log π_old), mask `[B, T]`, importance_weights `[B, T]` → `[B, 1]`.
    """
    lower = math.log(1e-8)
    seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)  # [B, 1]
    if importance_weights is not None:
        seq_log_ratio += torch.sum(torch.clamp(torch.log(importance_weights), lower, 20.0), dim=-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, lower, 20.0)  # [B, 1]
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # [B, 1]


def _importance_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """w: `exp(log_ratio)` per token `[B, T]`, or the exp of its masked mean per sequence `[B, 1]` (GSPO)."""
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        return torch.exp(((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1))
    raise ValueError(f"Unknown importance_sampling_level {level!r}; choose one of {IMPORTANCE_SAMPLING_LEVELS}")


def grpo_loss(
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    settings: LossSettings | None = None,
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    rollout_per_token_logps: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
    ctx: LossContext | None = None,
    **knobs,
) -> LossOutput:
    """The GRPO family's policy loss (TRL 1.16's `_compute_loss` without the forward pass, entropy bonus and MoE
    auxiliary loss).

    Args:
        per_token_logps (`[B, T]`): log π_θ of the completion tokens (with gradient).
        advantages (`[B]` or `[B, T]`): one advantage per completion (or per token).
        mask (`[B, T]`): 1 for tokens that are trained on (the loss mask, not the attention mask).
        settings (`LossSettings`): the knobs; `**knobs` (e.g. `loss_type="bnpo", beta=0.04`) replace its fields.
        old_per_token_logps (`[B, T]`, *optional*): log π_old; `None` means π_old = π_θ (detached), ratio = 1.
        ref_per_token_logps (`[B, T]`, *optional*): log π_ref, required when `beta > 0`.
        importance_weights (`[B, T]` or `[B, 1]`, *optional*): π_old / π_sampler correction, multiplied into the
            loss (vespo: folded into its gamma weights; token-level only).
        rollout_per_token_logps (`[B, T]`, *optional*): the generation engine's logps, for the off-policy mask
            (else π_old).
        token_mask (`[B, T]`, *optional*): tokens whose policy term is kept (the high-entropy mask).
        ctx (`LossContext`): normalisation scalars.
    """
    s = dataclasses.replace(settings or LossSettings(), **knobs)
    if s.loss_type not in LOSS_SPECS:
        raise ValueError(f"Unknown loss_type {s.loss_type!r}; choose one of {LOSS_TYPES}")
    ctx = ctx or LossContext()
    mask = mask.to(per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # [B, 1]
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    keep = None
    if s.off_policy_mask_threshold is not None:
        sampled = old if rollout_per_token_logps is None else rollout_per_token_logps
        keep = off_policy_mask(advantages, per_token_logps, sampled, mask, s.off_policy_mask_threshold)  # [B, 1]
    log_ratio = per_token_logps - old  # [B, T]
    ratio = _importance_ratio(log_ratio, mask, s.importance_sampling_level)  # [B, T']

    per_token_kl = None
    if s.beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta > 0 needs ref_per_token_logps")
        per_token_kl = k3_kl(per_token_logps, ref_per_token_logps)  # [B, T]
        if s.use_bias_correction_kl:
            per_token_kl = per_token_kl * ratio  # [B, T]

    spec = LOSS_SPECS[s.loss_type]
    term = spec.term(ratio, advantages, per_token_logps, log_ratio, mask, importance_weights, s)
    per_token_loss, ratio = term.pop("per_token_loss"), term.pop("ratio", ratio)

    if keep is not None:
        per_token_loss = per_token_loss * keep
    if token_mask is not None:
        per_token_loss = per_token_loss * token_mask
    if importance_weights is not None and not spec.folds_importance_weights:
        per_token_loss = per_token_loss * importance_weights
    if per_token_kl is not None:
        per_token_loss = per_token_loss + s.beta * per_token_kl
    loss = spec.reduce(per_token_loss, mask, ctx)
    policy_loss = loss.detach()
    if not spec.per_window:
        loss = loss / ctx.grad_accum_steps
    return LossOutput(
        loss=loss,
        policy_loss=policy_loss,
        per_token_loss=per_token_loss,
        ratio=ratio,
        per_token_kl=per_token_kl,
        **term,  # the loss type's metric tensors (is_low_clipped, is_high_clipped, cispo_clipped, phi_seq)
        off_policy_mask=keep,
    )


def mean_entropy(
    entropies: torch.Tensor, mask: torch.Tensor, grad_accum_steps: int = 1, tokens: float | None = None
) -> torch.Tensor:
    """The entropy bonus's H: mean per-token entropy over `mask`'s tokens `[B, T]`, scaled for gradient accumulation
    only (never by a loss type's normaliser, as in TRL); `tokens`: the whole micro-batch's count when `mask` covers
    a slice of it (`token_budget`). Returns `[]`."""
    n = mask.sum() if tokens is None else torch.as_tensor(tokens, dtype=mask.dtype, device=mask.device)
    return (entropies * mask).sum() / n.clamp(min=1.0) / grad_accum_steps


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
    rollout_per_token_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights π_old / π_sampler that correct for sampling with another policy (a stale or differently
    computed one: async rounds, vLLM kernels), the same math as TRL 1.16's vLLM importance-sampling correction.

    Per token `d = (log π_old − log π_sampler) · mask` (NaN rollout logprobs count as `d = 0`); token modes use
    `exp(d)` per token `[B, T]`, sequence modes `exp(Σ_t d)` per completion `[B, 1]`. `*_truncate` clips the ratio
    to `[clip_min, clip_max]`; `*_mask` sets ratios outside it to 0 (that token / sequence is not trained).

    Example: d = [[0.1, 0.2]], clip_max = 1.2 → token_truncate [[1.105, 1.2]], token_mask [[1.105, 0]],
    sequence_truncate [[1.2]], sequence_mask [[0]] (exp(0.3) = 1.35 > 1.2).

    Returns:
        `(weights, per_token_logps_diff)`: weights `[B, T]` or `[B, 1]`, and `d` `[B, T]` for metrics.
    """
    if mode not in IS_MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}; choose one of {tuple(IS_MODES)}")
    diff = (old_per_token_logps - rollout_per_token_logps) * mask  # [B, T]
    diff = torch.nan_to_num(diff, nan=0.0)
    level, bound = IS_MODES[mode]
    return bound(torch.exp(level(diff)), clip_min, clip_max), diff


def importance_sampling_outside(
    diff: torch.Tensor, mode: str, clip_min: float | None = None, clip_max: float | None = 3.0
) -> torch.Tensor:
    """Where the importance ratio of `diff` (`importance_sampling_weights`' second output `[B, T]`) falls outside
    `[clip_min, clip_max]`: the tokens (`[B, T]`) or completions (`[B, 1]`) that `*_mask` modes zero and
    `*_truncate` modes clip. Example: d = [[0.1, 0.2]], clip_max = 1.2 → token modes [[False, False]], sequence
    modes [[True]] (exp(0.3) = 1.35)."""
    level, _ = IS_MODES[mode]
    ratio = torch.exp(level(diff))  # [B, T] or [B, 1]
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return (ratio < low) | (ratio > high)


def importance_sampling_stats(
    weights: torch.Tensor,
    diff: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One process's sums behind the importance-sampling metrics (`pipeline.metrics.importance_sampling_metrics`
    names them), from `importance_sampling_weights`' `(weights [B, T] or [B, 1], diff [B, T])` over `mask [B, T]`:
    `stats [6]` = Σ|d|, the token count, max |d|, Σ k3 (`exp(d) − 1 − d`, the k3 estimate of KL(sampler ‖ π_old)),
    the tokens (or completions in sequence modes) whose ratio fell outside the clip range, the tokens (completions)
    that count; `ratios [4]` = min, Σ, count, max of the weights that count (±inf, 0 when none does)."""
    outside = importance_sampling_outside(diff, mode, clip_min, clip_max)  # [B, T] or [B, 1]
    on = mask.bool() if weights.size(1) > 1 else mask.bool().any(1, keepdim=True)  # tokens / completions that count
    d, w = diff[mask.bool()].float(), weights[on].float()
    k3 = torch.expm1(d) - d  # [n] ≥ 0
    stats = torch.tensor(
        [
            float(d.abs().sum()),
            float(d.numel()),
            float(d.abs().max()) if d.numel() else 0.0,
            float(k3.sum()),
            float(outside[on].sum()),
            float(on.sum()),
        ]
    )
    empty = w.numel() == 0  # every token of this process's rows is masked
    extremes = (
        [math.inf, 0.0, 0.0, -math.inf] if empty else [float(w.min()), float(w.sum()), w.numel(), float(w.max())]
    )
    return stats, torch.tensor(extremes, dtype=torch.float32)
