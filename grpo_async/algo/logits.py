"""Per-token quantities from logits: the log-probability of a chosen token and the entropy of the distribution.

Pure functions of tensors, shared by the padded (`algo.logprobs`), packed (`algo.packing`) and shared-prompt
(`algo.prefix_sharing`) forward passes. Shapes: `B` rows, `T` positions, `V` vocabulary.
"""

from __future__ import annotations

import torch


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature`, or `logits` itself at temperature 1 (TRL's default): dividing by 1 is exact, so the
    values and their gradients are the same bit for bit, without a logits-sized copy and a pass over the `[..., V]`
    logits forward and one backward each time (36 ms a pass, 3 a step, over the 109 completion tokens of a step of
    `tests/test_trl_qwen3_tools.py` with Qwen3's 151,936-token vocabulary). `[..., V]` → `[..., V]`.

    >>> x = torch.randn(2, 3)
    >>> scaled(x, 1.0) is x, torch.equal(scaled(x, 0.5), x / 0.5)
    (True, True)
    """
    return logits if temperature == 1.0 else logits / temperature


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


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 128) -> torch.Tensor:
    """Shannon entropy (nats) of `softmax(logits / temperature)`, in float32 whatever the logits' dtype (float64
    stays float64), `chunk_rows` rows at a time so the float32 copy never exceeds `chunk_rows × V`. Differentiable.
    `[..., V]` → `[...]`.

    A non-contiguous `[B, T, V]` (the padded path's `logits[:, :-1]`) is walked row by row rather than reshaped,
    which would copy all of it."""
    if logits.dim() > 2 and not logits.is_contiguous():
        return torch.stack([entropy_from_logits(row, temperature, chunk_rows) for row in logits.unbind(0)])
    flat = logits.reshape(-1, logits.size(-1))  # [N, V] (a view)
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16/fp16 → float32; float64 is not rounded down
    out = []
    for chunk in flat.split(chunk_rows):
        logp = torch.log_softmax(scaled(chunk.to(dtype), temperature), dim=-1)  # [n, V]
        out.append(-(logp.exp() * logp).sum(-1))  # [n]
    return (torch.cat(out) if out else flat.new_zeros(0, dtype=dtype)).reshape(logits.shape[:-1])
