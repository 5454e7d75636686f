"""What a weight push request is, apart from the engine that applies it: the `/ws/update` body's validation (the API
server checks it before any worker sees it; the worker checks it again), the LoRA spec, which parameters a push
covered (`PushCoverage`: a push that misses some is refused, not half-applied), the shared-memory segments a worker
maps, and the digest that proves bit-identical arrival. No vLLM import: the API server process uses it too."""

from __future__ import annotations

import gc
import hashlib
import logging

import torch

from grpo_async.weight_sync.buckets import validate_layout
from grpo_async.weight_sync.delta import validate_delta_spec
from grpo_async.weight_sync.names import WIRE_TRANSPORTS

logger = logging.getLogger("grpo_async.ws_worker")

#: what happens to requests in flight during a weight update: "wait" (they finish on the old weights first) or
#: "keep" (they are frozen, and resume on the new weights after the update: in-flight updates)
PAUSE_MODES = ("wait", "keep")


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (dtype- and shape-independent), used to prove bit-identical arrival."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def validate_update_request(req: object) -> dict:
    """Check a `/ws/update` request body (see `grpo_async.weight_sync.routes`) and return it."""
    if not isinstance(req, dict):
        raise ValueError("the weight-update request must be a JSON object")
    allowed = {
        "transport",
        "buckets",
        "version",
        "begin",
        "end",
        "load",
        "digests",
        "segments",
        "handles",
        "group",
        "pause",
        "lora",
        "session",
        "abort",
        "expect",
        "delta",
    }
    unknown = set(req) - allowed
    if unknown:
        raise ValueError(f"unknown keys in weight-update request: {sorted(unknown)}; allowed: {sorted(allowed)}")
    if req.get("transport") not in WIRE_TRANSPORTS:
        raise ValueError(f"'transport' must be one of {WIRE_TRANSPORTS}, got {req.get('transport')!r}")
    buckets = req.get("buckets")
    if not isinstance(buckets, list):
        raise ValueError("'buckets' must be a list of bucket layouts")
    for b in buckets:
        validate_layout(b)
    version = req.get("version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise ValueError(f"'version' must be an integer, got {version!r}")
    if "group" in req and not isinstance(req["group"], str):
        raise ValueError(f"'group' must be the group_name given to /ws/init_broadcast, got {req['group']!r}")
    if "lora" in req:
        validate_lora_spec(req["lora"])
    if req.get("pause", "wait") not in PAUSE_MODES:
        raise ValueError(f"'pause' must be one of {PAUSE_MODES}, got {req['pause']!r}")
    if "session" in req and not (isinstance(req["session"], str) and 0 < len(req["session"]) <= 64):
        raise ValueError(f"'session' must be the id /ws/update answered at begin, got {req['session']!r:.80}")
    expect = req.get("expect")
    if expect is not None and not (isinstance(expect, list) and all(isinstance(n, str) and n for n in expect)):
        raise ValueError("'expect' must list the tensor names the push will send (strings)")
    if expect is not None and not req.get("begin", True):
        raise ValueError("'expect' is declared with begin=true (the first request of a push)")
    for key in ("begin", "end", "load", "digests", "abort"):
        if key in req and not isinstance(req[key], bool):
            raise ValueError(f"'{key}' must be true or false, got {req[key]!r}")
    if "delta" in req:  # a delta-mode push (weight_sync.delta)
        validate_delta_spec(req["delta"], req)
    if req["transport"] == "shm":
        segs = req.get("segments")
        if not isinstance(segs, list) or len(segs) != len(buckets):
            raise ValueError("'segments' must list one {dtype: shared-memory name} object per bucket")
        for seg, layout in zip(segs, buckets):
            if not isinstance(seg, dict) or set(seg) != set(layout["buffers"]):
                raise ValueError("each 'segments' entry must name one shared-memory segment per dtype buffer")
            if not all(isinstance(v, str) and v and "/" not in v for v in seg.values()):
                raise ValueError("shared-memory segment names must be non-empty strings without '/'")
    if req["transport"] == "cuda_ipc":
        handles = req.get("handles")
        if not isinstance(handles, list) or len(handles) != len(buckets):
            raise ValueError("'handles' must list one {dtype: ipc handle} object per bucket")
    return req


def validate_lora_spec(spec: object) -> dict:
    """Check the `lora` part of a weight-update request: `{"name": str, "id": int >= 1, "config": {...}}` plus an
    optional `"keep"` (policy adapters kept resident, the new one included; default 2)."""
    if not isinstance(spec, dict) or not {"name", "id", "config"} <= set(spec) or set(spec) - LORA_SPEC_KEYS:
        raise ValueError(f"'lora' must be an object with keys name, id, config (optional keep), got {spec!r:.200}")
    if not isinstance(spec["name"], str) or not spec["name"]:
        raise ValueError(f"'lora.name' must be a non-empty string, got {spec['name']!r}")
    for key, low in (("id", 1), ("keep", 1)):
        v = spec.get(key, low)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"'lora.{key}' must be an integer >= {low}, got {v!r}")
    cfg = spec["config"]
    if not isinstance(cfg, dict) or not {"r", "lora_alpha", "target_modules"} <= set(cfg):
        raise ValueError("'lora.config' must be the adapter's config with at least r, lora_alpha, target_modules")
    return spec


