"""`VLLMColocateBackend(model_path)`: a `vllm.LLM` in this process; weights by in-process layerwise reload in
module-grouped buckets, or (`lora_rank=...`) a LoRA adapter by `load_adapter` (the base weights stay).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import replace

import torch

from grpo_async.gc_tuning import freeze_for_engine
from grpo_async.generation import vllm_cpu
from grpo_async.generation.base import Completion, GenerationAborted, SamplingConfig, check_completions
from grpo_async.generation.engine_loop import EngineLoop, adopt_torch_threads
from grpo_async.generation.routing_capture import RoutingRecorder
from grpo_async.generation.sampling_mask import SamplingMaskRecorder
from grpo_async.generation.vllm_common import (
    Groups,
    check_prompts,
    to_vllm_sampling_params,
)
from grpo_async.generation.vllm_images import (
    check_engine_prompts,
    engine_placeholder_words,
    engine_prompts,
    reset_vision_caches,
    suppress_words,
)
from grpo_async.weight_sync.lora import adapter_spec, vllm_max_lora_rank
from grpo_async.weight_sync.transports import ColocateTransport, ShmTransport

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- colocate
class VLLMColocateBackend:
    """A `vllm.LLM` in this process; weights loaded in place between rounds.

    The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here when unset) and weights are handed
    over by reference. With several training processes (`accelerate launch`, `torchrun`) every rank builds its own
    engine at the same point, as TRL's colocate mode does: vLLM's `external_launcher` executor, whose start-up makes
    its (one-rank) groups from the trainer's process group with collectives every rank enters. Where one rank alone
    builds an engine (the main process generating for all), those collectives would wait for the others forever:
    `separate_process=True` then runs the engine core in a child process of this rank (plus its worker process:
    vLLM's multiprocess executor) and weights travel through shared memory. On CPU the KV cache holds
    `kv_cache_seqs` requests of `max_model_len` tokens (`vllm_cpu.cpu_kv_cache_bytes`: +10%, within [64 MiB, 4 GiB
    or a quarter of the RAM]) unless `VLLM_CPU_KVCACHE_SPACE` (GiB) or `kv_cache_memory_bytes` says otherwise; vLLM's
    own CPU default would reserve `gpu_memory_utilization` of the RAM (5.4 GiB for a 2-layer model at 0.3 on 20 GiB).

    Args:
        model_path (`str`): model folder (HF format).
        dtype (`str`, *optional*, defaults to `"float32"`): vLLM weight dtype.
        max_model_len (`int`, *optional*, defaults to 1024): prompt + completion tokens.
        gpu_memory_utilization (`float`, *optional*, defaults to 0.3): share of GPU memory for vLLM (ignored on CPU).
        seed (`int`, *optional*, defaults to 0): engine seed.
        bucket_mb (`float`, *optional*, defaults to 64): weight-sync bucket size in MiB.
        enforce_eager (`bool`, *optional*, defaults to `True`): skip torch.compile / CUDA graphs (fast start).
        separate_process (`bool`, *optional*, defaults to `False`): run the engine core in a child process (when
            this rank alone builds an engine in a run of several processes).
        kv_cache_seqs (`int`, *optional*): on CPU, the requests of `max_model_len` tokens the KV cache is sized for
            (default: `max_num_seqs` if given, else 256); more at once wait for room in vLLM's scheduler.
        lora_rank (`int`, *optional*): serve the policy as the base model plus a LoRA adapter of at most this rank
            (vLLM `enable_lora`); the trainer then sends only the adapter (`load_adapter`), and every `generate` uses
            the adapter last loaded (none before the first load: the base model).
        record_routing (`bool`, *optional*, defaults to `False`): record the experts each generated token ran at
            every MoE layer (`Completion.routed_experts`, `GRPOConfig.router_replay`) with a hook on the routers of
            the engine's worker (`generation.routing_capture`); needs the worker in this process and eager mode.
        **llm_kwargs: passed to `vllm.LLM`.
    """

    takes_per_prompt_sampling = True  # `SamplingConfig.per_prompt` honoured
    #: `generate(..., images=)`: a vision-language model vLLM can load gets each prompt's images as
    #: `multi_modal_data` (`generation.vllm_images`)
    takes_images = True

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        max_model_len: int = 1024,
        gpu_memory_utilization: float = 0.3,
        seed: int = 0,
        bucket_mb: float = 64.0,
        enforce_eager: bool = True,
        separate_process: bool = False,
        kv_cache_seqs: int | None = None,
        lora_rank: int | None = None,
        record_routing: bool = False,
        **llm_kwargs,
    ):
        if record_routing and (separate_process or not enforce_eager):
            why = (
                "runs its engine in a child process here (one rank alone builds it), where the hook that records "
                "the routers cannot reach"
                if separate_process
                else "compiles the model (vllm_enforce_eager=False), and the routers' recording hook would be traced"
            )
            raise ValueError(
                f"GRPOConfig.router_replay: the in-process vLLM engine {why}; set router_replay='off'"
                + ("" if separate_process else " or vllm_enforce_eager=True")
            )
        if separate_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        else:
            if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
                raise ValueError(
                    "VLLMColocateBackend needs the in-process vLLM engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                    f"(found {os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}), or pass separate_process=True"
                )
            dist = torch.distributed
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        from vllm import LLM

        if lora_rank is not None:  # one adapter per batch; the previous one stays resident (keep=2)
            lora = {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(lora_rank), "max_loras": 1}
            llm_kwargs = {**lora, "max_cpu_loras": 2, **llm_kwargs}
        self.lora_request = None  # the policy adapter every generate uses (adapter sync), None: the base weights
        if vllm_cpu.is_cpu():
            vllm_cpu.inspect_models_in_process()
            vllm_cpu.register_kernel_overrides_once()
            # seeded requests whose prefill is cut into chunks crash vLLM CPU ("CPU Generator does not use offset");
            # whole prefills are as fast here
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            sized = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or llm_kwargs.get("kv_cache_memory_bytes") is not None
            if not sized:
                seqs = kv_cache_seqs or llm_kwargs.get("max_num_seqs")
                size = _cpu_kv_cache_size(model_path, dtype, max_model_len, seqs, llm_kwargs)
                llm_kwargs["kv_cache_memory_bytes"] = size
        if not enforce_eager and vllm_cpu.default_cpu_aot_compile(os.environ):  # a restart: inductor cache
            logger.info("VLLM_USE_AOT_COMPILE=0: vLLM's AOT compile cache does not load on CPU (set it to choose)")
        hook, single = sys.excepthook, not (torch.distributed.is_available() and torch.distributed.is_initialized())
        if not separate_process:
            forget_stale_groups()
            ensure_expert_group(model_path)
            freeze_for_engine()  # vLLM's three full collections while it loads then walk only what it makes
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="grpo_async.weight_sync.worker.WeightSyncWorker",
            **llm_kwargs,
        )
        if single and getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
            # the engine made a one-process torch.distributed group of its own, and `init_process_group` prefixed
            # every line of this process's uncaught tracebacks with `[rank0]:`: not a distributed run, no prefix
            sys.excepthook = hook
        self.separate_process = separate_process
        #: a VLM's image placeholder tokens, never sampled (`generation.vllm_images.engine_placeholder_words`)
        self.placeholder_words = engine_placeholder_words(self.llm)
        #: the sampler's kept sets (`generation.sampling_mask`): recorded in the worker, which must be in this process
        self.sampling_masks: SamplingMaskRecorder | None = None
        if separate_process:
            self.transport = ShmTransport(_EngineRpc(self.llm), bucket_mb)
        else:
            self.transport = ColocateTransport(self.llm, bucket_mb)
            recorder = SamplingMaskRecorder()
            runners = self.llm.collective_rpc(recorder.install)
            self.sampling_masks = recorder if recorder.installed else None
            if not recorder.installed:
                logger.info("the sampler's kept sets are not recorded on this engine: %s", runners)
        #: the experts each token ran (`generation.routing_capture`), when `record_routing`
        self.routing: RoutingRecorder | None = None
        self.version: int | None = None
        self._aborted = threading.Event()
        self._loop: EngineLoop | None = None  # stream mode: the thread that steps the engine (`start_streaming`)
        if record_routing:
            routing = RoutingRecorder()
            bound = self.llm.collective_rpc(routing.install)
            if not routing.installed:
                self.close()
                raise ValueError(
                    f"GRPOConfig.router_replay: the in-process vLLM engine cannot record its routing: {bound[0]}; set "
                    "router_replay='off'"
                )
            self.routing = routing

    def start_streaming(self) -> None:
        """Stream mode (`GroupStream`): from now on an engine loop thread owns the engine (`EngineLoop`); `generate`
        may be called from several threads at once, each call's requests finishing on their own, and a load runs
        between two engine steps with requests still running (every token then records its weights' version)."""
        if self._loop is None or not self._loop.is_running():
            self._loop = EngineLoop(self.llm.llm_engine, lambda: self.version).start()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, images=None) -> list[Completion]:
        """`images[k]` (`PromptImages` or None): prompt k's images, for a vision-language model."""
        check_prompts(prompt_ids)
        if self._loop is not None:
            return self._generate_streamed(prompt_ids, sampling, images)
        params = to_vllm_sampling_params(sampling)
        if sampling.seed is not None or sampling.per_prompt is not None:  # one request per prompt, its own seed
            # (its n samples: seed + j, vLLM's rule) and its own extras
            params = [to_vllm_sampling_params(sampling.for_prompt(i)) for i in range(len(prompt_ids))]
        outputs = self._run(prompt_ids, suppress_words(params, self.placeholder_words), images)
        check_engine_prompts([req.prompt_token_ids for req in outputs], prompt_ids, images)
        completions = []
        masks, routing = self.sampling_masks, self.routing
        for req in outputs:  # vLLM returns requests in submission order
            for o in sorted(req.outputs, key=lambda o: o.index):
                ids = list(o.token_ids)
                lps = [o.logprobs[i][t].logprob for i, t in enumerate(ids)] if o.logprobs is not None else []
                index = o.index if sampling.n > 1 else None  # vLLM's child request of sample `index`
                completions.append(
                    Completion(
                        completion_ids=ids,
                        logprobs=lps,
                        finish_reason="length" if o.finish_reason == "length" else "stop",
                        text=o.text,
                        sampling_mask=None if masks is None else masks.take(req.request_id, ids, index),
                        routed_experts=None
                        if routing is None
                        else routing.take(req.request_id, len(req.prompt_token_ids), len(ids), index),
                    )
                )
        return check_completions(completions, len(prompt_ids), sampling.n, "VLLMColocateBackend")

    def _generate_streamed(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, images=None
    ) -> list[Completion]:
        """`generate` through the engine loop: one request per completion (n = 1; seeded: completion j of prompt i
        samples with `seed + i·n + j`, vLLM's own rule for a request's n samples), waited for here. A prompt with
        images goes as its rendered text and images, as in `generate` (`vllm_images.engine_prompts`)."""
        if self._aborted.is_set():
            raise GenerationAborted("VLLMColocateBackend: generation aborted (shutting down)")
        n, params, prompts, rendered = sampling.n, [], [], []
        per_prompt = engine_prompts(prompt_ids, images)
        for i, p in enumerate(prompt_ids):
            own = sampling.for_prompt(i)
            for j in range(n):
                seed = None if own.seed is None else own.seed + j
                params.append(to_vllm_sampling_params(replace(own, n=1, seed=seed)))
                prompts.append(p)
                rendered.append(per_prompt[i])  # a VLM prompt's text + images as the engine takes them
        params = suppress_words(params, self.placeholder_words)  # a VLM's image placeholders
        requests = self._loop.submit(prompts, params, self.lora_request, rendered)
        masks, routing = self.sampling_masks, self.routing
        try:
            self._loop.wait(requests, self._aborted)
        except BaseException:
            for recorder in (masks, routing):
                if recorder is not None:
                    recorder.discard([r.request_id for r in requests])
            raise
        if images is not None:
            got = [r.engine_prompt_ids if r.engine_prompt is not None else r.prompt_ids for r in requests]
            check_engine_prompts(got, prompts, [images[i] for i in range(len(prompt_ids)) for _ in range(n)])
        completions = [
            Completion(
                completion_ids=r.token_ids,
                logprobs=r.logprobs,
                finish_reason=r.finish_reason or "stop",
                versions=[v if v is not None else 0 for v in r.versions],  # None: the weights it was built with
                sampling_mask=None if masks is None else masks.take(r.request_id, r.token_ids),
                routed_experts=None if routing is None else routing.take(r.request_id, len(p), len(r.token_ids)),
            )
            for r, p in zip(requests, prompts, strict=True)
        ]
        return check_completions(completions, len(prompt_ids), n, "VLLMColocateBackend")

    def _run(self, prompt_ids: list[list[int]], params, images=None) -> list:
        """`LLM.generate`, stepped here (`LLM.enqueue`, then `llm_engine.step()` until done) so that `abort()` can end
        it between two engine steps: the requests are aborted in the engine (this thread, no race with a step) and
        `GenerationAborted` is raised. Outputs in submission order."""
        if self._aborted.is_set():
            raise GenerationAborted("VLLMColocateBackend: generation aborted (shutting down)")
        adopt_torch_threads()  # the generator thread steps the engine: torch's thread count, not OpenMP's default
        llm = self.llm
        while llm.llm_engine.has_unfinished_requests():  # left by an aborted call (vLLM aborts a request with n > 1
            llm.llm_engine.step()  # by its children's ids, which enqueue does not return): finished, discarded
        for recorder in (self.sampling_masks, self.routing):
            if recorder is not None:
                recorder.clear()  # what those sampled, and what an aborted call's requests did
        prompts = engine_prompts(prompt_ids, images)  # token ids; a VLM's prompt with images: its text and images
        ids = llm.enqueue(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        engine, outputs = llm.llm_engine, []
        while engine.has_unfinished_requests():
            if self._aborted.is_set():
                engine.abort_request(ids, internal=True)
                raise GenerationAborted(f"VLLMColocateBackend: {len(ids)} requests aborted (shutting down)")
            outputs += [o for o in engine.step() if o.finished]
        return sorted(outputs, key=lambda o: int(o.request_id))  # vLLM's own order (LLM.generate)

    def abort(self) -> None:
        """Abort the `generate` call in progress after the engine step now running (any thread may call it);
        `generate` raises `GenerationAborted` until `resume()`."""
        self._aborted.set()

    def resume(self) -> None:
        self._aborted.clear()

    def _between_steps(self, fn, version: int) -> None:
        """`fn()` (a load), between two steps of the engine loop when it runs (stream mode), else now."""
        if self._loop is not None and self._loop.is_running():
            self._loop.between_steps(fn, version)
        else:
            fn()

    def load_weights(self, groups: Groups, version: int) -> None:
        def load():
            self.transport.push(groups, version)
            reset_vision_caches(self.llm)  # a VLM: no image features of the old vision tower
            if self.separate_process:
                self.llm.reset_prefix_cache()
            self.lora_request = None  # full weights are the whole policy
            self.version = version

        self._between_steps(load, version)

    def load_adapter(self, groups: Groups, config: dict, version: int) -> None:
        """Install a LoRA adapter (its `lora_A` / `lora_B` tensors, PEFT-named, and its config) as policy `version`:
        a new vLLM adapter id per version (`weight_sync.lora.adapter_spec`), used by every later `generate`."""
        self._between_steps(lambda: self._load_adapter(groups, config, version), version)

    def _load_adapter(self, groups: Groups, config: dict, version: int) -> None:
        from vllm.lora.request import LoRARequest

        spec = adapter_spec(version, config)
        self.transport.push(groups, version, lora=spec)
        reset_vision_caches(self.llm)  # an adapter on the vision tower changes the image features too
        if self.separate_process:
            self.llm.reset_prefix_cache()
        # the path is a label: the worker already holds the adapter, so vLLM never reads it
        self.lora_request = LoRARequest(spec["name"], spec["id"], f"grpo-async://{spec['name']}")
        self.version = version

    def close(self) -> None:
        """Shut the engine down (idempotent): the transport, then the engine core. Called before the trainer's
        process group is destroyed (`GRPOTrainer.end`), as the in-process engine's own groups need it."""
        self._aborted.set()
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.stop()
        transport = self.__dict__.pop("transport", None)
        if transport is not None:
            transport.close()
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # noqa: BLE001 - best effort
                logger.warning("VLLMColocateBackend.close: engine shutdown failed: %r", e)


#: vLLM's parallel groups (module globals of `vllm.distributed.parallel_state`), from the world down
VLLM_GROUPS = ("_WORLD", "_INNER_DP_WORLD", "_TP", "_ETP", "_ENGRAM_DP", "_DCP", "_PP", "_DP", "_EP", "_EPLB", "_PCP")


def forget_stale_groups() -> None:
    """Forget vLLM's parallel groups when the process group they were made in is gone, so that the next in-process
    engine makes them again.

    vLLM keeps its groups in module globals, made by the first in-process engine in the torch.distributed default
    group it joins or creates, and never destroys them (its in-process executor has no teardown). When something
    else then destroys that default group (`torch.distributed.destroy_process_group()`: a trainer's end, a test), the
    globals point at a dead group and every later engine failed at start-up ("Process group ... is not initialized in
    the world group map", or "Process group cannot be None"). The dead groups cannot be destroyed; they are dropped."""
    from vllm.distributed import parallel_state as ps

    world = ps._WORLD
    if world is None:
        return
    try:
        alive = torch.distributed.is_initialized() and torch.distributed.get_backend(world.device_group) is not None
    except (ValueError, RuntimeError, AssertionError):
        alive = False
    if not alive:
        logger.info("vLLM's parallel groups outlived their process group: forgotten, the engine makes them again")
        for name in VLLM_GROUPS:
            if hasattr(ps, name):
                setattr(ps, name, None)


def ensure_expert_group(model_path: str) -> None:
    """Give a mixture-of-experts model the expert-parallel group its in-process engine needs, when this process's
    vLLM parallel groups already exist without one.

    vLLM keeps its parallel groups in module globals, made by the first engine a process builds and reused by every
    engine built while it lives; a dense model's engine makes no expert-parallel group, so a MoE engine built beside
    it in the same process (an evaluation engine, a test) failed in its model's constructor ("expert parallel group
    is not initialized"). The group is made as vLLM's `initialize_model_parallel` makes it for data- and
    context-parallel size 1, the in-process engine's: the tensor-parallel groups. vLLM has no setter, hence its
    module global."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps._EP is not None:
        return
    from transformers import AutoConfig

    from grpo_async.algo.router_replay import is_moe_config

    if not is_moe_config(AutoConfig.from_pretrained(model_path)):
        return
    world, tp = ps.get_world_group(), ps.get_tp_group()
    groups = [list(range(s, s + tp.world_size)) for s in range(0, world.world_size, tp.world_size)]
    backend = torch.distributed.get_backend(world.device_group)
    ps._EP = ps.init_model_parallel_group(groups, world.local_rank, backend, group_name="ep")


def _cpu_kv_cache_size(model_path: str, dtype: str, max_model_len: int, seqs: int | None, llm_kwargs: dict) -> int:
    """`VLLMColocateBackend`'s KV cache on CPU: `seqs` requests of `max_model_len` tokens (see the class)."""
    import psutil

    per_token, _ = vllm_cpu.kv_bytes_per_token(
        model_path,
        dtype,
        str(llm_kwargs.get("kv_cache_dtype", "auto")),
        max_model_len,
        trust_remote_code=bool(llm_kwargs.get("trust_remote_code", False)),
        revision=llm_kwargs.get("revision"),
    )
    seqs = seqs or vllm_cpu.DEFAULT_MAX_NUM_SEQS
    size = vllm_cpu.cpu_kv_cache_bytes(per_token, max_model_len, seqs, psutil.virtual_memory().total)
    logger.info(
        "vLLM on CPU: KV cache %d MiB (%d requests x %d tokens at %d bytes/token +10%%, within [64 MiB, 4 GiB]); set "
        "VLLM_CPU_KVCACHE_SPACE or pass kv_cache_memory_bytes to choose",
        size // 2**20,
        seqs,
        max_model_len,
        per_token,
    )
    return size


class _EngineRpc:
    """What `ShmTransport` needs of a server (`post("/ws/update", body)`), answered by the engine's workers through
    `LLM.collective_rpc` instead of HTTP: the engine core in a child process maps the segments itself."""

    def __init__(self, llm):
        self.llm = llm
        self.url = "in-process engine (child process)"
        self.timeout = 600.0

    def post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        if path != "/ws/update":
            raise ValueError(f"_EngineRpc only carries /ws/update, not {path}")
        out = self.llm.collective_rpc("ws_update", kwargs={"request": body})[0]
        if "error" in out:
            raise RuntimeError(f"weight update failed in the vLLM engine: {out['error']}")
        return out


# ---------------------------------------------------------------------------------------------- HTTP backends
