"""Shared-prompt forward (`GRPOConfig.share_prompt_prefix`): the rows of a batch that carry the same prompt are scored
as one tree `[prompt, c1, ..., ck]`, the prompt computed once and each completion attending to it.

Shapes: `B` rows, `P` prompt columns (left-padded), `T` completion columns (right-padded), `p` real prompt tokens of
a group, `t_i` real tokens of completion i, `K` bins, `W` tokens in the fullest bin, `N` completion tokens that exist.

```txt
rows [B, P+T]              tree (one bin row)            position ids          attention (query ↓, key →)
. p p p | c c c .          p p p  a a a  b b             0 1 2  3 4 5  3 4      p: causal over the prompt
. p p p | c c . .    ─▶    (prompt once, then each       (each branch resumes   a: the prompt + a, causally
                            completion as a branch)       after the prompt)      b: the prompt + b (never a)
```

Each completion token sees exactly the tokens at exactly the positions it sees in its own padded row, so its
log-probability is the unshared one (up to float summation order) and the prompt's activations receive the sum of
the G branches' gradients, as the G copies would. The mask goes to the model as a `[K, 1, W, W]` tensor, which
transformers passes to the attention unchanged (`masking_utils._preprocess_mask_arguments`); SDPA and eager attention
honour it on CPU and GPU. FlashAttention and FlexAttention take no such tensor, and the mask would drop a
sliding window: `sharing_supported` refuses those, probes any other model once, and warns once with the reason when it
falls back to unshared rows.

Sharing is not always cheaper: a tree of width `p + Σ t_i` costs attention over `W²` pairs where G rows cost
`Σ (p + t_i)²`. `plan_group` splits a group's completions over as many trees as a cost model (`SharingCost`, FLOPs
of a row of width W: `per_token · W + per_pair · W²`) says is cheapest; one tree per completion is the unshared
computation, which `score_tokens` then runs on its usual path.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from .packing import PackedRows, check_rows, fit_bins

logger = logging.getLogger(__name__)

#: attention implementations that take no `[K, 1, W, W]` tensor mask (names start with these)
NO_TENSOR_MASK = ("flash_attention", "flex_attention", "paged")
#: cost of one (query, key) pair's softmax per head, in FLOP-equivalents
SOFTMAX_PAIR_COST = 16.0
#: share only when the trees are predicted at most this fraction of the unshared cost (bench/prefix.py measured one
#: tree at 1.40× the unshared time where the model predicts 1.40×, and 4.2× faster where it predicts 4.3×)
SHARE_MARGIN = 0.9


@dataclass(frozen=True)
class SharingCost:
    """Relative cost of one packed row of `W` tokens through the model: `per_token · W + per_pair · W²` (per layer;
    the layer count cancels). With a custom mask the attention computes every (query, key) pair of the row.

    Example: SmolLM2-135M (hidden 576, 9 heads of 64, 3 key-value heads, MLP 1536) → per_token ≈ 6.9e6, per_pair
    ≈ 2.4e3: a group of 8 with a 256-token prompt and 32-token completions costs 4.3× less as one tree of 512 than
    as 8 causal rows of 288; with a 32-token prompt and 256-token completions, one tree of 2080 costs 1.5× more.
    """

    per_token: float
    per_pair: float

    @classmethod
    def of(cls, model_config) -> SharingCost:
        """From a transformers config (its text config for multimodal models)."""
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        h = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or h // heads)
        mlp = int(getattr(text, "intermediate_size", None) or 4 * h)
        per_token = 2 * (h * head_dim * (heads + 2 * kv) + heads * head_dim * h + 3 * h * mlp)
        per_pair = heads * (4 * head_dim + SOFTMAX_PAIR_COST)
        return cls(per_token=float(per_token), per_pair=float(per_pair))

    def row(self, width: int) -> float:
        """A row under a custom mask: every (query, key) pair computed."""
        return self.per_token * width + self.per_pair * width * width

    def causal_row(self, width: int) -> float:
        """A plain causal row: the kernels skip the pairs above the diagonal."""
        return self.per_token * width + self.per_pair * width * width / 2


def plan_group(prompt_len: int, lengths: list[int], cost: SharingCost) -> list[list[int]]:
    """Split a group's completions (real lengths `lengths`) over the number of trees `[prompt, ...]` that costs
    least; completions are dealt longest first to the lightest tree. Returns each tree's completion indices, in
    order; one tree per completion (`[[0], [1], ...]`) means nothing is shared.

    Unshared rows run plain causal attention, whose kernels skip the masked half of the pairs; a tree's custom mask
    does not, so a tree pays every pair of its width. Sharing is chosen only when it is predicted at least
    `1 / SHARE_MARGIN` cheaper, so the cost model's error never makes a step slower.

    Example: prompt 256, eight completions of 32, SmolLM2's cost → one tree `[[0, 1, ..., 7]]`; prompt 32, eight
    completions of 256 → eight trees `[[0], [1], ..., [7]]` (one tree would cost 1.4× the unshared rows).
    """
    unshared = [[i] for i in range(len(lengths))]
    best = (SHARE_MARGIN * sum(cost.causal_row(prompt_len + n) for n in lengths), unshared)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for k in range(1, len(lengths)):
        trees: list[list[int]] = [[] for _ in range(k)]
        fill = [prompt_len] * k
        for i in order:
            j = min(range(k), key=fill.__getitem__)
            trees[j].append(i)
            fill[j] += lengths[i]
        total = sum(cost.row(w) for w in fill)
        if total < best[0]:
            best = (total, [sorted(t) for t in trees])
    return best[1]


def find_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> list[list[int]]:
    """Rows `[B, P+T]` whose real prompt tokens (the first `P = P+T − logits_to_keep` columns) are identical, in
    order of first appearance. Example: prompts (real tokens) [5 6], [7], [5 6] → [[0, 2], [1]]."""
    P = input_ids.size(1) - logits_to_keep
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ids, real) in enumerate(zip(input_ids[:, :P].tolist(), attention_mask[:, :P].tolist(), strict=True)):
        groups.setdefault(tuple(t for t, m in zip(ids, real, strict=True) if m), []).append(i)
    return list(groups.values())


def group_permutation(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A random order of rows `[L, P]` (left-padded prompts) that keeps the rows of a prompt together: the groups
    (`find_groups`) in random order, each group's rows in their own order. Cut into micro-batches, it puts a group's
    completions in the same forward pass, where they share the prompt. Returns `[L]` row indices.

    Example: prompts (real tokens) [a, b, a, c], groups [[0, 2], [1], [3]] drawn in the order (2, 0, 1) → [3, 0, 2, 1].
    """
    groups = find_groups(prompt_ids, prompt_mask, 0)  # the whole row is the prompt
    order = torch.randperm(len(groups), generator=generator).tolist()
    return torch.tensor([i for g in order for i in groups[g]], dtype=torch.long)  # [L]