LORA_SPEC_KEYS = {"name", "id", "config", "keep"}


class IncompletePushError(ValueError):
    """A push closed (`end`) without every tensor the served model needs, or not exactly the names the trainer
    declared with `expect`; the session is dropped and the served weights stay as they were."""


class PushCoverage:
    """Which HF checkpoint tensors a vLLM model needs, and which of them a set of received names misses.

    vLLM loads fused parameters from several checkpoint tensors (`qkv_proj` from `q_proj`, `k_proj`, `v_proj`;
    `gate_up_proj` from `gate_proj`, `up_proj`), one shard each. Every parameter of the served model must be covered,
    each fused one by all of its shards; names are mapped as vLLM's loader maps them (the model's
    `hf_to_vllm_mapper`, else its `packed_modules_mapping`). A tied LM head is the embedding (one parameter).

    A mixture-of-experts layer stacks its experts: `w13_weight` `[E, 2I, H]` (each expert's gate and up projection)
    and `w2_weight` `[E, H, I]`. Its shards are `expert e w1` / `w3` / `w2`, read off the layer's own expert mapping
    (`get_expert_mapping(include_fused=True)`, what its loader matches names against): a per-expert checkpoint tensor
    (`mlp.experts.3.gate_proj.weight`) covers one shard of one expert, a stacked one (`mlp.experts.gate_up_proj`, how
    transformers 5 keeps experts at run time) its shards of every expert.

    Example (a 1-layer Llama): receiving every checkpoint tensor but `model.layers.0.self_attn.k_proj.weight` gives
    `missing(...) == ["model.layers.0.self_attn.qkv_proj.weight (shard 'k' missing)"]`.
    """

    def __init__(self, model: torch.nn.Module):
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        self.mapper = mapper if hasattr(mapper, "map_name") else None
        stacked = dict(getattr(self.mapper, "orig_to_new_stacked", None) or {})
        if not stacked:  # a model without a stacked mapper: its packed modules name the shards
            for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
                stacked.update({f".{part}": (f".{fused}", part) for part in parts})
        self.stacked = {sub: (new, str(shard)) for sub, (new, shard) in stacked.items()}
        self.needed: dict[str, frozenset[str]] = {}
        for name, _ in model.named_parameters():  # shared parameters (a tied head) are listed once
            self.needed[name] = frozenset(sh for new, sh in self.stacked.values() if f"{new}." in f"{name}.")
        self.experts = [_ExpertLayer(name, m) for name, m in _expert_layers(model)]
        for layer in self.experts:
            self.needed.update(layer.needed)

    def target(self, hf_name: str) -> tuple[str, str | None] | None:
        """`(vLLM parameter name, shard)` a checkpoint tensor is loaded into, None when vLLM ignores it."""
        shard = next((sh for sub, (_, sh) in self.stacked.items() if f"{sub}." in f"{hf_name}."), None)
        if self.mapper is not None:
            name = self.mapper.map_name(hf_name)
            return None if name is None else (name, shard)
        for sub, (new, sh) in self.stacked.items():
            if f"{sub}." in f"{hf_name}.":
                return hf_name.replace(f"{sub}.", f"{new}.", 1), sh
        return hf_name, None

    def targets(self, hf_name: str) -> list[tuple[str, str | None]]:
        """Every `(vLLM parameter name, shard)` a checkpoint tensor is loaded into (several for stacked experts)."""
        mapped = self.mapper.map_name(hf_name) if self.mapper is not None else hf_name
        if mapped is None:
            return []
        for layer in self.experts:
            if mapped.startswith(layer.prefix):
                return layer.targets(mapped)
        t = self.target(hf_name)
        return [] if t is None else [t]

    def missing(self, names) -> list[str]:
        """The served model's parameters (and fused shards) that `names` (HF checkpoint names) do not cover."""
        got: dict[str, set] = {}
        for n in names:
            for name, shard in self.targets(n):
                got.setdefault(name, set()).add(shard)
        out = []
        for name, shards in self.needed.items():
            if name not in got:
                out.append(name)
            elif shards - got[name]:
                lost = sorted(shards - got[name])
                more = f" and {len(lost) - 4} more" if len(lost) > 4 else ""
                out.append(f"{name} (shard {', '.join(repr(x) for x in lost[:4])}{more} missing)")
        return out


