"""The training objective around the pure loss (`algo.loss.grpo_loss`), TRL 1.16's `_compute_loss` after the forward
pass: the high-entropy token mask (a quantile over every process's tokens), the entropy bonus with its static or
adaptive coefficient, and the MoE load-balancing loss. Collectives come in as one object (`Collectives`); the only
state, the adaptive entropy coefficient, has `state_dict` / `load_state_dict` for checkpoints.

```txt
TokenScores(logps [B, T], entropies [B, T], aux_loss [])  +  micro-batch (advantages, masks, old/ref/rollout logps)
   ─▶ entropy mask [B, T] (top_entropy_quantile < 1: entropy ≥ the (1 − ρ)-quantile of all processes' tokens)
   ─▶ IS weights π_old / π_sampler [B, T] or [B, 1], π_old = logps.detach()   (`InForwardImportanceSampling`)
   ─▶ grpo_loss(...)                                        policy loss, scaled for gradient accumulation
   ─▶ − coef · mean entropy over the (entropy-masked) tokens / GA        (entropy_coef ≠ 0 or use_adaptive_entropy)
   ─▶ + router_aux_loss_coef · aux_loss / GA                             (MoE models, as TRL)
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from .loss import (
    LossContext,
    LossOutput,
    LossSettings,
    grpo_loss,
    importance_sampling_stats,
    importance_sampling_weights,
    mean_entropy,
)
from .sampling_support import TruncationFilter


class Collectives(Protocol):
    """What the objective does across the training processes. Training passes the pipeline's one
    `AcceleratorCollectives` (`grpo_async/pipeline/collectives.py`); a single process (evaluation, tests)
    `SingleProcess()`. Tensors come back on the device they were given on."""

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the processes."""
        ...

    def gather_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Every process's `t`, concatenated along dim 0 in rank order."""
        ...

    def pad_across_processes(self, t: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        """`t` padded with `pad_index` along `dim` to the longest process's length (accelerate's signature)."""
        ...


class SingleProcess:
    """The `Collectives` of one process: every call is the identity."""

    num_processes, process_index = 1, 0

    def reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather_tensor(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def pad_across_processes(self, t: torch.Tensor, dim: int = 0, pad_index: float = 0) -> torch.Tensor:
        return t


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float, ops: Collectives) -> torch.Tensor:
    """Tokens whose entropy is at least the `threshold`-quantile of the entropies of every process's masked tokens
    (TRL's `get_high_entropy_mask`; `threshold = 1 − top_entropy_quantile`).

    Every process pads its masked entropies to the longest process's count with a negative sentinel (entropies are
    ≥ 0), gathers them all and drops the sentinel, so each process computes the quantile of the same values and gets
    the same threshold. entropies `[B, T]`, mask `[B, T]` → `[B, T]` bool (never true at masked tokens).
    """
    local = entropies[mask.bool()].detach().float()  # [n] this process's tokens
    sentinel = -1e9
    gathered = ops.gather_tensor(ops.pad_across_processes(local, dim=0, pad_index=sentinel))  # [N · max n]
    gathered = gathered[gathered != sentinel]
    if gathered.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    cut = torch.quantile(gathered, threshold)
    return ((entropies * mask.float()) >= cut) & mask.bool()


class EntropyController:
    """The entropy bonus's coefficient (TRL 1.16): static, or adaptive (Skywork-OR1) when `adaptive`.

    Adaptive: at the end of each accumulation window the window's mean entropy H over every process's (entropy-
    masked) tokens moves the coefficient by `delta` towards more bonus when H ≤ `target`, less otherwise, within
    [`coef_min`, `coef_max`]; the next window applies it only if H ≤ `target` (nothing before the first measurement).

    Example: target 0.2, delta 0.005, coef 0.01: a window with H = 0.1 → coef 0.015, applied next window; then a
    window with H = 0.5 → coef 0.01, and the next window applies 0.
    """

    def __init__(
        self,
        coef: float = 0.0,
        *,
        adaptive: bool = False,
        coef_min: float = 0.0,
        coef_max: float = 1.0,
        delta: float = 0.005,
        target: float = 0.2,
    ):
        self.coef, self.adaptive = coef, adaptive
        self.coef_min, self.coef_max, self.delta, self.target = coef_min, coef_max, delta, target
        self.enabled = coef != 0.0 or adaptive  # fixed for the run: an adaptive coef can come back from 0
        self.last_world_entropy = math.inf  # no measurement yet
        self._window: torch.Tensor | None = None  # [2] Σ entropy, tokens of this window so far (this process)

    def applied_coef(self) -> float:
        """The coefficient this window's micro-batches apply (the same for all of them)."""
        if self.adaptive:
            return self.coef if self.last_world_entropy <= self.target else 0.0
        return self.coef

    def observe(self, entropy_sum: torch.Tensor, tokens: torch.Tensor, end_of_window: bool, reduce_sum) -> None:
        """Add one micro-batch's entropy total and token count; at the window's end (every process at once) update
        the coefficient from the window's mean over every process."""
        if not self.adaptive:
            return
        stats = torch.stack([entropy_sum.detach(), tokens.detach()]).float()  # [2]
        self._window = stats if self._window is None else self._window + stats
        if not end_of_window:
            return
        totals = reduce_sum(self._window)
        world = (totals[0] / totals[1].clamp(min=1.0)).item()
        if world <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_world_entropy = world
        self._window = None

    def state_dict(self) -> dict:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_world_entropy}

    def load_state_dict(self, state: dict) -> None:
        """Restore the adaptive state (as TRL, only in adaptive mode: a static coef is the config's)."""
        if self.adaptive and state:
            self.coef = float(state["entropy_coef"])
            last = state["last_world_entropy"]  # null in a strict-JSON checkpoint: no measurement yet
            self.last_world_entropy = math.inf if last is None else float(last)


