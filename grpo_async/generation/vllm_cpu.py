"""vLLM's defaults on CPU that `grpo-async serve` and the colocated engine (`VLLMColocateBackend`) replace.

- **KV cache size.** vLLM's CPU worker reserves `gpu_memory_utilization` × the RAM (minus what the process already
  uses) for its KV cache unless told a size (`VLLM_CPU_KVCACHE_SPACE` in GiB, or `kv_cache_memory_bytes`): 5.4 GiB
  for a 2-layer model at the default 0.3 on a 20 GiB machine (9.1 GB behind `grpo-async serve`'s former default, half
  the free RAM). Both size it instead (`cpu_kv_cache_bytes`): the K and V of every layer for the tokens their requests
  can hold at once (+10%), within [64 MiB, 4 GiB or a quarter of the RAM].
- **Server memory and prefill** (`grpo-async serve`, where the user did not choose): `--gpu-memory-utilization` is
  half of the free RAM (`cpu_memory_utilization`), and chunked prefill is off (vLLM CPU cannot rewind a seeded
  request's generator after a partial prefill).
- **AOT compile cache.** vLLM 0.32 saves an AOT artifact of a compiled model at every start on CPU that the next start
  cannot load (`default_cpu_aot_compile`).
- **Kernel overrides.** vLLM registers its CPU kernel overrides again at every engine start, scanning every loaded
  module; the colocated engine has it register them once per process (`register_kernel_overrides_once`).
"""

from __future__ import annotations

import math

from .server_process import flag_passed

#: the CPU KV cache sized here is at most this (or a quarter of the RAM) and at least `KV_FLOOR_BYTES`
KV_CAP_BYTES = 4 * 2**30
KV_FLOOR_BYTES = 64 * 2**20
#: `--max-num-seqs` assumed for sizing when not given (the cap bounds the result)
DEFAULT_MAX_NUM_SEQS = 256


