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

Training (`GRPOConfig.router_replay`, docs/moe.md "Router replay"): a row carries its sampler's experts
`[T, layers, k]` (`MicroBatch.routed_experts`, compact: `routing_dtype`, the `unrouted` marker where the sampler ran a
token through none, e.g. the last one), laid out per forward by `routing_for_rows` (padded rows) or
`routing_for_packed` (padding-free bins and prompt-sharing trees); `replay_routing` then runs them and counts where
the router's own choice differs (`RoutingStats`).

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
from dataclasses import dataclass, field

import torch
from torch import nn

#: config attributes whose value > 1 marks a Mixture-of-Experts model (`is_moe_config`)
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_moe_config(config) -> bool:
    """Whether a model's config (a multimodal model's: its text config) describes a Mixture-of-Experts model: one of
    `EXPERT_COUNT_FIELDS` is an int > 1. `None` is not."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(isinstance(v := getattr(text, n, None), int) and v > 1 for n in EXPERT_COUNT_FIELDS)


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
        if is_moe_config(config):
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


def moe_layout(model: nn.Module) -> tuple[int, int, int] | None:
    """`(num_experts, num_moe_layers, top_k)` of a MoE model whose routers this module drives, `None` for a dense
    model; `ValueError` for a MoE model with a router it cannot drive (`moe_routers`)."""
    routers = moe_routers(model)
    if not routers:
        return None
    first = routers[0]
    experts = getattr(first, "num_experts", None) or first.weight.shape[0]
    return int(experts), len(routers), int(first.top_k)


# ---- the recorded experts of a row: compact, with a marker for tokens the sampler never ran ----------------------
def routing_dtype(num_experts: int) -> torch.dtype:
    """The dtype a row's experts travel in: `uint8` up to 255 experts (255 is `UNROUTED`), else `int16`."""
    return torch.uint8 if num_experts < 255 else torch.int16


def unrouted(dtype: torch.dtype) -> int:
    """The value marking a token the sampler did not route (`UNROUTED`), in `dtype` (`routing_dtype`'s)."""
    return 255 if dtype == torch.uint8 else -1


def routed(routing: torch.Tensor) -> torch.Tensor:
    """`[..., L, k]` experts → `[...]` bool: the token holds a recorded routing (no `unrouted` marker)."""
    return (routing != unrouted(routing.dtype)).flatten(-2).all(-1)


def stack_routing(rows: list[torch.Tensor | None], T: int) -> torch.Tensor | None:
    """Rows' experts `[T_i, L, k]` (`None`: nothing recorded) → `[R, T, L, k]` padded with the `unrouted` marker;
    `None` when no row holds any."""
    first = next((r for r in rows if r is not None), None)
    if first is None:
        return None
    out = torch.full((len(rows), T, *first.shape[1:]), unrouted(first.dtype), dtype=first.dtype)
    for i, r in enumerate(rows):
        if r is not None:
            if r.shape[1:] != first.shape[1:] or r.dtype != first.dtype:
                raise ValueError(
                    f"router replay: row {i} holds experts {tuple(r.shape)} {r.dtype}, row 0 "
                    f"{tuple(first.shape)} {first.dtype}"
                )
            out[i, : r.shape[0]] = r[:T]
    return out


def pad_routing(routing: torch.Tensor, T: int) -> torch.Tensor:
    """`[B, t, L, k]` → `[B, T, L, k]` (`T ≥ t`), the new positions `unrouted`."""
    if routing.size(1) >= T:
        return routing
    extra = routing.new_full((routing.size(0), T - routing.size(1), *routing.shape[2:]), unrouted(routing.dtype))
    return torch.cat([routing, extra], dim=1)


