"""Generation fields of `GRPOConfig`: sampling, the round's size, and which backend generates where."""

from dataclasses import dataclass, field
from typing import Literal

from ..generation import registered_backends
from .checks import InstanceOf, Number, OneOf, checked_field

GENERATION_BACKENDS = registered_backends()


@dataclass
class GenerationFields:
    """Sampling parameters, batch geometry of a round (`generation_batch_size`, `steps_per_generation`) and the
    generation backend (`hf`, `vllm`, `vllm_server`, `openai`, or a registered one) with its servers."""

    num_generations: int | None = checked_field(
        Number(ge=2, integer=True, what="an int >= 2 (GRPO compares completions of a prompt)"),
        default=8,
        metadata={"help": "Completions per prompt (G)."},
    )
    num_generations_eval: int | None = checked_field(
        Number(ge=1, integer=True, optional=True, what="an int >= 1 or None (= num_generations)"),
        default=None,
        metadata={
            "help": "Number of generations to sample during evaluation. This allows using fewer generations during "
            "evaluation to save computation. If `None`, uses the value of `num_generations`. Evaluation generates "
            "and scores per_device_eval_batch_size × processes rows at a time, which must then be a multiple of it "
            "when evaluating during training (as in TRL).",
        },
    )
    max_completion_length: int | None = checked_field(
        Number(gt=0, integer=True), default=512, metadata={"help": "Most tokens generated per completion."}
    )
    temperature: float = checked_field(
        Number(gt=0), default=1.0, metadata={"help": "Sampling temperature (also divides trainer logits)."}
    )
    top_p: float = checked_field(
        Number(gt=0, le=1, what="in (0, 1]"),
        default=1.0,
        metadata={"help": "Nucleus sampling; 1.0 disables it."},
    )
    top_k: int = checked_field(
        Number(ge=0, integer=True, what="an int >= 0 (0 disables it)"),
        default=0,
        metadata={"help": "Top-k sampling; 0 disables it."},
    )
    min_p: float | None = checked_field(
        Number(ge=0, lt=1, optional=True, what="in [0, 1) or None (off)"),
        default=0.0,
        metadata={"help": "Min-p sampling; 0.0 (or None) disables it."},
    )
    stop: list[str] | None = field(default=None, metadata={"help": "Stop strings (besides EOS)."})
    seeded_generation: bool = field(
        default=True,
        metadata={
            "help": "Sample every completion with its own seed derived from (seed, round, row), so that two runs with "
            "the same seed generate the same completions whatever the thread timing (hf, the in-process vllm "
            "engine; servers get a per-request seed). False: the samplers' own randomness (vLLM on a GPU samples "
            "large batches a little faster)."
        },
    )
    generation_batch_size: int | None = checked_field(
        Number(ge=1, integer=True, optional=True),
        default=None,
        metadata={
            "help": "Rows (completions) per generation round over all processes. Default: "
            "per_device_train_batch_size × processes × steps_per_generation. Set it or steps_per_generation.",
        },
    )
    steps_per_generation: int | None = checked_field(
        Number(ge=1, integer=True, optional=True),
        default=None,
        metadata={
            "help": "Micro-steps (per-device batches) trained from one generation round. Default: "
            "gradient_accumulation_steps, or generation_batch_size / (per_device_train_batch_size × processes).",
        },
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Exclude completions that hit max_completion_length from the loss."}
    )
    generation_backend: str | None = checked_field(
        OneOf(registered_backends, optional=True, hint=" (add others with grpo_async.generation.register_backend)"),
        default=None,
        metadata={
            "help": f"One of {GENERATION_BACKENDS}. Default: 'hf', or from use_vllm/vllm_mode like TRL.",
        },
    )
    use_vllm: bool = field(default=False, metadata={"help": "TRL-style switch: generate with vLLM."})
    vllm_mode: Literal["colocate", "server"] = field(
        default="colocate", metadata={"help": "TRL-style: 'colocate' (in-process) or 'server'."}
    )
    vllm_server_urls: list[str] | None = checked_field(
        InstanceOf((list, tuple), what="a list of URLs (wrap one URL in [ ])"),
        default=None,
        metadata={"help": "Base URLs of `grpo-async serve` servers (vllm_server backend)."},
    )
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "TRL-style single server URL; used together with vllm_server_urls."}
    )
    vllm_server_host: str = field(
        default="0.0.0.0",
        metadata={
            "help": "TRL-style server host: with the vllm_server backend and no URL given, the server is "
            "http://vllm_server_host:vllm_server_port."
        },
    )
    vllm_server_port: int = field(default=8000, metadata={"help": "TRL-style server port (see vllm_server_host)."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Seconds to wait for a server to answer."})
    vllm_api_key: str | None = field(default=None, metadata={"help": "API key of the servers / OpenAI endpoint."})
    vllm_gpu_memory_utilization: float = field(
        default=0.3,
        metadata={
            "help": "Colocated vLLM's share of the GPU's memory. On CPU its KV cache is sized instead to hold "
            "generation_batch_size x (num_batches_ahead + 1) requests of its max_model_len tokens (x 1.1, within 64 "
            "MiB and 4 GiB), unless VLLM_CPU_KVCACHE_SPACE (GiB) is set."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "vLLM max_model_len. Default: max_prompt_length + max_completion_length."}
    )
    vllm_dtype: str = checked_field(
        OneOf(("auto", "float32", "bfloat16", "float16")),
        default="auto",
        metadata={
            "help": "In-process vLLM engine (vllm backend): the dtype it holds the weights in and samples with. "
            "'auto': the policy's own dtype (a float32 policy samples in float32: sampler and trainer log-probs agree "
            "to ~1e-6). 'bfloat16' for a float32 policy: half the engine's weights and, on CPUs with bf16 "
            "instructions (AMX, AVX512-BF16) or a GPU, faster generation; the sampler's log-probs then differ from "
            "the trainer's by bf16 rounding, which the importance-sampling correction weighs (TRL's vLLM runs a "
            "float32 model in bfloat16 by default). Each push is rounded to it by vLLM's loader. A server's dtype is "
            "its own `--dtype`.",
        },
    )
    vllm_enforce_eager: bool = field(
        default=True,
        metadata={
            "help": "In-process vLLM engine (vllm backend): skip torch.compile for a start in seconds. False lets "
            "vLLM compile the model: a slower start, faster rounds (0.79 → 0.65 s for 64 × 64 tokens on 2 CPU cores)."
        },
    )
    vllm_max_concurrency: int = checked_field(
        Number(ge=1, integer=True),
        default=32,
        metadata={"help": "HTTP requests in flight over all servers (vllm_server, openai)."},
    )
    vllm_master_address: str | None = field(
        default=None,
        metadata={
            "help": "This trainer's address as the servers see it (broadcast weight sync hosts the store there). "
            "Default: 127.0.0.1 for servers on this machine, else this machine's address on the route to each server."
        },
    )
    openai_base_url: str | None = field(default=None, metadata={"help": "OpenAI-compatible endpoint (openai)."})
    openai_model: str | None = field(default=None, metadata={"help": "Model name sent to the OpenAI endpoint."})