def cpu_kv_cache_bytes(
    bytes_per_token: int, max_model_len: int, max_num_seqs: int, total_ram: int, cap: int = KV_CAP_BYTES
) -> int:
    """Bytes of CPU KV cache for `max_num_seqs` requests of `max_model_len` tokens (+10%), within
    [max(`KV_FLOOR_BYTES`, one full-length request), min(`cap`, `total_ram` / 4)], rounded up to MiB.

    >>> cpu_kv_cache_bytes(2 * 2 * 2 * 32 * 4, 256, 4, 16 * 2**30) == KV_FLOOR_BYTES  # tiny model: the floor
    True
    >>> cpu_kv_cache_bytes(2 * 30 * 3 * 64 * 4, 8192, 256, 64 * 2**30) == KV_CAP_BYTES  # SmolLM2, fp32: the cap
    True
    """
    one = int(bytes_per_token * max_model_len * 1.1)  # vLLM refuses a cache that cannot hold one full request
    want = int(bytes_per_token * max_model_len * max_num_seqs * 1.1)
    size = max(KV_FLOOR_BYTES, one, min(want, cap, total_ram // 4))
    return -(-size // 2**20) * 2**20


def kv_bytes_per_token(
    model: str,
    dtype: str,
    kv_cache_dtype: str = "auto",
    max_model_len: int | None = None,
    *,
    trust_remote_code: bool = False,
    revision: str | None = None,
) -> tuple[int, int]:
    """`(bytes of K and V per token over all layers, max_model_len)` of `model` (a folder or hub id) from its config,
    for vLLM weights in `dtype` (`"auto"`: the config's); `max_model_len` defaults to the model's context."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, revision=revision)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if str(kv_cache_dtype).startswith("fp8"):
        nbytes = 1
    elif dtype in ("float32", "float") or (dtype == "auto" and str(getattr(text, "dtype", None)) == "torch.float32"):
        nbytes = 4
    else:
        nbytes = 2
    max_len = max_model_len or getattr(text, "max_position_embeddings", None) or 4096
    return 2 * text.num_hidden_layers * kv_heads * head_dim * nbytes, int(max_len)


def is_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _inspect_here(fn):
    return fn()


def inspect_models_in_process() -> bool:
    """On CPU, have vLLM's model registry inspect a model class in this process; returns whether it does. vLLM inspects
    an architecture it has not cached yet (`~/.cache/vllm/modelinfos`) in a fresh interpreter
    (`registry._run_in_subprocess`), so that importing the model does not initialize CUDA in the caller. There is no
    CUDA on the CPU platform, and that interpreter (importing torch and vLLM again) took 21.6 s for `LlamaForCausalLM`
    on 2 AVX2 cores: the first engine of each architecture on a machine paid it (a fresh CI machine: every one). The
    engine imports the same module to load the model anyway; the result is cached as vLLM caches it."""
    if not is_cpu():
        return False
    from vllm.model_executor.models import registry

    if not callable(getattr(registry, "_run_in_subprocess", None)):  # a vLLM that inspects otherwise
        return False
    registry._run_in_subprocess = _inspect_here
    return True


def register_kernel_overrides_once() -> bool:
    """On CPU, have vLLM register its CPU kernel overrides once per process; returns whether it will. vLLM's worker
    start (`WorkerWrapperBase.__init__`) calls its CPU platform's `register_triton_kernel_overrides` at every engine
    start; after the first, each call wraps the wrappers again ("Kernel ... is already registered. Overwriting.") and
    scans every attribute of every module the process has loaded for references to rebind: 0.44 CPU-s of the ~1.4 a
    later colocated engine of the tiny model took to start in a trainer's process (2 AVX2 cores). The first call
    registers as before (a failed one is tried again at the next start); the later ones, and those of a process forked
    after it, find the overrides in place and return. Safe: an override calls its implementation, never the kernel it
    replaced, and the modules keep pointing at the first wrappers."""
    if not is_cpu():
        return False
    from vllm.platforms import current_platform

    platform = type(current_platform)
    register = getattr(platform, "register_triton_kernel_overrides", None)  # a classmethod, bound to the class
    if register is None:  # a vLLM that registers them otherwise
        return False
    if getattr(register, "registers_once", False):
        return True
    registered = []

    def once(cls) -> None:
        if not registered:
            register()
            registered.append(True)

    once.registers_once = True
    platform.register_triton_kernel_overrides = classmethod(once)
    return True


def default_cpu_aot_compile(environ) -> bool:
    """On CPU, unless `VLLM_USE_AOT_COMPILE` is set, turn vLLM's AOT compile cache off in `environ` (the processes an
    engine starts inherit it); returns whether it did. vLLM 0.32 saves an AOT artifact of the compiled model at every
    start on CPU that the next start cannot load (`'function' object has no attribute 'finalize_loading'`): each
    restart logged "Compiling model again due to a load failure" and compiled anew. Without it, torch inductor's own
    cache serves a restart. vLLM turns it off itself the same way for batch-invariant runs."""
    if "VLLM_USE_AOT_COMPILE" in environ or not is_cpu():
        return False
    environ["VLLM_USE_AOT_COMPILE"] = "0"
    return True


# ---- `grpo-async serve`'s CPU defaults, applied to its parsed arguments (`argv`: what the user passed) --------------
def cpu_memory_utilization(available_bytes: int, total_bytes: int) -> float:
    """The CPU default of `--gpu-memory-utilization` (there: the share of RAM vLLM reserves): half of the memory
    free now, at most 0.9 and at least 0.05, rounded down to 2 decimals."""
    share = 0.5 * available_bytes / max(total_bytes, 1)
    return max(0.05, min(0.9, math.floor(share * 100) / 100))


def default_cpu_memory(args, argv: list[str]) -> None:
    """On CPU, when the user did not pass --gpu-memory-utilization, replace vLLM's 0.92 (which fails to start
    whenever other processes use RAM) by `cpu_memory_utilization` of the memory free now."""
    if flag_passed(argv, "--gpu-memory-utilization"):
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import psutil

    mem = psutil.virtual_memory()
    args.gpu_memory_utilization = cpu_memory_utilization(mem.available, mem.total)
    print(
        f"grpo-async serve: CPU, --gpu-memory-utilization {args.gpu_memory_utilization} (half of the free RAM; "
        "pass the flag to choose)",
        flush=True,
    )


def default_cpu_kv_cache(args, argv: list[str], environ: dict) -> bool:
    """On CPU, unless the user chose (`VLLM_CPU_KVCACHE_SPACE`, `--kv-cache-memory-bytes`,
    `--gpu-memory-utilization`), set `--kv-cache-memory-bytes` to `cpu_kv_cache_bytes` of the model and say so.
    Returns whether the KV cache size is now explicit (vLLM then skips its share-of-RAM check)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    variable, flag = environ.get("VLLM_CPU_KVCACHE_SPACE"), flag_passed(argv, "--kv-cache-memory-bytes")
    if variable and flag:
        raise SystemExit(
            f"grpo-async serve: both VLLM_CPU_KVCACHE_SPACE={variable} and --kv-cache-memory-bytes choose the CPU KV "
            "cache, and vLLM would take the variable's size and ignore the flag: unset one"
        )
    if variable or flag:
        return True
    if flag_passed(argv, "--gpu-memory-utilization"):
        return False
    import psutil

    try:
        per_token, max_len = kv_bytes_per_token(
            args.model,
            str(args.dtype),
            str(getattr(args, "kv_cache_dtype", "auto")),
            args.max_model_len,
            trust_remote_code=bool(args.trust_remote_code),
            revision=getattr(args, "revision", None),
        )
    except Exception as e:  # noqa: BLE001 - an unusual config: vLLM's share of the RAM instead
        print(f"grpo-async serve: CPU KV cache not sized from the model config ({e}): vLLM's RAM share", flush=True)
        return False
    seqs = args.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    args.kv_cache_memory_bytes = cpu_kv_cache_bytes(per_token, max_len, seqs, psutil.virtual_memory().total)
    print(
        f"grpo-async serve: CPU KV cache {args.kv_cache_memory_bytes / 2**20:.0f} MiB (--max-model-len {max_len} x "
        f"--max-num-seqs {seqs} at {per_token} bytes/token +10%, within [64 MiB, 4 GiB]); pass "
        "--kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE to choose",
        flush=True,
    )
    return True


def default_cpu_chunked_prefill(args, argv: list[str]) -> None:
    """On CPU, unless the user chose, turn chunked prefill off: vLLM CPU cannot rewind a seeded request's generator
    after a partial prefill (the trainer sends per-request seeds, `GRPOConfig.seeded_generation`)."""
    chose = ("--enable-chunked-prefill", "--no-enable-chunked-prefill", "--max-num-batched-tokens")
    if any(flag_passed(argv, flag) for flag in chose):  # a token budget below the context needs chunks: left to vLLM
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        args.enable_chunked_prefill = False
