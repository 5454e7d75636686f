"""Per-token log-probabilities of completion tokens, computed in chunks to bound memory.

Shapes: `B` rows, `P` prompt tokens, `T` completion tokens, `V` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 128) -> torch.Tensor:
    """Shannon entropy (nats) of `softmax(logits / temperature)`, in float32 whatever the logits' dtype, `chunk_rows`
    rows at a time so the float32 copy never exceeds `chunk_rows × V`. Differentiable. `[..., V]` → `[...]`.

    A non-contiguous `[B, T, V]` (the padded path's `logits[:, :-1]`) is walked row by row rather than reshaped,
    which would copy all of it."""
    if logits.dim() > 2 and not logits.is_contiguous():
        return torch.stack([entropy_from_logits(row, temperature, chunk_rows) for row in logits.unbind(0)])
    flat = logits.reshape(-1, logits.size(-1))  # [N, V] (a view)
    out = []
    for chunk in flat.split(chunk_rows):
        logp = torch.log_softmax(chunk.float() / temperature, dim=-1)  # [n, V]
        out.append(-(logp.exp() * logp).sum(-1))  # [n]
    return (torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)).reshape(logits.shape[:-1])


@dataclass
class TokenScores:
    """What one training forward pass gives the loss.

    Attributes:
        logps (`[B, T]`): log π of the completion tokens (meaningless at padded positions; mask them).
        entropies (`[B, T]` float32, *optional*): entropy of each completion position's next-token distribution
            (temperature applied), 0 at padded positions; differentiable when asked for with `entropy_grad`.
        aux_loss (`[]`, *optional*): the MoE load-balancing loss over the real tokens (mean over chunks).
    """

    logps: torch.Tensor
    entropies: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def score_tokens(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float = 1.0,
    batch_size: int | None = None,
    padding_free: bool = False,
    entropy: bool = False,
    entropy_grad: bool = False,
    router: tuple[int, int] | None = None,
) -> TokenScores:
    """Log π(completion token | prefix) under `model`, with logits divided by `temperature` like the sampler, and
    optionally each position's entropy and the MoE load-balancing loss.

    Args:
        input_ids (`[B, P+T]`), attention_mask (`[B, P+T]`): prompt (left-padded) then completion (right-padded).
        logits_to_keep (`int`): T, the completion length.
        batch_size (`int`, *optional*): rows per forward pass (all at once when `None`).
        padding_free (`bool`): run each chunk's rows packed into bins without padding
            (`algo.packing`); logits only at the completion tokens. Padded positions then hold exactly 0.
        entropy (`bool`): also compute the entropies (float32); without `entropy_grad` they are computed without
            gradient (no `[B, T, V]` float32 copy is kept for the backward pass).
        router (`(num_experts, top_k)`, *optional*): request the router logits and return the load-balancing loss
            (Mixtral's `load_balancing_loss_func`, over real tokens only, as the model's own forward does).
    """
    from .packing import pack_rows, packed_token_scores, unpack_completion

    batch_size = batch_size or input_ids.size(0)
    logps, entropies, aux = [], [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start : start + batch_size]  # [b, P+T]
        am = attention_mask[start : start + batch_size]  # [b, P+T]
        if padding_free:
            packed = pack_rows(ids, am, logits_to_keep)
            lp, ent, aux_loss = packed_token_scores(model, packed, temperature, entropy, entropy_grad, router)
            logps.append(unpack_completion(lp, packed))  # [b, T]
            if ent is not None:
                entropies.append(unpack_completion(ent, packed))  # [b, T]
            aux.append(aux_loss)
            continue
        # position ids that skip the left padding, so a prompt's positions don't depend on its batch-mates
        position_ids = (am.cumsum(-1) - 1).clamp(min=0)  # [b, P+T]
        extra = {"output_router_logits": True} if router is not None else {}
        out = model(
            input_ids=ids, attention_mask=am, position_ids=position_ids, logits_to_keep=logits_to_keep + 1, **extra
        )
        raw = out.logits[:, :-1, :]  # [b, T, V]
        logps.append(selective_log_softmax(raw / temperature, ids[:, -logits_to_keep:]))  # [b, T]
        if entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = entropy_from_logits(raw, temperature)  # [b, T]
            entropies.append(ent.masked_fill(am[:, -logits_to_keep:] == 0, 0.0))
        aux.append(out.aux_loss if router is not None else None)
    return TokenScores(
        logps=torch.cat(logps, dim=0),  # [B, T]
        entropies=torch.cat(entropies, dim=0) if entropy else None,  # [B, T]
        aux_loss=torch.stack(aux).mean() if router is not None else None,
    )


def completion_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float = 1.0,
    batch_size: int | None = None,
    padding_free: bool = False,
) -> torch.Tensor:
    """`score_tokens(...).logps`: `[B, T]` log-probabilities of the completion tokens (values at padded positions are
    meaningless; mask them)."""
    return score_tokens(model, input_ids, attention_mask, logits_to_keep, temperature, batch_size, padding_free).logps


class LogpsScorer:
    """`scorer(ids [b, P+T], mask [b, P+T], T) -> logps [b, T]` (on CPU, no grad) under the model `model()` returns
    when called (the live, possibly wrapped policy, or a frozen reference), inside `context()` if given (e.g. a PEFT
    model's `disable_adapter`, which makes the policy its own reference).

    Example:
        >>> import tempfile, torch
        >>> from transformers import AutoModelForCausalLM
        >>> from grpo_async.testing import build_tiny_model
        >>> model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tempfile.mkdtemp() + "/tiny"))
        >>> scorer = LogpsScorer(lambda: model, temperature=0.7, padding_free=False, device="cpu")
        >>> ids, mask = torch.randint(3, 20, (2, 6)), torch.ones(2, 6, dtype=torch.long)  # b = 2 rows, P + T = 6
        >>> scorer(ids, mask, 4).shape  # T = 4 completion tokens
        torch.Size([2, 4])
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
