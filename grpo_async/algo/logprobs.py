"""Per-token log-probabilities of completion tokens, computed in chunks to bound memory.

Shapes: `B` rows, `P` prompt tokens, `T` completion tokens, `V` vocabulary.
"""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)[..., index]` without materialising the `[B, T, V]` log-softmax as a result.

    logits: `[B, T, V]`, index: `[B, T]` → `[B, T]`.
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)  # [B, T]
        # one call over the chunk: its temporaries are the size of the logits the chunk already holds
        norm = torch.logsumexp(logits, dim=-1)  # [B, T]
        return picked - norm
    # bf16/fp16: logsumexp is not accurate enough, go row by row in the logits' dtype
    out = []
    for row_logits, row_index in zip(logits, index, strict=True):
        row = torch.log_softmax(row_logits, dim=-1)  # [T, V]
        out.append(row.gather(dim=-1, index=row_index.unsqueeze(-1)).squeeze(-1))
    return torch.stack(out)


def completion_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float = 1.0,
    batch_size: int | None = None,
    padding_free: bool = False,
) -> torch.Tensor:
    """Log π(completion token | prefix) under `model`, with logits divided by `temperature` like the sampler.

    Args:
        input_ids (`[B, P+T]`), attention_mask (`[B, P+T]`): prompt (left-padded) then completion (right-padded).
        logits_to_keep (`int`): T, the completion length.
        batch_size (`int`, *optional*): rows per forward pass (all at once when `None`).
        padding_free (`bool`): run each chunk's rows packed into bins without padding
            (`algo.packing`); logits only at the completion tokens. Padded positions then hold exactly 0.

    Returns:
        `[B, T]` log-probabilities (values at padded positions are meaningless; mask them).
    """
    from .packing import pack_rows, packed_completion_logps, unpack_completion

    batch_size = batch_size or input_ids.size(0)
    out = []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start : start + batch_size]  # [b, P+T]
        am = attention_mask[start : start + batch_size]  # [b, P+T]
        if padding_free:
            packed = pack_rows(ids, am, logits_to_keep)
            out.append(unpack_completion(packed_completion_logps(model, packed, temperature), packed))  # [b, T]
            continue
        # position ids that skip the left padding, so a prompt's positions don't depend on its batch-mates
        position_ids = (am.cumsum(-1) - 1).clamp(min=0)  # [b, P+T]
        logits = model(
            input_ids=ids, attention_mask=am, position_ids=position_ids, logits_to_keep=logits_to_keep + 1
        ).logits  # [b, T+1, V]
        logits = logits[:, :-1, :] / temperature  # [b, T, V]
        out.append(selective_log_softmax(logits, ids[:, -logits_to_keep:]))  # [b, T]
    return torch.cat(out, dim=0)  # [B, T]


class LogpsScorer:
    """`scorer(ids [b, P+T], mask [b, P+T], T) -> logps [b, T]` (on CPU, no grad) under the model `model()` returns
    when called (the live, possibly wrapped policy, or a frozen reference), inside `context()` if given (e.g. a PEFT
    model's `disable_adapter`, which makes the policy its own reference).

    Example:
        >>> ref = LogpsScorer(lambda: ref_model, temperature=0.7, padding_free=True, device="cpu")   # doctest: +SKIP
        >>> ref(ids, mask, T).shape
        torch.Size([b, T])
    """

    def __init__(self, model, *, temperature: float, padding_free: bool, device, context=None):
        self.model, self.context = model, context
        self.temperature, self.padding_free, self.device = temperature, padding_free, device

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, T: int) -> torch.Tensor:
        import contextlib

        with self.context() if self.context is not None else contextlib.nullcontext():
            logps = completion_logps(
                self.model(),
                ids.to(self.device),
                mask.to(self.device),
                T,
                self.temperature,
                padding_free=self.padding_free,
            )
        return logps.cpu()  # [b, T]
