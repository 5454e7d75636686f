"""Send a model's weights in its checkpoint layout, the one vLLM's loaders read.

transformers 5 converts some checkpoints as it loads them and reverts the conversion when it saves
(`transformers.conversion_mapping`): the mixture-of-experts families keep their experts as stacked 3-D parameters at
run time (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj` `[E, H, I]`) while their checkpoints hold
one tensor per expert and projection (`mlp.experts.3.gate_proj.weight`, ...); Mixtral's layers are also renamed
(`block_sparse_moe.experts.3.w1.weight` on disk, `mlp.experts.gate_up_proj` in memory). vLLM loads checkpoints: its
Mixtral knows neither the runtime names nor the stacked tensors ("There is no module or parameter named 'layers.0.mlp'
in MixtralModel"), its Qwen3-MoE and OLMoE happen to take the stacked ones too. A weight push therefore sends what
`save_pretrained` would write, computed by the same transformers function (`revert_weight_conversion`), one module
group at a time (`iter_full_params`).

Cost: the reverse conversion copies a stacked expert tensor into per-expert tensors (transformers' `Chunk` makes its
pieces contiguous): one module's experts at a time, on top of the copy a transport makes anyway. A model without
conversions (Llama, Qwen2/3 dense, ...) is sent as before, untouched.

A conversion whose reverse needs several runtime tensors (a few vision and embedding models merge q/k/v at load) cannot
be reverted module by module; such a model is sent with its runtime names, as before this module existed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

Named = list[tuple[str, torch.Tensor]]


def _conversions(model: torch.nn.Module) -> list | None:
    """The weight conversions `save_pretrained` would revert for `model` (None: nothing to revert)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers without load-time conversions
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # as `revert_weight_conversion` does for a model not made by `from_pretrained`
        try:
            conversions = get_model_conversion_mapping(model, add_legacy=False)
        except Exception:  # noqa: BLE001 - a model transformers cannot map has nothing to revert
            return None
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    return list(conversions) or None


def checkpoint_layout(model: torch.nn.Module) -> Callable[[Named], Named] | None:
    """A function from one module group `[(runtime_name, tensor), ...]` to the same weights as the checkpoint names
    and tensors `save_pretrained` writes, or None when the model needs none (no conversion, or one that cannot be
    reverted module by module).

    Example (Qwen3-MoE, 4 experts): `[("model.layers.0.mlp.experts.gate_up_proj", [4, 128, 64]), (...down_proj...)]`
    becomes 12 tensors `model.layers.0.mlp.experts.{0..3}.{gate,up,down}_proj.weight` of `[64, 64]`.
    """
    conversions = _conversions(model)
    if conversions is None:
        return None
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    merged = [
        c.source_patterns
        for c in conversions
        if isinstance(c, WeightConverter) and len(c.reverse_transform().source_patterns) > 1
    ]
    if merged:
        logger.warning(
            "weight sync sends %s's weights with their runtime names: reverting its load-time conversion %s needs "
            "tensors of several modules at once",
            type(model).__name__,
            merged[0],
        )
        return None

    def convert(named: Named) -> Named:
        out = revert_weight_conversion(model, dict(named))
        if list(out) == [n for n, _ in named]:
            return named
        return list(out.items())

    return convert
