"""Algorithm fields of `GRPOConfig`: rewards, advantages, the loss family and its knobs, entropy."""

from dataclasses import dataclass, field
from typing import Literal

from ..algo.advantages import MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS
from ..algo.loss import IMPORTANCE_SAMPLING_LEVELS, IS_MODES, LOSS_TYPES
from .checks import Number, OneOf, checked_field


@dataclass
class LossFields:
    """KL, clipping, loss type, reward scaling and aggregation, importance sampling, SAPO/VESPO, entropy, MoE aux."""

    beta: float = checked_field(
        Number(ge=0),
        default=0.0,
        metadata={"help": "KL coefficient (k3 estimator); 0 loads no reference model."},
    )
    num_iterations: int = checked_field(
        Number(ge=1, integer=True), default=1, metadata={"help": "Passes over each generation round (μ)."}
    )
    epsilon: float = checked_field(Number(gt=0), default=0.2, metadata={"help": "Lower clipping range ε."})
    epsilon_high: float | None = checked_field(
        Number(gt=0, optional=True, what="> 0 or None (= epsilon)"),
        default=None,
        metadata={"help": "Upper clipping range; defaults to epsilon."},
    )
    loss_type: str = checked_field(
        OneOf(LOSS_TYPES), default="dapo", metadata={"help": f"One of {LOSS_TYPES} (TRL 1.16's)."}
    )
    scale_rewards: str = checked_field(
        OneOf(SCALE_REWARDS, hint=" (or True/False)"),
        default="group",
        metadata={
            "help": f"One of {SCALE_REWARDS}; True means 'group', False 'none' (as in TRL).",
        },
    )
    multi_objective_aggregation: Literal[MULTI_OBJECTIVE_AGGREGATIONS] = field(
        default="sum_then_normalize",
        metadata={
            "help": "How several reward functions become one advantage: 'sum_then_normalize' (default): weighted sum "
            "of the rewards, then normalised as `scale_rewards` says. 'normalize_then_sum' (GDPO): each reward "
            "normalised within its group (mean, std), then the weighted sum, then normalised over the whole batch; "
            "`scale_rewards` does not apply (as in TRL)."
        },
    )
    reward_weights: list[float] | None = field(default=None, metadata={"help": "Weight of each reward function."})
    reward_timeout: float | None = checked_field(
        Number(gt=0, optional=True, what="> 0 seconds or None (no limit)"),
        default=300.0,
        metadata={
            "help": "Seconds one reward-function call may take before the round fails with an error naming it "
            "(sync functions run in a worker thread that is abandoned). None: no limit.",
        },
    )
    mask_env_responses: bool = field(
        default=True,
        metadata={
            "help": "Multi-turn environments: tokens the environment or a tool wrote into the completion are in the "
            "sequence (attended to) but not trained on. False trains on them too."
        },
    )
    importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Weight the loss by π_old / π_sampler (the sampler's own logprobs): corrects for sampling from a "
            "stale policy (async rounds) or another engine's numerics (vLLM). Needs the old-policy logps pass. "
            "TRL name: vllm_importance_sampling_correction."
        },
    )
    importance_sampling_mode: str = checked_field(
        OneOf(tuple(IS_MODES)),
        default="sequence_mask",
        metadata={
            "help": f"One of {tuple(IS_MODES)} (TRL 1.16's vLLM IS modes). TRL name: vllm_importance_sampling_mode.",
        },
    )
    importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={
            "help": "Lower bound of the IS ratio (truncate: clip, mask: zero below); None: none. TRL name: "
            "vllm_importance_sampling_clip_min.",
        },
    )
    importance_sampling_clip_max: float | None = checked_field(
        Number(gt=0, optional=True, what="> 0 or None (unbounded)"),
        default=3.0,
        metadata={
            "help": "Upper bound of the IS ratio (truncate: clip, mask: zero above); None: none. TRL name: "
            "vllm_importance_sampling_clip_max.",
        },
    )
    importance_sampling_support_replay: bool = field(
        default=True,
        metadata={
            "help": "Where top_k / top_p / min_p (or a suppressed token) cut the sampler's vocabulary, its log-probs "
            "are normalised over the tokens it kept and the trainer's over all of them, which biases the IS ratio by "
            "the kept mass (top_p=0.8: a ratio mean of 0.24 with identical weights). True: the ratio compares the "
            "sampler with π_old renormalised over the sampler's kept set at each position (the sets the hf and "
            "in-process vLLM backends record; for servers, which cannot report them, the same top_k / top_p / "
            "min_p filter applied to π_old, with a warning; metric sampling/support_exact). False: full-vocabulary "
            "π_old, TRL 1.16's behaviour.",
        },
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the KL term by the ratio π/π_old, so its gradient is the unbiased reverse-KL gradient "
            "(DeepSeek-V3.2); changes the gradient whenever beta > 0, on-policy too."
        },
    )
    importance_sampling_level: Literal[IMPORTANCE_SAMPLING_LEVELS] = field(
        default="token",
        metadata={
            "help": f"One of {IMPORTANCE_SAMPLING_LEVELS}: the ratio π/π_old per token, or per sequence as the exp of "
            "the mean log-ratio over its tokens (GSPO; use it with loss_type='grpo' or 'luspo')."
        },
    )
    delta: float | None = checked_field(
        Number(gt=1, optional=True, what="> 1 (the ratio's cap; recommended > 1 + epsilon_high) or None"),
        default=None,
        metadata={"help": "Two-sided clipping (INTELLECT-2): cap the ratio at delta (> 1; recommended > 1 + ε_high)."},
    )
    off_policy_mask_threshold: float | None = checked_field(
        Number(ge=0, optional=True, what=">= 0 (a KL) or None"),
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2): drop sequences with A < 0 whose mean per-token "
            "log π_sampler − log π_θ exceeds this (>= 0); None: off.",
        },
    )
    sapo_temperature_neg: float = checked_field(
        Number(gt=0, what="> 0 (the loss divides by it)"),
        default=1.05,
        metadata={"help": "loss_type='sapo': τ for A <= 0 (> 0)."},
    )
    sapo_temperature_pos: float = checked_field(
        Number(gt=0, what="> 0 (the loss divides by it)"),
        default=1.0,
        metadata={"help": "loss_type='sapo': τ for A > 0 (> 0)."},
    )
    vespo_k_pos: float = checked_field(
        Number(ge=0), default=2.0, metadata={"help": "loss_type='vespo': power k for A >= 0 (>= 0)."}
    )
    vespo_lambda_pos: float = checked_field(
        Number(ge=0), default=3.0, metadata={"help": "loss_type='vespo': decay λ for A >= 0 (>= 0)."}
    )
    vespo_k_neg: float = checked_field(
        Number(ge=0), default=3.0, metadata={"help": "loss_type='vespo': power k for A < 0 (>= 0)."}
    )
    vespo_lambda_neg: float = checked_field(
        Number(ge=0), default=2.0, metadata={"help": "loss_type='vespo': decay λ for A < 0 (>= 0)."}
    )
    top_entropy_quantile: float = checked_field(
        Number(ge=0, le=1, what="in [0, 1] (1.0: every token)"),
        default=1.0,
        metadata={
            "help": "ρ in [0, 1]: train only the top-ρ tokens by entropy, the quantile taken over every process's "
            "trained tokens of the micro-step (1.0: all tokens).",
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus: subtract coef × the mean per-token entropy (of the entropy-masked tokens) from "
            "the loss; the initial coefficient with use_adaptive_entropy."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Adaptive entropy bonus (Skywork-OR1): each optimizer step entropy_coef moves by "
            "entropy_coef_delta up when the step's mean entropy is <= entropy_target, down otherwise, and is applied "
            "only while the entropy is <= entropy_target. Saved in checkpoints."
        },
    )
    entropy_coef_min: float = checked_field(
        Number(ge=0), default=0.0, metadata={"help": "Adaptive entropy: lower bound of entropy_coef."}
    )
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy: upper bound of entropy_coef."})
    entropy_coef_delta: float = checked_field(
        Number(ge=0), default=0.005, metadata={"help": "Adaptive entropy: step of entropy_coef."}
    )
    entropy_target: float = field(default=0.2, metadata={"help": "Adaptive entropy: target mean entropy (nats)."})
    router_aux_loss_coef: float | None = checked_field(
        Number(ge=0, optional=True, what=">= 0 or None (the model's own)"),
        default=None,
        metadata={
            "help": "Mixture-of-Experts models (a config with output_router_logits): weight of the load-balancing "
            "loss added to the loss; None: the model config's router_aux_loss_coef; 0.0: off. An error for "
            "other models.",
        },
    )
    router_replay: Literal["off", "record", "rollout"] = field(
        default="off",
        metadata={
            "help": "Mixture-of-Experts models: rollout router replay (R3). 'rollout': the sampler records the "
            "experts each generated token ran at every MoE layer and the old-logps and training forward passes run "
            "those tokens through them (prompt tokens are routed by the trainer); 'record': recorded and compared "
            "only (metrics routing/mismatch_tokens, routing/mismatch_pairs), routed by the trainer; 'off': neither. "
            "Backends: hf and the in-process vllm engine (servers refuse). Default 'off': replay needs a MoE model "
            "and a recording backend, and on the tiny Qwen3-MoE with a bfloat16 sampler (1 percent of tokens routed "
            "elsewhere) it cut the KL of the tokens after a misrouted one 5x but the whole sampling/kl only 1.5x, "
            "from 6.5e-7 (docs/moe.md); use 'rollout' for MoE models sampled in bfloat16. Refused: dense models, "
            "a MoE router it cannot drive, gradient_checkpointing with 'rollout', an environment or a rollout_func.",
        },
    )
