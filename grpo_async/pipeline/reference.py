"""Where the reference policy's log-probs come from when `beta > 0` (the KL term), and whether a round needs π_old.

| source | when | scorer |
|---|---|---|
| a reference server (`grpo-async serve --ref`) | `ref_server_url` | `RefLogpsClient.completion_logps` over HTTP |
| a frozen copy of the initial policy | `ref_model` given (full fine-tuning) | `LogpsScorer` over the copy |
| the policy with its adapter disabled | PEFT, no copy | `LogpsScorer` over the policy under `disable_adapter()` |
"""

from __future__ import annotations

from ..algo.logprobs import LogpsScorer


def reference_client(config):
    """The client of the reference server (`ref_server_url`) when `beta > 0`, else None."""
    from ..generation.ref_client import RefLogpsClient

    if config.beta > 0 and config.ref_server_url is not None:
        api_key = config.ref_server_api_key or config.vllm_api_key
        return RefLogpsClient(config.ref_server_url, api_key, config.vllm_server_timeout)
    return None


def reference_scorer(ref_client, ref_model, link, scoring: dict):
    """Reference logps `fn(ids, mask, T) -> [b, T]`: the frozen server, the frozen copy, or (PEFT) the policy with its
    adapter disabled. `link.policy()` / `link.unwrapped_policy()` (`pipeline.build.TrainerLink`) return the training
    model (wrapped by the Trainer after construction, hence callables)."""
    policy, unwrapped_policy = link.policy, link.unwrapped_policy

    if ref_client is not None:
        return lambda ids, mask, T: ref_client.completion_logps(ids, mask, T, scoring["temperature"])
    if ref_model is not None:
        return LogpsScorer(lambda: ref_model, **scoring)
    return LogpsScorer(policy, **scoring, context=lambda: unwrapped_policy().disable_adapter())


def needs_old_logps(config, in_forward: bool) -> bool:
    """Whether the consumer scores π_old before training a round: the policy moves before the round's last
    micro-batch is trained (μ > 1, or several optimizer steps per round), or importance sampling needs π_old and
    cannot take it from the training forward (`in_forward`: `algo.objective.InForwardImportanceSampling`)."""
    return (
        config.num_iterations > 1
        or config.steps_per_generation > config.gradient_accumulation_steps
        or (config.importance_sampling_correction and not in_forward)
    )