def pack_shared(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    cost: SharingCost,
    padding_free: bool = True,
    max_positions: int | None = None,
) -> PackedRows | None:
    """Pack `[B, P+T]` rows (prompt left-padded, completion right-padded; `attention_mask` marks real tokens) as
    prompt-sharing trees, or `None` when no group is cheaper shared (`plan_group`), the caller then scoring the rows
    as usual. With `padding_free` trees are packed first-fit into bins of the widest tree's width (wider where
    those bins would hold more than `max_positions` positions, filler included: `algo.packing.fit_bins`), else each
    tree is a bin of its own (padded to the widest). `PackedRows.attention [K, W, W]` holds each position's allowed
    keys: same tree, not after it, and in the prompt or its own branch; a filler position attends only to itself.

    Example: ids [[0, 5, 6, 7, 8], [0, 5, 6, 9, 0]], mask [[0, 1, 1, 1, 1], [0, 1, 1, 1, 0]], T = 2, a cost that
    shares → input_ids [[5, 6, 7, 8, 9]], position_ids [[0, 1, 2, 3, 2]], target_ids [7, 8, 9] scored by the logits
    at bin positions [1, 2, 1] (the prompt's last token scores both completions' first tokens).
    """
    B, width = check_rows(input_ids, attention_mask, logits_to_keep)
    T = logits_to_keep
    P = width - T
    real = attention_mask.bool().cpu()  # [B, P+T]
    ids_cpu = input_ids.cpu()
    prompts = [ids_cpu[i, :P][real[i, :P]] for i in range(B)]  # each [p_i]
    comp_cols = [real[i, P:].nonzero().squeeze(1) for i in range(B)]  # each [t_i]
    trees: list[tuple[int, list[int]]] = []  # (a row holding the prompt, rows of its branches)
    for group in find_groups(ids_cpu, real, T):
        members = [i for i in group if comp_cols[i].numel()]
        if not members:
            continue
        if prompts[group[0]].numel() == 0:
            raise ValueError("a completion token has no real token before it (a row with an empty prompt)")
        plan = plan_group(prompts[group[0]].numel(), [comp_cols[i].numel() for i in members], cost)
        trees += [(group[0], [members[j] for j in tree]) for tree in plan]
    if not trees or len(trees) == sum(len(branches) for _, branches in trees):
        return None  # nothing shared: the usual path is the same computation, without the custom mask
    widths = [prompts[r].numel() + sum(comp_cols[i].numel() for i in branches) for r, branches in trees]
    if padding_free:
        bin_of, offset, fill = fit_bins(widths, max_positions)
    else:
        bin_of, offset, fill = list(range(len(trees))), [0] * len(trees), widths
    K, W = len(fill), max(fill)
    packed_ids = torch.zeros(K, W, dtype=input_ids.dtype)  # [K, W]
    position_ids = torch.zeros(K, W, dtype=torch.long)  # [K, W]
    segment = -1 - torch.arange(K * W).view(K, W)  # [K, W] filler: a segment per position
    branch = torch.zeros(K, W, dtype=torch.long)  # [K, W] 0: prompt (or filler), b ≥ 1: the b-th completion
    before, tok_bin, rows, cols, targets, token_pos = [], [], [], [], [], []
    for t, ((prompt_row, branches), k, o) in enumerate(zip(trees, bin_of, offset, strict=True)):
        prompt = prompts[prompt_row]  # [p]
        p = prompt.numel()
        packed_ids[k, o : o + p] = prompt
        position_ids[k, o : o + p] = torch.arange(p)
        segment[k, o : o + widths[t]] = t
        at = o + p
        for b, row in enumerate(branches, start=1):
            c = comp_cols[row]  # [t_i] completion columns of the row
            n = c.numel()
            packed_ids[k, at : at + n] = ids_cpu[row, P:][c]
            position_ids[k, at : at + n] = torch.arange(p, p + n)
            branch[k, at : at + n] = b
            # the token at branch index j is scored by the logits before it: the prompt's last token for j = 0
            before.append(torch.cat([torch.tensor([o + p - 1]), torch.arange(at, at + n - 1)]))  # [t_i]
            token_pos.append(torch.arange(at, at + n))  # [t_i]
            tok_bin.append(torch.full((n,), k))
            rows.append(torch.full((n,), row))
            cols.append(c)
            targets.append(ids_cpu[row, P:][c])
            at += n
    filler = segment < 0  # [K, W]
    position_ids[filler] = 0
    causal = torch.ones(W, W, dtype=torch.bool).tril()  # [W, W] key ≤ query
    same_tree = segment.unsqueeze(2) == segment.unsqueeze(1)  # [K, W, W]
    visible_branch = (branch.unsqueeze(1) == 0) | (branch.unsqueeze(1) == branch.unsqueeze(2))  # [K, W, W]
    allowed = same_tree & causal & visible_branch  # [K, W, W]
    keep, logits_pos = torch.unique(torch.cat(before), sorted=True, return_inverse=True)  # [M], [N]
    device = input_ids.device
    return PackedRows(
        input_ids=packed_ids.to(device),
        position_ids=position_ids.to(device),
        keep=keep.to(device),
        logits_bin=torch.cat(tok_bin).to(device),
        logits_pos=logits_pos.to(device),
        target_ids=torch.cat(targets).to(device),
        rows=torch.cat(rows).to(device),
        cols=torch.cat(cols).to(device),
        shape=(B, T),
        real=(~filler).to(device),
        attention=allowed.to(device),
        token_pos=torch.cat(token_pos).to(device),
    )


