"""Generation backends behind one protocol (`base.GenerationBackend`), chosen by name from a registry.

The registry (`registry.py`) holds one `BackendSpec` per backend: its factory, the weight-sync transports it takes and
why, whether its engine lives in the training process and whether it streams. The built-ins are registered here with
the same `register_backend` a user calls. `GRPOConfig` only names a backend and checks it against its spec.
"""

from __future__ import annotations

from ..vision_processor import placeholder_words
from .base import Completion, GenerationBackend, SamplingConfig
from .registry import BackendSpec, backend_spec, register_backend, registered_backends, unregister_backend


def base_model(model):
    """The plain architecture under a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _make_hf(args, model, tokenizer, model_path: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from ..vision_processor import is_vision_config
    from .hf import HFBackend

    base = base_model(model)
    if hasattr(model, "peft_config"):  # generate from a plain copy of the architecture; merged weights arrive later
        auto = AutoModelForImageTextToText if is_vision_config(base.config) else AutoModelForCausalLM
        base = auto.from_config(base.config, dtype=base.dtype)
    return HFBackend(base, tokenizer, batch_size=None, record_routing=args.router_replay != "off")


def _torch_dtype_name(model) -> str:
    return str(getattr(model, "dtype", "float32")).removeprefix("torch.")


def _vllm_max_model_len(args, model) -> int:
    """`vllm_max_model_length`, or prompt + completion capped at the model's position limit."""
    if args.vllm_max_model_length is not None:
        return args.vllm_max_model_length
    want = (args.max_prompt_length or 1024) + args.max_completion_length
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config  # a VLM's
    limit = getattr(text, "max_position_embeddings", None)
    return min(want, limit) if limit else want


def _lora_rank(args, model) -> int | None:
    """The adapter's rank when the policy reaches vLLM as a LoRA adapter (`GRPOConfig.vllm_lora_sync`), else None."""
    from ..weight_sync.lora import adapter_max_rank, lora_sync_mode

    return adapter_max_rank(model) if lora_sync_mode(args, model) == "adapter" else None


def _make_vllm_colocate(args, model, tokenizer, model_path: str, separate_process: bool = False):
    from .vllm_colocate import VLLMColocateBackend

    base = base_model(model)
    return VLLMColocateBackend(
        model_path,
        dtype=_torch_dtype_name(base) if args.vllm_dtype == "auto" else args.vllm_dtype,
        max_model_len=_vllm_max_model_len(args, base),
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        seed=args.seed,
        bucket_mb=args.weight_sync_bucket_mb,
        trust_remote_code=args.trust_remote_code,  # off unless the user asked for it
        enforce_eager=args.vllm_enforce_eager,
        lora_rank=_lora_rank(args, model),  # adapter sync: the engine serves base + LoRA
        separate_process=separate_process,
        record_routing=args.router_replay != "off",  # GRPOConfig.router_replay: a hook in the engine's worker
        # on CPU the KV cache holds a round's rows and those generated ahead of it (more wait in vLLM's scheduler)
        kv_cache_seqs=args.generation_batch_size * (args.num_batches_ahead + 1),
    )


def _make_vllm_server(args, model, tokenizer, model_path: str):
    import torch

    from ..weight_sync.names import server_transport
    from .stock_server import detect_server_kind
    from .vllm_server import VLLMServerBackend

    urls = list(args.server_urls)
    transport = server_transport(args.weight_sync_transport, urls, cuda=torch.cuda.is_available())
    if detect_server_kind(urls[0], args.vllm_api_key) == "stock":  # a plain `vllm serve` / `trl vllm-serve`
        return _make_stock_server(args, urls, transport, placeholder_words(getattr(model, "config", None), tokenizer))
    return VLLMServerBackend(
        urls,
        api_key=args.vllm_api_key,
        timeout=args.vllm_server_timeout,
        transport=transport,
        bucket_mb=args.weight_sync_bucket_mb,
        max_concurrency=args.vllm_max_concurrency,
        master_address=args.vllm_master_address,
        inflight_updates=args.weight_sync_inflight,
        delta=args.weight_sync_delta,
        delta_full_every=args.weight_sync_delta_full_every,
        bad_words=placeholder_words(getattr(model, "config", None), tokenizer),
    )


def _make_stock_server(args, urls: list[str], transport: str, bad_words: list[str]):
    """A stock vLLM server (no `/ws/*` routes): weights through vLLM's RL API into our `grpo_async` weight-transfer
    engine, over shared memory ('ipc' / 'auto' on this machine; CUDA IPC is not among them) or a gloo broadcast (see
    `stock_server`); 'none': generation only."""
    from .stock_server import StockVLLMServerBackend

    return StockVLLMServerBackend(
        urls,
        api_key=args.vllm_api_key,
        timeout=args.vllm_server_timeout,
        transport="shm" if transport == "cuda_ipc" else transport,
        bucket_mb=args.weight_sync_bucket_mb,
        max_concurrency=args.vllm_max_concurrency,
        master_address=args.vllm_master_address,
        inflight_updates=args.weight_sync_inflight,
        delta=args.weight_sync_delta,  # refused: a stock server takes whole pushes only
        bad_words=bad_words,
    )


