"""vLLM generation backends: in-process (colocate), `grpo-async serve` servers, and any OpenAI-compatible server.

- `VLLMColocateBackend(model_path)`: a `vllm.LLM` in this process; weights by in-process layerwise reload in
  module-grouped buckets, or (`lora_rank=...`) a LoRA adapter by `load_adapter` (the base weights stay).
- `VLLMServerBackend(urls)`: `/v1/completions` on `grpo-async serve` servers, least-outstanding routing, failover;
  weights by `"broadcast"` (gloo/NCCL), `"shm"` or `"cuda_ipc"` (same machine).
  A LoRA adapter alone (`load_adapter`) goes over the same transports to servers started with `--enable-lora`.
- `OpenAIRemoteBackend(base_url, model)`: any `/v1/completions`; weights: none, or `"checkpoint_dir"` (writes
  safetensors for the remote's operator).

Sampling means the same everywhere (`SamplingConfig`): `top_k = 0`, `top_p = 1`, `min_p = 0` are off, and every
completion carries the sampler's logprob of each token under the distribution it sampled from (vLLM runs with
`logprobs_mode="processed_logprobs"`: temperature and filters applied), comparable to the trainer's
`log_softmax(logits / T)` when no filter is on.

Routing over servers (`VLLMServerBackend`): each prompt (with its `n` samples) is one request, sent to the live server
with the fewest outstanding requests. A server that fails to answer (connection error, timeout, 5xx) is taken out
of rotation with a warning and the request is retried on another; only when none is left does `generate` raise.
A server out of rotation is asked `GET /health` again at the next weight push at least `rejoin_interval` seconds
after it left (or was last asked; the probe waits at most `min(timeout, 5)` s); one that answers (restarted on the
same URL, say) receives that push with the others and rejoins the rotation when it has loaded it, so it never serves a
round on other weights than the live servers'.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import replace
from typing import Literal

import torch

from grpo_async.generation import vllm_cpu
from grpo_async.generation.base import Completion, GenerationAborted, SamplingConfig, check_completions
from grpo_async.generation.engine_loop import EngineLoop, adopt_torch_threads
from grpo_async.generation.http_client import ServerAuthError, ServerClient, ServerError
from grpo_async.generation.sampling_mask import SamplingMaskRecorder
from grpo_async.weight_sync.buckets import NamedTensors, iter_buckets
from grpo_async.weight_sync.lora import adapter_spec, vllm_max_lora_rank
from grpo_async.weight_sync.names import WIRE_TRANSPORTS, WireTransport, check_transport
from grpo_async.weight_sync.transports import ColocateTransport, ShmTransport, make_transport

logger = logging.getLogger("grpo_async.vllm_backends")

Groups = Iterable[tuple[str, NamedTensors]]


def validate_sampling(s: SamplingConfig) -> SamplingConfig:
    """Raise `ValueError` naming the field of `SamplingConfig` that no backend can honour."""
    if not (isinstance(s.n, int) and s.n >= 1):
        raise ValueError(f"SamplingConfig.n must be an integer ≥ 1, got {s.n!r}")
    if not (isinstance(s.max_tokens, int) and s.max_tokens >= 1):
        raise ValueError(f"SamplingConfig.max_tokens must be an integer ≥ 1, got {s.max_tokens!r}")
    if not s.temperature >= 0:
        raise ValueError(f"SamplingConfig.temperature must be ≥ 0, got {s.temperature!r}")
    if not 0 < s.top_p <= 1:
        raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {s.top_p!r}")
    if not (isinstance(s.top_k, int) and s.top_k >= 0):
        raise ValueError(f"SamplingConfig.top_k must be an integer ≥ 0 (0 = off), got {s.top_k!r}")
    if not 0 <= s.min_p <= 1:
        raise ValueError(f"SamplingConfig.min_p must be in [0, 1], got {s.min_p!r}")
    if s.stop is not None and not (isinstance(s.stop, list) and all(isinstance(x, str) for x in s.stop)):
        raise ValueError(f"SamplingConfig.stop must be a list of strings or None, got {s.stop!r}")
    if not s.repetition_penalty > 0:
        raise ValueError(f"SamplingConfig.repetition_penalty must be > 0 (1.0 = off), got {s.repetition_penalty!r}")
    if s.extra is not None and not (isinstance(s.extra, dict) and all(isinstance(k, str) for k in s.extra)):
        raise ValueError(f"SamplingConfig.extra (generation_kwargs) must be a dict keyed by name, got {s.extra!r}")
    return s


def model_head_dim(config) -> int | None:
    """Attention head size of a HF config: `head_dim`, else `hidden_size // num_attention_heads`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d = getattr(text, "head_dim", None)
    if d is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        d = text.hidden_size // text.num_attention_heads
    return d