def routing_for_rows(routing: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recorded experts of a padded forward: rows `[b, P+T]` (prompt, then the `T` completion columns `routing
    [b, T, L, k]` covers), flattened as the routers see them (row-major). Returns `(experts [b·(P+T), L, k],
    replay [b·(P+T)] bool)`: completion tokens that exist and were recorded; prompt tokens and padding are not."""
    b, width = attention_mask.shape
    T = routing.size(1)
    full = routing.new_full((b, width, *routing.shape[2:]), unrouted(routing.dtype))  # [b, P+T, L, k]
    full[:, width - T :] = routing.to(full.device)
    replay = routed(full) & attention_mask.bool().to(full.device)  # [b, P+T]
    return full.flatten(0, 1), replay.flatten()


def routing_for_packed(routing: torch.Tensor, packed) -> tuple[torch.Tensor, torch.Tensor]:
    """The recorded experts of a packed forward (`algo.packing.PackedRows` bins `[K, W]`, rows or prompt-sharing
    trees): each completion token's experts at its bin position (`packed.logits_bin`, `packed.token_pos`), flattened
    as the routers see them. Returns `(experts [K·W, L, k], replay [K·W] bool)`; prompts and filler are not
    replayed."""
    K, W = packed.input_ids.shape
    device = packed.input_ids.device
    full = routing.new_full((K * W, *routing.shape[2:]), unrouted(routing.dtype)).to(device)  # [K·W, L, k]
    at = packed.logits_bin.to(device) * W + packed.token_pos.to(device)  # [N]
    full[at] = routing.to(device)[packed.rows.to(device), packed.cols.to(device)]  # [N, L, k]
    return full, routed(full)


@dataclass
class RoutingStats:
    """Where the routers' own choice differed from the recording, over the replayed tokens of the forwards inside one
    `replay_routing` context (summed): `counts` `[4]` float64 = (tokens whose expert set differs at some MoE layer,
    replayed tokens, (token, layer) pairs whose set differs, (token, layer) pairs)."""

    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(4, dtype=torch.float64))

    def add(self, other: RoutingStats | torch.Tensor) -> None:
        self.counts += other.counts if isinstance(other, RoutingStats) else other

    @property
    def token_mismatch(self) -> float:
        """The fraction of replayed tokens whose expert set differs at one MoE layer or more (0 with none)."""
        return float(self.counts[0] / self.counts[1].clamp(min=1))

    @property
    def pair_mismatch(self) -> float:
        """The fraction of (token, MoE layer) pairs whose expert set differs (0 with none)."""
        return float(self.counts[2] / self.counts[3].clamp(min=1))


@contextlib.contextmanager
def replay_routing(
    model: nn.Module, experts: torch.Tensor, mask: torch.Tensor, apply: bool = True
) -> Iterator[RoutingStats]:
    """Route the tokens of the forwards inside this context as recorded, and count where the routers' own choice
    differs from the recording (the yielded `RoutingStats`, complete when the context exits).

    Args:
        experts (`torch.Tensor` `[N, layers, k]`, integer): the experts each token ran, per MoE layer, in the forward's
            token order (a `[B, T]` batch flattened row-major).
        mask (`torch.Tensor` `[N]`, bool): the tokens to replay; the others keep the router's choice.
        apply (`bool`, *optional*, defaults to `True`): `False` only counts (the routers route as they would).
    """
    routers = moe_routers(model)
    if experts.dim() != 3 or experts.shape[1] != len(routers) or mask.shape != experts.shape[:1]:
        raise ValueError(
            f"router replay: experts must be [tokens, {len(routers)} MoE layers, k] and mask [tokens], got "
            f"{tuple(experts.shape)} and {tuple(mask.shape)}"
        )
    stats = RoutingStats()
    differs: list[torch.Tensor] = []  # per forward and layer: [N] bool, the router's own set is not the recording

    def hook(layer: int):
        def replace(module, args, out):
            logits, scores, indices = out
            if logits.shape[0] != experts.shape[0] or indices.shape[1] != experts.shape[2]:
                raise ValueError(
                    f"router replay: layer {layer} routes {tuple(indices.shape)} tokens x experts, the recording "
                    f"holds {tuple(experts[:, layer].shape)}"
                )
            keep = mask.to(indices.device)[:, None]
            recorded = experts[:, layer].to(device=indices.device, dtype=indices.dtype)  # [N, k]
            differs.append(
                ((indices.sort(-1).values != recorded.sort(-1).values).any(-1) & keep[:, 0]).detach()
            )  # [N]
            if not apply:
                return None
            chosen = torch.where(keep, recorded, indices)
            weights = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
            if ROUTERS[type(module).__name__] or getattr(module, "norm_topk_prob", False):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), chosen

        return replace

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()
        L, tokens = len(routers), float(mask.sum())
        for start in range(0, len(differs) - L + 1, L):  # one forward's layers
            per_layer = torch.stack(differs[start : start + L])  # [L, N]
            pairs = float(per_layer.sum())
            stats.add(torch.tensor([float(per_layer.any(0).sum()), tokens, pairs, tokens * L], dtype=torch.float64))
