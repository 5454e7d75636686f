"""The sampler's support: which tokens a truncated sampler (top-k, top-p, min-p) could have drawn at each position,
and the trainer's probability mass on them, so that the importance ratio compares like with like.

Shapes: `B` rows, `T` completion tokens, `V` vocabulary, `K` the largest kept set of a batch, `N` positions.

Why. A sampler that cuts the vocabulary renormalises over the tokens it kept: its log-prob of the sampled token is
`log π_s(x) − log Σ_{v ∈ S} π_s(v)`. The trainer scores the same token over the whole vocabulary. Their ratio then
carries the kept mass `Z = Σ_{v ∈ S} π_old(v) < 1` at every position, which is not a policy change: with identical
weights and `top_p = 0.8` the sequence-level ratio of a 12-token completion is about `0.8^12`. The fix (DeepSeek
V3.2's "keep sampling mask", TRL #7269, vLLM's `return_sampling_mask`): renormalise the trainer's log-probs over the
sampler's kept set `S`, i.e. put the sampler's log-probs on the trainer's support:

```txt
rollout logp on the trainer's support = rollout logp + log Z_old(S)      Z_old(S) = Σ_{v ∈ S} π_old(v)
IS ratio = π_old(x) / (π_s(x | S) · Z_old(S)) = π_old(x | S) / π_s(x | S)
```

Worked example: V = 4, π_old = π_s = [0.5, 0.3, 0.15, 0.05], top_p = 0.8 keeps S = {0, 1} (0.5 + 0.3 ≥ 0.8). The
sampler draws token 1 with log-prob log(0.3 / 0.8) = −0.981; the trainer's full-vocabulary log-prob is log 0.3 =
−1.204, a ratio of 0.8. With log Z_old(S) = log 0.8 = −0.223 added to the sampler's log-prob, the ratio is 1.

How the kept set travels: `MicroBatch.sampling_mask [B, T, K]` (int32, `encode_support`: per position the kept ids,
or the cut ids encoded `−(id + 2)` where those are fewer; `NO_TOKEN` = −1 padding). A position of padding only had
no cut: `log Z = 0` there, the plain ratio. `K` is the largest set of the batch; rows without a cut add nothing.
`MicroBatch.support_known [B]` says which rows' sets the backend reported.

Where a backend cannot report its kept set exactly, the trainer can apply the sampler's filter to π_old itself
(`TruncationFilter`, vLLM's order: min-p, then top-k, then top-p, all after temperature): exact when the trainer's
and the sampler's distributions agree, approximate when they drift (the sets then differ near the cut).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the padding of `sampling_mask` (a position's unused slots, and every slot of a position with no cut)
NO_TOKEN = -1


@dataclass(frozen=True)
class TruncationFilter:
    """A sampler's vocabulary cut, applied by the trainer to its own (temperature-scaled) logits when the backend
    could not report the kept set. `top_k = 0`, `top_p = 1.0`, `min_p = 0.0` are off. vLLM's order: the banned
    tokens (its `bad_words` logits processor), then min-p, top-k, top-p (`vllm/v1/sample/sampler.py`,
    `ops/topk_topp_sampler.py`)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    #: token ids the sampler never samples, at any position (vLLM's `bad_words`, hf's `suppress_tokens`: a
    #: vision-language model's image placeholders, `vision_processor.vision_placeholder_ids`)
    banned: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, a, banned: tuple[int, ...] = ()) -> TruncationFilter:
        """The run's top-k / top-p / min-p (`a`, a `GRPOConfig`), for rows whose kept sets the sampler did not report
        (servers): `generation_kwargs` override the config's fields, as they do in every backend's sampling."""
        extra = a.generation_kwargs or {}
        top_k, top_p, min_p = extra.get("top_k", a.top_k), extra.get("top_p", a.top_p), extra.get("min_p", a.min_p)
        return cls(top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, min_p=min_p or 0.0, banned=tuple(banned))

    @property
    def cuts(self) -> bool:
        return bool(self.banned) or self.samples_a_cut

    @property
    def samples_a_cut(self) -> bool:
        """Whether the kept set depends on the logits (top-k, top-p, min-p): the trainer's filter of π_old is then
        the sampler's only while the two agree. The banned tokens alone are the same set at every position: exact."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def kept(self, logits: torch.Tensor) -> torch.Tensor:
        """`[N, V]` temperature-scaled logits → `[N, V]` bool, the tokens this filter keeps."""
        keep = torch.ones_like(logits, dtype=torch.bool)  # [N, V]
        if self.banned:
            keep[:, [t for t in self.banned if t < logits.size(-1)]] = False
        logits = logits.float().masked_fill(~keep, -torch.inf)  # [N, V] what the filters below see
        probs = torch.softmax(logits, dim=-1)  # [N, V]
        if self.min_p > 0.0:
            keep &= probs >= self.min_p * probs.max(dim=-1, keepdim=True).values
        if self.top_k > 0 and self.top_k < logits.size(-1):
            kth = logits.masked_fill(~keep, -torch.inf).topk(self.top_k, dim=-1).values[..., -1:]  # [N, 1]
            keep &= logits >= kth
        if self.top_p < 1.0:
            masked = logits.masked_fill(~keep, -torch.inf)  # [N, V]
            p_sorted, order = torch.softmax(masked, dim=-1).sort(dim=-1, descending=False)  # ascending, as vLLM
            drop_sorted = p_sorted.cumsum(dim=-1) <= 1.0 - self.top_p  # [N, V] the low tail summing to ≤ 1 − p
            drop_sorted[..., -1] = False  # the most likely token always stays
            keep &= ~torch.zeros_like(keep).scatter(-1, order, drop_sorted)
        return keep


def encode_support(kept: torch.Tensor) -> list[list[int] | None]:
    """`[n, V]` bool (the tokens a sampler kept at each of `n` positions) → per position the encoded set, whichever
    list is shorter: the kept ids (`≥ 0`), or the cut ids encoded `−(id + 2)` (`≤ −2`, never `NO_TOKEN`); `None`
    where nothing was cut. A suppression that removes a handful of tokens (e.g. EOS before `min_tokens`) costs a
    handful of ids, not the vocabulary.

    Example: [[T, T, F, F], [T, T, T, F], [T, T, T, T]] → [[0, 1], [-5], None]."""
    V = kept.size(-1)
    counts = kept.sum(-1).tolist()  # [n]
    out: list[list[int] | None] = []
    for i, n in enumerate(counts):
        if n >= V:
            out.append(None)
        elif n <= V - n:
            out.append(kept[i].nonzero().view(-1).tolist())
        else:
            out.append([-(j + 2) for j in (~kept[i]).nonzero().view(-1).tolist()])
    return out


def log_kept_mass(logits: torch.Tensor, support) -> torch.Tensor:
    """`log Σ_{v ∈ S} softmax(logits)_v` at each position: `logits [N, V]` (temperature applied), `support` either
    encoded sets `[N, K]` (`encode_support`: kept ids ≥ 0 or cut ids −(id + 2), `NO_TOKEN` padding; a position of
    padding only had no cut: 0) or a `TruncationFilter`. → `[N]` ≤ 0.

    Example: logits = log [0.5, 0.3, 0.15, 0.05]; support [[0, 1, -1]] (kept) or [[-4, -5, -1]] (cut 2 and 3) →
    [log 0.8] = [-0.2231] both."""
    logits = logits.float()
    norm = torch.logsumexp(logits, dim=-1)  # [N]
    if isinstance(support, TruncationFilter):
        if not support.cuts:
            return torch.zeros_like(norm)
        return torch.logsumexp(logits.masked_fill(~support.kept(logits), -torch.inf), dim=-1) - norm  # [N]
    ids = support.to(logits.device).long()  # [N, K]
    if ids.size(-1) == 0:
        return torch.zeros_like(norm)
    kept, cut = ids >= 0, ids <= -2  # [N, K] each; a position holds one kind only
    token = torch.where(cut, -ids - 2, ids).clamp(min=0)  # [N, K]
    picked = logits.gather(-1, token) - norm.unsqueeze(-1)  # [N, K] log-probs of the listed ids
    log_kept = torch.logsumexp(picked.masked_fill(~kept, -torch.inf), dim=-1)  # [N]
    log_cut = torch.logsumexp(picked.masked_fill(~cut, -torch.inf), dim=-1).clamp(max=0.0)  # [N]
    log_rest = torch.log(-torch.expm1(log_cut))  # [N] log(1 − cut mass); −inf at no cut listed → log 1 = 0
    out = torch.where(kept.any(-1), log_kept, torch.where(cut.any(-1), log_rest, torch.zeros_like(norm)))
    return out  # [N]


def pad_kept_sets(rows: list[list[list[int] | None] | None], T: int) -> torch.Tensor | None:
    """Per row, per position the encoded set (`encode_support`; `None`: no cut there; a row `None`: no cut
    anywhere) → `[R, T, K]` int32 padded with `NO_TOKEN`, or `None` when no position of any row had a cut.

    Example: [[[3, 5], None], None] with T = 2 → [[[3, 5], [-1, -1]], [[-1, -1], [-1, -1]]]."""
    K = max((len(s) for r in rows if r for s in r if s), default=0)
    if K == 0:
        return None
    out = torch.full((len(rows), T, K), NO_TOKEN, dtype=torch.int32)
    for i, row in enumerate(rows):
        for t, kept in enumerate(row or []):
            if kept:
                out[i, t, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
    return out