# ---- can this model share exactly? ----------------------------------------------------------------------------------
_REASONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → None (supported) or why not
_WARNED: set[str] = set()


def _base_model(model):
    """The model inside its training wrappers (DistributedDataParallel, DeepSpeedEngine, FSDP1 keep it as `.module`;
    a DeepSpeedEngine's own `config` is a dict, not the model's)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def sharing_cost(model) -> SharingCost:
    """`SharingCost.of` the config of `model` (training wrappers are looked through)."""
    return SharingCost.of(_base_model(model).config)


def unsupported_reason(model, router: tuple[int, int] | None = None) -> str | None:
    """Why `model` cannot score a shared prompt exactly, or `None` when it can. A model whose attention takes no
    tensor mask is refused by name; any other is probed once (a shared tree against each completion run alone)."""
    if router is not None:
        return (
            "the MoE load-balancing loss averages over every token of every row; with the prompt shared it would "
            "count each prompt token once instead of once per completion"
        )
    base = _base_model(model)
    if getattr(base.config, "vision_config", None) is not None:
        return (
            "a vision-language model's prompt holds its images' tokens, whose features (and Qwen-VL's 3-D positions) "
            "the prompt-sharing tree does not carry: prompt sharing is off for vision-language models"
        )
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    layer_types = set(getattr(text, "layer_types", None) or ())
    if any("sliding" in t for t in layer_types) or (not layer_types and getattr(text, "sliding_window", None)):
        return (
            f"the model has sliding-window attention (sliding_window={getattr(text, 'sliding_window', None)}), "
            "which a custom 4D mask would replace by full attention"
        )
    impl = str(getattr(base.config, "_attn_implementation", None))
    if impl.startswith(NO_TENSOR_MASK):
        return f"attention implementation {impl!r} takes no custom 4D attention mask (sdpa and eager do)"
    if base not in _REASONS:
        _REASONS[base] = _probe(base)
    return _REASONS[base]


def sharing_supported(model, router: tuple[int, int] | None = None) -> bool:
    """`unsupported_reason(...) is None`; otherwise one warning per reason and process, naming it."""
    reason = unsupported_reason(model, router)
    if reason is None:
        return True
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning(
            "GRPOConfig.share_prompt_prefix: %s; scoring every completion with its own copy of the prompt instead.",
            reason,
        )
    return False


@torch.no_grad()
def _probe(model) -> str | None:
    """Score a prompt of 5 tokens with completions of 3 and 2 as one tree and each completion alone; the reason
    when they differ (the model ignored the mask)."""
    from .logits import selective_log_softmax
    from .packing import packed_token_scores

    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.arange(3, 8) % vocab  # [5]
    a, b = torch.arange(9, 12) % vocab, torch.arange(13, 15) % vocab  # [3], [2]
    ids = torch.stack([torch.cat([prompt, a]), torch.cat([prompt, b, torch.zeros(1, dtype=torch.long)])])  # [2, 8]
    mask = torch.ones_like(ids)
    mask[1, -1] = 0
    was_training = model.training
    model.eval()
    try:
        packed = pack_shared(ids.to(device), mask.to(device), 3, SharingCost(per_token=1.0, per_pair=0.0))
        shared = packed_token_scores(model, packed)[0]  # [5]
        alone = []
        for row, n in ((ids[0], 3), (ids[1, :-1], 2)):
            logits = model(input_ids=row.unsqueeze(0).to(device), use_cache=False).logits[:, -n - 1 : -1]  # [1, n, V]
            alone.append(selective_log_softmax(logits.float(), row[-n:].unsqueeze(0).to(device)).squeeze(0))
    finally:
        model.train(was_training)
    alone_t = torch.cat(alone)  # [5] rows in order, as packed (row 0's tokens, then row 1's)
    worst = (shared.float() - alone_t.float()).abs().max().item()
    half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    # float noise grows with the log-probs' size (SmolLM2 on random tokens: |logp| ≈ 20, noise ≈ 2e-4); attending to
    # the other completion changes them by far more
    if worst <= (5e-2 if half else 1e-4) * max(1.0, alone_t.float().abs().max().item()):
        return None
    impl = getattr(model.config, "_attn_implementation", "?")
    return (
        f"the model's attention ({impl!r}) ignores a custom 4D attention mask (shared-prompt log-probs differ from "
        f"unshared ones by {worst:.3g})"
    )
