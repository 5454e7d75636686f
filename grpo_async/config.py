"""`GRPOConfig`: every knob of the trainer, grouped by concern, validated at construction.

Names follow TRL's `GRPOConfig` wherever TRL has the same knob, so a TRL config ports by changing the import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .algo.advantages import SCALE_REWARDS
from .algo.loss import IS_MODES, LOSS_TYPES
from .rollout.aggregation import REUSE_ORDERS, STAGES, check_stage_sizes, service_target_bs, sizes_that_fit

GENERATION_BACKENDS = ("hf", "vllm", "vllm_server", "openai")
VLLM_MODES = ("colocate", "server")
WEIGHT_SYNC_TRANSPORTS = ("auto", "broadcast", "ipc", "checkpoint_dir", "none")
#: the weight-sync transports each backend can use ('none': the sampler keeps its initial weights)
SYNC_BY_BACKEND = {
    "hf": ("auto", "none"),
    "vllm": ("auto", "none"),
    "vllm_server": ("auto", "broadcast", "ipc", "none"),
    "openai": ("auto", "checkpoint_dir", "none"),
}
SYNC_WHY = {
    "hf": "the sampler lives in this process and is updated in place",
    "vllm": "the engine lives in this process and loads the weights in place",
    "vllm_server": "a grpo-async serve server takes a broadcast or, on this machine, shared memory / CUDA IPC; "
    "it does not watch a checkpoint folder",
    "openai": "a remote OpenAI-compatible engine can neither join a process group nor map this machine's memory "
    "(seed 002); it can only reload a shared checkpoint folder",
}


def _err(field_name: str, message: str) -> ValueError:
    return ValueError(f"GRPOConfig.{field_name}: {message}")


@dataclass
class GRPOConfig(TrainingArguments):
    r"""Configuration of [`GRPOTrainer`]; all [`~transformers.TrainingArguments`] fields apply as well.

    Batch geometry (G = `num_generations`, μ = `num_iterations`, N = processes):

    ```txt
    generation round = per_device_train_batch_size × N × steps_per_generation rows  (= prompts × G)
    one round is generated every steps_per_generation × μ micro-steps, trained μ times (epoch order: a b | a b)
    ```
    """

    # ---- overridden TrainingArguments defaults -------------------------------------------------------------
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (TRL's GRPO default)."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X optimizer steps."})
    remove_unused_columns: bool | None = field(
        default=False, metadata={"help": "Keep dataset columns: they are passed to the reward functions."}
    )

    # ---- model -------------------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | None = field(
        default=None, metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a name or path."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Set every dropout probability to 0."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the model repo."})

    # ---- data --------------------------------------------------------------------------------------------
    max_prompt_length: int | None = field(
        default=512,
        metadata={
            "help": "Prompts longer than this (in tokens) are truncated from the left, or rejected (see "
            "`prompt_truncation`). `None` keeps them whole."
        },
    )
    prompt_truncation: str = field(
        default="left", metadata={"help": "'left': keep the last tokens and count it; 'error': raise."}
    )
    shuffle_dataset: bool = field(default=True, metadata={"help": "Shuffle the prompts each epoch."})

    # ---- generation --------------------------------------------------------------------------------------
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (G)."})
    max_completion_length: int = field(default=256, metadata={"help": "Most tokens generated per completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (also divides trainer logits)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling; 1.0 disables it."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 disables it."})
    min_p: float = field(default=0.0, metadata={"help": "Min-p sampling; 0.0 disables it."})
    stop: list[str] | None = field(default=None, metadata={"help": "Stop strings (besides EOS)."})
    generation_batch_size: int | None = field(
        default=None,
        metadata={"help": "Rows per generation round across processes. Derived from steps_per_generation if unset."},
    )
    steps_per_generation: int | None = field(
        default=None, metadata={"help": "Micro-steps per generation round. Defaults to gradient_accumulation_steps."}
    )
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Exclude completions that hit max_completion_length from the loss."}
    )
    generation_backend: str | None = field(
        default=None,
        metadata={"help": f"One of {GENERATION_BACKENDS}. Default: 'hf', or from use_vllm/vllm_mode like TRL."},
    )
    use_vllm: bool = field(default=False, metadata={"help": "TRL-style switch: generate with vLLM."})
    vllm_mode: str = field(default="colocate", metadata={"help": "TRL-style: 'colocate' (in-process) or 'server'."})
    vllm_server_urls: list[str] | None = field(
        default=None, metadata={"help": "Base URLs of `grpo-async serve` servers (vllm_server backend)."}
    )
    vllm_server_base_url: str | None = field(
        default=None, metadata={"help": "TRL-style single server URL; appended to vllm_server_urls."}
    )
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Seconds to wait for a server to answer."})
    vllm_api_key: str | None = field(default=None, metadata={"help": "API key of the servers / OpenAI endpoint."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "Colocated vLLM's memory share."})
    vllm_max_model_length: int | None = field(
        default=None, metadata={"help": "vLLM max_model_len. Default: max_prompt_length + max_completion_length."}
    )
    vllm_enforce_eager: bool = field(
        default=True,
        metadata={
            "help": "In-process vLLM engine (vllm backend): skip torch.compile for a start in seconds. False lets "
            "vLLM compile the model: a slower start, faster rounds (0.79 → 0.65 s for 64 × 64 tokens on 2 CPU cores)."
        },
    )
    vllm_max_concurrency: int = field(
        default=32, metadata={"help": "HTTP requests in flight over all servers (vllm_server, openai)."}
    )
    vllm_master_address: str = field(
        default="127.0.0.1",
        metadata={"help": "This trainer's address as the servers see it (broadcast weight sync hosts the store)."},
    )
    openai_base_url: str | None = field(default=None, metadata={"help": "OpenAI-compatible endpoint (openai)."})
    openai_model: str | None = field(default=None, metadata={"help": "Model name sent to the OpenAI endpoint."})

    # ---- weight sync -------------------------------------------------------------------------------------
    weight_sync_transport: str = field(
        default="auto",
        metadata={"help": f"One of {WEIGHT_SYNC_TRANSPORTS}; 'auto' picks the best the backend supports."},
    )
    weight_sync_bucket_mb: float = field(
        default=256.0, metadata={"help": "Size threshold of a weight-transfer bucket (modules are never split)."}
    )
    weight_sync_inflight: bool = field(
        default=False,
        metadata={
            "help": "vllm_server only: push new weights as soon as the optimizer made them, while the round in flight "
            "keeps generating (its running requests continue on the new weights). Off: a round finishes on the "
            "weights it started with. Samples record the version their round started with."
        },
    )

    # ---- per-stage micro-batches (seed 000) ---------------------------------------------------------------
    rollout_micro_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generate call (rows after the ×G repeat). Default: per_device_train_batch_size. "
            "vLLM batches internally: set it to generation_batch_size for one call per round."
        },
    )
    ref_logps_micro_batch_size: int | None = field(
        default=None,
        metadata={"help": "Rows per reference-model forward pass. Default: per_device_train_batch_size."},
    )
    old_logps_micro_batch_size: int | None = field(
        default=None,
        metadata={"help": "Rows per old-policy forward pass. Default: per_device_train_batch_size."},
    )
    reuse_order: str = field(
        default="epoch",
        metadata={
            "help": f"Order of the μ passes over a round's micro-batches, one of {REUSE_ORDERS}: 'epoch' (a b | a b) "
            "or seed 000's 'consecutive' (a a b b)."
        },
    )

    # ---- async pipeline ----------------------------------------------------------------------------------
    num_batches_ahead: int = field(
        default=1,
        metadata={"help": "Rounds generated ahead of training (0 = synchronous; k = staleness of at most k rounds)."},
    )
    async_generation_timeout: float = field(
        default=600.0, metadata={"help": "Seconds any wait on the generator may last before raising."}
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Never train a sample generated more than this many rounds before the round it is trained in "
            "(its loss mask is zeroed; counted in async/dropped_stale). Default: num_batches_ahead (nothing is "
            "dropped in the normal pipeline). With weight_sync_transport='none' the sampler never updates: raise it."
        },
    )
    async_max_queue_size: int | None = field(
        default=None, metadata={"help": "Rounds queued or completed-unfetched at once. Default num_batches_ahead+2."}
    )

    # ---- algorithm ---------------------------------------------------------------------------------------
    beta: float = field(default=0.0, metadata={"help": "KL coefficient (k3 estimator); 0 loads no reference model."})
    num_iterations: int = field(default=1, metadata={"help": "Passes over each generation round (μ)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range ε."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping range; defaults to epsilon."})
    loss_type: str = field(default="dapo", metadata={"help": f"One of {LOSS_TYPES}."})
    scale_rewards: str = field(default="group", metadata={"help": f"One of {SCALE_REWARDS}."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "Weight of each reward function."})
    reward_timeout: float | None = field(
        default=300.0,
        metadata={
            "help": "Seconds one reward-function call may take before the round fails with an error naming it "
            "(sync functions run in a worker thread that is abandoned). None: no limit."
        },
    )
    mask_env_responses: bool = field(
        default=True,
        metadata={
            "help": "Multi-turn environments: tokens the environment or a tool wrote into the completion are in the "
            "sequence (attended to) but not trained on. False trains on them too."
        },
    )
    importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Weight the loss by π_old / π_sampler (the sampler's own logprobs): corrects for sampling from a "
            "stale policy (async rounds) or another engine's numerics (vLLM). Needs the old-policy logps pass."
        },
    )
    importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={"help": f"One of {tuple(IS_MODES)} (TRL 1.16's vLLM IS modes)."},
    )
    importance_sampling_clip_min: float | None = field(
        default=None, metadata={"help": "Lower bound of the IS ratio (truncate: clip, mask: zero below); None: none."}
    )
    importance_sampling_clip_max: float | None = field(
        default=3.0, metadata={"help": "Upper bound of the IS ratio (truncate: clip, mask: zero above); None: none."}
    )

    # ---- memory: packing, reference model ----------------------------------------------------------------
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Run the logps and training forward passes without padding: each micro-batch's rows packed, "
            "longest first, into bins no longer than its longest row (position ids reset per row; logits only at "
            "completion tokens). Same numbers as the padded path, never more attention work; much less memory and "
            "time when lengths are skewed (one long completion among short ones), as in RL. Needs "
            "a model whose attention honours restarting position ids (transformers 5 models do; checked at start)."
        },
    )
    ref_server_url: str | None = field(
        default=None,
        metadata={
            "help": "Base URL of a `grpo-async serve` server holding the frozen reference weights (never updated): "
            "with beta > 0 the reference logps come from it and the trainer loads no reference model."
        },
    )
    ref_server_api_key: str | None = field(
        default=None, metadata={"help": "API key of the reference server. Default: vllm_api_key."}
    )

    # ---- logging -----------------------------------------------------------------------------------------
    log_completions: bool = field(default=False, metadata={"help": "Print a sample of completions when logging."})
    num_completions_to_print: int = field(default=4, metadata={"help": "Completions printed per log."})

    def __post_init__(self):
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.vllm_server_base_url:
            self.vllm_server_urls = list(self.vllm_server_urls or []) + [self.vllm_server_base_url]
        if self.generation_backend is None:
            if self.openai_base_url:
                self.generation_backend = "openai"
            elif self.use_vllm:
                if self.vllm_mode not in VLLM_MODES:
                    raise _err("vllm_mode", f"must be one of {VLLM_MODES}, got {self.vllm_mode!r}")
                self.generation_backend = "vllm" if self.vllm_mode == "colocate" else "vllm_server"
            else:
                self.generation_backend = "hf"
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.async_max_queue_size is None:
            self.async_max_queue_size = self.num_batches_ahead + 2
        if self.max_staleness is None:
            self.max_staleness = self.num_batches_ahead
        for name in ("rollout_micro_batch_size", "ref_logps_micro_batch_size", "old_logps_micro_batch_size"):
            if getattr(self, name) is None:
                setattr(self, name, self.per_device_train_batch_size)
        self._validate()

    @property
    def service_target_bs(self) -> int:
        """Derived: rows buffered before the stages run, LCM of the rollout, ref-logps and old-logps micro-batches."""
        return service_target_bs(
            self.rollout_micro_batch_size, self.ref_logps_micro_batch_size, self.old_logps_micro_batch_size
        )

    @property
    def global_micro_batch_size(self) -> int:
        """Derived: rows trained per micro-step across all processes."""
        return self.per_device_train_batch_size * self.world_size

    def _validate(self) -> None:
        G = self.num_generations
        if not isinstance(G, int) or G < 2:
            raise _err("num_generations", f"must be an int >= 2 (GRPO compares completions of a prompt), got {G!r}")
        for name in ("steps_per_generation", "num_iterations"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise _err(name, f"must be an int >= 1, got {v!r}")
        micro = self.global_micro_batch_size
        if self.generation_batch_size is None:
            self.generation_batch_size = micro * self.steps_per_generation
        elif self.generation_batch_size % micro != 0:
            raise _err(
                "generation_batch_size",
                f"{self.generation_batch_size} is not a multiple of per_device_train_batch_size × processes = {micro}",
            )
        else:
            self.steps_per_generation = self.generation_batch_size // micro
        if self.generation_batch_size % G != 0:
            raise _err(
                "generation_batch_size",
                f"the generation round has {self.generation_batch_size} rows "
                f"(per_device_train_batch_size={self.per_device_train_batch_size} × processes={self.world_size} × "
                f"steps_per_generation={self.steps_per_generation}), not a multiple of num_generations={G}; "
                f"valid num_generations divide {self.generation_batch_size}: "
                f"{[g for g in range(2, self.generation_batch_size + 1) if self.generation_batch_size % g == 0]}",
            )
        stages = ("rollout_micro_batch_size", "ref_logps_micro_batch_size", "old_logps_micro_batch_size")
        for name in stages:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _err(name, f"must be an int >= 1 (rows, counted after the ×G repeat), got {v!r}")
        local_rows, sizes = self.generation_batch_size // self.world_size, [getattr(self, n) for n in stages]
        try:  # the stages run on each process's rows of a round: the LCM must divide them
            check_stage_sizes(local_rows, *sizes)
        except ValueError as e:
            fits = sizes_that_fit(local_rows, *sizes)  # name the one stage that can fix it alone, if any
            culprit = next((n for n, k in zip(stages, STAGES) if fits[k]), stages[0])
            raise _err(culprit, f"per-stage micro-batches do not fit the per-process generation batch: {e}") from None
        if self.importance_sampling_mode not in IS_MODES:
            raise _err(
                "importance_sampling_mode", f"must be one of {tuple(IS_MODES)}, got {self.importance_sampling_mode!r}"
            )
        lo, hi = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if (
            (lo is not None and lo < 0)
            or (hi is not None and hi <= 0)
            or (lo is not None and hi is not None and lo >= hi)
        ):
            raise _err(
                "importance_sampling_clip_max",
                f"need 0 <= importance_sampling_clip_min < importance_sampling_clip_max (None = unbounded), "
                f"got min={lo!r}, max={hi!r}",
            )
        if self.reuse_order not in REUSE_ORDERS:
            raise _err("reuse_order", f"must be one of {REUSE_ORDERS}, got {self.reuse_order!r}")
        if not isinstance(self.num_batches_ahead, int) or self.num_batches_ahead < 0:
            raise _err("num_batches_ahead", f"must be an int >= 0 (0 = synchronous), got {self.num_batches_ahead!r}")
        if not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool) or self.max_staleness < 0:
            raise _err("max_staleness", f"must be an int >= 0 (rounds), got {self.max_staleness!r}")
        if not self.async_generation_timeout or self.async_generation_timeout <= 0:
            raise _err("async_generation_timeout", f"must be > 0 seconds, got {self.async_generation_timeout!r}")
        if self.async_max_queue_size < self.num_batches_ahead + 1:
            raise _err(
                "async_max_queue_size",
                f"{self.async_max_queue_size} cannot hold num_batches_ahead + 1 = {self.num_batches_ahead + 1} rounds",
            )
        if not self.temperature > 0:
            raise _err("temperature", f"must be > 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise _err("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise _err("top_k", f"must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p < 1:
            raise _err("min_p", f"must be in [0, 1), got {self.min_p!r}")
        if not isinstance(self.max_completion_length, int) or self.max_completion_length <= 0:
            raise _err("max_completion_length", f"must be an int > 0, got {self.max_completion_length!r}")
        if self.max_prompt_length is not None and (
            not isinstance(self.max_prompt_length, int) or self.max_prompt_length <= 0
        ):
            raise _err("max_prompt_length", f"must be an int > 0 or None, got {self.max_prompt_length!r}")
        if self.prompt_truncation not in ("left", "error"):
            raise _err("prompt_truncation", f"must be 'left' or 'error', got {self.prompt_truncation!r}")
        if self.loss_type not in LOSS_TYPES:
            raise _err("loss_type", f"unknown loss type {self.loss_type!r}; choose one of {LOSS_TYPES}")
        if self.scale_rewards not in SCALE_REWARDS:
            raise _err("scale_rewards", f"must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}")
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise _err("reward_timeout", f"must be > 0 seconds or None (no limit), got {self.reward_timeout!r}")
        if self.beta < 0:
            raise _err("beta", f"must be >= 0, got {self.beta!r}")
        if self.ref_server_url is not None:
            if not str(self.ref_server_url).startswith(("http://", "https://")):
                raise _err("ref_server_url", f"must be an http(s):// URL, got {self.ref_server_url!r}")
            if self.beta == 0:
                raise _err("ref_server_url", "is set but beta=0: no reference logps are computed; set beta > 0")
            if self.ref_server_url.rstrip("/") in [u.rstrip("/") for u in self.vllm_server_urls or []]:
                raise _err(
                    "ref_server_url",
                    f"{self.ref_server_url} is also a generation server (vllm_server_urls): it receives the policy's "
                    "weight updates, so it cannot hold the frozen reference; start a separate server for it",
                )
        if not self.epsilon > 0 or not self.epsilon_high > 0:
            raise _err("epsilon", f"epsilon and epsilon_high must be > 0, got {self.epsilon!r}, {self.epsilon_high!r}")
        if self.generation_backend not in GENERATION_BACKENDS:
            raise _err("generation_backend", f"must be one of {GENERATION_BACKENDS}, got {self.generation_backend!r}")
        if self.weight_sync_transport not in WEIGHT_SYNC_TRANSPORTS:
            raise _err(
                "weight_sync_transport", f"must be one of {WEIGHT_SYNC_TRANSPORTS}, got {self.weight_sync_transport!r}"
            )
        if self.weight_sync_bucket_mb <= 0:
            raise _err("weight_sync_bucket_mb", f"must be > 0, got {self.weight_sync_bucket_mb!r}")
        if self.generation_backend == "vllm_server" and not self.vllm_server_urls:
            raise _err("vllm_server_urls", "the vllm_server backend needs at least one server URL")
        if not isinstance(self.vllm_max_concurrency, int) or self.vllm_max_concurrency < 1:
            raise _err("vllm_max_concurrency", f"must be an int >= 1, got {self.vllm_max_concurrency!r}")
        if self.weight_sync_inflight and (
            self.generation_backend != "vllm_server" or self.weight_sync_transport == "none"
        ):
            raise _err(
                "weight_sync_inflight",
                "in-flight weight updates need the vllm_server backend with a weight-sync transport (a server can "
                f"pause running requests and resume them); got generation_backend={self.generation_backend!r}, "
                f"weight_sync_transport={self.weight_sync_transport!r}",
            )
        allowed = SYNC_BY_BACKEND[self.generation_backend]
        if self.weight_sync_transport not in allowed:
            raise _err(
                "weight_sync_transport",
                f"{self.weight_sync_transport!r} is not possible with generation_backend={self.generation_backend!r}"
                f" ({SYNC_WHY[self.generation_backend]}); choose one of {allowed}",
            )
        if self.generation_backend == "openai" and not self.openai_base_url:
            raise _err("openai_base_url", "the openai backend needs openai_base_url")