def check_vllm_can_serve(config, where: str = "VLLMColocateBackend") -> None:
    """Refuse, before an engine is built, a model whose head size vLLM's CPU attention cannot serve (on GPU the
    attention backend is picked per model by vLLM itself, which then reports it)."""
    if torch.cuda.is_available():
        return
    d = model_head_dim(config)
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if d is not None and d not in sizes:
        raise ValueError(
            f"{where}: the model's attention head size is {d} (head_dim, or hidden_size / num_attention_heads), "
            f"which vLLM's CPU attention cannot serve; it supports head sizes {sizes}. Use generation_backend='hf' "
            "or a model with a supported head size."
        )


def _check_prompts(prompt_ids) -> None:
    if not isinstance(prompt_ids, list) or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt_ids
    ):
        raise ValueError("prompt_ids must be a list of non-empty lists of token ids (int)")


def to_vllm_sampling_params(s: SamplingConfig):
    """`SamplingConfig` → `vllm.SamplingParams` with `logprobs=0` (the sampled token's logprob only)."""
    from vllm import SamplingParams

    validate_sampling(s)
    fields = dict(
        n=s.n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,  # vLLM: 0 = off
        min_p=s.min_p,
        stop=s.stop,
        seed=s.seed,
        repetition_penalty=s.repetition_penalty,
        logprobs=0,
    )
    return SamplingParams(**{**fields, **(s.extra or {})})  # the extras override the fields (as in a request body)


def to_completions_body(model: str, prompt: list[int], s: SamplingConfig) -> dict:
    """`/v1/completions` body for one tokenized prompt; filters that are off are left out (portable)."""
    validate_sampling(s)
    body = {
        "model": model,
        "prompt": prompt,
        "n": s.n,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "logprobs": 0,
        "return_token_ids": True,  # vLLM extension
        "return_tokens_as_token_ids": True,  # fallback: tokens come back as "token_id:<id>"
    }
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.min_p > 0:
        body["min_p"] = s.min_p
    if s.stop:
        body["stop"] = s.stop
    if s.seed is not None:
        body["seed"] = s.seed
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty  # vLLM extension
    body.update(s.extra or {})
    return body


