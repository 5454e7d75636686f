"""`GRPOConfig`: every knob of the trainer, grouped by concern, validated at construction.

Names and defaults follow TRL 1.16's `GRPOConfig` wherever TRL has the same knob, so a TRL config ports by changing
the import: every field of `trl.GRPOConfig` is accepted. Deliberate default differences are listed in
`DEFAULT_DIFFERENCES`; TRL fields this trainer does not implement (they raise `NotImplementedError` when set to
anything but TRL's default) in `UNSUPPORTED_TRL_FIELDS`; TRL names of knobs this trainer calls otherwise in
`TRL_ALIASES`.

A config is a value: `__post_init__` never overwrites what the user gave with a value derived from other fields. A
derived value (e.g. `generation_batch_size` when only `per_device_train_batch_size` was set) is stored marked as
derived, so `dataclasses.replace(cfg, per_device_train_batch_size=8)` derives it again instead of keeping the stale
number.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .algo.advantages import MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS
from .algo.loss import IMPORTANCE_SAMPLING_LEVELS, IS_MODES, LOSS_TYPES, combination_warnings
from .pipeline.aggregation import REUSE_ORDERS

GENERATION_BACKENDS = ("hf", "vllm", "vllm_server", "openai")
VLLM_MODES = ("colocate", "server")
WEIGHT_SYNC_TRANSPORTS = ("auto", "broadcast", "ipc", "checkpoint_dir", "none")
#: the weight-sync transports each backend can use ('none': the sampler keeps its initial weights); backends added with
#: `grpo_async.generation.register_backend` are added here
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
    "openai": "a remote OpenAI-compatible engine can neither join a process group nor map this machine's memory; "
    "it can only reload a shared checkpoint folder",
}
#: loss types TRL 1.16 has (all in `LOSS_TYPES`; a missing one would raise `NotImplementedError`, not `ValueError`)
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")

#: TRL 1.16 field name → the field of this config that holds the same knob (same values, same meaning). Accepted as
#: keyword arguments and readable (and settable) as attributes; not separate dataclass fields, so a copy never
#: carries two values of one knob.
TRL_ALIASES = {
    "vllm_importance_sampling_correction": "importance_sampling_correction",
    "vllm_importance_sampling_mode": "importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min": "importance_sampling_clip_min",
}
#: deprecated TRL names, accepted as keyword arguments with a `FutureWarning` (TRL 1.16 warns the same way)
TRL_DEPRECATED = {"vllm_importance_sampling_cap": "importance_sampling_clip_max"}

#: fields whose default differs from TRL 1.16's `GRPOConfig`, and why. TRL's value is accepted for each.
DEFAULT_DIFFERENCES = {
    "disable_dropout": "True here (TRL: False). The old-policy logps, the training pass and the sampler must score "
    "the same function; with dropout on, the ratio π/π_old is noise even on-policy and the importance-sampling "
    "correction against the sampler (which never uses dropout) is biased.",
    "gradient_checkpointing": "False here (TRL: True). The training passes are packed without padding "
    "(`padding_free`), which already keeps activation memory low; checkpointing costs about 20% of the step. Set "
    "it to True for large models.",
    "bf16": "False here (TRL: None, which means True unless fp16). Training runs in float32 by default so the "
    "trainer's logps match the sampler's; bf16=None is accepted with TRL's meaning.",
    "min_p": "0.0 here (TRL: None); both mean off. None is accepted and read back as 0.0.",
    "num_completions_to_print": "4 here (TRL: None = every completion of the round). None prints them all.",
}

#: TRL 1.16 fields this trainer accepts only at TRL's default: field → what to do instead (see `_unsupported`)
_UNSUPPORTED = {
    "ds3_gather_for_generation": "the policy weights are always gathered for generation under DeepSpeed ZeRO-3; "
    "leave it True",
    "pad_to_multiple_of": "rows are packed without padding (padding_free); leave it 'auto' or None",
    "cache_implementation": "the hf backend uses the model's default cache; leave it None",
    "vllm_model_impl": "the vllm backend uses vLLM's own model implementation; leave it 'vllm'",
    "vllm_enable_sleep_mode": "the in-process engine stays resident; lower vllm_gpu_memory_utilization or generate "
    "on a server (generation_backend='vllm_server') to free trainer memory",
    "vllm_structured_outputs_regex": "structured outputs are not passed to the sampler; leave it None",
    "vllm_group_port": "the broadcast weight sync picks a free port itself; leave it 51216",
    "vllm_tensor_parallel_size": "the in-process engine runs on one device; for tensor parallelism start "
    "`grpo-async serve` with it and use generation_backend='vllm_server'",
    "log_completions_hub_repo": "completions are written to output_dir/completions/ as parquet; upload that folder",
    "use_transformers_continuous_batching": "use generation_backend='vllm' (or use_vllm=True) for batched generation",
    "transformers_continuous_batching_config": "use generation_backend='vllm' (or use_vllm=True) for batched "
    "generation",
    "use_transformers_paged": "use generation_backend='vllm' (or use_vllm=True) for batched generation",
    "use_liger_kernel": "TRL's GRPOTrainer uses it for Liger's fused GRPO loss, which this trainer does not have; "
    "to patch the model's layers with fused kernels load it with model_init_kwargs={'use_kernels': True}",
}
#: TRL 1.16 fields accepted only at TRL's default (`NotImplementedError` otherwise): the README's table
UNSUPPORTED_TRL_FIELDS = tuple(_UNSUPPORTED)
_STAGES = ("rollout_micro_batch_size", "ref_logps_micro_batch_size", "old_logps_micro_batch_size")


# ---- derived values --------------------------------------------------------------------------------------------
class _Derived:
    """Marks a value that `__post_init__` derived from other fields rather than one the user gave.

    The value behaves exactly like its base type (`==`, arithmetic, `json.dumps`, `repr`); a config constructed from
    it (`dataclasses.replace`, `copy`, `GRPOConfig(**cfg.to_dict())`) derives the field again from the new values.
    """

    __slots__ = ()


class _DerivedInt(_Derived, int):
    __slots__ = ()


class _DerivedFloat(_Derived, float):
    __slots__ = ()


class _DerivedStr(_Derived, str):
    __slots__ = ()


def _derived(value):
    """`value` marked as derived (ints, floats and strings; `None` and bools stay as they are)."""
    if value is None or isinstance(value, (bool, _Derived)):
        return value
    for base, marked in ((int, _DerivedInt), (float, _DerivedFloat), (str, _DerivedStr)):
        if isinstance(value, base):
            return marked(value)
    return value


def _given(value):
    """What the user gave: `None` for a value an earlier `__post_init__` derived."""
    return None if isinstance(value, _Derived) else value


def is_derived(config: Any, name: str) -> bool:
    """Whether `config.<name>` was derived by `__post_init__` (from other fields) rather than set by the user."""
    return isinstance(getattr(config, name), _Derived)


def _err(field_name: str, message: str) -> ValueError:
    return ValueError(f"GRPOConfig.{field_name}: {message}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class GRPOConfig(TrainingArguments):
    r"""Configuration of [`GRPOTrainer`]; all [`~transformers.TrainingArguments`] fields apply as well.

    Batch geometry (G = `num_generations`, μ = `num_iterations`, N = processes):

    ```txt
    generation round = per_device_train_batch_size × N × steps_per_generation rows  (= prompts × G)
    one round is generated every steps_per_generation × μ micro-steps, trained μ times (epoch order: a b | a b)
    optimizer steps per round (steps_per_round) = steps_per_generation × μ / gradient_accumulation_steps
    ```

    Every field of TRL 1.16's `GRPOConfig` is accepted with TRL's meaning (see the module docstring).
    """

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + [
        "model_init_kwargs",
        "generation_kwargs",
        "chat_template_kwargs",
        "transformers_continuous_batching_config",
    ]

    # ---- overridden TrainingArguments defaults -------------------------------------------------------------
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (TRL's GRPO default)."})
    logging_steps: float = field(default=10, metadata={"help": "Log every X optimizer steps."})
    remove_unused_columns: bool | None = field(
        default=False, metadata={"help": "Keep dataset columns: they are passed to the reward functions."}
    )

    # ---- model -------------------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None, metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a name or path."}
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Set every dropout probability to 0, so the sampler, the old-policy pass and the training pass "
            "score the same function (TRL's default is False)."
        },
    )
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
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the prompts each epoch."})

    # ---- generation --------------------------------------------------------------------------------------
    num_generations: int | None = field(default=8, metadata={"help": "Completions per prompt (G)."})
    num_generations_eval: int | None = field(
        default=None,
        metadata={
            "help": "Number of generations to sample during evaluation. This allows using fewer generations during "
            "evaluation to save computation. If `None`, uses the value of `num_generations`. Evaluation generates "
            "and scores per_device_eval_batch_size × processes rows at a time, which must then be a multiple of it "
            "when evaluating during training (as in TRL)."
        },
    )
    max_completion_length: int | None = field(default=512, metadata={"help": "Most tokens generated per completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (also divides trainer logits)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling; 1.0 disables it."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 disables it."})
    min_p: float | None = field(default=0.0, metadata={"help": "Min-p sampling; 0.0 (or None) disables it."})
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
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Rows (completions) per generation round over all processes. Default: "
            "per_device_train_batch_size × processes × steps_per_generation. Set it or steps_per_generation."
        },
    )
    steps_per_generation: int | None = field(
        default=None,
        metadata={
            "help": "Micro-steps (per-device batches) trained from one generation round. Default: "
            "gradient_accumulation_steps, or generation_batch_size / (per_device_train_batch_size × processes)."
        },
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
    vllm_master_address: str | None = field(
        default=None,
        metadata={
            "help": "This trainer's address as the servers see it (broadcast weight sync hosts the store there). "
            "Default: 127.0.0.1 for servers on this machine, else this machine's address on the route to each server."
        },
    )
    openai_base_url: str | None = field(default=None, metadata={"help": "OpenAI-compatible endpoint (openai)."})
    openai_model: str | None = field(default=None, metadata={"help": "Model name sent to the OpenAI endpoint."})

    # ---- weight sync -------------------------------------------------------------------------------------
    weight_sync_transport: str = field(
        default="auto",
        metadata={
            "help": f"One of {WEIGHT_SYNC_TRANSPORTS}; 'auto' picks the best the backend supports (with the openai "
            "backend: no sync); 'none': the sampler keeps its initial weights."
        },
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
    vllm_lora_sync: str = field(
        default="auto",
        metadata={
            "help": "With a PEFT LoRA adapter (peft_config), what a weight sync sends to vLLM: 'adapter' (only the "
            "adapter's lora_A/lora_B tensors; the sampler serves base + LoRA with a new adapter per policy version "
            "and its base weights never move; a vllm_server must run with --enable-lora --max-lora-rank R), "
            "'merged' (merge the adapter, push every full weight, unmerge) or 'auto' ('adapter' for the in-process "
            "vllm backend when vLLM can serve the adapter (LoRA, no DoRA, bias or modules_to_save), else 'merged')."
        },
    )

    # ---- per-stage micro-batches -------------------------------------------------------------------------
    rollout_micro_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions per generate call (rows after the ×G repeat), on the main process, over the whole "
            "round; must divide generation_batch_size. Default: per_device_train_batch_size. vLLM batches "
            "internally: set it to generation_batch_size for one call per round."
        },
    )
    ref_logps_micro_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Rows per reference-model forward pass, on each process over its generation_batch_size / "
            "processes rows (must divide them). Default: per_device_train_batch_size."
        },
    )
    old_logps_micro_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Rows per old-policy forward pass, on each process over its generation_batch_size / processes "
            "rows (must divide them). Default: per_device_train_batch_size."
        },
    )
    reuse_order: str = field(
        default="epoch",
        metadata={
            "help": f"Order of the μ passes over a round's micro-batches, one of {REUSE_ORDERS}: 'epoch' (a b | a b) "
            "or 'consecutive' (a a b b: each micro-batch trained μ times in a row)."
        },
    )

    # ---- async pipeline ----------------------------------------------------------------------------------
    num_batches_ahead: int = field(
        default=1,
        metadata={
            "help": "Rounds generated ahead of training (0 = synchronous). Staleness is counted in policy versions "
            "(optimizer steps): with k rounds ahead a sample lags at most ceil(k × steps_per_round) versions when "
            "its round starts (see max_staleness)."
        },
    )
    async_generation_timeout: float = field(
        default=600.0, metadata={"help": "Seconds any wait on the generator may last before raising."}
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Most policy versions (optimizer steps) a sample may lag: a sample generated from the weights of "
            "step v and trained in a round starting from the weights of step s has staleness s - v; staler samples "
            "are not trained (loss mask zeroed, counted in async/dropped_stale). Default: what the pipeline can "
            "produce, ceil(num_batches_ahead × steps_per_round), so nothing is dropped; when the sampler never "
            "receives weights (weight_sync_transport='none', or the openai backend without 'checkpoint_dir') there "
            "is no limit and it must stay unset."
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
    loss_type: str = field(default="dapo", metadata={"help": f"One of {LOSS_TYPES} (TRL 1.16's)."})
    scale_rewards: str = field(
        default="group", metadata={"help": f"One of {SCALE_REWARDS}; True means 'group', False 'none' (as in TRL)."}
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "How several reward functions become one advantage: 'sum_then_normalize' (default): weighted sum "
            "of the rewards, then normalised as `scale_rewards` says. 'normalize_then_sum' (GDPO): each reward "
            "normalised within its group (mean, std), then the weighted sum, then normalised over the whole batch; "
            "`scale_rewards` does not apply (as in TRL)."
        },
    )
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
            "stale policy (async rounds) or another engine's numerics (vLLM). Needs the old-policy logps pass. "
            "TRL name: vllm_importance_sampling_correction."
        },
    )
    importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": f"One of {tuple(IS_MODES)} (TRL 1.16's vLLM IS modes). TRL name: vllm_importance_sampling_mode."
        },
    )
    importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={
            "help": "Lower bound of the IS ratio (truncate: clip, mask: zero below); None: none. TRL name: "
            "vllm_importance_sampling_clip_min."
        },
    )
    importance_sampling_clip_max: float | None = field(
        default=3.0,
        metadata={
            "help": "Upper bound of the IS ratio (truncate: clip, mask: zero above); None: none. TRL name: "
            "vllm_importance_sampling_clip_max."
        },
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the KL term by the ratio π/π_old, so its gradient is the unbiased reverse-KL gradient "
            "(DeepSeek-V3.2); changes the gradient whenever beta > 0, on-policy too."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": f"One of {IMPORTANCE_SAMPLING_LEVELS}: the ratio π/π_old per token, or per sequence as the exp of "
            "the mean log-ratio over its tokens (GSPO; use it with loss_type='grpo' or 'luspo')."
        },
    )
    delta: float | None = field(
        default=None,
        metadata={"help": "Two-sided clipping (INTELLECT-2): cap the ratio at delta (> 1; recommended > 1 + ε_high)."},
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Off-policy sequence masking (DeepSeek-V3.2): drop sequences with A < 0 whose mean per-token "
            "log π_sampler − log π_θ exceeds this (>= 0); None: off."
        },
    )
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "loss_type='sapo': τ for A <= 0 (> 0)."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "loss_type='sapo': τ for A > 0 (> 0)."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "loss_type='vespo': power k for A >= 0 (>= 0)."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "loss_type='vespo': decay λ for A >= 0 (>= 0)."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "loss_type='vespo': power k for A < 0 (>= 0)."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "loss_type='vespo': decay λ for A < 0 (>= 0)."})
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "ρ in [0, 1]: train only the top-ρ tokens by entropy, the quantile taken over every process's "
            "trained tokens of the micro-step (1.0: all tokens)."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Entropy bonus: subtract coef × the mean per-token entropy (of the entropy-masked tokens) from "
            "the loss; the initial coefficient with use_adaptive_entropy."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Adaptive entropy bonus (Skywork-OR1): each optimizer step entropy_coef moves by "
            "entropy_coef_delta up when the step's mean entropy is <= entropy_target, down otherwise, and is applied "
            "only while the entropy is <= entropy_target. Saved in checkpoints."
        },
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy: lower bound of entropy_coef."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy: upper bound of entropy_coef."})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "Adaptive entropy: step of entropy_coef."})
    entropy_target: float = field(default=0.2, metadata={"help": "Adaptive entropy: target mean entropy (nats)."})
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Mixture-of-Experts models (a config with output_router_logits): weight of the load-balancing "
            "loss added to the loss; None: the model config's router_aux_loss_coef; 0.0: off. An error for "
            "other models."
        },
    )

    # ---- memory: packing, reference model ----------------------------------------------------------------
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Run the logps and training forward passes without padding: each micro-batch's rows packed, "
            "longest first, into bins no longer than its longest row (position ids reset per row; logits only at "
            "completion tokens). Same numbers as the padded path, never more attention work; much less memory and "
            "time when lengths are skewed (one long completion among short ones), as in RL. Needs a model whose "
            "attention isolates packed rows (restarting position ids); the trainer checks this at start. None "
            "(default): packed when the model isolates packed rows, else padded with a warning (e.g. OPT, Bloom, "
            "Falcon); True: packed, or an error naming the model; False: padded."
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
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Whether to synchronize the reference model with the active model every `ref_model_sync_steps` "
            "steps, using the `ref_model_mixup_alpha` parameter (TR-DPO). Needs beta > 0 and a reference model "
            "in this process: not with PEFT or ref_server_url."
        },
    )
    ref_model_mixup_alpha: float = field(
        default=0.6,
        metadata={
            "help": "α parameter from the TR-DPO paper, which controls the mix between the current policy and the "
            "previous reference policy during updates. The reference policy is updated according to the equation: "
            "`π_ref = α * π_θ + (1 - α) * π_ref_prev`. To use this parameter, you must set `sync_ref_model=True`."
        },
    )
    ref_model_sync_steps: int = field(
        default=512,
        metadata={
            "help": "τ parameter from the TR-DPO paper, which determines how frequently the current policy is "
            "synchronized with the reference policy. To use this parameter, you must set `sync_ref_model=True`."
        },
    )

    # ---- logging -----------------------------------------------------------------------------------------
    log_completions: bool = field(default=False, metadata={"help": "Print a sample of completions when logging."})
    num_completions_to_print: int | None = field(
        default=4, metadata={"help": "Completions printed per log; None prints all of them."}
    )
    log_multimodal: bool = field(
        default=True, metadata={"help": "TRL: log images/videos with completions. Text-only here: no effect."}
    )

    # ---- TRL 1.16 fields accepted only at TRL's default (UNSUPPORTED_TRL_FIELDS) ---------------------------
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "As TRL: the LM head in float32 (its weights and matmul), so a bf16/fp16 model computes float32 "
            "logits and logps; with tied embeddings the embedding output keeps the model's dtype."
        },
    )
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "TRL field; always gathered here."})
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": "TRL field; rows are packed."})
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra sampling arguments for the backend, as TRL: GenerationConfig fields (hf) or vLLM "
            "SamplingParams fields (vllm; for servers, /v1/completions body fields). They override the fields this "
            "config sets (temperature, top_p, ...): the trainer's logps still use `temperature`."
        },
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra arguments of the tokenizer's apply_chat_template for conversational prompts and every "
            "environment turn (e.g. {'enable_thinking': False}), as TRL."
        },
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata={
            "help": "Penalise tokens already in the prompt or completion (> 1) or favour them (< 1); 1.0 is off. The "
            "sampler's distribution then differs from π/T the trainer scores: the importance-sampling correction sees "
            "that gap (sampling/logp_diff)."
        },
    )
    cache_implementation: str | None = field(default=None, metadata={"help": "TRL field; not implemented."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "TRL field; vLLM's implementation only."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "TRL field; not implemented."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "TRL field; not implemented."})
    vllm_group_port: int = field(default=51216, metadata={"help": "TRL field; the port is picked automatically."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "TRL field; use a server for TP."})
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={
            "help": "tools= / environment_factory: most tool-calling turns of a rollout (TRL); None: until "
            "max_completion_length. An environment= object sets its own max_turns."
        },
    )
    log_unique_prompts: bool = field(
        default=False,
        metadata={
            "help": "Print one completion per distinct prompt in the completions table (the parquet keeps all)."
        },
    )
    log_completions_hub_repo: str | None = field(default=None, metadata={"help": "TRL field; not implemented."})
    use_transformers_continuous_batching: bool = field(default=False, metadata={"help": "TRL field; use vllm."})
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "TRL field; use vllm."}
    )
    use_transformers_paged: bool = field(default=False, metadata={"help": "Deprecated TRL field; use vllm."})

    def __new__(cls, *args, **kwargs):
        # A dataclass subclass gets its own generated __init__: wrap it (once) so it too accepts TRL's names and
        # answers a misspelled field with a suggestion. type.__call__ looks __init__ up after __new__ returns.
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_grpo_wrapped", False):
            cls.__init__ = _wrap_init(init)
        return super().__new__(cls)

    def __post_init__(self):
        if self.bf16 is None:  # TRL: None means bf16 unless fp16
            self.bf16 = not self.fp16
        self._check_trl_fields()  # before TrainingArguments, which would fail on use_liger_kernel without Liger
        super().__post_init__()
        if self.min_p is None:  # TRL's "off"
            self.min_p = 0.0
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        self.epsilon_high = _given(self.epsilon_high)
        if self.epsilon_high is None:
            self.epsilon_high = _derived(float(self.epsilon))
        self.generation_backend = _given(self.generation_backend)
        if self.generation_backend is None:
            if self.openai_base_url:
                self.generation_backend = _derived("openai")
            elif self.use_vllm:
                if self.vllm_mode not in VLLM_MODES:
                    raise _err("vllm_mode", f"must be one of {VLLM_MODES}, got {self.vllm_mode!r}")
                self.generation_backend = _derived("vllm" if self.vllm_mode == "colocate" else "vllm_server")
            else:
                self.generation_backend = _derived("hf")
        if not isinstance(self.num_batches_ahead, int) or self.num_batches_ahead < 0:
            raise _err("num_batches_ahead", f"must be an int >= 0 (0 = synchronous), got {self.num_batches_ahead!r}")
        self.async_max_queue_size = _given(self.async_max_queue_size)
        if self.async_max_queue_size is None:
            self.async_max_queue_size = _derived(self.num_batches_ahead + 2)
        self._derive_batch_geometry()
        for name in _STAGES:
            if _given(getattr(self, name)) is None:
                setattr(self, name, _derived(self.per_device_train_batch_size))
        self._validate()

    # ---- secrets: never written out ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """`TrainingArguments.to_dict` (what TensorBoard, wandb, mlflow, ... receive) with the API keys replaced by
        `"<FIELD_NAME>"`, as transformers replaces its `*_token` fields."""
        return _redacted(super().to_dict())

    def __str__(self) -> str:  # TrainingArguments.__str__, with the API keys masked too
        d = {k: f"<{k.upper()}>" if k.endswith("_token") else v for k, v in dataclasses.asdict(self).items()}
        attrs = "".join(f"{k}={v},\n" for k, v in sorted(_redacted(d).items()))
        return f"{type(self).__name__}(\n{attrs})"

    __repr__ = __str__

    def __getstate__(self) -> dict:
        """Pickled (the Trainer's `training_args.bin` in every checkpoint, uploaded with it): without the API keys.
        A config read back from it has `"<VLLM_API_KEY>"` there: set the keys again to use it against a server."""
        return _redacted(dict(self.__dict__))

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo):  # in-process copies keep the keys
        import copy

        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    # ---- derived, read-only ------------------------------------------------------------------------------
    @property
    def server_urls(self) -> list[str]:
        """The generation servers: `vllm_server_urls`, then `vllm_server_base_url`, de-duplicated (order kept); with
        the vllm_server backend and no URL given, TRL's `http://vllm_server_host:vllm_server_port`."""
        urls = list(self.vllm_server_urls or [])
        if self.vllm_server_base_url:
            urls.append(self.vllm_server_base_url)
        if not urls and self.generation_backend == "vllm_server":
            urls.append(f"http://{self.vllm_server_host}:{self.vllm_server_port}")
        out, seen = [], set()
        for u in urls:
            key = str(u).rstrip("/")
            if key not in seen:
                seen.add(key)
                out.append(u)
        return out

    @property
    def syncs_weights(self) -> bool:
        """Whether the sampler ever receives the trainer's weights: not with `weight_sync_transport='none'`, nor with
        the openai backend unless it reloads a shared checkpoint folder (`'checkpoint_dir'`)."""
        if self.weight_sync_transport == "none":
            return False
        if self.generation_backend == "openai":
            return self.weight_sync_transport == "checkpoint_dir"
        return True

    @property
    def steps_per_round(self) -> float:
        """Optimizer steps per generation round: `steps_per_generation × num_iterations / gradient_accumulation_steps`
        (may be fractional: a round can end inside an accumulation window)."""
        return self.steps_per_generation * self.num_iterations / self.gradient_accumulation_steps

    @property
    def staleness_limit(self) -> int | None:
        """Most policy versions (optimizer steps) a trained sample may lag (see `max_staleness`), or `None`: no limit.

        `max_staleness` if set; else, when the sampler receives weights, the most the pipeline produces,
        `ceil(num_batches_ahead × steps_per_round)` (nothing is dropped by default); else `None` (the sampler never
        updates, samples are corrected by importance sampling, nothing is dropped).
        """
        if self.max_staleness is not None:
            return self.max_staleness
        if not self.syncs_weights:
            return None
        # integer form of ceil(num_batches_ahead * steps_per_round): no float rounding
        num = self.num_batches_ahead * self.steps_per_generation * self.num_iterations
        return -(-num // self.gradient_accumulation_steps)

    @property
    def global_micro_batch_size(self) -> int:
        """Rows trained per micro-step across all processes."""
        return self.per_device_train_batch_size * self.world_size

    # ---- construction steps ------------------------------------------------------------------------------
    def _check_trl_fields(self) -> None:
        """TRL 1.16 fields this trainer does not implement must keep TRL's default (`NotImplementedError`)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        for name, instead in _UNSUPPORTED.items():
            value, f = getattr(self, name), fields[name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if name == "pad_to_multiple_of" and (
                value is None or (isinstance(value, str) and value.lower() in ("auto", "none", "null"))
            ):
                continue  # TRL: 'auto' pads only on Neuron; None never pads
            if value != default:
                raise NotImplementedError(
                    f"GRPOConfig.{name}={value!r} is a TRL GRPOConfig option this trainer does not implement: "
                    f"{instead}."
                )
        if self.loss_type in TRL_LOSS_TYPES and self.loss_type not in LOSS_TYPES:
            raise NotImplementedError(
                f"GRPOConfig.loss_type={self.loss_type!r} is a TRL loss type this trainer does not implement; "
                f"choose one of {LOSS_TYPES}."
            )
        if self.auto_find_batch_size:
            raise _err(
                "auto_find_batch_size",
                "not supported: the generation round must hold whole groups of num_generations completions, and "
                "halving the batch on out-of-memory breaks that; set it to False and lower "
                "per_device_train_batch_size instead",
            )
        pc = getattr(self, "parallelism_config", None)
        if pc is not None and (getattr(pc, "cp_enabled", False) or getattr(pc, "sp_enabled", False)):
            raise _err(
                "parallelism_config",
                "sequence-dim parallelism (cp_size > 1 or sp_size > 1) is not supported: the model inputs are built "
                "after generation; set cp_size=1 and sp_size=1",
            )

    def _derive_batch_geometry(self) -> None:
        """`generation_batch_size` and `steps_per_generation` from whichever the user set (TRL's rules)."""
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _err(name, f"must be an int >= 1, got {v!r}")
        micro = self.global_micro_batch_size
        gbs, spg = _given(self.generation_batch_size), _given(self.steps_per_generation)
        if spg is not None and (not isinstance(spg, int) or isinstance(spg, bool) or spg < 1):
            raise _err("steps_per_generation", f"must be an int >= 1, got {spg!r}")
        if gbs is not None and (not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1):
            raise _err("generation_batch_size", f"must be an int >= 1, got {gbs!r}")
        if gbs is None:
            spg = spg if spg is not None else _derived(self.gradient_accumulation_steps)
            gbs = _derived(micro * spg)
        else:
            if gbs % micro != 0:
                raise _err(
                    "generation_batch_size",
                    f"{gbs} is not a multiple of per_device_train_batch_size={self.per_device_train_batch_size} × "
                    f"processes={self.world_size} = {micro} (each micro-step trains {micro} rows over all processes)",
                )
            if spg is not None and spg != gbs // micro:
                raise _err(
                    "generation_batch_size",
                    f"{gbs} and steps_per_generation={spg} disagree: a round of {gbs} rows is "
                    f"{gbs // micro} micro-steps of per_device_train_batch_size={self.per_device_train_batch_size} × "
                    f"processes={self.world_size}; set only one of the two",
                )
            spg = _derived(gbs // micro)
        self.generation_batch_size, self.steps_per_generation = gbs, spg

    def _round_description(self) -> tuple[str, str]:
        """(field to blame, how the round's row count came about), naming only what the user set."""
        gbs = self.generation_batch_size
        if not is_derived(self, "generation_batch_size"):
            return "generation_batch_size", f"generation_batch_size={gbs}"
        steps = (
            f"gradient_accumulation_steps={self.gradient_accumulation_steps}"
            if is_derived(self, "steps_per_generation")
            else f"steps_per_generation={self.steps_per_generation}"
        )
        return "num_generations", (
            f"per_device_train_batch_size={self.per_device_train_batch_size} × processes={self.world_size} × "
            f"{steps} = {gbs}"
        )

    def _validate(self) -> None:
        G = self.num_generations
        if not isinstance(G, int) or isinstance(G, bool) or G < 2:
            raise _err("num_generations", f"must be an int >= 2 (GRPO compares completions of a prompt), got {G!r}")
        if not isinstance(self.num_iterations, int) or self.num_iterations < 1:
            raise _err("num_iterations", f"must be an int >= 1, got {self.num_iterations!r}")
        if not (isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0):
            raise _err("repetition_penalty", f"must be a number > 0 (1.0 = off), got {self.repetition_penalty!r}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise _err("chat_template_kwargs", f"must be a dict (or its JSON text), got {self.chat_template_kwargs!r}")
        it = self.max_tool_calling_iterations
        if it is not None and not (isinstance(it, int) and not isinstance(it, bool) and it >= 0):
            raise _err("max_tool_calling_iterations", f"must be an int >= 0 or None, got {it!r}")
        if self.generation_kwargs is not None and not isinstance(self.generation_kwargs, dict):
            raise _err("generation_kwargs", f"must be a dict (or its JSON text), got {self.generation_kwargs!r}")
        gbs = self.generation_batch_size
        if gbs % G != 0:
            blame, how = self._round_description()
            raise _err(
                blame,
                f"a generation round has {how} rows, not a multiple of num_generations={G} (a prompt's {G} "
                f"completions must land in one round); valid num_generations divide {gbs}: "
                f"{[g for g in range(2, gbs + 1) if gbs % g == 0]}, or change the batch so the rows are a "
                f"multiple of {G}",
            )
        self._validate_stages()
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
        if (
            self.importance_sampling_correction
            and self.importance_sampling_mode.endswith("_truncate")
            and lo is None
            and hi is None
        ):
            raise _err(
                "importance_sampling_clip_max",
                f"importance_sampling_mode={self.importance_sampling_mode!r} clips the ratio, so at least one of "
                "importance_sampling_clip_min / importance_sampling_clip_max must be set",
            )
        if self.reuse_order not in REUSE_ORDERS:
            raise _err("reuse_order", f"must be one of {REUSE_ORDERS}, got {self.reuse_order!r}")
        if not self.async_generation_timeout or self.async_generation_timeout <= 0:
            raise _err("async_generation_timeout", f"must be > 0 seconds, got {self.async_generation_timeout!r}")
        if not isinstance(self.async_max_queue_size, int) or self.async_max_queue_size < self.num_batches_ahead + 1:
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
        if self.num_completions_to_print is not None and (
            not isinstance(self.num_completions_to_print, int) or self.num_completions_to_print < 0
        ):
            raise _err(
                "num_completions_to_print", f"must be an int >= 0 or None (all), got {self.num_completions_to_print!r}"
            )
        if self.loss_type not in LOSS_TYPES:
            raise _err("loss_type", f"unknown loss type {self.loss_type!r}; choose one of {LOSS_TYPES}")
        self._validate_loss()
        if self.scale_rewards not in SCALE_REWARDS:
            raise _err("scale_rewards", f"must be one of {SCALE_REWARDS} (or True/False), got {self.scale_rewards!r}")
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise _err("reward_timeout", f"must be > 0 seconds or None (no limit), got {self.reward_timeout!r}")
        if self.beta < 0:
            raise _err("beta", f"must be >= 0, got {self.beta!r}")
        if not self.epsilon > 0 or not self.epsilon_high > 0:
            raise _err("epsilon", f"epsilon and epsilon_high must be > 0, got {self.epsilon!r}, {self.epsilon_high!r}")
        self._validate_generation()
        self._validate_staleness()
        self._validate_eval_and_reference()

    def _validate_loss(self) -> None:
        """The loss family's knobs (TRL 1.16's meanings); TRL's warnings about known-bad combinations."""
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise _err(
                "importance_sampling_level",
                f"must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {self.importance_sampling_level!r}",
            )
        if self.delta is not None and not self.delta > 1:
            raise _err(
                "delta", f"must be > 1 (the ratio's cap; recommended > 1 + epsilon_high) or None, got {self.delta!r}"
            )
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold >= 0:
            raise _err(
                "off_policy_mask_threshold", f"must be >= 0 (a KL) or None, got {self.off_policy_mask_threshold!r}"
            )
        for name in ("sapo_temperature_neg", "sapo_temperature_pos"):
            if not getattr(self, name) > 0:
                raise _err(name, f"must be > 0 (the loss divides by it), got {getattr(self, name)!r}")
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            if not getattr(self, name) >= 0:
                raise _err(name, f"must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.top_entropy_quantile <= 1:
            raise _err(
                "top_entropy_quantile", f"must be in [0, 1] (1.0: every token), got {self.top_entropy_quantile!r}"
            )
        if not 0 <= self.entropy_coef_min <= self.entropy_coef_max:
            raise _err(
                "entropy_coef_min",
                f"need 0 <= entropy_coef_min <= entropy_coef_max, got {self.entropy_coef_min!r}, "
                f"{self.entropy_coef_max!r}",
            )
        if not self.entropy_coef_delta >= 0:
            raise _err("entropy_coef_delta", f"must be >= 0, got {self.entropy_coef_delta!r}")
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            raise _err(
                "router_aux_loss_coef", f"must be >= 0 or None (the model's own), got {self.router_aux_loss_coef!r}"
            )
        if (  # TRL's rule: with vLLM only (hf: a sequence mode's [B, 1] ratio joins VESPO's sequence weight)
            self.loss_type == "vespo"
            and self.generation_backend != "hf"
            and self.importance_sampling_correction
            and self.importance_sampling_mode.startswith("sequence")
        ):
            raise _err(
                "importance_sampling_mode",
                "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. "
                f"Got: {self.importance_sampling_mode}. (loss_type='vespo' folds the importance-sampling ratio "
                "π_old / π_sampler into its sequence weights token by token; set importance_sampling_mode="
                "'token_mask' or 'token_truncate', or importance_sampling_correction=False)",
            )
        for message in combination_warnings(self.loss_type, self.importance_sampling_level):
            warnings.warn(f"GRPOConfig: {message}", UserWarning, stacklevel=6)

    def _validate_stages(self) -> None:
        """Every chunk of every stage is full: the rollout runs on the main process over the whole round, the
        ref/old logps passes on each process over its share of the round."""
        for name in _STAGES:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _err(name, f"must be an int >= 1 (rows, counted after the ×G repeat), got {v!r}")
        gbs, n = self.generation_batch_size, self.world_size
        r = self.rollout_micro_batch_size
        if gbs % r != 0:
            raise _err(
                "rollout_micro_batch_size",
                f"{r} does not divide the generation round of {gbs} rows: the main process generates the whole "
                f"round in calls of {r} rows and every call must be full; choose a divisor of {gbs}: "
                f"{_divisors(gbs)}",
            )
        local = gbs // n
        for name in _STAGES[1:]:
            v = getattr(self, name)
            if local % v != 0:
                raise _err(
                    name,
                    f"{v} does not divide the {local} rows each process scores per round (generation_batch_size={gbs}"
                    f" / processes={n}) in chunks of {v}; every chunk must be full: choose a divisor of {local}: "
                    f"{_divisors(local)}",
                )

    def _validate_generation(self) -> None:
        if (
            self.generation_backend not in SYNC_BY_BACKEND
        ):  # the built-ins and grpo_async.generation.register_backend's
            raise _err(
                "generation_backend",
                f"must be one of {tuple(SYNC_BY_BACKEND)} (add others with grpo_async.generation.register_backend), "
                f"got {self.generation_backend!r}",
            )
        if self.weight_sync_transport not in WEIGHT_SYNC_TRANSPORTS:
            raise _err(
                "weight_sync_transport", f"must be one of {WEIGHT_SYNC_TRANSPORTS}, got {self.weight_sync_transport!r}"
            )
        if self.weight_sync_bucket_mb <= 0:
            raise _err("weight_sync_bucket_mb", f"must be > 0, got {self.weight_sync_bucket_mb!r}")
        if isinstance(self.vllm_server_urls, str):
            raise _err(
                "vllm_server_urls", f"must be a list of URLs, got the string {self.vllm_server_urls!r}; wrap it in [ ]"
            )
        if self.generation_backend == "vllm_server" and not self.server_urls:
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
        if self.vllm_lora_sync not in ("auto", "adapter", "merged"):
            raise _err("vllm_lora_sync", f"must be 'auto', 'adapter' or 'merged', got {self.vllm_lora_sync!r}")
        if self.vllm_lora_sync == "adapter" and (
            self.generation_backend not in ("vllm", "vllm_server") or self.weight_sync_transport == "none"
        ):
            raise _err(
                "vllm_lora_sync",
                "'adapter' sends a LoRA adapter to a vLLM sampler: it needs generation_backend 'vllm' or "
                f"'vllm_server' with a weight sync; got generation_backend={self.generation_backend!r}, "
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
        if self.ref_server_url is not None:
            if not str(self.ref_server_url).startswith(("http://", "https://")):
                raise _err("ref_server_url", f"must be an http(s):// URL, got {self.ref_server_url!r}")
            if self.beta == 0:
                raise _err("ref_server_url", "is set but beta=0: no reference logps are computed; set beta > 0")
            if self.ref_server_url.rstrip("/") in [str(u).rstrip("/") for u in self.server_urls]:
                raise _err(
                    "ref_server_url",
                    f"{self.ref_server_url} is also a generation server: it receives the policy's weight updates, so "
                    "it cannot hold the frozen reference; start a separate server for it",
                )

    def _validate_eval_and_reference(self) -> None:
        """`num_generations_eval`, `multi_objective_aggregation`, and the TR-DPO reference updates (TRL's rules)."""
        g_eval = self.num_generations_eval
        if g_eval is not None and (not isinstance(g_eval, int) or isinstance(g_eval, bool) or g_eval < 1):
            raise _err("num_generations_eval", f"must be an int >= 1 or None (= num_generations), got {g_eval!r}")
        rows = self.per_device_eval_batch_size * self.world_size
        if self.do_eval and self.eval_strategy != "no" and rows % (g_eval or self.num_generations) != 0:
            g = g_eval or self.num_generations
            raise _err(
                "num_generations_eval",
                f"the global eval batch (per_device_eval_batch_size={self.per_device_eval_batch_size} × processes="
                f"{self.world_size} = {rows} rows) must be a multiple of the completions sampled per eval prompt "
                f"({g}{'' if g_eval else ', num_generations since num_generations_eval is None'}), as in TRL: set "
                f"num_generations_eval to a divisor of {rows} ({_divisors(rows)}) or per_device_eval_batch_size to a "
                f"multiple of {g}",
            )
        if self.multi_objective_aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
            raise _err(
                "multi_objective_aggregation",
                f"must be one of {MULTI_OBJECTIVE_AGGREGATIONS}, got {self.multi_objective_aggregation!r}",
            )
        if not self.sync_ref_model:
            return
        if self.beta == 0:  # TRL raises the same (at trainer construction)
            raise _err(
                "sync_ref_model",
                "is True but beta=0: no reference model is loaded (the KL term is off), so there is nothing to "
                "synchronize; set sync_ref_model=False, or beta > 0",
            )
        if self.ref_server_url is not None:
            raise NotImplementedError(
                f"GRPOConfig.sync_ref_model=True with GRPOConfig.ref_server_url={self.ref_server_url!r}: the "
                "reference server holds frozen weights that this trainer cannot mix the policy into; leave "
                "ref_server_url unset (the reference model is then loaded in this process and synchronized) or set "
                "sync_ref_model=False"
            )
        alpha, tau = self.ref_model_mixup_alpha, self.ref_model_sync_steps
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise _err("ref_model_mixup_alpha", f"must be in [0, 1] (the policy's share of the mix), got {alpha!r}")
        if not isinstance(tau, int) or isinstance(tau, bool) or tau < 1:
            raise _err("ref_model_sync_steps", f"must be an int >= 1 (optimizer steps), got {tau!r}")

    def _validate_staleness(self) -> None:
        s = self.max_staleness
        if s is None:
            return
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise _err(
                "max_staleness", f"must be an int >= 0 (policy versions, i.e. optimizer steps) or None, got {s!r}"
            )
        if not self.syncs_weights:
            raise _err(
                "max_staleness",
                f"is set ({s}) but the sampler never receives the trainer's weights (generation_backend="
                f"{self.generation_backend!r}, weight_sync_transport={self.weight_sync_transport!r}): every sample "
                "falls further behind each step, so after a few steps every sample would be dropped; leave "
                "max_staleness unset (stale samples are corrected by importance sampling), or choose a weight-sync "
                "transport that updates the sampler",
            )


# ---- keyword arguments: TRL's names, misspellings ----------------------------------------------------------------
#: fields holding credentials: redacted from `to_dict` (logging integrations), `repr` and pickles (training_args.bin)
SECRET_FIELDS = ("vllm_api_key", "ref_server_api_key")


def _redacted(d: dict) -> dict:
    return {**d, **{k: f"<{k.upper()}>" for k in SECRET_FIELDS if d.get(k) is not None}}


def _init_field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _translate_trl_names(cls, kwargs: dict) -> dict:
    """`kwargs` with TRL's names of our knobs (`TRL_ALIASES`, `TRL_DEPRECATED`) renamed to ours."""
    out = dict(kwargs)
    names = _init_field_names(cls)
    # dataclasses.replace passes every field: there, a TRL name is the change asked for and our name the old value
    full_copy = names <= out.keys()
    for trl_name, ours in TRL_DEPRECATED.items():
        if trl_name in out:
            value = out.pop(trl_name)
            if value is not None:
                warnings.warn(
                    f"GRPOConfig: `{trl_name}` is deprecated (TRL removes it in v2.0.0); use `{ours}`.",
                    FutureWarning,
                    stacklevel=4,
                )
                out[ours] = value  # TRL: the deprecated cap overrides the clip_max
    for trl_name, ours in TRL_ALIASES.items():
        if trl_name not in out:
            continue
        value = out.pop(trl_name)
        if ours in out and out[ours] != value and not full_copy:
            raise TypeError(
                f"GRPOConfig got both {trl_name}={value!r} (TRL's name) and {ours}={out[ours]!r}, which are the same "
                "setting; pass only one"
            )
        out[ours] = value
    unknown = [k for k in out if k not in names]
    if unknown:
        known = sorted(names | set(TRL_ALIASES) | set(TRL_DEPRECATED))
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, known, n=1, cutoff=0.6)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise TypeError(f"{cls.__name__} got unexpected keyword argument(s): {', '.join(hints)}")
    return out


class _ClassSignature:
    """`inspect.signature(cls)` gives the dataclass fields (the `__new__` above would otherwise hide them)."""

    def __get__(self, obj, cls):
        sig = inspect.signature(cls.__init__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])


def _wrap_init(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **_translate_trl_names(type(self), kwargs))

    __init__._grpo_wrapped = True
    return __init__


GRPOConfig.__init__ = _wrap_init(GRPOConfig.__init__)
GRPOConfig.__signature__ = _ClassSignature()


def _alias_property(ours: str) -> property:
    def get(self):
        return getattr(self, ours)

    def set_(self, value):
        setattr(self, ours, value)

    return property(get, set_, doc=f"TRL's name of `{ours}` (same value).")


for _trl_name, _ours in TRL_ALIASES.items():
    setattr(GRPOConfig, _trl_name, _alias_property(_ours))
del _trl_name, _ours
