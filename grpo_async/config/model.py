"""Model and data fields of `GRPOConfig`: how the policy is loaded and how prompts are read."""

from dataclasses import dataclass, field
from typing import Any, Literal

from .checks import Number, checked_field


@dataclass
class ModelFields:
    """The policy model (`model_init_kwargs`, dropout, remote code) and its prompts (length, truncation, order)."""

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

    max_prompt_length: int | None = checked_field(
        Number(gt=0, integer=True, optional=True),
        default=512,
        metadata={
            "help": "Prompts longer than this (in tokens) are truncated from the left, or rejected (see "
            "`prompt_truncation`). `None` keeps them whole.",
        },
    )
    prompt_truncation: Literal["left", "error"] = field(
        default="left", metadata={"help": "'left': keep the last tokens and count it; 'error': raise."}
    )
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the prompts each epoch."})
