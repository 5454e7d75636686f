"""Tiny mixture-of-experts models, offline: `build_tiny_moe(path, TinyMoESpec(family=...))`.

The same kit as `build_tiny_model` (random weights, the character-level tokenizer and its chat template, a
`tiny_spec.json` marker so a second call with the same spec reuses the folder), for the MoE families vLLM 0.32 serves
on CPU (docs/moe.md): `"qwen3_moe"` (`Qwen3MoeForCausalLM`), `"olmoe"` (`OlmoeForCausalLM`), `"mixtral"`
(`MixtralForCausalLM`) and `"qwen2_moe"` (`Qwen2MoeForCausalLM`, with its shared expert).

Shapes: hidden 64, 2 heads of 32 (vLLM's CPU attention needs head_dim >= 32), 2 layers, 4 experts of which 2 route
each token, expert width 64. vLLM's CPU MoE kernel pads an expert width that is not a multiple of 32; 64 needs no
padding.

```
path/
  config.json  generation_config.json  model.safetensors  (experts saved per expert, as save_pretrained writes them)
  tokenizer.json  tokenizer_config.json  special_tokens_map.json  tiny_spec.json
```
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

#: family -> (config class, model class) in transformers
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}


@dataclass
class TinyMoESpec:
    """Shape of a tiny MoE model. `family` is a key of `MOE_FAMILIES`."""

    family: str = "qwen3_moe"
    hidden_size: int = 64
    expert_size: int = 64  # an expert's width (`moe_intermediate_size`; Mixtral, OLMoE: `intermediate_size`)
    num_experts: int = 4
    experts_per_token: int = 2
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    seed: int = 0


def _family_fields(spec: TinyMoESpec) -> dict:
    if spec.family == "qwen3_moe":
        return dict(
            moe_intermediate_size=spec.expert_size,
            intermediate_size=2 * spec.expert_size,
            num_experts=spec.num_experts,
            norm_topk_prob=True,
        )
    if spec.family == "qwen2_moe":
        return dict(
            moe_intermediate_size=spec.expert_size,
            intermediate_size=2 * spec.expert_size,
            shared_expert_intermediate_size=spec.expert_size,
            num_experts=spec.num_experts,
        )
    if spec.family == "olmoe":
        return dict(intermediate_size=spec.expert_size, num_experts=spec.num_experts)
    return dict(intermediate_size=spec.expert_size, num_local_experts=spec.num_experts)  # mixtral


def build_tiny_moe(path: str | os.PathLike, spec: TinyMoESpec | None = None, dtype: str = "float32") -> str:
    """Write a randomly initialised tiny MoE model plus the demo tokenizer to `path` (idempotent for the same spec).

    Args:
        path (`str`): folder to write; created if missing.
        spec (`TinyMoESpec`, *optional*): family and shape; defaults to a 2-layer Qwen3-MoE with 4 experts, top-2.
        dtype (`str`, *optional*, defaults to `"float32"`): weight dtype written to disk.

    Returns:
        `str`: the folder, usable as `model=` for `GRPOTrainer` and as a vLLM model path.
    """
    import torch
    import transformers

    from . import build_tokenizer, cached_folder, save_model

    spec = spec or TinyMoESpec()
    if spec.family not in MOE_FAMILIES:
        raise ValueError(f"TinyMoESpec.family must be one of {sorted(MOE_FAMILIES)}, got {spec.family!r}")
    head_dim = spec.hidden_size // spec.num_attention_heads
    if head_dim < 32:
        raise ValueError(f"head_dim {head_dim} is below 32; vLLM's CPU attention needs head_dim >= 32")
    path, marker, wanted, built = cached_folder(path, spec, dtype)
    if built:
        return path
    tokenizer = build_tokenizer()
    config_cls, model_cls = (getattr(transformers, n) for n in MOE_FAMILIES[spec.family])
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=head_dim,
        num_experts_per_tok=spec.experts_per_token,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **_family_fields(spec),
    )
    torch.manual_seed(spec.seed)
    save_model(model_cls(config).to(getattr(torch, dtype)), tokenizer, path)
    tokenizer.save_pretrained(path)
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return path
