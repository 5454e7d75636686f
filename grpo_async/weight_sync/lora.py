"""LoRA adapter-only weight sync: what the trainer sends to a vLLM sampler when it trains a PEFT LoRA adapter.

With `GRPOConfig.vllm_lora_sync` resolving to `"adapter"` (see `lora_sync_mode`), a publish sends only the adapter's
`lora_A` / `lora_B` tensors and its config; the sampler's engine keeps the base weights it loaded at start-up (the
same checkpoint the trainer's frozen base came from) and serves the policy as base + LoRA (vLLM's `enable_lora`).
Every publish installs a new adapter id (`adapter_spec`), so vLLM's prefix cache (keyed by adapter) never serves KV
computed with an older adapter. The merged path (`"merged"`: `merge_adapter()`, push every full weight, unmerge)
stays available.

```txt
trainer (PeftModel)                                     sampler worker (vLLM, enable_lora)
iter_adapter_params ─▶ buckets of lora_A/lora_B ─▶ transport (in-process / shm / broadcast / cuda_ipc)
                                                  ─▶ LoRAModel.from_lora_tensors(id = LORA_ID_BASE + version)
                                                  ─▶ adapter manager: add + activate; older ones dropped
generate(...) with LoRARequest("policy-v<version>", id)   # the base weights never move
```

Tensor names follow PEFT's saved-adapter format (`base_model.model.<module>.lora_A.weight`, adapter name removed),
which vLLM parses like an `adapter_model.safetensors`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .buckets import module_of
from .collect import _full, _gathered, _is_peft

LORA_SYNC_MODES = ("auto", "adapter", "merged")
#: first vLLM LoRA id used for the policy (id = LORA_ID_BASE + version): far above the ids vLLM gives adapters loaded
#: with `--lora-modules` or its runtime API, so they never collide
LORA_ID_BASE = 1 << 20
#: the `max_lora_rank` values vLLM accepts (`vllm.config.lora.MaxLoRARanks`)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: PEFT init methods that modify the base weights (the served base would no longer match): merged sync only
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq")
#: config fields vLLM's `PEFTHelper` reads
_CONFIG_KEYS = (
    "r",
    "lora_alpha",
    "target_modules",
    "bias",
    "modules_to_save",
    "use_rslora",
    "use_dora",
    "lora_bias",
    "init_lora_weights",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
)


def _active(model) -> str:
    name = model.active_adapter
    return name if isinstance(name, str) else name[0]


def _plain(v):
    """JSON-able copy of a PEFT config value (sets → sorted lists, enums → their value)."""
    if isinstance(v, (set, frozenset)):
        return sorted(_plain(x) for x in v)
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if hasattr(v, "value") and not isinstance(v, (int, float, str, bool)):
        return v.value
    return v


def adapter_config(model: nn.Module) -> dict:
    """The active LoRA adapter's config as plain JSON values, restricted to the fields vLLM reads."""
    cfg = model.peft_config[_active(model)]
    return {k: _plain(getattr(cfg, k)) for k in _CONFIG_KEYS if hasattr(cfg, k)}


def adapter_max_rank(model: nn.Module) -> int:
    """The largest LoRA rank of the active adapter (`r`, or a larger one from `rank_pattern`)."""
    cfg = model.peft_config[_active(model)]
    return max([int(cfg.r), *(int(r) for r in (getattr(cfg, "rank_pattern", None) or {}).values())])


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})")


