"""TR-DPO reference updates (TRL 1.16 `sync_ref_model`): every `ref_model_sync_steps` optimizer steps,
`π_ref ← α · π_θ + (1 − α) · π_ref`, parameter by parameter, as TRL's `SyncRefModelCallback`.

Example, α = 0.6, τ = 2: after step 2, a reference weight 1.0 whose policy weight is 2.0 becomes 0.6·2.0 + 0.4·1.0 =
1.6; after step 4 it mixes again with the policy of step 4. The reference logps of every round trained after a sync
come from the mixed weights (they are computed when the round starts training).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import TrainerCallback


@torch.no_grad()
def mix_into(ref_model: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """`ref ← α · policy + (1 − α) · ref` for every parameter (in place, the two models' parameters in the same order).

    Under DeepSpeed ZeRO-3 the partitioned parameters of both models are gathered, rank 0 mixes them and DeepSpeed
    scatters the result back, as in TRL."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        import deepspeed

        params = list(policy.parameters()) + list(ref_model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            if deepspeed.comm.get_rank() == 0:
                _mix(ref_model, policy, alpha)
    else:
        _mix(ref_model, policy, alpha)


def _mix(ref_model: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    for ref_param, param in zip(ref_model.parameters(), policy.parameters(), strict=True):
        ref_param.data.mul_(1.0 - alpha).add_(param.data, alpha=alpha)


class RefModelSyncCallback(TrainerCallback):
    """Mixes the policy into the reference model at the end of every `sync_steps`-th optimizer step.

    Args:
        ref_model (`torch.nn.Module`): the reference model (a separate frozen copy; updated in place).
        policy (`Callable[[], torch.nn.Module]`): returns the training model, unwrapped (the Trainer wraps it after
            construction, hence a callable).
        alpha (`float`): α in [0, 1], the policy's share (`ref_model_mixup_alpha`).
        sync_steps (`int`): τ >= 1, optimizer steps between mixes (`ref_model_sync_steps`).
    """

    def __init__(
        self, ref_model: torch.nn.Module, policy: Callable[[], torch.nn.Module], alpha: float, sync_steps: int
    ):
        if ref_model is None:
            raise ValueError("RefModelSyncCallback needs a reference model (beta > 0, no PEFT, no ref_server_url)")
        self.ref_model, self.policy, self.alpha, self.sync_steps = ref_model, policy, alpha, sync_steps

    @classmethod
    def from_config(cls, args, ref_model: torch.nn.Module, policy: Callable[[], torch.nn.Module]):
        """With `args.ref_model_mixup_alpha` and `args.ref_model_sync_steps` (a `GRPOConfig`)."""
        return cls(ref_model, policy, args.ref_model_mixup_alpha, args.ref_model_sync_steps)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.sync_steps == 0:
            mix_into(self.ref_model, self.policy(), self.alpha)
