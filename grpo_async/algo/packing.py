"""Padding-free packing (seed 004): the real tokens of B padded rows as one `[1, S]` sequence, `S = Σ_i L_i`.

Shapes: `B` rows, `P` prompt columns (left-padded), `T` completion columns (right-padded), `L_i` real tokens of row i,
`S = Σ L_i` packed tokens, `N` completion tokens that exist (`Σ_i` completion-mask ones), `V` vocabulary.

```
padded  [B, P+T]:  . . p p c c c .        packed [1, S]:  p p c c c | p p p c c | ...
                   p p p p c c . .        position_ids:   0 1 2 3 4 | 0 1 2 3 4 | ...   (reset per row)
```

Sequences stay isolated because transformers (5.x, `masking_utils.create_causal_mask`) reads position ids that
restart at 0 as sequence starts and builds a block-diagonal causal mask, for the sdpa, eager and flash
implementations alike, when it gets `attention_mask=None` and no KV cache (`use_cache=False`; with a cache the
detection is skipped and rows leak into each other). `check_isolation` proves it for a given model.
The logits are computed only at the `N` positions that predict a completion token (`logits_to_keep` as an index
tensor), so the `[B, T, V]` logits of the padded path become `[1, N, V]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """Rows packed into one sequence, and where each completion token goes back to.

    Attributes:
        input_ids (`[1, S]`), position_ids (`[1, S]`): the packed sequence, positions restarting at 0 per row.
        logits_index (`[N]`): packed positions whose logits predict a completion token (the position before it).
        target_ids (`[N]`): the completion tokens those logits score.
        rows (`[N]`), cols (`[N]`): where each completion token sits in the `[B, T]` completion block.
        shape (`(B, T)`): the completion block's shape.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits_index: torch.Tensor
    target_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> PackedRows:
    """Drop the padding of `[B, P+T]` rows (prompt then completion; `attention_mask` marks real tokens) and
    concatenate them into one `[1, S]` sequence with position ids reset per row.

    Positions equal the padded path's `cumsum(mask) - 1`, so each token sees the same prefix at the same positions
    as when the row is run alone. A completion token must follow at least one real token of its row.

    Example: ids [[0, 5, 6, 7], [8, 9, 3, 0]], mask [[0, 1, 1, 1], [1, 1, 1, 0]], T = 2 →
    input_ids [[5, 6, 7, 8, 9, 3]], position_ids [[0, 1, 2, 0, 1, 2]], logits_index [0, 1, 4], target_ids [6, 7, 3],
    rows [0, 0, 1], cols [0, 1, 0].
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask must be the same [B, L] shape")
    B, width = input_ids.shape
    T = logits_to_keep
    if not 0 < T < width:
        raise ValueError(f"logits_to_keep={T} must be in [1, {width - 1}] (rows hold prompt + completion)")
    real = attention_mask.bool()  # [B, P+T]
    position = real.long().cumsum(-1) - 1  # [B, P+T] position of each real token in its row
    lengths = real.sum(-1)  # [B]
    starts = torch.cumsum(lengths, 0) - lengths  # [B] where each row starts in the packed sequence
    packed_at = starts.unsqueeze(1) + position  # [B, P+T] packed index of each real token
    completion = real[:, -T:]  # [B, T] completion tokens that exist
    rows, cols = completion.nonzero(as_tuple=True)  # [N], [N] (row-major: the packed order)
    target_index = packed_at[:, -T:][rows, cols]  # [N]
    if (position[:, -T:][rows, cols] < 1).any():
        raise ValueError("a completion token has no real token before it (a row with an empty prompt)")
    return PackedRows(
        input_ids=input_ids[real].unsqueeze(0),  # [1, S] (boolean indexing keeps row-major order)
        position_ids=position[real].unsqueeze(0),  # [1, S]
        logits_index=target_index - 1,  # [N]
        target_ids=input_ids[:, -T:][rows, cols],  # [N]
        rows=rows,
        cols=cols,
        shape=(B, T),
    )


def unpack_completion(values: torch.Tensor, packed: PackedRows, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-completion-token values `[N]` back into the `[B, T]` completion block (`fill` at padding).
    Differentiable with respect to `values`."""
    out = values.new_full(packed.shape, fill)  # [B, T]
    return out.index_put((packed.rows, packed.cols), values)  # [B, T]


def packed_completion_logps(model, packed: PackedRows, temperature: float = 1.0) -> torch.Tensor:
    """Log π(completion token | its row's prefix) for the `N` completion tokens of a packed batch. Returns `[N]`."""
    from .logprobs import selective_log_softmax

    logits = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=None,  # None + restarting position ids: transformers builds the block-diagonal mask
        use_cache=False,  # with a cache, the packed-sequence detection is skipped
        logits_to_keep=packed.logits_index,
    ).logits  # [1, N, V]
    logits = logits / temperature
    return selective_log_softmax(logits, packed.target_ids.unsqueeze(0)).squeeze(0)  # [N]


@torch.no_grad()
def check_isolation(model, atol: float = 1e-4) -> None:
    """Run two short sequences packed and alone; raise if the packed logits differ (the model's attention does not
    honour restarting position ids, so packed rows would attend to each other)."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    a = torch.arange(3, 8, device=device) % vocab  # [5]
    b = torch.arange(9, 12, device=device) % vocab  # [3]
    ids = torch.cat([a, b]).unsqueeze(0)  # [1, 8]
    pos = torch.cat([torch.arange(5, device=device), torch.arange(3, device=device)]).unsqueeze(0)  # [1, 8]
    packed = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0, 5:]  # [3, V]
    alone = model(input_ids=b.unsqueeze(0), use_cache=False).logits[0]  # [3, V]
    worst = (packed.float() - alone.float()).abs().max().item()
    if not worst <= atol * max(1.0, alone.float().abs().max().item()):
        raise ValueError(
            "GRPOConfig.padding_free: this model's attention does not isolate packed sequences (logits of a packed "
            f"sequence differ from the same sequence alone by {worst:.3g}); its attention implementation "
            f"({getattr(model.config, '_attn_implementation', '?')!r}) ignores restarting position ids. "
            "Set padding_free=False."
        )
