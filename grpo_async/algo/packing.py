"""Padding-free packing (seed 004): the real tokens of B padded rows, packed into K bins of at most `C` tokens.

Shapes: `B` rows, `P` prompt columns (left-padded), `T` completion columns (right-padded), `L_i` real tokens of row i,
`K` bins, `W` tokens in the fullest bin (`≤ C`, the capacity, by default `max_i L_i`), `M` distinct bin positions
whose logits are needed, `N` completion tokens that exist (`Σ_i` completion-mask ones), `V` vocabulary.

```
padded  [B, P+T]:  . . p p c c c .        packed [K, W]:  p p c c c | p p p c c     (rows first-fit, longest first)
                   p p p p c c . .        position_ids:   0 1 2 3 4 | 0 1 2 3 4     (reset per row)
                   . . . p c . . .                        p c . . . . . . . .       (filler: its own segment)
```

Why bins of at most the longest row: attention costs `Σ_bins W²`. One `[1, ΣL]` sequence costs `(ΣL)²`, which for
64 equal rows is 64× the padded path's `B·L²` (measured 4.8× slower per step); bins of capacity `max L` cost at most
`ΣL · max L ≤ B · max L²`, never more than padding, and far less when lengths are skewed (one long row, many short).
Their filler counts against a token budget (`GRPOConfig.token_budget`): rows of 1,949 real tokens in bins of 605 run
4 × 605 = 2,420 positions, 18% over a budget of 2,048, and the step's peak memory rises with them. The budget's slicer
counts `packed_positions`; where a pass is packed otherwise (prompt-sharing trees) `max_positions` widens its bins
until `K · W` fits (`fit_bins`).

Sequences stay isolated because transformers (5.x, `masking_utils.create_causal_mask`) reads position ids that
restart at 0 as sequence starts and builds a block-diagonal causal mask, for the sdpa, eager and flash
implementations alike, when it gets `attention_mask=None` and no KV cache (`use_cache=False`; with a cache the
detection is skipped and rows leak into each other). `check_isolation` proves it for a given model.
The logits are computed only at the `M` bin positions that predict a completion token (`logits_to_keep` as an index
tensor), so the `[B, T, V]` logits of the padded path become `[K, M, V]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .logits import entropy_from_logits, scaled, selective_log_softmax


@dataclass
class PackedRows:
    """Rows packed into bins, and where each completion token goes back to.

    Attributes:
        input_ids (`[K, W]`), position_ids (`[K, W]`): the bins, positions restarting at 0 per row (and per filler).
        keep (`[M]`): bin positions whose logits are computed (those predicting a completion token in some bin).
        logits_bin (`[N]`), logits_pos (`[N]`): for each completion token, its bin and the index into `keep` of the
            position before it (whose logits score it).
        target_ids (`[N]`): the completion tokens those logits score.
        rows (`[N]`), cols (`[N]`): where each completion token sits in the `[B, T]` completion block.
        shape (`(B, T)`): the completion block's shape.
        real (`[K, W]` bool): bin positions holding a real token (not filler).
        attention (`[K, W, W]` bool, *optional*): which bin positions each position attends to, when the bins are
            not plain concatenations of rows (`algo.prefix_sharing`'s trees); `None`: restarting position ids
            delimit the rows.
        token_pos (`[N]`, *optional*): each completion token's own column in its bin (`logits_bin`): where its
            recorded experts go (`algo.router_replay.routing_for_packed`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep: torch.Tensor
    logits_bin: torch.Tensor
    logits_pos: torch.Tensor
    target_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]
    real: torch.Tensor | None = None
    attention: torch.Tensor | None = None
    token_pos: torch.Tensor | None = None


def first_fit_decreasing(lengths: list[int], capacity: int) -> tuple[list[int], list[int], list[int]]:
    """Place items of `lengths` into bins of `capacity`, longest first, each into the first bin it fits.

    Returns `(bin_of, offset, fill)`: each item's bin and start offset in it, and each bin's filled length.

    Example: lengths [3, 5, 2, 4], capacity 5: 5 → bin 0; 4 → bin 1; 3 → bin 2; 2 → bin 2 (3 + 2 = 5), so
    bin_of [2, 0, 2, 1], offset [0, 0, 3, 0], fill [5, 4, 5].
    """
    if any(n > capacity for n in lengths):
        raise ValueError(f"an item of {max(lengths)} tokens does not fit a bin of capacity {capacity}")
    bin_of, offset, fill = [0] * len(lengths), [0] * len(lengths), []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):  # stable: ties keep row order
        for k, f in enumerate(fill):
            if f + lengths[i] <= capacity:
                bin_of[i], offset[i], fill[k] = k, f, f + lengths[i]
                break
        else:
            bin_of[i], offset[i] = len(fill), 0
            fill.append(lengths[i])
    return bin_of, offset, fill


