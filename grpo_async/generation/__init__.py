"""Generation backends behind one protocol (`base.GenerationBackend`), chosen by name from a registry."""

from __future__ import annotations

from collections.abc import Callable

from .base import Completion, GenerationBackend, SamplingConfig


def _make_hf(args, model, tokenizer):
    from transformers import AutoModelForCausalLM

    from .hf import HFBackend

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(model, "peft_config"):  # generate from a plain copy of the architecture; merged weights arrive later
        base = AutoModelForCausalLM.from_config(base.config, dtype=base.dtype)
    return HFBackend(base, tokenizer, batch_size=None)


BACKENDS: dict[str, Callable] = {"hf": _make_hf}


def register_backend(name: str, factory: Callable) -> None:
    """Add a backend factory `factory(args, unwrapped_model, tokenizer) -> GenerationBackend`."""
    BACKENDS[name] = factory


def make_backend(args, model, tokenizer) -> GenerationBackend:
    """Build the backend named by `args.generation_backend`."""
    name = args.generation_backend
    if name not in BACKENDS:
        raise ValueError(f"generation_backend {name!r} is not available; registered: {sorted(BACKENDS)}")
    return BACKENDS[name](args, model, tokenizer)


__all__ = ["BACKENDS", "Completion", "GenerationBackend", "SamplingConfig", "make_backend", "register_backend"]
