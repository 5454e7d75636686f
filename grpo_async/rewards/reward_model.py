"""A sequence-classification reward model as a reward function, scored the way TRL 1.16's `GRPOTrainer` scores one.

TRL accepts, in `reward_funcs`, a model id or path (loaded with `AutoModelForSequenceClassification`,
`num_labels=1`) or a `PreTrainedModel`, with its tokenizer from `reward_processing_classes` (else loaded from the
model's name). Each completion is scored on its prompt + completion text: conversational rows through the reward
tokenizer's chat template (`messages = prompt + completion`), standard rows concatenated; tokenized right-padded
without added special tokens; the reward is `logits[:, 0]`. The model reads the last non-pad token, so its config's
`pad_token_id` is set to the tokenizer's (EOS when it has no pad token).

Example:
    >>> rm = RewardModel.load("./my-reward-model")   # doctest: +SKIP
    >>> rm(prompts=["2+2="], completions=["4"])  # doctest: +SKIP
    [1.73]
"""

from __future__ import annotations

import torch


class RewardModel:
    """Calls `model` on prompt + completion texts; `__name__` is the model's name (TRL's reward function name).

    Args:
        model (`PreTrainedModel`): a sequence-classification model with one label.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer (chat template for conversational rows).
        batch_size (`int`, *optional*): texts per forward pass (all at once when `None`).
    """

    def __init__(self, model, tokenizer, batch_size: int | None = None):
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        for p in model.parameters():
            p.requires_grad_(False)
        self.__name__ = (
            str(getattr(model.config, "_name_or_path", "") or type(model).__name__).rstrip("/").split("/")[-1]
        )

    @classmethod
    def load(cls, name_or_path: str, tokenizer=None, **from_pretrained_kwargs) -> RewardModel:
        """Load the model (`num_labels=1`) and, unless given, its tokenizer; errors name a missing folder."""
        from transformers import AutoModelForSequenceClassification

        from ..loading import load_tokenizer, resolve_name_or_path

        resolve_name_or_path(name_or_path, "reward model")
        kwargs = {"num_labels": 1, **from_pretrained_kwargs}
        model = AutoModelForSequenceClassification.from_pretrained(name_or_path, **kwargs)
        trust = from_pretrained_kwargs.get("trust_remote_code", False)
        return cls(
            model, tokenizer if tokenizer is not None else load_tokenizer(name_or_path, trust_remote_code=trust)
        )

    def texts(self, prompts: list, completions: list) -> list[str]:
        out = []
        for p, c in zip(prompts, completions, strict=True):
            if isinstance(p, list):  # conversational: the chat template of the whole conversation
                out.append(self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False))
            else:
                out.append(p + c)
        return out

    @torch.inference_mode()
    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
        texts = self.texts(prompts, completions)
        device = next(self.model.parameters()).device
        size = self.batch_size or len(texts) or 1
        scores = []
        for start in range(0, len(texts), size):
            inputs = self.tokenizer(
                text=texts[start : start + size],
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
            ).to(device)
            scores.extend(self.model(**inputs).logits[:, 0].float().tolist())  # [b]
        return scores