def parse_completions_response(resp, n: int, where: str) -> list[Completion]:
    """The `n` choices of one `/v1/completions` answer, in choice-index order.

    Raises `ServerError` (status `None`, i.e. "the server is broken") naming `where` when the answer does not have the
    documented shape: the router then takes that server out of rotation instead of training on garbage.
    """

    def bad(what: str):
        return ServerError(f"{where} returned a malformed /v1/completions answer: {what}")

    if not isinstance(resp, dict) or not isinstance(resp.get("choices"), list):
        raise bad(f"expected a JSON object with a 'choices' list, got {str(resp)[:200]!r}")
    if not all(isinstance(c, dict) for c in resp["choices"]):
        raise bad("'choices' holds something other than objects")
    choices = sorted(resp["choices"], key=lambda c: c.get("index", 0) if isinstance(c.get("index"), int) else 0)
    if len(choices) != n:
        raise bad(f"{len(choices)} choices for n={n}")
    out = []
    for c in choices:
        lp = c.get("logprobs") or {}
        if not isinstance(lp, dict):
            raise bad(f"'logprobs' is a {type(lp).__name__}, not an object")
        ids = c.get("token_ids")
        if ids is None:
            toks = lp.get("tokens") or []
            if not all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
                raise bad("no token ids (needs vLLM's return_token_ids or return_tokens_as_token_ids)")
            ids = [int(t.split(":", 1)[1]) for t in toks]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad(f"token_ids is not a list of ints: {str(ids)[:100]!r}")
        logprobs = lp.get("token_logprobs")
        if logprobs is None:
            raise bad("no logprobs (the request had logprobs=0)")
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            raise bad(f"{len(ids)} token ids but logprobs {str(logprobs)[:100]!r}")
        try:
            logprobs = [float(x) for x in logprobs]
        except (TypeError, ValueError) as e:
            raise bad(f"logprobs are not numbers ({e})") from None
        if not all(math.isfinite(x) and x <= 1e-3 for x in logprobs):  # NaN, ±inf, or a log-probability above 0
            raise bad(f"logprobs must be finite and <= 0, got {logprobs[:8]}")
        finish = c.get("finish_reason") or "stop"
        out.append(
            Completion(
                completion_ids=list(ids),
                logprobs=logprobs,
                finish_reason="length" if finish == "length" else "stop",
                text=c.get("text") if isinstance(c.get("text"), str) else None,
            )
        )
    return out


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
        **llm_kwargs: passed to `vllm.LLM`.
    """

    takes_per_prompt_sampling = True  # `SamplingConfig.per_prompt` honoured

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
        **llm_kwargs,
    ):
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
        self.separate_process = separate_process
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
        self.version: int | None = None
        self._aborted = threading.Event()
        self._loop: EngineLoop | None = None  # stream mode: the thread that steps the engine (`start_streaming`)

    def start_streaming(self) -> None:
        """Stream mode (`GroupStream`): from now on an engine loop thread owns the engine (`EngineLoop`); `generate`
        may be called from several threads at once, each call's requests finishing on their own, and a load runs
        between two engine steps with requests still running (every token then records its weights' version)."""
        if self._loop is None or not self._loop.is_running():
            self._loop = EngineLoop(self.llm.llm_engine, lambda: self.version).start()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        _check_prompts(prompt_ids)
        if self._loop is not None:
            return self._generate_streamed(prompt_ids, sampling)
        params = to_vllm_sampling_params(sampling)
        if sampling.seed is not None or sampling.per_prompt is not None:  # one request per prompt, its own seed
            # (its n samples: seed + j, vLLM's rule) and its own extras
            params = [to_vllm_sampling_params(sampling.for_prompt(i)) for i in range(len(prompt_ids))]
        outputs = self._run(prompt_ids, params)
        completions = []
        masks = self.sampling_masks
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
                    )
                )
        return check_completions(completions, len(prompt_ids), sampling.n, "VLLMColocateBackend")

    def _generate_streamed(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        """`generate` through the engine loop: one request per completion (n = 1; seeded: completion j of prompt i
        samples with `seed + i·n + j`, vLLM's own rule for a request's n samples), waited for here."""
        if self._aborted.is_set():
            raise GenerationAborted("VLLMColocateBackend: generation aborted (shutting down)")
        n, params, prompts = sampling.n, [], []
        for i, p in enumerate(prompt_ids):
            own = sampling.for_prompt(i)
            for j in range(n):
                seed = None if own.seed is None else own.seed + j
                params.append(to_vllm_sampling_params(replace(own, n=1, seed=seed)))
                prompts.append(p)
        requests = self._loop.submit(prompts, params, self.lora_request)
        masks = self.sampling_masks
        try:
            self._loop.wait(requests, self._aborted)
        except BaseException:
            if masks is not None:
                masks.discard([r.request_id for r in requests])
            raise
        completions = [
            Completion(
                completion_ids=r.token_ids,
                logprobs=r.logprobs,
                finish_reason=r.finish_reason or "stop",
                versions=[v if v is not None else 0 for v in r.versions],  # None: the weights it was built with
                sampling_mask=None if masks is None else masks.take(r.request_id, r.token_ids),
            )
            for r in requests
        ]
        return check_completions(completions, len(prompt_ids), n, "VLLMColocateBackend")

    def _run(self, prompt_ids: list[list[int]], params) -> list:
        """`LLM.generate`, stepped here (`LLM.enqueue`, then `llm_engine.step()` until done) so that `abort()` can end
        it between two engine steps: the requests are aborted in the engine (this thread, no race with a step) and
        `GenerationAborted` is raised. Outputs in submission order."""
        if self._aborted.is_set():
            raise GenerationAborted("VLLMColocateBackend: generation aborted (shutting down)")
        adopt_torch_threads()  # the generator thread steps the engine: torch's thread count, not OpenMP's default
        llm = self.llm
        while llm.llm_engine.has_unfinished_requests():  # left by an aborted call (vLLM aborts a request with n > 1
            llm.llm_engine.step()  # by its children's ids, which enqueue does not return): finished, discarded
        if self.sampling_masks is not None:
            self.sampling_masks.clear()  # what those sampled, and what an aborted call's requests did
        ids = llm.enqueue(
            [{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False, lora_request=self.lora_request
        )
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
class _CompletionsRouter:
    """Least-outstanding routing of `/v1/completions` requests over live servers, with failover."""

    def __init__(self, clients: list[ServerClient], model: str | None, max_concurrency: int, name: str):
        self.clients = list(clients)
        self.live = list(clients)
        self.outstanding = {c.url: 0 for c in clients}
        self.served = {c.url: 0 for c in clients}
        self.errors: dict[str, str] = {}  # url -> why it left the rotation
        self.left_at: dict[str, float] = {}  # url -> when it left the rotation, or was last probed (monotonic)
        self.lock = threading.Lock()
        self.name = name
        self.model = model
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"{name}-http")
        self.aborted = threading.Event()  # set by the backend's abort(): generate stops waiting for its requests

    @property
    def live_urls(self) -> list[str]:
        with self.lock:
            return [c.url for c in self.live]

    def pick(self) -> ServerClient:
        """The live server with the fewest outstanding requests (ties: first listed); counts the request."""
        with self.lock:
            if not self.live:
                why = "; ".join(f"{u}: {e}" for u, e in self.errors.items())
                raise RuntimeError(
                    f"{self.name}: no vLLM server left in rotation (all of {[c.url for c in self.clients]} "
                    f"stopped answering or answered garbage){': ' + why if why else ''}"
                )
            client = min(self.live, key=lambda c: self.outstanding[c.url])
            self.outstanding[client.url] += 1
            return client

    def done(self, client: ServerClient) -> None:
        with self.lock:
            self.outstanding[client.url] -= 1
            self.served[client.url] += 1

    def mark_dead(self, client: ServerClient, error: Exception) -> None:
        with self.lock:
            self.errors[client.url] = str(error)
            self.left_at[client.url] = time.monotonic()
            if client in self.live:
                self.live.remove(client)
                logger.warning(
                    "%s: taking %s out of rotation (%s); %d server(s) left",
                    self.name,
                    client.url,
                    error,
                    len(self.live),
                )

    def answering_again(self, interval: float, timeout: float) -> list[ServerClient]:
        """The servers out of rotation, last seen at least `interval` seconds ago, that answer `GET /health` now
        (each probe waits at most `timeout` seconds). They are not put back: `rejoin` does, once they hold the
        current weights."""
        now = time.monotonic()
        with self.lock:
            due = [c for c in self.clients if c not in self.live and now - self.left_at.get(c.url, 0.0) >= interval]
        back = []
        for client in due:
            try:
                client.get("/health", timeout=timeout)
                back.append(client)
            except ServerError as e:
                logger.info("%s: %s still out of rotation (%s)", self.name, client.url, e)
            with self.lock:
                self.left_at[client.url] = time.monotonic()
        return back

    def rejoin(self, client: ServerClient) -> None:
        """Put a server that answers again (and holds the current weights) back into the rotation."""
        with self.lock:
            if client not in self.live:
                self.live.append(client)
                self.live.sort(key=self.clients.index)
                self.errors.pop(client.url, None)
                live = len(self.live)
                logger.warning("%s: %s rejoined the rotation; %d server(s) live", self.name, client.url, live)

    def _one(self, prompt: list[int], sampling: SamplingConfig) -> list[Completion]:
        body = None
        while True:
            client = self.pick()
            try:
                body = body or to_completions_body(self.model, prompt, sampling)
                resp = client.post("/v1/completions", body)
                return parse_completions_response(resp, sampling.n, client.url)
            except ServerError as e:
                if e.status is not None and e.status < 500:
                    raise  # our request is wrong; another server would refuse it too
                self.mark_dead(client, e)
            finally:
                self.done(client)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        _check_prompts(prompt_ids)
        validate_sampling(sampling)
        # seeded: each request its own seed (`SamplingConfig.for_prompt`); without it, G copies of a prompt (n = 1)
        # would sample the same completion
        futures = [self.pool.submit(self._one, p, sampling.for_prompt(i)) for i, p in enumerate(prompt_ids)]
        pending = set(futures)
        while pending:  # every request bounded by the client timeout; `abort()` stops the wait within 0.25 s
            if self.aborted.is_set():
                for f in pending:
                    f.cancel()
                raise GenerationAborted(f"{self.name}: generation aborted (shutting down), {len(pending)} requests")
            _, pending = wait(pending, timeout=0.25, return_when=FIRST_EXCEPTION)
            if any(f.done() and not f.cancelled() and f.exception() is not None for f in futures):
                break
        out: list[Completion] = []
        for f in futures:  # each request is bounded by the client timeout (and retried at most once per server)
            out.extend(f.result())
        return check_completions(out, len(prompt_ids), sampling.n, self.name)

    def close(self) -> None:
        """Cancel queued requests and close the clients (idempotent); requests on the wire end by their timeout."""
        self.aborted.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()


def _discard(transport) -> None:
    """Release a server transport without a goodbye request when it has `discard` (`WeightTransport`), else `close`."""
    getattr(transport, "discard", transport.close)()


def _model_name(client: ServerClient) -> str:
    resp = client.get("/v1/models")
    data = resp.get("data") if isinstance(resp, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    if not isinstance(first, dict) or not isinstance(first.get("id"), str):
        raise ServerError(f"{client.url}/v1/models lists no model (answer: {str(resp)[:200]!r})")
    return data[0]["id"]


class VLLMServerBackend:
    """Generate on one or more `grpo-async serve` servers; push weights to every live server.

    Args:
        urls (`list[str]`): server base URLs, e.g. `["http://127.0.0.1:8000"]`.
        api_key (`str`, *optional*): the servers' `--api-key`.
        timeout (`float`, *optional*, defaults to 120): seconds any request (generation or weight push) may take.
        transport (`str`, *optional*, defaults to `"broadcast"`): a wire transport (`weight_sync.names`):
            `"broadcast"` (gloo on CPU / NCCL on GPU, works for remote servers), `"shm"` (CPU, same machine),
            `"cuda_ipc"` (GPU, same machine), or `"none"` (generation only: `load_weights` raises).
        bucket_mb (`float`, *optional*, defaults to 64): weight-sync bucket size in MiB.
        model (`str`, *optional*): served model name; asked from `/v1/models` when omitted.
        max_concurrency (`int`, *optional*, defaults to 16): requests in flight over all servers.
        master_address (`str`, *optional*): this process's address as the servers see it (broadcast only: the
            trainer hosts the process group's store). Default: found per server (`address_seen_by`: `127.0.0.1`
            for a loopback server, else this machine's address on the route to it).
        inflight_updates (`bool`, *optional*, defaults to `False`): `update_weights` may run while `generate` is in
            progress; the servers freeze running requests, load, and continue them on the new weights (vLLM pause
            mode "keep"). Off: requests in flight finish on the old weights before the load starts.
        group_timeout (`float`, *optional*, defaults to 60): broadcast only: seconds the process group waits for a
            server's workers (to join, or to receive a bucket) before the push fails and that server leaves rotation.
        rejoin_interval (`float` or `None`, *optional*, defaults to 10): a server out of rotation (or not answering
            at construction) is probed with `GET /health` at the next weight push at least this many seconds after
            it left or was last probed (the probe waits at most `min(timeout, 5)` s); one that answers gets that push
            and rejoins the rotation once it has loaded it. `None`: a server that left never comes back.
    """

    takes_per_prompt_sampling = True  # `SamplingConfig.per_prompt` honoured

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        transport: WireTransport | Literal["none"] = "broadcast",
        bucket_mb: float = 64.0,
        model: str | None = None,
        max_concurrency: int = 16,
        master_address: str | None = None,
        inflight_updates: bool = False,
        group_timeout: float = 60.0,
        rejoin_interval: float | None = 10.0,
    ):
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("VLLMServerBackend needs at least one server url")
        check_transport(transport, (*WIRE_TRANSPORTS, "none"), f"{type(self).__name__} transport")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if rejoin_interval is not None and not rejoin_interval >= 0:
            raise ValueError(f"rejoin_interval must be seconds >= 0 or None (never), got {rejoin_interval!r}")
        clients = [ServerClient(u, api_key=api_key, timeout=timeout) for u in urls]
        live, why, left_out = [], [], {}
        for c in clients:
            try:
                c.get("/health", timeout=min(timeout, 10.0))
                model = model or _model_name(c)
                live.append(c)
            except ServerAuthError as e:  # running, but the key is wrong: not "not answering"
                logger.warning("VLLMServerBackend: %s left out of rotation: %s", c.url, e)
                why.append(f"{c.url} refused the API key (HTTP {e.status}): {e}")
                left_out[c.url] = e
            except ServerError as e:
                if e.status == 503 and "weight reload session" in str(e):  # a dead trainer's push: ours drops it
                    logger.warning("VLLMServerBackend: %s: %s; the first push replaces that session", c.url, e)
                    model = model or _model_name(c)
                    live.append(c)
                    continue
                logger.warning("VLLMServerBackend: %s is not answering (%s); left out of rotation", c.url, e)
                why.append(f"{c.url} is not answering: {e}")
                left_out[c.url] = e
        if not live:
            raise RuntimeError(f"VLLMServerBackend: none of the servers {urls} answered /health: {'; '.join(why)}")
        self.router = _CompletionsRouter(clients, model, max_concurrency, "VLLMServerBackend")
        for c in clients:
            if c.url in left_out:
                self.router.mark_dead(c, left_out[c.url])
        self.rejoin_interval = rejoin_interval
        self.router_timeout = float(timeout)
        self.base_model = model  # the router asks for the policy adapter's name instead after load_adapter
        self._lora_checked = False
        self.transport_name = transport
        self.bucket_mb = bucket_mb
        self.master_address = master_address
        self.inflight_updates = inflight_updates
        self.group_timeout = float(group_timeout)
        self.transports: dict[str, object] = {}
        self.version: int | None = None

    @property
    def live_urls(self) -> list[str]:
        return self.router.live_urls

    def start_streaming(self) -> None:
        """Stream mode: nothing to start; `generate` already takes calls from several threads at once (each request
        its own HTTP call, `max_concurrency` at a time)."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        return self.router.generate(prompt_ids, sampling)

    def _transport(self, client: ServerClient, device: torch.device):
        tr = self.transports.get(client.url)
        if tr is None:
            kwargs = {}
            if self.transport_name == "broadcast":
                kwargs = {"master_address": self.master_address, "device": device, "group_timeout": self.group_timeout}
            elif self.transport_name == "cuda_ipc":
                kwargs = {"device": device}
            tr = make_transport(self.transport_name, client, self.bucket_mb, **kwargs)
            tr.pause = "keep" if self.inflight_updates else "wait"
            self.transports[client.url] = tr
        return tr

    def load_weights(self, groups: Groups, version: int) -> None:
        """Stream the groups to every live server at once, bucket by bucket (the groups are produced once: each
        bucket goes to every server before the next is asked for); a server that fails leaves the rotation."""
        self._push(groups, version)
        self.router.model = self.base_model  # full weights are the whole policy

    def load_adapter(self, groups: Groups, config: dict, version: int) -> None:
        """Send only a LoRA adapter (PEFT-named `lora_A` / `lora_B` tensors and its config) to every live server,
        over the same transport as full weights; each installs it as model `policy-v<version>`, which every later
        completion request asks for. The servers must run with `--enable-lora --max-lora-rank R` (R >= the adapter's
        rank), and with `--max-cpu-loras 2` for in-flight updates (a request frozen mid-update resumes on the adapter
        it started with, which must still be resident)."""
        spec = adapter_spec(version, config)
        if not self._lora_checked:
            self._check_lora(config)
        self._push(groups, version, lora=spec)
        self.router.model = spec["name"]

    def _check_lora(self, config: dict) -> None:
        rank = max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])
        for client in list(self.router.live):
            workers = client.get("/ws/info").get("workers") or [{}]
            lora = workers[0].get("lora") or {}
            problem = None
            if not lora.get("enabled"):
                problem = "was started without LoRA support"
            elif lora["max_lora_rank"] < rank:
                problem = f"serves LoRA ranks up to {lora['max_lora_rank']}, the adapter has rank {rank}"
            elif self.inflight_updates and lora["max_cpu_loras"] < 2:
                problem = "keeps one adapter (--max-cpu-loras 1); in-flight updates need the previous one resident"
            if problem:
                flags = f"--enable-lora --max-lora-rank {vllm_max_lora_rank(rank)} --max-cpu-loras 2"
                raise RuntimeError(
                    f"VLLMServerBackend: LoRA adapter sync to {client.url}: the server {problem}. Start it with "
                    f"`grpo-async serve ... {flags}`, or sync merged weights (GRPOConfig.vllm_lora_sync='merged')"
                )
        self._lora_checked = True

    def _push(self, groups: Groups, version: int, lora: dict | None = None) -> None:
        if self.transport_name == "none":
            raise RuntimeError(
                f"{type(self).__name__}(transport='none') generates only (GRPOConfig.weight_sync_transport='none'): "
                "it takes no weights; build it with a wire transport ('broadcast', 'shm', 'cuda_ipc') to push them"
            )
        errors: list[str] = []
        sessions = {}
        for client in list(self.router.live):
            sessions[client.url] = (client, None)
        returning = []
        if self.rejoin_interval is not None:  # servers that answer again get this push, then rejoin the rotation
            returning = self.router.answering_again(self.rejoin_interval, min(self.router_timeout, 5.0))
            for client in returning:
                stale = self.transports.pop(client.url, None)  # a restarted server knows nothing of the old one
                if stale is not None:
                    _discard(stale)
                sessions[client.url] = (client, None)

        def drop(url: str, e: BaseException) -> None:
            client, _ = sessions.pop(url)
            errors.append(f"{url}: {e}")
            self.router.mark_dead(client, e)
            tr = self.transports.pop(url, None)
            if tr is not None:
                _discard(tr)  # it stopped answering: no goodbye request (another timeout)

        def each(fn) -> None:
            for url, (client, _) in list(sessions.items()):
                try:
                    fn(url, client)
                except (ServerError, RuntimeError, OSError) as e:
                    drop(url, e)

        def open_stream(url, client):
            sessions[url] = (client, self._transport(client, device).stream(version, lora=lora))

        device = None
        for bucket in iter_buckets(groups, self.bucket_mb):
            if device is None:
                device = bucket[0][1].device
                each(open_stream)
            each(lambda url, client, b=bucket: sessions[url][1].send(b))
        if device is None:  # a model without parameters: nothing to send, still close the session
            device = torch.device("cpu")
            each(open_stream)
        each(lambda url, client: sessions[url][1].close())
        for client in returning:
            if client.url in sessions:  # loaded this push: serves the next rounds
                self.router.rejoin(client)
        if not self.router.live:
            raise RuntimeError(
                f"VLLMServerBackend: no vLLM server left in rotation while pushing weights version {version} "
                f"(all of {[c.url for c in self.router.clients]} stopped answering); last errors: {errors}"
            )
        self.version = version

    def abort(self) -> None:
        """Stop waiting for the `generate` call in progress (any thread may call it): it raises `GenerationAborted`
        within 0.25 s, until `resume()`; requests already on the wire end on the server."""
        self.router.aborted.set()

    def resume(self) -> None:
        self.router.aborted.clear()

    def close(self) -> None:
        """Close the weight transports and the router (idempotent)."""
        for tr in self.transports.values():
            tr.close()
        self.transports.clear()
        self.router.close()


class OpenAIRemoteBackend:
    """Generation on any OpenAI-compatible `/v1/completions` server (vLLM, SGLang, TGI, a hosted API).

    Remote engines cannot take IPC handles or join our process group: `weight_sync` is `"none"` (generation only;
    `load_weights` raises) or `"checkpoint_dir"` (each update is written as `checkpoint_dir/version-<v>/
    model.safetensors` plus `latest` pointing at it, for the remote's operator to reload).

    Args:
        base_url (`str`): e.g. `"http://host:8000"` or `"http://host:8000/v1"`.
        model (`str`): model name sent with each request.
        api_key (`str`, *optional*): bearer token.
        weight_sync (`str`, *optional*, defaults to `"none"`): `"none"` or `"checkpoint_dir"` (the names of
            `weight_sync.names`); `"broadcast"`, `"shm"`, `"cuda_ipc"` and any other value raise `ValueError`.
        checkpoint_dir (`str`, *optional*): required with `weight_sync="checkpoint_dir"`.
        timeout (`float`, *optional*, defaults to 120): seconds per request.
        max_concurrency (`int`, *optional*, defaults to 8): requests in flight.

    Sampler logprobs are what the remote returns; only a vLLM started with `--logprobs-mode processed_logprobs`
    returns temperature-scaled ones.
    """

    takes_per_prompt_sampling = True  # `SamplingConfig.per_prompt` honoured

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        weight_sync: Literal["none", "checkpoint_dir"] = "none",
        checkpoint_dir: str | None = None,
        timeout: float = 120.0,
        max_concurrency: int = 8,
    ):
        if weight_sync not in ("none", "checkpoint_dir"):
            raise ValueError(
                f"OpenAIRemoteBackend cannot sync weights with {weight_sync!r}: a remote OpenAI-compatible engine "
                "takes neither IPC handles (shm/cuda_ipc) nor a process-group broadcast. Use weight_sync='none' "
                "(generation only), weight_sync='checkpoint_dir', or VLLMServerBackend with a grpo-async serve server."
            )
        if weight_sync == "checkpoint_dir" and not checkpoint_dir:
            raise ValueError("OpenAIRemoteBackend(weight_sync='checkpoint_dir') needs checkpoint_dir=<folder>")
        if not model:
            raise ValueError("OpenAIRemoteBackend needs the model name to send (model=...)")
        base = base_url.rstrip("/")
        base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.router = _CompletionsRouter(
            [ServerClient(base, api_key=api_key, timeout=timeout)], model, max_concurrency, "OpenAIRemoteBackend"
        )
        self.weight_sync = weight_sync
        self.checkpoint_dir = checkpoint_dir
        self.version: int | None = None

    def start_streaming(self) -> None:
        """Stream mode: as `VLLMServerBackend.start_streaming` (concurrent calls are already safe)."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]:
        return self.router.generate(prompt_ids, sampling)

    def load_weights(self, groups: Groups, version: int) -> None:
        """`checkpoint_dir`: write `version-<v>/` as safetensors shards (one per bucket, with the standard
        `model.safetensors.index.json`), then point `latest` at it."""
        if self.weight_sync == "none":
            raise RuntimeError(
                "OpenAIRemoteBackend(weight_sync='none') is generation-only and cannot receive weights; "
                "use weight_sync='checkpoint_dir' or a VLLMServerBackend"
            )
        import json

        from safetensors.torch import save_file

        folder = os.path.join(self.checkpoint_dir, f"version-{version}")
        os.makedirs(folder, exist_ok=True)
        weight_map, total = {}, 0
        for i, bucket in enumerate(iter_buckets(groups, 1024.0)):
            name = f"model-{i + 1:05d}.safetensors"
            save_file({k: v.detach().contiguous().cpu() for k, v in bucket}, os.path.join(folder, name))
            weight_map.update(dict.fromkeys((k for k, _ in bucket), name))
            total += sum(v.numel() * v.element_size() for _, v in bucket)
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        tmp = os.path.join(self.checkpoint_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(f"version-{version}\n")
        os.replace(tmp, os.path.join(self.checkpoint_dir, "latest"))
        self.version = version

    def abort(self) -> None:
        """As `VLLMServerBackend.abort`."""
        self.router.aborted.set()

    def resume(self) -> None:
        self.router.aborted.clear()

    def close(self) -> None:
        self.router.close()
