"""Per-token log-probabilities of completion tokens, computed in chunks to bound memory.

Shapes: `B` rows, `P` prompt tokens, `T` completion tokens, `V` vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .logits import entropy_from_logits, scaled, selective_log_softmax
from .packing import pack_rows, packed_token_scores, unpack_completion
from .prefix_sharing import SharingCost, pack_shared, sharing_cost, sharing_supported
from .router_replay import RoutingStats, replay_routing, routing_for_packed, routing_for_rows
from .sampling_support import log_kept_mass


@dataclass
class TokenScores:
    """What one training forward pass gives the loss.

    Attributes:
        logps (`[B, T]`): log π of the completion tokens (meaningless at padded positions; mask them).
        entropies (`[B, T]` float32, *optional*): entropy of each completion position's next-token distribution
            (temperature applied), 0 at padded positions; differentiable when asked for with `entropy_grad`.
        aux_loss (`[]`, *optional*): the MoE load-balancing loss over the real tokens (mean over chunks).
        log_kept_mass (`[B, T]` float32, *optional*): log of π's mass on the sampler's kept set at each position
            (`algo.sampling_support`; 0 where nothing was cut), when `score_tokens` was given a `support`.
        routing (`RoutingStats`, *optional*): where the routers' own choice differed from the sampler's recorded
            experts (`algo.router_replay`), when `score_tokens` was given a `routing`.
    """

    logps: torch.Tensor
    entropies: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    log_kept_mass: torch.Tensor | None = None
    routing: RoutingStats | None = None


def score_tokens(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float = 1.0,
    batch_size: int | None = None,
    padding_free: bool = False,
    entropy: bool = False,
    entropy_grad: bool = False,
    router: tuple[int, int] | None = None,
    share_prefix: bool | SharingCost = False,
    max_positions: int | None = None,
    support=None,
    routing: torch.Tensor | None = None,
    replay: bool = True,
    vision=None,
) -> TokenScores:
    """Log π(completion token | prefix) under `model`, with logits divided by `temperature` like the sampler, and
    optionally each position's entropy and the MoE load-balancing loss.

    Args:
        input_ids (`[B, P+T]`), attention_mask (`[B, P+T]`): prompt (left-padded) then completion (right-padded).
        logits_to_keep (`int`): T, the completion length.
        batch_size (`int`, *optional*): rows per forward pass (all at once when `None`).
        padding_free (`bool`): run each chunk's rows packed into bins without padding
            (`algo.packing`); logits only at the completion tokens. Padded positions then hold exactly 0.
        entropy (`bool`): also compute the entropies (float32); without `entropy_grad` they are computed without
            gradient (no `[B, T, V]` float32 copy is kept for the backward pass).
        router (`(num_experts, top_k)`, *optional*): request the router logits and return the load-balancing loss
            (Mixtral's `load_balancing_loss_func`, over real tokens only, as the model's own forward does).
        share_prefix (`bool`): score the rows of a chunk that share a prompt as prompt-sharing trees
            (`algo.prefix_sharing`) where the cost model says it is cheaper; same values as unshared. Falls back to
            unshared rows, with one warning, where the model cannot do it exactly. A `SharingCost` instead of
            `True` replaces the model's cost model (benchmarks: force one tree per group).
        support (*optional*): the sampler's kept sets `[B, T, K]` (`MicroBatch.sampling_mask`) or a
            `TruncationFilter`: also return `log_kept_mass` (no gradient), π's log-mass on them.
        max_positions (`int`, *optional*): with `padding_free`, the most token positions (filler included) a
            chunk's packed `[K, W]` may hold (`GRPOConfig.token_budget`; `algo.packing.fit_bins`). The chunk's real
            tokens must fit in it; the padded path ignores it.
        routing (`[B, T, L, k]`, *optional*): the experts the sampler ran each completion token through, per MoE
            layer (`MicroBatch.routed_experts`; `algo.router_replay.unrouted` where it ran none): the forward passes
            route those tokens to them (prompt tokens keep the router's choice) and `TokenScores.routing` counts
            where the routers' own choice differs. With `replay=False` it only counts.
        vision (`VisionRows`, *optional*): a vision-language model's inputs of the `B` rows (`algo.vision`): each
            chunk's forward gets its own rows' images. Padded forward passes only (packing cannot isolate a row's
            images: refused; prompt sharing falls back to unshared rows with one warning).
    """
    batch_size = batch_size or input_ids.size(0)
    if vision is not None and padding_free:
        raise ValueError(
            "padding_free packs rows into shared bins, which cannot carry each row's images (pixel_values, "
            "image_grid_thw): a vision-language model trains with padded forward passes (GRPOConfig.padding_free)"
        )
    stats = RoutingStats() if routing is not None else None
    cost = None
    if share_prefix and sharing_supported(model, router):
        cost = share_prefix if isinstance(share_prefix, SharingCost) else sharing_cost(model)
    logps, entropies, aux, kept = [], [], [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start : start + batch_size]  # [b, P+T]
        am = attention_mask[start : start + batch_size]  # [b, P+T]
        sets = support[start : start + batch_size] if isinstance(support, torch.Tensor) else support  # [b, T, K]
        experts = routing[start : start + batch_size] if routing is not None else None  # [b, T, L, k]
        packed = None
        if cost is not None:
            packed = pack_shared(ids, am, logits_to_keep, cost, padding_free, max_positions)
        if packed is None and padding_free:
            packed = pack_rows(ids, am, logits_to_keep, max_positions=max_positions)
        if packed is not None:
            with _routed(model, experts, replay, stats, packed=packed):
                lp, ent, aux_loss, mass = packed_token_scores(
                    model, packed, temperature, entropy, entropy_grad, router, support=sets
                )
            logps.append(unpack_completion(lp, packed))  # [b, T]
            if ent is not None:
                entropies.append(unpack_completion(ent, packed))  # [b, T]
            if mass is not None:
                kept.append(unpack_completion(mass, packed))  # [b, T]
            aux.append(aux_loss)
            continue
        extra = {"output_router_logits": True} if router is not None else {}
        rows = None if vision is None else vision.select(slice(start, start + batch_size))
        if rows is not None:  # this chunk's own images; token types over [P+T]
            extra.update(rows.model_inputs(logits_to_keep, ids.size(1) - logits_to_keep))
        if rows is None or not rows.uses_mrope:
            # position ids that skip the left padding, so a prompt's positions don't depend on its batch-mates
            # (Qwen-VL computes its own 3-D positions from the token types, the image grids and the mask)
            extra["position_ids"] = (am.cumsum(-1) - 1).clamp(min=0)  # [b, P+T]
        with _routed(model, experts, replay, stats, attention_mask=am):
            out = model(input_ids=ids, attention_mask=am, logits_to_keep=logits_to_keep + 1, **extra)
        raw = out.logits[:, :-1, :]  # [b, T, V]
        z = scaled(raw, temperature)  # [b, T, V] what the sampler's distribution is the softmax of
        logps.append(selective_log_softmax(z, ids[:, -logits_to_keep:]))  # [b, T]
        if entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = entropy_from_logits(raw, temperature)  # [b, T]
            entropies.append(ent.masked_fill(am[:, -logits_to_keep:] == 0, 0.0))
        if support is not None:
            flat = z.detach().reshape(-1, raw.size(-1))  # [b·T, V]
            per_pos = sets.reshape(-1, sets.size(-1)) if isinstance(sets, torch.Tensor) else sets  # [b·T, K]
            mass = log_kept_mass(flat, per_pos).view(raw.shape[:2])  # [b, T]
            kept.append(mass.masked_fill(am[:, -logits_to_keep:] == 0, 0.0))
        aux.append(out.aux_loss if router is not None else None)
    return TokenScores(
        logps=torch.cat(logps, dim=0),  # [B, T]
        entropies=torch.cat(entropies, dim=0) if entropy else None,  # [B, T]
        aux_loss=torch.stack(aux).mean() if router is not None else None,
        log_kept_mass=torch.cat(kept, dim=0) if support is not None else None,  # [B, T]
        routing=stats,
    )


@contextlib.contextmanager
def _routed(model, experts, replay: bool, stats: RoutingStats | None, packed=None, attention_mask=None):
    """One forward pass's router replay (`algo.router_replay`): nothing without recorded `experts` `[b, T, L, k]`;
    else they are laid out as the pass sees its tokens (packed bins, or padded rows), replayed (or only compared,
    `replay=False`), and the comparison is added to `stats`."""
    if experts is None:
        yield
        return
    if packed is not None:
        flat, mask = routing_for_packed(experts, packed)
    else:
        flat, mask = routing_for_rows(experts, attention_mask)
    with replay_routing(model, flat, mask, apply=replay) as seen:
        yield
    stats.add(seen)


def completion_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float = 1.0,
    batch_size: int | None = None,
    padding_free: bool = False,
    share_prefix: bool = False,
    max_positions: int | None = None,
) -> torch.Tensor:
    """`score_tokens(...).logps`: `[B, T]` log-probabilities of the completion tokens (values at padded positions are
    meaningless; mask them)."""
    args = (model, input_ids, attention_mask, logits_to_keep, temperature, batch_size, padding_free)
    return score_tokens(*args, share_prefix=share_prefix, max_positions=max_positions).logps


class LogpsScorer:
    """`scorer(ids [b, P+T], mask [b, P+T], T) -> logps [b, T]` (on CPU, no grad) under the model `model()` returns
    when called (the live, possibly wrapped policy, or a frozen reference), inside `context()` if given (e.g. a PEFT
    model's `disable_adapter`, which makes the policy its own reference).

    Example:
        >>> import tempfile, torch
        >>> from transformers import AutoModelForCausalLM
        >>> from grpo_async.testing import build_tiny_model
        >>> model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tempfile.mkdtemp() + "/tiny"))
        >>> scorer = LogpsScorer(lambda: model, temperature=0.7, padding_free=False, device="cpu")
        >>> ids, mask = torch.randint(3, 20, (2, 6)), torch.ones(2, 6, dtype=torch.long)  # b = 2 rows, P + T = 6
        >>> scorer(ids, mask, 4).shape  # T = 4 completion tokens
        torch.Size([2, 4])
    """

    def __init__(
        self,
        model,
        *,
        temperature: float,
        padding_free: bool,
        device,
        context=None,
        share_prefix=False,
        max_positions: int | None = None,
    ):
        self.model, self.context = model, context
        self.temperature, self.padding_free, self.device = temperature, padding_free, device
        self.share_prefix = share_prefix
        self.max_positions = max_positions  # GRPOConfig.token_budget: positions of a packed pass, filler included

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, T: int, vision=None) -> torch.Tensor:
        return self.scores(ids, mask, T, vision=vision)[0]  # [b, T]

    @torch.no_grad()
    def scores(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        T: int,
        support=None,
        routing=None,
        replay: bool = True,
        vision=None,
    ) -> tuple:
        """`(logps [b, T], log_kept_mass [b, T] or None)` on CPU: with `support` (the sampler's kept sets `[b, T, K]`
        or a `TruncationFilter`) also the model's log-mass on them, from the same forward pass. With `routing` (the
        sampler's experts `[b, T, L, k]`, `score_tokens`) a third element, the `RoutingStats` of the pass, whose
        completion tokens ran those experts unless `replay=False`. `vision`: the rows' images (`algo.vision`)."""
        if isinstance(support, torch.Tensor):
            support = support.to(self.device)
        with self.context() if self.context is not None else contextlib.nullcontext():
            out = score_tokens(
                self.model(),
                ids.to(self.device),
                mask.to(self.device),
                T,
                self.temperature,
                padding_free=self.padding_free,
                share_prefix=self.share_prefix,
                max_positions=self.max_positions,
                support=support,
                routing=routing,
                replay=replay,
                vision=None if vision is None else vision.to(self.device),
            )
        mass = None if out.log_kept_mass is None else out.log_kept_mass.cpu()
        if routing is not None:
            return out.logps.cpu(), mass, out.routing  # [b, T], [b, T], RoutingStats
        return out.logps.cpu(), mass  # [b, T], [b, T]
