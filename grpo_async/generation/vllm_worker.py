"""vLLM worker extension that receives weights.

Use: `--worker-extension-cls grpo_async.generation.vllm_worker.WeightSyncWorker` (the default of `grpo-async serve`).

vLLM mixes this class into its worker (`CPUWorker` / GPU `Worker`), so `self.model_runner.model` is the served model
and `self.rank` the worker's rank. Every method is prefixed `ws_` (vLLM refuses names that clash with the worker).
Methods are reached through `collective_rpc`: from `grpo-async serve`'s narrow `/ws/*` routes (JSON in, msgpack-able
dicts out) or in-process from `VLLMColocateBackend`.

One reload session (layerwise reload, the sequence that works after vLLM repacked weights for its kernels):

```
begin:  initialize_layerwise_reload(model)              # layers go to meta, loaders buffer until a layer is whole
load:   model.load_weights([(hf_name, tensor), ...])     # once per bucket; vLLM fuses q/k/v and gate/up itself
        lm_head.weight.weight_loader(embedding)         # tied LM head only (`tied_lm_head`): vLLM drops lm_head.*
end:    finalize_layerwise_reload(model, model_config)  # ALWAYS (in `finally`): otherwise the model stays on meta
```

A request may carry a whole session (`begin` and `end` true, the normal case) or a part of one (per-tensor mode used
by the benchmark); any error finalizes the open session before it propagates.

A LoRA session (the request carries `"lora": {"name", "id", "config"}`, see `grpo_async.weight_sync.lora`) moves the
adapter's tensors over the same transports but never touches the base weights: `begin` opens an empty adapter,
`load` copies the received tensors into it, `end` builds a vLLM `LoRAModel` from them (`LoRAModel.from_lora_tensors`,
what vLLM does with an `adapter_model.safetensors`) and installs it in the worker's LoRA manager under `id`, dropping
the policy adapters older than the previous one. A session that fails, or is closed without the `lora` spec (an
abort), installs nothing. The engine must have been started with LoRA (`enable_lora`, `--enable-lora`).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import time
from datetime import timedelta

import torch

from grpo_async.generation.server_process import exit_with_parent
from grpo_async.weight_sync.buckets import unpack_bucket, validate_layout

logger = logging.getLogger("grpo_async.ws_worker")


class _RotaryReloadFilter(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" on every sync: that layer has no
    checkpoint weights (its cos/sin cache is computed) and vLLM puts the cache back. Drop that one misleading line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadFilter())

TRANSPORTS = ("broadcast", "shm", "cuda_ipc")
#: what happens to requests in flight during a weight update: "wait" (they finish on the old weights first) or
#: "keep" (they are frozen, and resume on the new weights after the update: in-flight updates)
PAUSE_MODES = ("wait", "keep")


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (dtype- and shape-independent), used to prove bit-identical arrival."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()


def validate_update_request(req: object) -> dict:
    """Check a `/ws/update` request body (see `grpo_async.generation.serve`) and return it."""
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
    }
    unknown = set(req) - allowed
    if unknown:
        raise ValueError(f"unknown keys in weight-update request: {sorted(unknown)}; allowed: {sorted(allowed)}")
    if req.get("transport") not in TRANSPORTS:
        raise ValueError(f"'transport' must be one of {TRANSPORTS}, got {req.get('transport')!r}")
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
    for key in ("begin", "end", "load", "digests"):
        if key in req and not isinstance(req[key], bool):
            raise ValueError(f"'{key}' must be true or false, got {req[key]!r}")
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


class WeightSyncWorker:
    """Mixed into vLLM's worker; see the module docstring."""

    # ------------------------------------------------------------------ state helpers
    def _ws_state(self) -> dict:
        st = self.__dict__.get("_ws")
        if st is None:
            st = {"pgs": {}, "last_group": None, "open": False, "keep": [], "version": None, "lora": None, "loras": []}
            st["tied"] = None  # (LM head, HF name of the embedding it is tied to) during a full-weights session
            st["received"] = {"broadcast": 0, "shm": 0, "cuda_ipc": 0}  # buckets received, by transport
            self.__dict__["_ws"] = st
        return st

    def _ws_model(self):
        return self.model_runner.model

    def _ws_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    def _ws_begin(self, lora: dict | None = None) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        st = self._ws_state()
        if st["open"]:
            raise RuntimeError("a weight reload session is already open (begin sent twice without end)")
        if lora is not None:  # an adapter session: the base weights stay as they are
            self._ws_lora_manager()  # fail now if the engine has no LoRA support
            st["lora"] = {}
        else:
            st["tied"] = tied_lm_head(self._ws_model())  # before the reload puts each layer's weights on meta
            with set_current_vllm_config(self.vllm_config):
                initialize_layerwise_reload(self._ws_model())
        st["open"] = True

    def _ws_load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        st = self._ws_state()
        if not st["open"]:
            raise RuntimeError("weights sent without an open reload session (send begin=true first)")
        if st["lora"] is not None:  # copies: the received tensors may be views of shared memory or live parameters
            st["lora"].update({n: t.detach().to("cpu", copy=True) for n, t in named})
            return
        with set_current_vllm_config(self.vllm_config):
            self._ws_model().load_weights(named)
            if st["tied"] is not None:  # vLLM's loader drops `lm_head.*` here: load the head from the embedding
                head, embed_name = st["tied"]
                for name, tensor in named:
                    if name == embed_name:
                        head.weight.weight_loader(head.weight, tensor)

    def _ws_end(self, lora: dict | None = None) -> None:
        """Close the open session: finalize a weight reload; install a LoRA session's adapter when `lora` (the closing
        request's spec) is given, else discard it (a failed or aborted push installs nothing)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        st = self._ws_state()
        if not st["open"]:
            return
        if st["lora"] is not None:
            tensors, st["lora"] = st["lora"], None
            try:
                if lora is not None:
                    self._ws_lora_install(lora, tensors)
            finally:
                st["open"] = False
                self._ws_release()
            return
        try:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self._ws_model(), self.vllm_config.model_config)
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                fn = getattr(self.model_runner, reset, None)
                if fn is not None:
                    fn()
        finally:
            st["open"] = False
            st["tied"] = None
            self._ws_release()

    def _ws_lora_manager(self):
        mgr = getattr(self.model_runner, "lora_manager", None)
        if mgr is None:
            raise RuntimeError(
                "this vLLM engine was started without LoRA support, so it cannot take an adapter: start it with "
                "enable_lora=True (grpo-async serve --enable-lora --max-lora-rank R), or sync merged weights "
                "(GRPOConfig.vllm_lora_sync='merged')"
            )
        return mgr

    def _ws_lora_install(self, spec: dict, tensors: dict[str, torch.Tensor]) -> None:
        """Build a vLLM `LoRAModel` from the received tensors (as vLLM's own `_load_adapter` does from a folder) and
        make it the resident policy adapter; older policy adapters beyond `keep` are removed."""
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import parse_fine_tuned_lora_name

        mgr = self._ws_lora_manager()
        am = mgr._adapter_manager  # noqa: SLF001 - vLLM keeps its adapter manager here
        if not tensors:
            raise ValueError(f"LoRA adapter {spec['name']!r}: no tensors were received")
        helper = PEFTHelper.from_dict({**spec["config"], "vllm_max_position_embeddings": mgr.max_position_embeddings})
        helper.validate_legal(mgr.lora_config)
        expected = set()
        for module in am.supported_lora_modules:
            expected.update(am.packed_modules_mapping.get(module, [module]))
        model = am.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        mapper = mapper.get_rename_mapper() if mapper is not None else None
        unexpected = sorted(
            {
                m
                for m in (parse_fine_tuned_lora_name(n, mapper)[0] for n in tensors)
                if m.rsplit(".", 1)[-1] not in expected
            }
        )
        if unexpected:
            raise ValueError(
                f"LoRA adapter {spec['name']!r} adapts modules vLLM cannot adapt in this model: {unexpected[:8]} "
                f"(it adapts {sorted(expected)})"
            )
        lora = mgr._lora_model_cls.from_lora_tensors(  # noqa: SLF001
            lora_model_id=spec["id"],
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=mgr.lora_config.lora_dtype,
            model_vocab_size=mgr.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        st = self._ws_state()
        am.remove_adapter(lora.id)  # the same version sent again replaces it
        ours = [i for i in st["loras"] if i != lora.id]
        keep = max(1, min(int(spec.get("keep", 2)), am.capacity))
        for old in ours[: max(0, len(ours) - (keep - 1))]:
            am.remove_adapter(old)
        st["loras"] = [*ours[max(0, len(ours) - (keep - 1)) :], lora.id]
        am.add_adapter(lora)
        am.activate_adapter(lora.id)

    def _ws_release(self) -> None:
        """Drop views of shared memory, then close the segments (a mapped view makes `close()` raise)."""
        st = self._ws_state()
        segments = [k for k in st["keep"] if not isinstance(k, torch.Tensor)]
        st["keep"] = []
        close_segments(segments)

    # ------------------------------------------------------------------ public methods (ws_*)
    def ws_info(self) -> dict:
        """`{"rank", "world_size", "device", "version", "reload_open", "lora", "received"}` of this worker;
        `received`: the buckets it has received so far over each transport (`{"broadcast": n, "shm": n,
        "cuda_ipc": n}`)."""
        st = self._ws_state()
        return {
            "rank": int(getattr(self, "rank", 0)),
            "world_size": int(self.vllm_config.parallel_config.world_size),
            "device": str(self._ws_device()),
            "version": st["version"],
            "reload_open": st["open"],
            "lora": self._ws_lora_info(),
            "received": dict(st["received"]),
        }

    def _ws_lora_info(self) -> dict:
        """`{"enabled": False}`, or the engine's LoRA limits and the resident policy adapters."""
        cfg = getattr(self.vllm_config, "lora_config", None)
        if cfg is None or getattr(self.model_runner, "lora_manager", None) is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "max_lora_rank": int(cfg.max_lora_rank),
            "max_loras": int(cfg.max_loras),
            "max_cpu_loras": int(cfg.max_cpu_loras or cfg.max_loras),
            "adapters": list(self._ws_state()["loras"]),
        }

    def ws_init_broadcast(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int = 1,
        group_name: str = "grpo_async_ws",
        timeout_s: float = 60.0,
    ) -> dict:
        """Join the trainer's dedicated process group (gloo on CPU, NCCL on GPU) as rank `rank_offset + self.rank`.

        Uses a `TCPStore` (the trainer is master) wrapped in a `PrefixStore`; vLLM's own default group is untouched.
        """
        from torch.distributed import PrefixStore, TCPStore

        st = self._ws_state()
        self.ws_close_broadcast(group_name)
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        timeout = timedelta(seconds=float(timeout_s))
        store = TCPStore(host, int(port), int(world_size), is_master=False, timeout=timeout)
        prefixed = PrefixStore(group_name, store)
        if self._ws_device().type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            pg = ProcessGroupNCCL(prefixed, rank, int(world_size), ProcessGroupNCCL.Options())
        else:
            from torch.distributed import ProcessGroupGloo

            pg = ProcessGroupGloo(prefixed, rank, int(world_size), timeout)
        st["pgs"][group_name] = (pg, store)
        st["last_group"] = group_name
        return {"rank": rank, "world_size": int(world_size)}

    def ws_close_broadcast(self, group_name: str | None = None) -> dict:
        """Leave one process group (`group_name`), or all of them when it is None."""
        st = self._ws_state()
        names = list(st["pgs"]) if group_name is None else [group_name]
        closed = False
        for name in names:
            pg, _ = st["pgs"].pop(name, (None, None))
            if pg is not None:
                closed = True
                try:
                    if hasattr(pg, "shutdown"):
                        pg.shutdown()
                except Exception:  # noqa: BLE001 - best effort on teardown
                    pass
        return {"closed": closed}

    def ws_update(self, request: dict) -> dict:
        """Receive and load buckets; `request` is the JSON body documented in `grpo_async.generation.serve`.

        Returns:
            `dict`: `{"tensors": int, "bytes": int, "version": int | None, "seconds": float}` plus
            `"digests": {name: sha256}` of the tensors as received when `request["digests"]` is true, or
            `{"error": "<type>: <message>"}` when it failed (vLLM's RPC would hide the message; the open reload
            session has been finalized either way).
        """
        try:
            return self._ws_update(request)
        except Exception as e:  # noqa: BLE001 - reported to the HTTP caller
            logger.exception("weight update failed")
            return {"error": f"{type(e).__name__}: {e}"}

    def _ws_update(self, request: dict) -> dict:
        req = validate_update_request(request)
        t0 = time.perf_counter()
        begin, end, load = req.get("begin", True), req.get("end", True), req.get("load", True)
        want_digests = req.get("digests", False)
        layouts = req["buckets"]
        digests: dict[str, str] = {}
        phases = {"begin": 0.0, "receive": 0.0, "load": 0.0, "end": 0.0}
        count = nbytes = 0
        lora = req.get("lora")
        try:
            if begin and load:
                self._ws_begin(lora)
            phases["begin"] = (t := time.perf_counter()) - t0
            for named in self._ws_receive(req):
                self._ws_state()["received"][req["transport"]] += 1
                phases["receive"] += (t1 := time.perf_counter()) - t
                count += len(named)
                nbytes += sum(x.numel() * x.element_size() for _, x in named)
                if want_digests:
                    digests.update({n: tensor_digest(x) for n, x in named})
                if load:
                    self._ws_load(named)
                phases["load"] += (t := time.perf_counter()) - t1
        except BaseException:
            self._ws_end()  # never leave the model on meta
            raise
        t = time.perf_counter()
        if end:
            self._ws_end(lora)
            if req.get("version") is not None:
                self._ws_state()["version"] = req["version"]
        elif not load:
            self._ws_release()
        phases["end"] = time.perf_counter() - t
        out = {"tensors": count, "bytes": nbytes, "buckets": len(layouts), "version": self._ws_state()["version"]}
        out["seconds"] = time.perf_counter() - t0
        out["phases"] = phases
        if want_digests:
            out["digests"] = digests
        if req.get("lora") is not None:
            out["lora_adapters"] = list(self._ws_state()["loras"])  # the policy adapters resident after this request
        return out

    def ws_load_tensors(
        self,
        buckets,
        version: int | None = None,
        digests: bool = False,
        begin: bool = True,
        end: bool = True,
        lora: dict | None = None,
    ) -> dict:
        """In-process only (colocate): load each bucket (`list[(name, tensor)]`) in turn. A call may hold a whole
        session (`begin` and `end`, the default) or a part of one, so the trainer can stream bucket by bucket; a call
        that fails closes the session (the model never stays half-reloaded). With `lora` (see `validate_lora_spec`)
        the buckets are a LoRA adapter's tensors, installed as that adapter at `end`."""
        if lora is not None:
            validate_lora_spec(lora)
        out: dict[str, str] = {}
        count = 0
        if begin:
            self._ws_begin(lora)
        ok = False
        try:
            for named in buckets:
                if digests:
                    out.update({n: tensor_digest(t) for n, t in named})
                count += len(named)
                self._ws_load(named)
            ok = True
        finally:
            if end or not ok:
                self._ws_end(lora if ok else None)
        if version is not None:
            self._ws_state()["version"] = version
        result = {"tensors": count, "version": self._ws_state()["version"]}
        if digests:
            result["digests"] = out
        return result

    # ------------------------------------------------------------------ receivers (yield one bucket at a time)
    def _ws_receive(self, req: dict):
        kind = req["transport"]
        if kind == "broadcast":
            yield from self._ws_recv_broadcast(req["buckets"], req.get("group"))
        elif kind == "shm":
            yield from self._ws_recv_shm(req["buckets"], req["segments"])
        else:
            yield from self._ws_recv_cuda_ipc(req["buckets"], req["handles"])

    def _ws_recv_broadcast(self, layouts: list[dict], group: str | None):
        from torch.distributed import BroadcastOptions

        st = self._ws_state()
        group = group or st["last_group"]
        if group not in st["pgs"]:
            raise RuntimeError(f"broadcast update for process group {group!r}, which /ws/init_broadcast never set up")
        pg, device = st["pgs"][group][0], self._ws_device()
        opts = BroadcastOptions()
        opts.rootRank = 0

        def post(layout):
            bufs = {dt: torch.empty(n, dtype=torch.uint8, device=device) for dt, n in layout["buffers"].items()}
            works = [pg.broadcast([bufs[dt]], opts) for dt in layout["buffers"]]  # same dtype order as the sender
            return bufs, works

        # Pipeline: the receive of bucket i+1 is posted before bucket i is loaded.
        nxt = post(layouts[0]) if layouts else None
        for i, layout in enumerate(layouts):
            bufs, works = nxt
            nxt = post(layouts[i + 1]) if i + 1 < len(layouts) else None
            for w in works:
                w.wait()
            yield unpack_bucket(layout, bufs)

    def _ws_recv_shm(self, layouts: list[dict], segments: list[dict]):
        st = self._ws_state()
        for layout, seg in zip(layouts, segments):
            bufs = {}
            for dt, name in seg.items():
                shm = AttachedSegment(name)
                st["keep"].append(shm)
                if shm.size < layout["buffers"][dt]:
                    raise ValueError(f"shared-memory segment {name!r} holds {shm.size} bytes, layout needs more")
                bufs[dt] = (
                    torch.frombuffer(shm.buf, dtype=torch.uint8, count=layout["buffers"][dt])
                    if layout["buffers"][dt]
                    else torch.empty(0, dtype=torch.uint8)
                )
            yield unpack_bucket(layout, bufs)
            del bufs

    def _ws_recv_cuda_ipc(self, layouts: list[dict], handles: list[dict]):
        from grpo_async.weight_sync.transports import decode_cuda_ipc

        device = self._ws_device()
        for layout, handle in zip(layouts, handles):
            bufs = {dt: decode_cuda_ipc(handle[dt], device) for dt in layout["buffers"]}
            yield unpack_bucket(layout, bufs)


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


exit_with_parent()  # in vLLM engine/worker processes: exit when the process that started them dies (server_process)
