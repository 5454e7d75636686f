"""Router capture and replay for transformers' MoE models: the trainer side of rollout router replay (R3).

In transformers 5 the MoE families route in one small module per layer, `mlp.gate` (`Qwen3MoeTopKRouter`,
`Qwen2MoeTopKRouter`, `OlmoeTopKRouter`, `MixtralTopKRouter`): it takes the layer's hidden states flattened to
`[N, H]` (a `[B, T]` batch row-major) and returns `(router_logits [N, E], scores [N, k], indices [N, k])`; the
experts module then runs exactly `indices`, weighted by `scores`. Both functions here hook those modules:

- `capture_routing(model)`: records each router's `indices` per forward call (a sampler's own routing, e.g. the `hf`
  backend's `generate`: the prefill call covers the prompt, each decode call one token per row);
- `replay_routing(model, experts, mask)`: where `mask` is set, the experts run are `experts[:, layer]` instead of the
  router's choice, weighted by the router's softmax at those experts (renormalised as the router does), so the
  gradient still reaches the router through the replayed experts' weights; `router_logits`, which the load-balancing
  loss reads, are left as computed. Elsewhere (prompt tokens, padding) the router's own choice stands.

Not wired into training yet (docs/moe.md, "Router replay"): a row would carry its sampler's `[T, layers, k]` experts.

Example:
    >>> with capture_routing(model) as calls:  # doctest: +SKIP
    ...     model(input_ids)
    >>> recorded = torch.stack([c[0] for c in calls], 1)  # [B*T, layers, k]  # doctest: +SKIP
    >>> with replay_routing(model, recorded, torch.ones(len(recorded), dtype=torch.bool)):  # doctest: +SKIP
    ...     out = model(input_ids)  # routed as recorded, whatever the router's weights are now
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

#: router classes whose forward returns `(logits, scores, indices)` from a softmax top-k -> whether they always
#: renormalise the top-k scores (else the router's own `norm_topk_prob` says)
ROUTERS = {
    "Qwen3MoeTopKRouter": False,
    "Qwen2MoeTopKRouter": False,
    "OlmoeTopKRouter": False,
    "MixtralTopKRouter": True,
}


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order; `ValueError` for a MoE model whose routers are not ones this module can
    drive (e.g. DeepSeek's grouped top-k with a bias)."""
    routers = [m for m in model.modules() if type(m).__name__ in ROUTERS]
    if not routers:
        config = getattr(model, "config", None)
        if any(getattr(config, k, None) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
            raise ValueError(
                f"router replay: {type(model).__name__} is a mixture-of-experts model whose router is not one of "
                f"{sorted(ROUTERS)}; its routing cannot be captured or replayed"
            )
    return routers


@contextlib.contextmanager
def capture_routing(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Yield `calls`: `calls[i][layer]` the `indices [N, k]` of MoE layer `layer` in the model's `i`-th forward."""
    routers = moe_routers(model)
    calls: list[list[torch.Tensor]] = []

    def hook(layer: int):
        def record(module, args, out):
            if layer == 0:
                calls.append([])
            calls[-1].append(out[2].detach().clone())

        return record

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def replay_routing(model: nn.Module, experts: torch.Tensor, mask: torch.Tensor) -> Iterator[None]:
    """Route the tokens of the forwards inside this context as recorded.

    Args:
        experts (`torch.Tensor` `[N, layers, k]`, integer): the experts each token ran, per MoE layer, in the forward's
            token order (a `[B, T]` batch flattened row-major).
        mask (`torch.Tensor` `[N]`, bool): the tokens to replay; the others keep the router's choice.
    """
    routers = moe_routers(model)
    if experts.dim() != 3 or experts.shape[1] != len(routers) or mask.shape != experts.shape[:1]:
        raise ValueError(
            f"router replay: experts must be [tokens, {len(routers)} MoE layers, k] and mask [tokens], got "
            f"{tuple(experts.shape)} and {tuple(mask.shape)}"
        )

    def hook(layer: int):
        def replace(module, args, out):
            logits, scores, indices = out
            if logits.shape[0] != experts.shape[0] or indices.shape[1] != experts.shape[2]:
                raise ValueError(
                    f"router replay: layer {layer} routes {tuple(indices.shape)} tokens x experts, the recording "
                    f"holds {tuple(experts[:, layer].shape)}"
                )
            keep = mask.to(indices.device)[:, None]
            chosen = torch.where(keep, experts[:, layer].to(indices), indices)
            weights = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
            if ROUTERS[type(module).__name__] or getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), chosen

        return replace

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
