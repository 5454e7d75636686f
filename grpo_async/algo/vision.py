"""`VisionRows`: a vision-language model's per-row vision inputs (the processor's `pixel_values`, `image_grid_thw`,
`image_sizes`, `mm_token_type_ids`, `token_type_ids`, ...), kept so that any subset of rows takes exactly its own
images along.

A processor returns its vision tensors flattened over a batch: Qwen2-VL's `pixel_values` is `[Σ patches, D]` (a
variable number of patches per image), `image_grid_thw` `[Σ images, 3]`; LLaVA / Gemma3's `pixel_values`
`[Σ images, C, H, W]`. Here each prompt is processed on its own and each of its rows keeps its own slice, padded:

```txt
processor, prompt k:  pixel_values [n_k, D]  image_grid_thw [i_k, 3]  mm_token_type_ids [1, P_k]
VisionRows [B]:       stacks["pixel_values"]   [B, max n, D]   counts["pixel_values"]   [B] = n of each row
                      stacks["image_grid_thw"] [B, max i, 3]   counts["image_grid_thw"] [B] = i of each row
                      tokens["mm_token_type_ids"] [B, P]  left-padded like prompt_ids (0 on padding)
model_inputs(T):      pixel_values = cat(stacks[b, :counts[b]] for b in rows)  → [Σ n_b, D], as the processor gives
                      mm_token_type_ids = [tokens | zeros(B, T)]               → [B, P+T], aligned with the ids
```

A processor that batches a prompt's images in an inner dimension (Idefics3's `pixel_values` `[1, images, 3, H, W]`
and `pixel_attention_mask` `[1, images, H, W]`) gives prompts with different image counts different trailing
shapes: the stacks are zero-padded at the end of every dimension, as the processor pads a batch itself (Idefics3 drops
the all-zero images; LLaVA-NeXT's crops are counted from `image_sizes`).

`select` (micro-batch, process slice, shuffle), `cat` (rows of several processes or groups), `to`, and the prompt
columns' `trim_prompt` / `pad_prompt` keep the rows, their images and their token types together.
Pure tensor code: no model, no processor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

#: processor outputs aligned with the prompt's tokens (`[1, P]` per prompt); everything else is a per-prompt stack
TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")
#: processor outputs that are not model inputs
NOT_MODEL_INPUTS = ("input_ids", "attention_mask")
#: Qwen-VL's token types: with them (and images) the model computes its own 3-D rotary positions (M-RoPE)
MROPE_FIELD = "mm_token_type_ids"


@dataclass
class VisionRows:
    """Vision inputs of `B` rows.

    Attributes:
        stacks (`dict[str, Tensor]`): each `[B, N, ...]`: row b's first `counts[name][b]` entries are its own.
        counts (`dict[str, Tensor]`): each `[B]` long.
        tokens (`dict[str, Tensor]`): each `[B, P]`, left-padded with 0 like `prompt_ids`.
    """

    stacks: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)

    # ---- building ---------------------------------------------------------------------------------------------
    @classmethod
    def from_prompts(cls, per_prompt: list[dict | None], prompt_lengths: list[int]) -> VisionRows:
        """Rows from each prompt's processor output (`None`: a prompt without images), one row per prompt;
        `prompt_lengths[k]`: prompt k's token count (its token fields must have that length)."""
        names = dict.fromkeys(k for d in per_prompt if d for k in d if k not in NOT_MODEL_INPUTS)
        B = len(per_prompt)
        width = max(prompt_lengths, default=0)
        out = cls()
        for name in names:
            values = [None if d is None else d.get(name) for d in per_prompt]
            ref = next(v for v in values if v is not None)
            if not isinstance(ref, torch.Tensor):
                raise TypeError(f"VisionRows: the processor's {name!r} is a {type(ref).__name__}, not a tensor")
            if name in TOKEN_FIELDS:
                tok = torch.zeros(B, width, dtype=ref.dtype)
                for b, v in enumerate(values):
                    if v is not None:
                        v = v.reshape(-1)
                        if v.numel() != prompt_lengths[b]:
                            raise ValueError(
                                f"VisionRows: {name} of prompt {b} has {v.numel()} entries for {prompt_lengths[b]} "
                                "prompt tokens"
                            )
                        tok[b, width - v.numel() :] = v
                out.tokens[name] = tok
                continue
            n = torch.tensor([0 if v is None else v.size(0) for v in values], dtype=torch.long)
            trailing = [max(v.size(d) for v in values if v is not None) for d in range(1, ref.dim())]
            none = ref.new_zeros((0, *ref.shape[1:]))  # a prompt without images: no entry
            rows = [_zero_pad((none if v is None else v)[None], [int(n.max()), *trailing]) for v in values]
            out.stacks[name], out.counts[name] = torch.cat(rows), n
        return out

    def __len__(self) -> int:
        for t in (*self.stacks.values(), *self.tokens.values()):
            return t.size(0)
        return 0

    # ---- rows -------------------------------------------------------------------------------------------------
    def select(self, index) -> VisionRows:
        """Rows `index` (a slice or an index tensor), each with its own images."""
        return VisionRows(
            {k: v[index] for k, v in self.stacks.items()},
            {k: v[index] for k, v in self.counts.items()},
            {k: v[index] for k, v in self.tokens.items()},
        )

    def to(self, device) -> VisionRows:
        return VisionRows(
            {k: v.to(device) for k, v in self.stacks.items()},
            {k: v.to(device) for k, v in self.counts.items()},
            {k: v.to(device) for k, v in self.tokens.items()},
        )

    @staticmethod
    def cat(parts: list[VisionRows | None], lengths: list[int]) -> VisionRows | None:
        """Rows of `parts` in order (`lengths[i]` rows in part i; a `None` part: rows without images); stacks padded
        to the widest part, token fields left-padded to the widest prompt. `None` when no part has vision rows."""
        if all(p is None for p in parts):
            return None
        ref = next(p for p in parts if p is not None)
        parts = [p if p is not None else _empty_like(ref, n) for p, n in zip(parts, lengths, strict=True)]
        out = VisionRows()
        for name in ref.stacks:
            shape = [max(p.stacks[name].size(d) for p in parts) for d in range(1, ref.stacks[name].dim())]
            out.stacks[name] = torch.cat([_zero_pad(p.stacks[name], shape) for p in parts])
            out.counts[name] = torch.cat([p.counts[name] for p in parts])
        for name in ref.tokens:
            P = max(p.tokens[name].size(1) for p in parts)
            out.tokens[name] = torch.cat([F.pad(p.tokens[name], (P - p.tokens[name].size(1), 0)) for p in parts])
        return out

    def trim_prompt(self, keep: int) -> VisionRows:
        """Keep the last `keep` prompt columns of the token fields (`MicroBatch.trim`)."""
        P = next(iter(self.tokens.values())).size(1) if self.tokens else 0
        return VisionRows(self.stacks, self.counts, {k: v[:, P - keep :] for k, v in self.tokens.items()})

    def pad_prompt(self, left: int) -> VisionRows:
        """`left` more prompt columns of padding (type 0) on the left of the token fields (`pad_to_multiple`)."""
        return VisionRows(self.stacks, self.counts, {k: F.pad(v, (left, 0)) for k, v in self.tokens.items()})

    # ---- the forward pass -------------------------------------------------------------------------------------
    @property
    def uses_mrope(self) -> bool:
        """The model computes its own 3-D positions from the token types and image grids (Qwen-VL): a forward must
        not be given 1-D `position_ids`."""
        return MROPE_FIELD in self.tokens and any(int(c.sum()) for c in self.counts.values())

    def model_inputs(self, completion_len: int = 0, prompt_width: int | None = None) -> dict[str, torch.Tensor]:
        """The model's keyword inputs for these rows, flattened over rows as the processor returns them: each
        stack's own entries of every row, concatenated; token fields `[B, P + completion_len]` (completion tokens are
        text: 0). `prompt_width`: the prompt columns of the ids the inputs go with (default: the token fields'
        own; must be at least that: extra columns are left padding). A stack no row fills is left out (the model
        then sees no images)."""
        out = {}
        for name, stack in self.stacks.items():
            n = self.counts[name]
            if int(n.sum()) == 0:
                continue
            out[name] = torch.cat([stack[b, : int(n[b])] for b in range(stack.size(0))])
        for name, tok in self.tokens.items():
            extra = 0 if prompt_width is None else prompt_width - tok.size(1)
            if extra < 0:
                raise ValueError(f"VisionRows: {name} has {tok.size(1)} prompt columns, the ids {prompt_width}")
            out[name] = F.pad(tok, (extra, completion_len))
        return out

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def flat(self) -> dict[str, torch.Tensor]:
        """`{"stack/<name>": ..., "count/<name>": ..., "token/<name>": ...}` (a checkpoint's tensors)."""
        out = {f"stack/{k}": v for k, v in self.stacks.items()}
        out.update({f"count/{k}": v for k, v in self.counts.items()})
        out.update({f"token/{k}": v for k, v in self.tokens.items()})
        return out

    @classmethod
    def from_flat(cls, flat: dict[str, torch.Tensor]) -> VisionRows | None:
        """The inverse of `flat` (`None` for an empty dict)."""
        if not flat:
            return None
        out = cls()
        for key, v in flat.items():
            kind, name = key.split("/", 1)
            {"stack": out.stacks, "count": out.counts, "token": out.tokens}[kind][name] = v
        return out


def _zero_pad(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """`t` `[B, ...]` padded with zeros at the end of every dimension but the first to `[B, *shape]`."""
    if list(t.shape[1:]) == shape:
        return t
    out = t.new_zeros((t.size(0), *shape))
    out[tuple(slice(0, k) for k in t.shape)] = t
    return out


def _empty_like(ref: VisionRows, rows: int) -> VisionRows:
    """`rows` rows without images, shaped like `ref`'s fields."""
    return VisionRows(
        {k: v.new_zeros((rows, 0, *v.shape[2:])) for k, v in ref.stacks.items()},
        {k: v.new_zeros(rows) for k, v in ref.counts.items()},
        {k: v.new_zeros((rows, 0)) for k, v in ref.tokens.items()},
    )