def _expert_layers(model) -> list[tuple[str, object]]:
    """vLLM's MoE expert layers in `model`: the modules that hold stacked expert weights and load them by their expert
    mapping (`RoutedExperts` in vLLM 0.32; `FusedMoE` before)."""
    named_modules = getattr(model, "named_modules", None)
    out = []
    for name, module in named_modules() if callable(named_modules) else ():
        if (
            callable(getattr(module, "get_expert_mapping", None))
            and isinstance(getattr(module, "layer_name", None), str)
            and "w13_weight" in getattr(module, "_parameters", {})
        ):
            out.append((name, module))
    return out


class _ExpertLayer:
    """One MoE layer's coverage: its served parameters' shards, and the shards a checkpoint name fills, matched the
    way the layer's loader matches them (`RoutedExperts.load_weights`: the layer name, then the expert mapping's
    checkpoint names as substrings; a name with an expert index takes that expert's entries, one without is a stack of
    every expert)."""

    def __init__(self, module_name: str, layer):
        self.layer_name = layer.layer_name  # the names its loader sees start with it (the MoE block's module path)
        self.prefix = self.layer_name + "."
        self.module_name = module_name  # where its parameters are in `named_parameters()`
        self.params = set(layer._parameters)
        self.mapping = list(layer.get_expert_mapping(include_fused=True))
        self.by_expert: dict[str, list] = {}
        self.shards: dict[str, set[str]] = {}  # parameter -> every expert's shards
        for param, weight, expert, shard in self.mapping:
            key = weight.partition(".")[2].partition(".")[0]
            if key.isdecimal():  # a per-expert entry (`experts.3.gate_proj.` -> `experts.w13_`): this expert's shard
                self.by_expert.setdefault(key, []).append((param, weight, expert, shard))
                attr = param.partition("experts.")[2] + "weight"  # what `...experts.3.gate_proj.weight` loads into
                self.shards.setdefault(attr, set()).add(f"expert {expert} {shard}")
        self.needed = {f"{module_name}.{p}": frozenset(s) for p, s in self.shards.items() if p in self.params}

    def targets(self, name: str) -> list[tuple[str, str]]:
        key = name.partition("experts.")[2].partition(".")[0]
        named = self.by_expert.get(key) if name.count("experts.") == 1 else None
        out = []
        for param, weight, expert, shard in named or self.mapping:
            if weight not in name:
                continue
            attr = name.replace(weight, param).removeprefix(self.prefix)
            if attr not in self.params:
                continue
            if named:  # one expert's tensor
                out.append((f"{self.module_name}.{attr}", f"expert {expert} {shard}"))
            else:  # stacked: this shard of every expert
                shards = self.shards.get(attr, ())
                out += [(f"{self.module_name}.{attr}", s) for s in shards if s.endswith(f" {shard}")]
        if not out:  # not an expert weight (a bias, a scale): the parameter of that name, whole
            out.append((f"{self.module_name}.{name.removeprefix(self.prefix)}", None))
        return out


def close_segments(segments) -> None:
    """Close shared-memory segments whose views were dropped (a view still referenced makes `close()` raise: collect
    cycles once and retry, else leave the segment to the garbage collector with a warning)."""
    for shm in segments:
        try:
            shm.close()
        except BufferError:  # a view is still referenced: collect cycles once, then try again
            gc.collect()
            try:
                shm.close()
            except BufferError:
                logger.warning("shared-memory segment %s still has views; left to the garbage collector", shm.name)


class AttachedSegment:
    """A POSIX shared-memory segment the trainer created, mapped here read-write without registering it with
    Python's resource tracker (`SharedMemory(name=...)` does on Python < 3.13): the trainer owns and unlinks it.
    Registering and then unregistering it here would take the trainer's own registration out of a tracker this
    process shares with it (an engine process started by `multiprocessing`), and the trainer's later `unlink` would
    make the tracker print a `KeyError` traceback at exit."""

    def __init__(self, name: str):
        import _posixshmem
        import mmap
        import os

        self.name = name
        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            self.buf = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap (raises `BufferError` while a view of `buf` is alive, like `SharedMemory.close`)."""
        self.buf.close()


def tied_lm_head(model) -> tuple[torch.nn.Module, str] | None:
    """`(lm_head, "model.embed_tokens.weight")` when vLLM serves `model` with its LM head tied to the input embedding
    (one parameter: SmolLM2, Gemma, Qwen2.5-0.5B, ...), else None. Call it outside a reload session.

    vLLM's `load_weights` drops `lm_head.*` for such a model (the head *is* the embedding), so a layerwise reload sees
    no weights for the head layer: it would warn "ParallelLMHead: Failed to load weights", put the head's old tensors
    back and keep its old CPU matmul kernel (prepacked from the weight at load time: the sampler would score every
    token with the old output embedding; measured on SmolLM2 before the head was reloaded: logprobs off by up to 1.7
    after one push). The worker therefore feeds the received embedding to the head's own weight loader as well: the
    reload then processes the head like any other layer (its kernel prepared from the new weight), and says nothing.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(head, "weight", None)
    if weight is None or embed is None or weight is not getattr(embed, "weight", None):
        return None
    return head, "model.embed_tokens.weight"
