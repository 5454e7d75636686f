"""TRL 1.16 `GRPOConfig` fields without a group of their own: the honoured ones (`generation_kwargs`,
`repetition_penalty`, ...) and the ones accepted only at TRL's default (`trl_compat.UNSUPPORTED_TRL_FIELDS`)."""

from dataclasses import dataclass, field

from .checks import InstanceOf, Number, checked_field


@dataclass
class TRLFields:
    """TRL fields: honoured ones (see each help), and ones refused at any value but TRL's default."""

    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "As TRL: the LM head in float32 (its weights and matmul), so a bf16/fp16 model computes float32 "
            "logits and logps; with tied embeddings the embedding output keeps the model's dtype."
        },
    )
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "TRL field; always gathered here."})
    pad_to_multiple_of: int | str | None = field(
        default="auto",
        metadata={
            "help": "As TRL: pad the training micro-batches' prompt and completion widths to a multiple of this "
            "(an int >= 1); 'auto' or None: no padding beyond the longest row (TRL's 'auto' pads only on Neuron). "
            "With padding_free the packed forward has no padding either way.",
        },
    )
    generation_kwargs: dict | str | None = checked_field(
        InstanceOf(dict, what="a dict (or its JSON text)"),
        default=None,
        metadata={
            "help": "Extra sampling arguments for the backend, as TRL: GenerationConfig fields (hf) or vLLM "
            "SamplingParams fields (vllm; for servers, /v1/completions body fields). They override the fields this "
            "config sets (temperature, top_p, ...): the trainer's logps still use `temperature`.",
        },
    )
    chat_template_kwargs: dict | str | None = checked_field(
        InstanceOf(dict, what="a dict (or its JSON text)"),
        default=None,
        metadata={
            "help": "Extra arguments of the tokenizer's apply_chat_template for conversational prompts and every "
            "environment turn (e.g. {'enable_thinking': False}), as TRL.",
        },
    )
    repetition_penalty: float = checked_field(
        Number(gt=0, what="a number > 0 (1.0 = off)"),
        default=1.0,
        metadata={
            "help": "Penalise tokens already in the prompt or completion (> 1) or favour them (< 1); 1.0 is off. The "
            "sampler's distribution then differs from π/T the trainer scores: the importance-sampling correction sees "
            "that gap (sampling/logp_diff).",
        },
    )
    cache_implementation: str | None = field(default=None, metadata={"help": "TRL field; not implemented."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "TRL field; vLLM's implementation only."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "TRL field; not implemented."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "TRL field; not implemented."})
    vllm_group_port: int = field(default=51216, metadata={"help": "TRL field; the port is picked automatically."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "TRL field; use a server for TP."})
    max_tool_calling_iterations: int | None = checked_field(
        Number(ge=0, integer=True, optional=True),
        default=None,
        metadata={
            "help": "tools= / environment_factory: most tool-calling turns of a rollout (TRL); None: until "
            "max_completion_length. An environment= object sets its own max_turns.",
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
