"""Collect full, HF-named parameters from the training model, whatever wraps it.

Supported: a plain model, DDP (unwrapped by accelerate), PEFT (adapters merged into the base weights, names
stripped of `base_model.model.` and `.base_layer`, adapter tensors skipped, then unmerged), DeepSpeed ZeRO-3
(parameters gathered one module at a time, never the whole model at once) and FSDP2 (`DTensor.full_tensor()`).

`iter_full_params` is a generator of `(module_name, [(hf_name, tensor), ...])` groups, in module order, so callers
can bucket by module without holding more than one module gathered at a time. Names and tensors are the checkpoint's
(`checkpoint_layout`: a mixture-of-experts model's stacked experts go out one tensor per expert, as `save_pretrained`
writes them and vLLM loads them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .buckets import module_of, single_thread
from .checkpoint_layout import checkpoint_layout as to_checkpoint_layout

PEFT_PREFIX = "base_model.model."


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a test dependency
        return False
    return isinstance(model, PeftModel)


def hf_name(name: str, peft: bool) -> str | None:
    """Map a parameter name of the training model to the HF checkpoint name vLLM expects, or None to skip it.

    >>> hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", peft=True)
    'model.layers.0.self_attn.q_proj.weight'
    >>> hf_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", peft=True) is None
    True
    """
    if peft:
        if ".lora_" in name or "lora_embedding" in name:
            return None
        if name.startswith(PEFT_PREFIX):
            name = name[len(PEFT_PREFIX) :]
        name = name.replace(".base_layer", "")
        name = name.replace(".modules_to_save.default", "")
        if ".original_module" in name:
            return None
    return name


def _cpu_single_thread(model: nn.Module):
    """On CPU, merge / unmerge / copy with one intra-op thread: hundreds of small matmuls with two threads on a busy
    2-core machine took SmolLM2's merge (210 LoRA modules) from 0.3 s to 9-15 s."""
    p = next(model.parameters(), None)
    return single_thread() if p is not None and p.device.type == "cpu" else contextlib.nullcontext()


@contextlib.contextmanager
def _merged(model: nn.Module):
    if _is_peft(model):
        with _cpu_single_thread(model):
            model.merge_adapter()
        try:
            yield
        finally:
            with _cpu_single_thread(model):
                model.unmerge_adapter()
    else:
        yield


def _gathered(params: list[nn.Parameter]):
    """ZeRO-3: gather these parameters (all ranks must call); otherwise a no-op."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def _full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # FSDP2 DTensor: a new, whole tensor
        return t.full_tensor().detach()
    if hasattr(t, "ds_id"):  # ZeRO-3: the gathered storage is released when its group ends: keep a copy
        return t.detach().clone()
    return t.detach()  # the live parameter (a view, no copy)


@torch.no_grad()
def iter_full_params(
    model: nn.Module, checkpoint_layout: bool = True
) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """Yield `(module_name, [(hf_name, full_tensor), ...])` per module, all ranks participating.

    Plain parameters are yielded as views of the live tensors (no copy); ZeRO-3 parameters are gathered one module
    at a time and copied, FSDP2's `full_tensor()` is a new tensor, so a consumer that packs a bucket of groups before
    asking for more holds about one bucket beyond the model. Under PEFT the weights the adapter is merged into
    (`.base_layer.`) are copied while merged: the merge is undone as soon as the last group has been handed out, which
    is before a bucketing consumer (`iter_buckets`) sends its final bucket, so views would arrive unmerged.

    A model whose checkpoint layout differs from its parameters (transformers 5's MoE families: stacked experts at run
    time, one tensor per expert on disk) has each group converted to the checkpoint's names and tensors, what an
    engine loads (`weight_sync.checkpoint_layout`; the converted expert tensors are copies), unless
    `checkpoint_layout=False` (the model's own parameter names, for an HF model of the same class).
    """
    peft = _is_peft(model)
    to_checkpoint = to_checkpoint_layout(model.get_base_model() if peft else model) if checkpoint_layout else None
    # Group parameters by owning module, keeping module order.
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        groups.setdefault(module_of(name), []).append((name, p))
    with _merged(model):
        for module_name, items in groups.items():
            with _gathered([p for _, p in items]):
                out = []
                for name, p in items:
                    mapped = hf_name(name, peft)
                    if mapped is not None:
                        t = _full(p)
                        if peft and ".base_layer." in name and t.data_ptr() == p.data_ptr():  # merged into
                            with _cpu_single_thread(model):
                                t = t.clone()
                        out.append((mapped, t))
                if out:
                    if to_checkpoint is not None:
                        out = to_checkpoint(out)
                    yield (hf_name(module_name + ".x", peft) or module_name).rsplit(".", 1)[0], out


@torch.no_grad()
def collect_state_dict(model: nn.Module, is_main_process: bool = True, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Full HF-named copy of the weights (PEFT merged) on `device`; every rank must call, only main gets data."""
    state: dict[str, torch.Tensor] = {}
    for _, tensors in iter_full_params(model):
        if is_main_process:
            for name, t in tensors:
                state[name] = t.to(device, copy=True)
    return state
