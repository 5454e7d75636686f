"""`ModelConfig`: the model and LoRA options of the recipes, with TRL's names (`--use_peft`, `--lora_r`, ...).

Our own small dataclass so that recipes do not depend on `trl`; it parses with `transformers.HfArgumentParser`:

```python
parser = HfArgumentParser((ModelConfig,))
parser.add_argument("--max_steps", type=int, default=200)  # the recipe's own flags
model_args, recipe_args = parser.parse_args_into_dataclasses()
trainer = GRPOTrainer(model_args.model_name_or_path, rewards, args=args, peft_config=get_peft_config(model_args))
```
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .algo.router_replay import is_moe_config

LORA_TASK_TYPES = ("CAUSAL_LM", "SEQ_CLS", "SEQ_2_SEQ_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")


@dataclass
class ModelConfig:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Model id on the Hub or local path."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model."})
    dtype: str | None = field(
        default=None, metadata={"help": "Weights dtype: auto, bfloat16, float16 or float32 (default: the model's)."}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the Hub."})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention implementation, e.g. sdpa, eager, flash_attention_2."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of the full model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Module names to adapt, e.g. q_proj v_proj, or 'all-linear' (default: PEFT's choice for the "
            "architecture)."
        },
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved with the adapter, e.g. lm_head."}
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "PEFT task type."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA (scale alpha / sqrt(r))."})
    use_dora: bool = field(default=False, metadata={"help": "Weight-decomposed LoRA (DoRA)."})

    def __post_init__(self):
        if self.dtype not in (None, "auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"ModelConfig.dtype: {self.dtype!r} is not one of 'auto', 'bfloat16', 'float16', 'float32'"
            )
        if self.lora_r < 1:
            raise ValueError(f"ModelConfig.lora_r: must be >= 1, got {self.lora_r}")
        if self.lora_alpha <= 0:
            raise ValueError(f"ModelConfig.lora_alpha: must be > 0, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"ModelConfig.lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        if self.lora_task_type not in LORA_TASK_TYPES:
            raise ValueError(f"ModelConfig.lora_task_type: {self.lora_task_type!r} is not one of {LORA_TASK_TYPES}")
        if self.lora_target_modules == ["all-linear"]:  # PEFT takes this keyword as a string, not a module list
            self.lora_target_modules = "all-linear"

    def model_init_kwargs(self) -> dict:
        """`GRPOConfig.model_init_kwargs` for these options (dtype, revision, attention)."""
        kwargs = {"revision": self.model_revision, "trust_remote_code": self.trust_remote_code}
        if self.dtype is not None:
            kwargs["dtype"] = self.dtype
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        return kwargs


def get_peft_config(model_args: ModelConfig):
    """A `peft.LoraConfig` when `model_args.use_peft`, else `None` (the trainer then trains the full model)."""
    if not model_args.use_peft:
        return None
    try:
        from peft import LoraConfig
    except ImportError as e:  # pragma: no cover - peft is installed with the test extra
        raise ImportError("ModelConfig.use_peft: needs the `peft` package (pip install peft)") from e
    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
        modules_to_save=model_args.lora_modules_to_save,
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        bias="none",
    )


# ---- checks of the model's own config against the training settings (at trainer construction) ----------------------


def check_context_length(args, model_config) -> None:
    """Refuse a `max_completion_length` that leaves no room for a prompt in the model's context: such completions
    could not be generated or scored. (The prompt + completion budget, `grpo_async.loading.check_lengths`, is what
    the recipes check; a trainer cannot, since `max_prompt_length` defaults to 512, a truncation bound, not a length.)

    Raises:
        `ValueError`: naming `GRPOConfig.max_completion_length`, its value and the model's context length.
    """
    from .loading import model_max_positions

    limit = model_max_positions(model_config)
    if limit is None or args.max_completion_length is None or args.max_completion_length < limit:
        return
    raise ValueError(
        f"GRPOConfig.max_completion_length={args.max_completion_length} does not fit the model's context "
        f"(max_position_embeddings={limit}) with even a one-token prompt: completions that long cannot be generated "
        f"or scored. Set max_completion_length below {limit}, leaving room for the prompt."
    )


def needs_find_unused_parameters(model, args) -> bool:
    """Whether DDP must look for parameters without gradients (`find_unused_parameters=True`), which costs a graph
    traversal per step and makes DDP warn at every run when none are found. Needed only when a forward pass can leave
    trainable parameters unused: a vision-language model trained on text (its vision tower; TRL's rule, off with
    reentrant gradient checkpointing, which fails with it) or a Mixture-of-Experts model (experts no token was routed
    to). transformers would turn it on for every model trained without gradient checkpointing.
    """
    config = model.config
    if getattr(config, "vision_config", None) is not None:
        return not (args.gradient_checkpointing_kwargs or {}).get("use_reentrant")
    return is_moe_config(config)  # an expert no token was routed to gets no gradient in that step