def router_aux_settings(model_config, coef: float | None) -> tuple[float, tuple[int, int] | None]:
    """TRL's MoE load-balancing loss rule: `(coefficient, (num_experts, top_k))`, or `(0.0, None)` when off.

    On when the model's (text) config has `output_router_logits` (a Mixture-of-Experts model that can return its
    router logits) and the coefficient is not 0; `coef=None` takes the config's `router_aux_loss_coef` (0 if none).
    A coefficient set for a model without router logits is an error.
    """
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    moe = hasattr(text, "output_router_logits")
    if coef and not moe:
        raise ValueError(
            f"GRPOConfig.router_aux_loss_coef={coef}: {type(text).__name__} is not a Mixture-of-Experts model that "
            "returns its router logits, so there is no auxiliary loss to weight; leave it None"
        )
    value = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    if not moe or not value:
        return 0.0, None
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    if not experts or not top_k:
        raise ValueError(
            f"GRPOConfig.router_aux_loss_coef: the load-balancing loss needs the number of experts and experts per "
            f"token, but {type(text).__name__} has no num_experts / num_local_experts or num_experts_per_tok; set "
            "router_aux_loss_coef=0.0 to train without it"
        )
    return float(value), (int(experts), int(top_k))


@dataclass(frozen=True)
class InForwardImportanceSampling:
    """Importance sampling (`GRPOConfig.importance_sampling_correction`) with π_old taken from the training forward
    itself (its log-probs, detached) instead of a no-grad pass over the round before it is trained (the consumer's).

    Exact where π_old is the policy that trains the row: the policy does not move before the round's last micro-batch
    is trained (`num_iterations == 1`, one optimizer step per round), so every micro-batch of the round sees the same
    weights a separate pass would have. Not used where π_old is needed for more than the ratio: its mass on a
    vocabulary the sampler cut (`importance_sampling_support_replay` with top-k / top-p / min-p or banned tokens:
    the consumer measures it in its pass) or router replay's routing statistics. TRL 1.16 scores π_old in a pass of
    its own whenever its vLLM importance sampling is on (`_generate_and_score_completions`); this skips it: the same
    weights, the same rows, one forward fewer per row.
    """

    mode: str
    clip_min: float | None
    clip_max: float | None

    @classmethod
    def from_config(cls, a, never_sampled: tuple[int, ...] = ()) -> InForwardImportanceSampling | None:
        """From a `GRPOConfig`, or None where the consumer's π_old pass is needed (or importance sampling is off);
        `never_sampled`: the tokens no backend samples (a vision-language model's image placeholders)."""
        if not a.importance_sampling_correction:
            return None
        if a.num_iterations > 1 or a.steps_per_generation > a.gradient_accumulation_steps:
            return None  # the policy moves before the round's last micro-batch is trained
        if getattr(a, "router_replay", "off") != "off":
            return None
        if a.importance_sampling_support_replay and TruncationFilter.from_config(a, never_sampled).cuts:
            return None
        return cls(a.importance_sampling_mode, a.importance_sampling_clip_min, a.importance_sampling_clip_max)

    def weights(self, logps: torch.Tensor, batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`(weights [B, T] or [B, 1], (stats [6], ratios [4]))` of `batch` (`rollout_logps`, `loss_mask [B, T]`)
        given the training forward's `logps [B, T]` (`algo.loss.importance_sampling_stats`)."""
        old = logps.detach()
        clip = (self.clip_min, self.clip_max)
        weights, diff = importance_sampling_weights(old, batch.rollout_logps, batch.loss_mask, self.mode, *clip)
        return weights, importance_sampling_stats(weights, diff, batch.loss_mask, self.mode, *clip)


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # [] what is backpropagated, scaled for gradient accumulation
    terms: LossOutput  # the policy loss's terms
    entropies: torch.Tensor | None  # [B, T]
    entropy_mask: torch.Tensor | None  # [B, T] bool (top_entropy_quantile < 1)
    entropy_bonus: bool  # the bonus is on (TRL then logs policy_loss)
    entropy_coef: float | None  # the coefficient after this micro-batch, at the end of a window (bonus on)
    aux_loss: torch.Tensor | None  # [] MoE load-balancing loss (unscaled)
    #: this process's importance-sampling sums `(stats [6], ratios [4])` (`algo.loss.importance_sampling_stats`),
    #: when this objective weighed the micro-batch itself (`InForwardImportanceSampling`)
    importance_stats: tuple[torch.Tensor, torch.Tensor] | None = None


class PolicyObjective:
    """`objective(scores, batch, ctx, end_of_window)` → `ObjectiveOutput`: the whole loss of one micro-batch.

    Args:
        settings (`LossSettings`): the policy loss's knobs.
        top_entropy_quantile (`float`): ρ; train only the top-ρ tokens by entropy (1.0: all tokens).
        entropy (`EntropyController`, *optional*): the entropy bonus (off when `None` or not `enabled`).
        aux_loss_coef (`float`), router (`(num_experts, top_k)`, *optional*): the MoE load-balancing loss.
        ops (`Collectives`): collectives (the entropy quantile, the adaptive controller's window mean).
        router_replay (`str`, *optional*, defaults to `"off"`): `GRPOConfig.router_replay`; `"rollout"`: the forward
            pass routes the completion tokens of a micro-batch that carries `routed_experts` (the sampler's) to them
            (`algo.router_replay`); `"record"` and `"off"`: the routers route.
        importance_sampling (`InForwardImportanceSampling`, *optional*): weigh each micro-batch that carries no
            `is_weights` of its own by π_old / π_sampler with π_old = this forward's log-probs (training only).
    """

    def __init__(
        self,
        settings: LossSettings,
        *,
        top_entropy_quantile: float = 1.0,
        entropy: EntropyController | None = None,
        aux_loss_coef: float = 0.0,
        router: tuple[int, int] | None = None,
        ops: Collectives | None = None,
        router_replay: str = "off",
        importance_sampling: InForwardImportanceSampling | None = None,
    ):
        self.settings, self.top_entropy_quantile = settings, top_entropy_quantile
        self.router_replay = router_replay
        self.importance_sampling = importance_sampling
        self.entropy = entropy or EntropyController()
        self.aux_loss_coef, self.router = aux_loss_coef, router
        self.ops = ops or SingleProcess()

    @classmethod
    def from_config(
        cls, args, model_config, ops: Collectives, importance_sampling: InForwardImportanceSampling | None = None
    ) -> PolicyObjective:
        """From a `GRPOConfig` (TRL's field names) and the policy's model config (for the MoE auxiliary loss);
        `importance_sampling`: the training objective's (`InForwardImportanceSampling.from_config`), None to
        evaluate."""
        coef, router = router_aux_settings(model_config, args.router_aux_loss_coef)
        entropy = EntropyController(
            args.entropy_coef,
            adaptive=args.use_adaptive_entropy,
            coef_min=args.entropy_coef_min,
            coef_max=args.entropy_coef_max,
            delta=args.entropy_coef_delta,
            target=args.entropy_target,
        )
        return cls(
            LossSettings.from_config(args),
            top_entropy_quantile=args.top_entropy_quantile,
            entropy=entropy,
            aux_loss_coef=coef,
            router=router,
            ops=ops,
            router_replay=getattr(args, "router_replay", "off"),
            importance_sampling=importance_sampling,
        )

    @property
    def scoring(self) -> dict:
        """What the forward pass must compute (`algo.logprobs.score_tokens` keywords). Entropies are always
        computed, as TRL does, for the `entropy` metric; with gradient only when the bonus backpropagates them."""
        return {"entropy": True, "entropy_grad": self.entropy.enabled, "router": self.router}

    def forward_loss(
        self,
        model,
        batch,
        ctx: LossContext,
        *,
        temperature: float,
        padding_free: bool,
        share_prefix: bool,
        max_positions: int | None = None,
        end_of_window: bool = True,
    ) -> ObjectiveOutput:
        """One micro-batch's forward pass and loss, for training and evaluation alike: the policy scores the
        completion tokens of `batch` (`prompt_ids [B, P]` + `completion_ids [B, T]` and their masks, on the model's
        device) at `temperature` (`algo.logprobs.score_tokens`, with what this objective needs: `scoring`), then
        `self(scores, batch, ctx, end_of_window)`. With `router_replay="rollout"` and the sampler's experts in
        `batch.routed_experts`, the completion tokens run those (`algo.router_replay`)."""
        from .logprobs import score_tokens

        T = batch.completion_ids.size(1)
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [B, P+T]
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)  # [B, P+T]
        scoring = {"share_prefix": share_prefix, "max_positions": max_positions, **self.scoring}
        if getattr(batch, "vision", None) is not None:  # a vision-language model: each row's images
            scoring["vision"] = batch.vision
        routing = getattr(batch, "routed_experts", None)  # [B, T, L, k]
        if self.router_replay == "rollout" and routing is not None:
            scoring["routing"] = routing
        scores = score_tokens(model, ids, mask, T, temperature, None, padding_free, **scoring)
        return self(scores, batch, ctx, end_of_window=end_of_window)

    def __call__(self, scores, batch, ctx: LossContext, end_of_window: bool = True) -> ObjectiveOutput:
        """`scores`: `TokenScores`; `batch`: a `MicroBatch` (reads `advantages [B]`, `loss_mask [B, T]`, `old_logps`,
        `ref_logps`, `is_weights`, `rollout_logps`); `end_of_window`: the last micro-batch before an optimizer step."""
        mask = batch.loss_mask  # [B, T]
        entropies = scores.entropies  # [B, T]
        if ctx.micro_batch_rows is not None and (self.top_entropy_quantile < 1.0 or self.router is not None):
            raise ValueError(
                "GRPOConfig.token_budget splits a micro-batch into slices, but top_entropy_quantile < 1 (a quantile "
                "over the whole micro-batch) and the MoE load-balancing loss (a mean over it) cannot be computed "
                "slice by slice; leave token_budget None with them"
            )
        emask = None
        if self.top_entropy_quantile < 1.0:
            if entropies is None:
                raise ValueError("top_entropy_quantile < 1 needs the entropies (score_tokens(..., entropy=True))")
            emask = high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile, self.ops)  # [B, T]
        is_weights, is_stats = batch.is_weights, None
        if self.importance_sampling is not None and is_weights is None and batch.old_logps is None:
            is_weights, is_stats = self.importance_sampling.weights(scores.logps, batch)
        terms = grpo_loss(
            scores.logps,
            batch.advantages,
            mask,
            settings=self.settings,
            old_per_token_logps=batch.old_logps,
            ref_per_token_logps=batch.ref_logps,
            importance_weights=is_weights,
            rollout_per_token_logps=getattr(batch, "rollout_logps", None),
            token_mask=emask,
            ctx=ctx,
        )
        loss, coef_logged = terms.loss, None
        if self.entropy.enabled:
            if entropies is None:
                raise ValueError("the entropy bonus needs the entropies (score_tokens(..., entropy=True))")
            m = mask.to(entropies.dtype) if emask is None else mask.to(entropies.dtype) * emask  # [B, T]
            H = mean_entropy(entropies, m, ctx.grad_accum_steps, ctx.micro_batch_tokens)
            loss = loss - self.entropy.applied_coef() * H
            self.entropy.observe((entropies * m).sum(), m.sum(), end_of_window, self.ops.reduce_sum)
            coef_logged = self.entropy.coef if end_of_window else None
        if self.router is not None:
            if scores.aux_loss is None:
                raise ValueError("router_aux_loss_coef needs the aux loss (score_tokens(..., router=...))")
            loss = loss + self.aux_loss_coef * scores.aux_loss / ctx.grad_accum_steps
        return ObjectiveOutput(
            loss=loss,
            terms=terms,
            entropies=entropies,
            entropy_mask=emask,
            entropy_bonus=self.entropy.enabled,
            entropy_coef=coef_logged,
            aux_loss=scores.aux_loss,
            importance_stats=is_stats,
        )

    def state_dict(self) -> dict:
        return {"entropy": self.entropy.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        self.entropy.load_state_dict((state or {}).get("entropy", {}))