def _make_openai(args, model, tokenizer, model_path: str):
    import os

    from .openai_remote import OpenAIRemoteBackend

    checkpoint = args.weight_sync_transport == "checkpoint_dir"  # 'auto' and 'none': generation only
    return OpenAIRemoteBackend(
        args.openai_base_url,
        args.openai_model or model_path,
        api_key=args.vllm_api_key,
        weight_sync="checkpoint_dir" if checkpoint else "none",
        checkpoint_dir=os.path.join(args.output_dir, "sampler_weights") if checkpoint else None,
        timeout=args.vllm_server_timeout,
        max_concurrency=args.vllm_max_concurrency,
        bad_words=placeholder_words(getattr(model, "config", None), tokenizer),  # empty for a text model
    )


#: every backend, built-in or registered: what it is and what it can do, in one place (`registry.BackendSpec`)
for _spec in (
    BackendSpec(
        "hf",
        _make_hf,
        weight_sync=("auto", "none"),
        why="the sampler lives in this process and is updated in place",
        in_process=True,
        records_routing=True,
        runs_on_caller=True,  # `model.generate` on the calling thread
    ),
    BackendSpec(
        "vllm",
        _make_vllm_colocate,
        weight_sync=("auto", "none"),
        why="the engine lives in this process and loads the weights in place",
        in_process=True,
        streams=True,
        records_routing=True,
        # rounds mode steps the engine on the calling thread (`VLLMColocateBackend._run`; with its engine core in a
        # child process, the main process generating for several, that thread only waits there)
        runs_on_caller=True,
    ),
    BackendSpec(
        "vllm_server",
        _make_vllm_server,
        weight_sync=("auto", "broadcast", "ipc", "none"),
        why="a grpo-async serve server takes a broadcast or, on this machine, shared memory / CUDA IPC; "
        "it does not watch a checkpoint folder",
        streams=True,
        delta=True,
    ),
    BackendSpec(
        "openai",
        _make_openai,
        weight_sync=("auto", "checkpoint_dir", "none"),
        why="a remote OpenAI-compatible engine can neither join a process group nor map this machine's memory; "
        "it can only reload a shared checkpoint folder",
        streams=True,
    ),
):
    register_backend(_spec)


def make_backend(args, model, tokenizer, model_path: str | None = None) -> GenerationBackend:
    """Build the backend named by `args.generation_backend`."""
    return backend_spec(args.generation_backend).factory(args, model, tokenizer, model_path)


def make_trainer_backend(args, model, tokenizer, model_source: str | None, *, alone: bool = False):
    """The backend a trainer generates with: `(backend, temporary folder to delete at close or None)`.

    `alone`: this process is the only one of several to build an engine (the main process generating for all): an
    in-process vLLM engine then starts its engine core in a child process, since its in-process start-up takes part
    in collectives of the trainer's process group that no other rank enters (`VLLMColocateBackend`).

    Under ZeRO-3 the `hf` backend generates on an unpartitioned twin of the architecture (a forward of the
    partitioned policy needs every rank); it receives whole weights, gathered group by group, before its first round.
    An in-process vLLM engine needs a folder: when the model was given as an object it is saved to a temporary one
    (under PEFT: the base weights with their plain names, the adapter left out).
    """
    import copy
    import tempfile

    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if args.generation_backend == "hf" and is_deepspeed_zero3_enabled():
        base = base_model(model)
        model = type(base)(copy.deepcopy(base.config))
        model.generation_config = copy.deepcopy(base.generation_config)
    folder = None
    if model_source is None and args.generation_backend == "vllm":
        from ..weight_sync.collect import hf_name

        folder = model_source = tempfile.mkdtemp(prefix="grpo_async_engine_")
        state = None
        if hasattr(model, "peft_config"):  # unmerged base weights, without PEFT's base_layer / lora names
            named = ((hf_name(k, True), v) for k, v in base_model(model).state_dict().items())
            state = {k: v for k, v in named if k is not None}
        base_model(model).save_pretrained(folder, state_dict=state)
        tokenizer.save_pretrained(folder)
    if alone and backend_spec(args.generation_backend).factory is _make_vllm_colocate:
        return _make_vllm_colocate(args, model, tokenizer, model_source, separate_process=True), folder
    return make_backend(args, model, tokenizer, model_source), folder


__all__ = [
    "BackendSpec",
    "Completion",
    "GenerationBackend",
    "SamplingConfig",
    "backend_spec",
    "make_backend",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]
