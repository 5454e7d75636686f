"""`TRLAttributes`: TRL 1.16 `GRPOTrainer`'s public attributes and static helpers, mixed into `GRPOTrainer`.

They read and write the components that own the state (the round producer's reward functions, the policy
objective's entropy coefficient and router) and call the pure functions of `algo/`; nothing here is a Trainer
override.
"""

from __future__ import annotations

import torch

from .algo.loss import gamma_weights, off_policy_mask
from .algo.objective import high_entropy_mask
from .trainer_setup import ProducerAttribute


class TRLAttributes:
    """TRL's names on `GRPOTrainer` (`reward_funcs`, `entropy_coef`, `get_off_policy_mask`, ...); needs the trainer's
    `producer` and `objective`."""

    # the reward functions belong to the round producer; TRL's attributes read and replace them there
    reward_funcs = ProducerAttribute("reward_funcs")
    reward_func_names = ProducerAttribute("reward_names")
    reward_weights = ProducerAttribute("reward_weights")

    # ---- TRL's public attributes and static helpers ----------------------------------------------------------------
    @property
    def _logs(self) -> dict:
        """TRL's buffer of the newest round's samples (what its completions table shows), read-only here: `prompt`,
        `completion`, `rewards` (per reward function), `advantages`, `extra` (the reward functions' `log_extra`
        columns) and `images`. Empty before the first round."""
        s = self.rounds.last_samples or {}
        return {
            "images": list(s.get("images", [])),
            "prompt": list(s.get("prompt", [])),
            "completion": list(s.get("completion", [])),
            "rewards": {name: list(v) for name, v in s.get("rewards", {}).items()},
            "advantages": [float(a) for a in s.get("advantage", [])],
            "extra": {name: list(v) for name, v in s.get("extra", {}).items()},
        }

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's: the MoE load-balancing loss is added (router logits returned, coefficient not 0)."""
        return self.objective.router is not None

    @property
    def entropy_coef(self) -> float:
        """TRL's: the entropy bonus's coefficient now (moves between optimizer steps with `use_adaptive_entropy`)."""
        return self.objective.entropy.coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        self.objective.entropy.coef = float(value)

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's: `[B, T]` bool, the tokens whose entropy is at least the `threshold`-quantile of every process's
        masked entropies (`algo.objective.high_entropy_mask`). As in TRL it needs only `self.accelerator` (TRL's tests
        call it on a stand-in that has one); a trainer uses its objective's collectives."""
        objective = getattr(self, "objective", None)
        if objective is not None:
            ops = objective.ops
        else:
            from .pipeline.collectives import AcceleratorCollectives

            ops = AcceleratorCollectives(self.accelerator)
        return high_entropy_mask(entropies, mask, threshold, ops)

    def _generate(self, prompts: list):
        """TRL's rollout dispatch: one completion for each of `prompts` (already repeated, as TRL passes a process's
        rows), from this trainer's generation backend. Returns TRL's tuple `(prompt_ids, completion_ids, tool_mask,
        completions, logprobs, extra_fields, images, tool_images)` (no tools here: `tool_mask`, `images` and
        `tool_images` are None; `completions` are decoded texts, or assistant messages for conversational prompts).

        A subclass that overrides it generates every training round through its override, as in TRL: the trainer
        then calls it like a `rollout_func` (`generate_override_rollout`), so it must return the sampler's
        `logprobs`."""
        prompt_ids, outs = self.producer.generate_once(prompts)
        ids = [c.completion_ids for c in outs]
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        if prompts and isinstance(prompts[0], list):  # conversational: one assistant message each
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        else:
            completions = texts
        return prompt_ids, ids, None, completions, [c.logprobs for c in outs], {}, None, None

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """TRL's: the off-policy sequence mask `[B, 1]` (1.0 kept, 0.0 dropped; `algo.loss.off_policy_mask`)."""
        return off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold)

    @staticmethod
    def get_gamma_weights(
        advantages: torch.Tensor,
        log_ratio_per_token: torch.Tensor,
        mask: torch.Tensor,
        importance_sampling_ratio: torch.Tensor | None,
        k_pos: float = 2.0,
        lambda_pos: float = 3.0,
        k_neg: float = 3.0,
        lambda_neg: float = 2.0,
    ) -> torch.Tensor:
        """TRL's: VESPO's gamma weights `[B, 1]`, without gradient (`algo.loss.gamma_weights`)."""
        return gamma_weights(
            advantages, log_ratio_per_token, mask, importance_sampling_ratio, k_pos, lambda_pos, k_neg, lambda_neg
        )


def overrides_generate(trainer_type: type) -> bool:
    """Whether a `GRPOTrainer` subclass replaced TRL's `_generate` (its rounds then go through it)."""
    return trainer_type._generate is not TRLAttributes._generate


def generate_override_rollout(prompts: list, trainer) -> dict:
    """A `rollout_func` over a subclass's `_generate(prompts)` override: TRL's tuple into the rollout dict the
    pipeline takes (`prompt_ids`, `completion_ids`, `logprobs`, `env_mask` from TRL's `tool_mask`, the extra
    fields as reward-function columns)."""
    prompt_ids, completion_ids, tool_mask, _completions, logprobs, extra, _images, _tool_images = trainer._generate(
        prompts
    )
    if logprobs is None:
        raise ValueError(
            f"{type(trainer).__name__}._generate returned logprobs=None: return the sampler's log-probability of "
            "each completion token (the importance-sampling correction and the old log-probs need them)"
        )
    out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs, **(extra or {})}
    if tool_mask is not None:
        out["env_mask"] = tool_mask
    return out
