"""vLLM worker extension that receives weights.

Use: `--worker-extension-cls grpo_async.weight_sync.worker.WeightSyncWorker` (the default of `grpo-async serve`).

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

On CPU the MoE layers' kernels are detached for the session (`moe_reload`): vLLM then prepacks the reloaded experts
for its CPU kernel, which its weight-update path skips.

A request may carry a whole session (`begin` and `end` true, the normal case) or a part of one (one request per
bucket, what the trainer sends); any error closes the open session before it propagates.

Over `/ws/update` (`ws_update`) a full-weights session is *staged*: the buckets received are kept (views of the
broadcast buffers, copies of shared memory / CUDA IPC memory) and the model is not touched until `end`, which first
checks that the push is complete (every parameter of the served model, each fused q/k/v and gate/up shard included,
and exactly the names the trainer declared with `expect` at `begin`, when it did), then runs the reload above in one
go. An incomplete push is refused (`IncompletePushError`) and an aborted one (`abort`, an error, a sender that went
away) is dropped: the served weights and their version stay what they were. vLLM's layerwise reload cannot be undone
once a layer is whole (its old tensors are gone), so loading as the buckets arrive could leave half a push in the
model; staging costs one copy of the pushed bytes (shared memory) or none (broadcast) and the memory to hold them.
`ws_load_tensors` (colocate, in-process) loads as it goes, as before.

A LoRA session (the request carries `"lora": {"name", "id", "config"}`, see `grpo_async.weight_sync.lora`) moves the
adapter's tensors over the same transports but never touches the base weights: `begin` opens an empty adapter,
`load` copies the received tensors into it, `end` builds a vLLM `LoRAModel` from them (`LoRAModel.from_lora_tensors`,
what vLLM does with an `adapter_model.safetensors`) and installs it in the worker's LoRA manager under `id`, dropping
the policy adapters older than the previous one. A session that fails, or is closed without the `lora` spec (an
abort), installs nothing. The engine must have been started with LoRA (`enable_lora`, `--enable-lora`).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import torch

from grpo_async.parent_watch import exit_with_parent
from grpo_async.weight_sync.delta import DeltaRefused, DeltaShadow
from grpo_async.weight_sync.moe_reload import detach_cpu_moe_kernels, restore_cpu_moe_kernels
from grpo_async.weight_sync.requests import (
    IncompletePushError,
    PushCoverage,
    close_segments,
    tensor_digest,
    tied_lm_head,
    validate_lora_spec,
    validate_update_request,
)
from grpo_async.weight_sync.worker_receive import BucketReceiver

logger = logging.getLogger("grpo_async.ws_worker")


class _RotaryReloadFilter(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" on every sync: that layer has no
    checkpoint weights (its cos/sin cache is computed) and vLLM puts the cache back. Drop that one misleading line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadFilter())


class WeightSyncWorker(BucketReceiver):
    """Mixed into vLLM's worker; see the module docstring."""

    # ------------------------------------------------------------------ state helpers
    def _ws_state(self) -> dict:
        st = self.__dict__.get("_ws")
        if st is None:
            st = {"pgs": {}, "last_group": None, "open": False, "keep": [], "version": None, "lora": None, "loras": []}
            st["tied"] = None  # (LM head, HF name of the embedding it is tied to) during a full-weights session
            st["received"] = {"broadcast": 0, "shm": 0, "cuda_ipc": 0}  # buckets received, by transport
            st["staged"] = None  # a staged full-weights session: the buckets received so far, loaded at `end`
            st["names"], st["expect"] = set(), None  # names received in the open session; the trainer's `expect`
            st["coverage"] = None  # PushCoverage of the served model (computed once, outside a reload)
            st["shadow"] = DeltaShadow()  # the last weights of a delta-mode push (weight_sync/delta.py)
            self.__dict__["_ws"] = st
        return st

    def _ws_model(self):
        return self.model_runner.model

    def _ws_device(self) -> torch.device:
        dev = getattr(self, "device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    def _ws_dtype(self) -> torch.dtype:
        return self.vllm_config.model_config.dtype

    def _ws_begin(
        self,
        lora: dict | None = None,
        staged: bool = False,
        expect: list[str] | None = None,
        delta: dict | None = None,
    ) -> None:
        """Open a session: an adapter (`lora`), a staged full-weights push (`staged`: nothing touches the model before
        a complete `end`) or a direct one (each bucket loaded as it comes; colocate). `expect`: every name the push
        will send (checked at `end`). `delta` (staged only): a delta-mode push (`weight_sync.delta`), refused with
        `DeltaRefused` when it is a delta on weights this worker's copy does not hold."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        st = self._ws_state()
        if st["open"]:
            raise RuntimeError("a weight reload session is already open (begin sent twice without end)")
        st["names"], st["expect"] = set(), None if expect is None else set(expect)
        if lora is not None:  # an adapter session: the base weights stay as they are
            self._ws_lora_manager()  # fail now if the engine has no LoRA support
            st["lora"] = {}
        elif staged:
            if delta is not None:
                st["shadow"].begin(delta)
            if st["coverage"] is None:
                st["coverage"] = PushCoverage(self._ws_model())
            st["staged"] = []
        else:
            st["tied"] = tied_lm_head(self._ws_model())  # before the reload puts each layer's weights on meta
            with set_current_vllm_config(self.vllm_config):
                initialize_layerwise_reload(self._ws_model())
            st["moe_kernels"] = detach_cpu_moe_kernels(self._ws_model())
        st["open"] = True

    def _ws_load(self, named: list[tuple[str, torch.Tensor]], copy: bool = True) -> None:
        """Take one bucket: keep it (adapter, staged session; a copy unless `copy` is False, for buffers this session
        owns) or load it into the model (direct session)."""
        st = self._ws_state()
        if not st["open"]:
            raise RuntimeError("weights sent without an open reload session (send begin=true first)")
        if st["staged"] is not None and st["shadow"].open:  # delta mode: staged from the copy, updated in place
            named, copy = st["shadow"].take(named, self._ws_dtype(), copy), False
        st["names"].update(n for n, _ in named)
        if st["lora"] is not None:  # copies: the received tensors may be views of shared memory or live parameters
            st["lora"].update({n: t.detach().to("cpu", copy=True) for n, t in named})
            return
        if st["staged"] is not None:  # shared memory / CUDA IPC buffers are the trainer's, reused by its next bucket
            st["staged"].append([(n, t.detach().clone() if copy else t) for n, t in named])
            return
        self._ws_load_into_model(named, st["tied"])

    def _ws_load_into_model(self, named: list[tuple[str, torch.Tensor]], tied) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self._ws_model().load_weights(named)
            if tied is not None:  # vLLM's loader drops `lm_head.*` here: load the head from the embedding
                head, embed_name = tied
                for name, tensor in named:
                    if name == embed_name:
                        head.weight.weight_loader(head.weight, tensor)

    def _ws_check_complete(self, names: set[str], expect: set[str] | None, adapter: bool = False) -> None:
        """Raise `IncompletePushError` unless `names` are exactly the declared `expect` (when declared) and, for full
        weights, cover every parameter of the served model."""
        what = "LoRA adapter push" if adapter else "weight push"
        if expect is not None and names != expect:
            missing, extra = sorted(expect - names), sorted(names - expect)
            raise IncompletePushError(
                f"incomplete {what}: {len(missing)} of the {len(expect)} tensors declared at begin never arrived "
                f"{missing[:6]}"
                + (f", {len(extra)} arrived undeclared {extra[:6]}" if extra else "")
                + "; the served weights and version are unchanged"
            )
        if adapter:
            return
        missing = self._ws_state()["coverage"].missing(names)
        if missing:
            raise IncompletePushError(
                f"incomplete weight push: {len(missing)} parameters of the served model were not (fully) sent, e.g. "
                f"{missing[:6]}; a partial push would lose the rest of each fused layer, so it is refused and the "
                "served weights and version are unchanged (send every parameter in one push)"
            )

    def _ws_reload(self, staged: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Load a complete staged push in one layerwise-reload session."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self._ws_model()
        tied = tied_lm_head(model)  # before the reload puts each layer's weights on meta
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        moe_kernels = detach_cpu_moe_kernels(model)
        try:
            while staged:
                self._ws_load_into_model(staged.pop(0), tied)  # each bucket's memory goes once it is loaded
        finally:
            try:
                with set_current_vllm_config(self.vllm_config):
                    finalize_layerwise_reload(model, self.vllm_config.model_config)
            finally:
                restore_cpu_moe_kernels(moe_kernels)
            self._ws_reset_caches()

    def _ws_reset_caches(self) -> None:
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(self.model_runner, reset, None)
            if fn is not None:
                fn()

    def _ws_end(self, lora: dict | None = None, abort: bool = False) -> None:
        """Close the open session. `abort`: drop it (nothing is loaded or installed; a direct session, already in the
        model, is finalized). Else finalize a direct reload; check a staged push is complete (`IncompletePushError`
        if not, the session dropped) and load it; install a LoRA session's adapter when `lora` (the closing request's
        spec) is given and it is complete, else discard it (a failed or aborted push installs nothing)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        st = self._ws_state()
        if not st["open"]:
            return
        names, expect = st["names"], st["expect"]
        st["names"], st["expect"] = set(), None
        if st["lora"] is not None:
            tensors, st["lora"] = st["lora"], None
            try:
                if lora is not None and not abort:
                    self._ws_check_complete(names, expect, adapter=True)
                    self._ws_lora_install(lora, tensors)
            finally:
                st["open"] = False
                self._ws_release()
            return
        if st["staged"] is not None:
            staged, st["staged"] = st["staged"], None
            shadow = st["shadow"]
            try:
                if not abort:
                    if shadow.open and shadow.spec["mode"] == "delta":  # the tensors the delta left unchanged
                        rest = shadow.complete(names)
                        staged.append(rest)
                        names |= {n for n, _ in rest}
                    self._ws_check_complete(names, expect)
                    total = shadow.verify(shadow.expected) if shadow.open else None  # before touching the model
                    if not shadow.open:
                        shadow.drop()  # weights from a push without delta: the copy no longer matches them
                    self._ws_reload(staged)
                    if shadow.open:
                        shadow.commit(total)
            finally:
                shadow.abort()  # a push dropped or failed with its copy half-updated: the copy goes
                staged.clear()
                st["open"] = False
                self._ws_release()
            return
        st["shadow"].drop()  # a direct session (colocate) loaded weights the copy does not know
        try:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self._ws_model(), self.vllm_config.model_config)
            self._ws_reset_caches()
        finally:
            restore_cpu_moe_kernels(st.pop("moe_kernels", None))
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
        """`{"rank", "world_size", "device", "dtype", "version", "reload_open", "lora", "received", "delta"}` of this
        worker; `received`: the buckets it has received so far over each transport (`{"broadcast": n, "shm": n,
        "cuda_ipc": n}`); `dtype`: the engine's (what a delta is computed in); `delta`: its copy for delta sync
        (`{"id", "checksum", "tensors"}`, id None when it holds none)."""
        st = self._ws_state()
        return {
            "dtype": str(self._ws_dtype()).removeprefix("torch."),
            "delta": st["shadow"].info(),
            "rank": int(getattr(self, "rank", 0)),
            "world_size": int(self.vllm_config.parallel_config.world_size),
            "device": str(self._ws_device()),
            "version": st["version"],
            "reload_open": st["open"],
            "staged_buckets": len(st["staged"] or []),
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
        background: bool = False,
    ) -> dict:
        """Join the trainer's dedicated process group (gloo on CPU, NCCL on GPU) as rank `rank_offset + self.rank`.

        Uses a `TCPStore` (the trainer is master) wrapped in a `PrefixStore`; vLLM's own default group is untouched.
        `background`: join on a thread named `ws-join-<group>` and return at once with `"pending": True` (poll
        `ws_init_status`): the rendezvous waits for the trainer, and the engine, which runs this call between its
        steps, would generate nothing meanwhile.
        """
        st = self._ws_state()
        self.ws_close_broadcast(group_name)
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        args = (host, int(port), int(world_size), rank, group_name, float(timeout_s))
        if not background:
            self._ws_join(*args)
            return {"rank": rank, "world_size": int(world_size)}
        joining = {"done": False, "error": None}
        st.setdefault("joining", {})[group_name] = joining

        def run() -> None:
            try:
                if self._ws_device().type == "cuda":  # a new thread starts on the default device
                    torch.cuda.set_device(self._ws_device())
                self._ws_join(*args)
            except Exception as e:  # noqa: BLE001 - reported by ws_init_status
                joining["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            joining["done"] = True

        threading.Thread(target=run, name=f"ws-join-{group_name}", daemon=True).start()
        return {"rank": rank, "world_size": int(world_size), "pending": True}

    def ws_init_status(self, group_name: str = "grpo_async_ws") -> dict:
        """`{"done": bool, "error": str | None}` of a background `ws_init_broadcast` of `group_name`."""
        joining = self._ws_state().get("joining", {}).get(group_name)
        if joining is None:
            return {"done": True, "error": f"no join of process group {group_name!r} was started"}
        return dict(joining)

    def _ws_join(self, host: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float) -> None:
        from torch.distributed import PrefixStore, TCPStore

        timeout = timedelta(seconds=timeout_s)
        store = TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        prefixed = PrefixStore(group_name, store)
        if self._ws_device().type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            pg = ProcessGroupNCCL(prefixed, rank, world_size, ProcessGroupNCCL.Options())
        else:
            from torch.distributed import ProcessGroupGloo

            pg = ProcessGroupGloo(prefixed, rank, world_size, timeout)
        st = self._ws_state()
        st["pgs"][group_name] = (pg, store)
        st["last_group"] = group_name

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

    def ws_abort(self) -> dict:
        """Drop the open session, if any (nothing of a staged or adapter push is loaded); `{"aborted": bool}`."""
        was_open = self._ws_state()["open"]
        self._ws_end(abort=True)
        return {"aborted": was_open}

    def ws_update(self, request: dict) -> dict:
        """Receive and load buckets; `request` is the JSON body documented in `grpo_async.weight_sync.routes`.

        Returns:
            `dict`: `{"tensors": int, "bytes": int, "version": int | None, "seconds": float}` plus
            `"digests": {name: sha256}` of the tensors as received when `request["digests"]` is true, or
            `{"error": "<type>: <message>", "incomplete": bool}` when it failed (vLLM's RPC would hide the message;
            the open session has been closed either way, a staged push without loading anything).
        """
        try:
            return self._ws_update(request)
        except (IncompletePushError, DeltaRefused) as e:
            logger.warning("weight push refused: %s", e)
            return {"error": f"{type(e).__name__}: {e}", "incomplete": True, "version": self._ws_state()["version"]}
        except Exception as e:  # noqa: BLE001 - reported to the HTTP caller
            logger.exception("weight update failed")
            return {"error": f"{type(e).__name__}: {e}", "incomplete": False}

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
        owned = req["transport"] == "broadcast"  # fresh buffers per bucket: staged as they are, no copy
        try:
            if req.get("abort"):
                self._ws_end(abort=True)
                version = self._ws_state()["version"]
                return {"tensors": 0, "bytes": 0, "buckets": 0, "version": version, "aborted": True}
            if begin and load:
                try:
                    self._ws_begin(lora, staged=True, expect=req.get("expect"), delta=req.get("delta"))
                except DeltaRefused:
                    for _ in self._ws_receive(req):  # take this request's buckets: a broadcast group stays in step
                        pass
                    raise
            phases["begin"] = (t := time.perf_counter()) - t0
            for named in self._ws_receive(req):
                self._ws_state()["received"][req["transport"]] += 1
                phases["receive"] += (t1 := time.perf_counter()) - t
                count += len(named)
                nbytes += sum(x.numel() * x.element_size() for _, x in named)
                if want_digests:
                    digests.update({n: tensor_digest(x) for n, x in named})
                if load:
                    self._ws_load(named, copy=not owned)
                phases["load"] += (t := time.perf_counter()) - t1
        except BaseException:
            self._ws_end(abort=True)  # nothing of a failed push is loaded
            raise
        t = time.perf_counter()
        if end:
            shadow = self._ws_state()["shadow"]
            shadow.expected = (req.get("delta") or {}).get("checksum")
            self._ws_end(lora)  # raises IncompletePushError (session dropped, weights unchanged) when incomplete
            if req.get("version") is not None:
                self._ws_state()["version"] = req["version"]
        else:
            self._ws_release()  # staged buckets are copies: the shared memory can go
        phases["end"] = time.perf_counter() - t
        out = {"tensors": count, "bytes": nbytes, "buckets": len(layouts), "version": self._ws_state()["version"]}
        out["seconds"] = time.perf_counter() - t0
        out["phases"] = phases
        if want_digests:
            out["digests"] = digests
        if end and req.get("delta") is not None:
            out["delta"] = self._ws_state()["shadow"].info()  # the copy the push left: {"id", "checksum", "tensors"}
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


exit_with_parent()  # in vLLM engine/worker processes: exit when the process that started them dies (server_process)