def adapter_problem(model: nn.Module) -> str | None:
    """Why vLLM cannot serve this model's adapter as an adapter (the merged sync still can), or None if it can."""
    if not _is_peft(model):
        return "the model has no PEFT adapter"
    cfg = model.peft_config[_active(model)]
    peft_type = str(getattr(getattr(cfg, "peft_type", None), "value", getattr(cfg, "peft_type", "")))
    if peft_type != "LORA":
        return f"the adapter is {peft_type}, not LoRA"
    if len(model.peft_config) > 1:
        return f"the model holds {len(model.peft_config)} adapters (one is served)"
    if getattr(cfg, "use_dora", False):
        return "vLLM does not serve DoRA adapters"
    if getattr(cfg, "bias", "none") != "none" or getattr(cfg, "lora_bias", False):
        return "vLLM does not serve LoRA biases (bias / lora_bias)"
    if getattr(cfg, "modules_to_save", None):
        return f"modules_to_save={cfg.modules_to_save} trains full modules, which vLLM's LoRA does not take"
    if getattr(cfg, "layer_replication", None):
        return "vLLM does not serve layer_replication"
    init = getattr(cfg, "init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        return f"init_lora_weights={init!r} modifies the base weights"
    if any("lora_embedding" in n or "lora_magnitude" in n for n, _ in model.named_parameters()):
        return "the adapter has embedding (or DoRA magnitude) parameters; vLLM's LoRA sync here takes linear layers"
    if adapter_max_rank(model) > VLLM_LORA_RANKS[-1]:
        return f"rank {adapter_max_rank(model)} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})"
    return None


def lora_sync_mode(args, model: nn.Module) -> str | None:
    """How the policy reaches the sampler: `"adapter"`, `"merged"`, or `None` when the model has no PEFT adapter.

    `args.vllm_lora_sync`: `"auto"` is `"adapter"` for the in-process `vllm` backend when vLLM can serve the adapter
    (else `"merged"`), and `"merged"` for everything else (a `vllm_server` must be started with `--enable-lora`,
    which the trainer cannot know from its config: ask for `"adapter"` there). `"adapter"` raises `ValueError` when
    the adapter cannot be served as one. The result depends on the config and model only, so every process agrees.
    """
    mode = getattr(args, "vllm_lora_sync", "auto")
    if not _is_peft(model):
        if mode == "adapter":
            raise ValueError("GRPOConfig.vllm_lora_sync='adapter' needs a PEFT LoRA model (pass peft_config)")
        return None
    if mode == "merged":
        return "merged"
    vllm = args.generation_backend in ("vllm", "vllm_server") and args.weight_sync_transport != "none"
    problem = adapter_problem(model) or (None if vllm else f"generation_backend={args.generation_backend!r}")
    if mode == "adapter":
        if problem:
            raise ValueError(f"GRPOConfig.vllm_lora_sync='adapter' is not possible: {problem}; use 'merged'")
        return "adapter"
    return "adapter" if problem is None and args.generation_backend == "vllm" else "merged"


def adapter_spec(version: int, config: dict) -> dict:
    """The adapter a publish installs: `{"name": "policy-v<version>", "id": LORA_ID_BASE + version, "config"}`."""
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"the policy version must be an int >= 0, got {version!r}")
    return {"name": f"policy-v{version}", "id": LORA_ID_BASE + version, "config": dict(config)}


def peft_tensor_name(name: str, adapter: str) -> str | None:
    """PEFT's saved-adapter name of a LoRA parameter of the training model, or None for any other parameter.

    >>> peft_tensor_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "default")
    'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    >>> peft_tensor_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "default") is None
    True
    """
    for part in ("lora_A", "lora_B"):
        key = f".{part}.{adapter}."
        if key in name:
            return name.replace(key, f".{part}.")
    return None


@torch.no_grad()
def iter_adapter_params(model: nn.Module) -> Iterator[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """Yield `(module_name, [(peft_name, tensor), ...])` for the active adapter's `lora_A` / `lora_B` only, module by
    module, all ranks participating (ZeRO-3 gathers just these modules; FSDP2 `full_tensor()`s). Plain parameters
    are views of the live tensors (no copy)."""
    adapter = _active(model)
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        peft = peft_tensor_name(name, adapter)
        if peft is not None:  # grouped by the adapted module (its lora_A and lora_B together)
            groups.setdefault(module_of(module_of(peft)), []).append((name, p))
    for module_name, items in groups.items():
        with _gathered([p for _, p in items]):
            yield module_name, [(peft_tensor_name(n, adapter), _full(p)) for n, p in items]