def packed_positions(lengths: list[int]) -> int:
    """Token positions `K · W` of `lengths` packed as `pack_rows` packs them by default (first-fit-decreasing into
    bins of the longest item), filler included: what a packed forward pass runs. Example: [10, 6, 6, 6] → bins [10]
    [6] [6] [6] → 4 × 10 = 40; [6, 6, 4] → [6] [6] [4] → 18 (6 + 4 > 6)."""
    if not lengths:
        return 0
    fill = first_fit_decreasing(lengths, max(lengths))[2]
    return len(fill) * max(fill)


def fit_bins(lengths: list[int], max_positions: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """`first_fit_decreasing` into bins as long as the longest item, unless those `K` bins of width `W` (filler
    included) would hold more than `max_positions` positions (`GRPOConfig.token_budget` bounds the `[K, W]` a forward
    pass runs); then wider bins: the most bins `k` whose capacity `max_positions // k` packs every item into at most
    `k` bins, so `K · W ≤ max_positions` (`k = 1`, one bin of `Σ lengths`, always does when `Σ lengths ≤
    max_positions`). Fewer, wider bins hold less filler but cost more attention (`Σ W²`), hence the most bins that
    fit. The budget's slicer (`algo.token_budget.budget_slices`) already cuts rows so that their default bins fit;
    the widening is for what it does not count: prompt-sharing trees (`algo.prefix_sharing.pack_shared`), whose bins
    are as wide as the widest tree.

    Example: lengths [10, 6, 6, 6], `max_positions` 28: bins of 10 are [10] [6] [6] [6], 4 × 10 = 40 > 28 positions;
    k = 2 (capacity 14) needs 3 bins [10] [6 6] [6]; k = 1 (capacity 28): one bin [10 6 6 6] of 28 →
    bin_of [0, 0, 0, 0], offset [0, 10, 16, 22], fill [28].
    """
    longest = max(lengths)
    bin_of, offset, fill = first_fit_decreasing(lengths, longest)
    if max_positions is None or len(fill) * max(fill) <= max_positions:
        return bin_of, offset, fill
    if sum(lengths) > max_positions:
        raise ValueError(f"{sum(lengths)} tokens do not fit in a forward pass of at most {max_positions} positions")
    # the largest k that fits, by bisection: k = 1 fits, and fewer, wider bins fit at least as easily (up to
    # first-fit's quirks, which can only make it settle on a smaller k that it checked)
    lo, hi = 1, max_positions // longest
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(first_fit_decreasing(lengths, max_positions // mid)[2]) <= mid:
            lo = mid
        else:
            hi = mid - 1
    return first_fit_decreasing(lengths, max_positions // lo)


def check_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> tuple[int, int]:
    """`(B, width)` of rows of prompt + completion (`[B, L]` ids and mask, the last `logits_to_keep` positions the
    completion); a `ValueError` naming what is wrong otherwise."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask must be the same [B, L] shape")
    B, width = input_ids.shape
    if not 0 < logits_to_keep < width:
        raise ValueError(
            f"logits_to_keep={logits_to_keep} must be in [1, {width - 1}] (rows hold prompt + completion)"
        )
    return B, width


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    capacity: int | None = None,
    max_positions: int | None = None,
) -> PackedRows:
    """Drop the padding of `[B, P+T]` rows (prompt then completion; `attention_mask` marks real tokens) and pack
    them into bins of at most `capacity` tokens (default: the longest row, or with `max_positions` bins whose
    `[K, W]` holds at most that many positions, filler included: `fit_bins`) with position ids reset per row.

    Positions equal the padded path's `cumsum(mask) - 1`, so each token sees the same prefix at the same positions
    as when the row is run alone. A completion token must follow at least one real token of its row. The space left
    in a bin holds token 0 at positions 0, 1, ...: a segment of its own, attended by nothing else.

    Example: ids [[0, 5, 6, 7], [8, 9, 3, 0]], mask [[0, 1, 1, 1], [1, 1, 1, 0]], T = 2, capacity 6 →
    input_ids [[5, 6, 7, 8, 9, 3]], position_ids [[0, 1, 2, 0, 1, 2]], keep [0, 1, 4], logits_bin [0, 0, 0],
    logits_pos [0, 1, 2], target_ids [6, 7, 3], rows [0, 0, 1], cols [0, 1, 0]. With the default capacity (3) each
    row gets its own bin: input_ids [[5, 6, 7], [8, 9, 3]], keep [0, 1], logits_bin [0, 0, 1], logits_pos [0, 1, 1].
    """
    B, width = check_rows(input_ids, attention_mask, logits_to_keep)
    T = logits_to_keep
    real = attention_mask.bool()  # [B, P+T]
    position = real.long().cumsum(-1) - 1  # [B, P+T] position of each real token in its row
    lengths = real.sum(-1)  # [B]
    completion = real[:, -T:]  # [B, T] completion tokens that exist
    rows, cols = completion.nonzero(as_tuple=True)  # [N], [N] (row-major)
    if (position[:, -T:][rows, cols] < 1).any():
        raise ValueError("a completion token has no real token before it (a row with an empty prompt)")
    if capacity is not None and max_positions is not None:
        raise ValueError("pack_rows takes a capacity or max_positions, not both")
    if capacity is None:
        bin_of, offset, fill = fit_bins(lengths.tolist(), max_positions)
    else:
        bin_of, offset, fill = first_fit_decreasing(lengths.tolist(), capacity)
    K, W = len(fill), max(fill)
    device = input_ids.device
    bin_of_t, offset_t = torch.tensor(bin_of, device=device), torch.tensor(offset, device=device)  # [B], [B]
    tok_rows, tok_cols = real.nonzero(as_tuple=True)  # [S], [S] every real token
    tok_bin = bin_of_t[tok_rows]  # [S]
    tok_at = offset_t[tok_rows] + position[tok_rows, tok_cols]  # [S] column in its bin
    packed_ids = input_ids.new_zeros(K, W)  # [K, W]
    packed_ids[tok_bin, tok_at] = input_ids[tok_rows, tok_cols]
    free = torch.arange(W, device=device).unsqueeze(0) - torch.tensor(fill, device=device).unsqueeze(1)  # [K, W]
    position_ids = free.clamp(min=0)  # [K, W] past a bin's fill: filler positions 0, 1, ...
    position_ids[tok_bin, tok_at] = position[tok_rows, tok_cols]
    real_in_bin = torch.zeros(K, W, dtype=torch.bool, device=device)  # [K, W]
    real_in_bin[tok_bin, tok_at] = True
    before = offset_t[rows] + position[:, -T:][rows, cols] - 1  # [N] bin column whose logits score the token
    keep, logits_pos = torch.unique(before, sorted=True, return_inverse=True)  # [M], [N]
    return PackedRows(
        input_ids=packed_ids,
        position_ids=position_ids,
        keep=keep,
        logits_bin=bin_of_t[rows],
        logits_pos=logits_pos,
        target_ids=input_ids[:, -T:][rows, cols],
        rows=rows,
        cols=cols,
        shape=(B, T),
        real=real_in_bin,
        token_pos=before + 1,
    )


def unpack_completion(values: torch.Tensor, packed: PackedRows, fill: float = 0.0) -> torch.Tensor:
    """Scatter per-completion-token values `[N]` back into the `[B, T]` completion block (`fill` at padding).
    Differentiable with respect to `values`."""
    out = values.new_full(packed.shape, fill)  # [B, T]
    return out.index_put((packed.rows, packed.cols), values)  # [B, T]


def packed_token_scores(
    model,
    packed: PackedRows,
    temperature: float = 1.0,
    entropy: bool = False,
    entropy_grad: bool = False,
    router: tuple[int, int] | None = None,
    support=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Log π(completion token | its row's prefix) for the `N` completion tokens of a packed batch `[N]`, their
    entropies `[N]` (float32, with `entropy`; differentiable with `entropy_grad`), with `router =
    (num_experts, top_k)` the MoE load-balancing loss `[]` over the real tokens (filler left out), and with `support`
    (the sampler's sets `[B, T, K]` of the unpacked rows, or a `TruncationFilter`) the log of π's mass on them `[N]`
    (`algo.sampling_support.log_kept_mass`)."""
    device = packed.input_ids.device
    mask = None  # None + restarting position ids: transformers builds the block-diagonal mask
    if packed.attention is not None:  # a custom mask: [K, 1, W, W], as the model's attention implementation takes it
        mask = attention_mask_4d(packed.attention.to(device), model)
    out = model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=mask,
        use_cache=False,  # with a cache, the packed-sequence detection is skipped
        logits_to_keep=packed.keep.to(device),
        **({"output_router_logits": True} if router is not None else {}),
    )
    raw = gather_logits(out.logits, packed.logits_bin.to(device), packed.logits_pos.to(device))  # [N, V]
    target = packed.target_ids.to(device).unsqueeze(0)  # [1, N]
    z = scaled(raw, temperature)  # [N, V] what the sampler's distribution is the softmax of
    logps = selective_log_softmax(z.unsqueeze(0), target).squeeze(0)  # [N]
    entropies = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = entropy_from_logits(raw, temperature)  # [N]
    aux_loss = None
    if router is not None:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        num_experts, top_k = router
        aux_loss = load_balancing_loss_func(out.router_logits, num_experts, top_k, packed.real.to(device))
    kept = None
    if support is not None:
        from .sampling_support import log_kept_mass

        sets = support if not isinstance(support, torch.Tensor) else support[packed.rows, packed.cols]  # [N, K]
        kept = log_kept_mass(z.detach(), sets)  # [N]
    return logps, entropies, aux_loss, kept


def gather_logits(logits: torch.Tensor, bins: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`logits[bins, pos]` (`[K, M, V]`, `[N]`, `[N]` → `[N, V]`) with a backward pass that sums the gradients of a
    position picked several times in the same order every run. Prompt sharing picks a prompt's last position once per
    completion of its tree. On CPU the backward of `logits[bins, pos]` (`index_put_` with accumulation) adds those
    gradients with atomic adds from every intra-op thread once `N × V` reaches torch's grain size (32768), so their
    order, hence the float sum, followed the thread timing: loaded runs with 2 threads diverged (issue 41). On CPU the
    rows are taken with `index_select`, whose backward (`index_add_`) adds them in index order; on CUDA advanced
    indexing's backward already sorts the indices, where `index_add_` would use atomics. On CPU, when the picks are
    every row once in order (one bin: each column a token's), the logits are returned as a `[N, V]` view instead: no
    copy, and no zero-filled `[N, V]` gradient to add into.

    >>> logits = torch.arange(12.0).view(2, 3, 2).requires_grad_()
    >>> rows = gather_logits(logits, torch.tensor([0, 0, 1]), torch.tensor([2, 2, 0]))
    >>> rows.tolist()
    [[4.0, 5.0], [4.0, 5.0], [6.0, 7.0]]
    >>> rows.sum().backward(); logits.grad[0, 2].tolist()  # picked twice
    [2.0, 2.0]
    >>> every = gather_logits(logits, torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 1, 2, 0, 1, 2]))
    >>> every.data_ptr() == logits.data_ptr(), every.tolist() == logits.reshape(6, 2).tolist()  # a view of all rows
    (True, True)
    """
    if logits.device.type != "cpu":
        return logits[bins, pos]  # [N, V] (no identity check here: comparing device indices would wait for the GPU)
    K, M, V = logits.shape
    rows = bins * M + pos  # [N] row of the flattened [K·M, V]
    if rows.numel() == K * M and torch.equal(rows, torch.arange(K * M)):
        return logits.reshape(K * M, V)  # every row once, in order (one bin): a view, no copy, no gradient scatter
    return logits.reshape(K * M, V).index_select(0, rows)  # [N, V]


def attention_mask_4d(allowed: torch.Tensor, model) -> torch.Tensor:
    """`allowed [K, W, W]` (query, key) → the `[K, 1, W, W]` mask transformers passes through unchanged: boolean for
    SDPA (any query dtype, autocast included), additive (0 / dtype min) in the model's dtype for eager attention."""
    allowed = allowed.unsqueeze(1)  # [K, 1, W, W]
    base = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if getattr(base.config, "_attn_implementation", "sdpa") == "sdpa":
        return allowed
    dtype = next(base.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


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
