"""Typed data between the pipeline's stages: `RoundRequest` → `Round` → `MicroBatch`.

Shape legend: `R` rows of a whole round (prompts × G, every process's), `L` rows of one process, `B` rows of one
micro-batch, `P` prompt tokens (left-padded), `T` completion tokens (right-padded).

```txt
trainer (every rank)          producer (main, job-queue thread)         consumer (every rank)
RoundRequest(rows [R]) ─────▶ Round(batch: MicroBatch [R], metrics) ──▶ slice [L] → stale rows masked → logps
                                                                         → IS weights → GA micro-batches [B]
```

A `MicroBatch` also reads like the dict TRL's `compute_loss` receives (`inputs["advantages"]`, `"ref_logps" in
inputs`, `inputs.get("old_logps")`), so a `compute_loss` override written for TRL keeps working.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..algo.router_replay import pad_routing
from ..algo.vision import VisionRows


@dataclass
class RoundRequest:
    """What the trainer asks the producer for: one generation round.

    Args:
        round_id (`int`): global index of the round (across epochs).
        rows (`list[dict]`): `[R]` dataset rows of every process, in rank order; each prompt's G copies are
            consecutive (the `RepeatSampler` layout). With an engine on every rank (`pipeline/join.py`): `[L]`, this
            process's rows only (whole groups).
        first_row (`int`, *optional*, defaults to 0): index of `rows[0]` in the whole round (`process_index × L` with
            an engine on every rank): seeds and row indices count from it, so a row samples as it would in one
            process; in stream mode a request holds one prompt group (`pipeline/group_stream.py`), and its
            rows keep their round's seeds and row indices.
    """

    round_id: int
    rows: list[dict]
    first_row: int = 0


@dataclass
class MicroBatch:
    """Rows ready for the loss. The same type holds a whole round (`[R]`), one process's slice (`[L]`) or one
    gradient-accumulation micro-batch (`[B]`); the optional tensors are filled in by the consumer."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 = a prompt token
    completion_ids: torch.Tensor  # [B, T] right-padded
    completion_mask: torch.Tensor  # [B, T] 1 = the token exists (attention)
    loss_mask: torch.Tensor  # [B, T] 1 = trained on (never the attention mask: env tokens, truncation, staleness)
    #: [B, T] the generation engine's logprobs of the sampled tokens (temperature applied); after the consumer, where
    #: the sampler cut the vocabulary, on the trainer's support: + `support_log_mass` (the engine's own values are
    #: `rollout_logps - support_log_mass`)
    rollout_logps: torch.Tensor
    advantages: torch.Tensor  # [B]
    policy_version: torch.Tensor  # [B] optimizer step of the weights the row's OLDEST token was sampled with
    round_id: torch.Tensor  # [B] the round the row was requested in
    row_index: torch.Tensor  # [B] position in that round's request
    old_logps: torch.Tensor | None = None  # [B, T] π_old, when the policy moves before the row is trained
    ref_logps: torch.Tensor | None = None  # [B, T] reference model, when beta > 0
    is_weights: torch.Tensor | None = None  # [B, T] (token modes) or [B, 1] (sequence modes)
    token_version: torch.Tensor | None = None  # [B, T] optimizer step of the weights each token was sampled with
    #: [B, T, K] int32: the sampler's kept set where it cut the vocabulary (top-k / top-p / min-p), encoded by
    #: `algo.sampling_support.encode_support` (−1 padding; a position of padding only: no cut); None: no cut anywhere
    sampling_mask: torch.Tensor | None = None
    support_known: torch.Tensor | None = None  # [B] bool: the backend reported the row's kept sets (sampling_mask)
    support_log_mass: torch.Tensor | None = None  # [B, T] log π_old(kept set) the consumer added to rollout_logps
    #: [B, T, L, k] uint8 (int16 past 254 experts): the experts the sampler ran each completion token through, per
    #: MoE layer (`GRPOConfig.router_replay`; `algo.router_replay.unrouted` where it ran none, e.g. the last token)
    routed_experts: torch.Tensor | None = None
    num_items_in_batch: float = 0.0  # loss-mask tokens of the whole round, every process: the loss normaliser
    #: a vision-language model's inputs of each row (`algo.vision.VisionRows`: pixel values, image grids, token
    #: types), selected, moved and concatenated with the rows; None: no images
    vision: VisionRows | None = None

    # ---- rows ----------------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-row tensors that are set, by field name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def __len__(self) -> int:
        return self.advantages.size(0)

    def select(self, index: slice | torch.Tensor) -> MicroBatch:
        """Rows `index` (a slice or an index tensor) of every per-row tensor (and their images)."""
        vision = None if self.vision is None else self.vision.select(index)
        return dataclasses.replace(self, **{k: v[index] for k, v in self.tensors().items()}, vision=vision)

    def split(self, parts: int) -> list[MicroBatch]:
        """`parts` consecutive micro-batches of equal size (`len(self)` must divide evenly)."""
        n = len(self)
        if n % parts:
            raise ValueError(f"{n} rows do not split into {parts} equal micro-batches")
        size = n // parts
        return [self.select(slice(i * size, (i + 1) * size)) for i in range(parts)]

    def trim(self) -> MicroBatch:
        """Drop prompt columns that are padding in every row (left) and completion columns likewise (right)."""
        p_keep = int(self.prompt_mask.sum(1).max().item()) if len(self) else 0
        t_keep = max(1, int(self.completion_mask.sum(1).max().item())) if len(self) else 0
        P = self.prompt_ids.size(1)
        out = {"prompt_ids": self.prompt_ids[:, P - p_keep :], "prompt_mask": self.prompt_mask[:, P - p_keep :]}
        if self.vision is not None:  # token types are prompt columns too
            out["vision"] = self.vision.trim_prompt(p_keep)
        for k, v in self.tensors().items():
            if k in _PER_TOKEN or (k == "is_weights" and v.size(1) > 1):
                out[k] = v[:, :t_keep]
        if self.sampling_mask is not None:  # [B, t_keep, K] → the widest kept set left
            mask = out["sampling_mask"]
            k_keep = int((mask != -1).sum(-1).max().item()) if mask.numel() else 0
            out["sampling_mask"] = mask[..., :k_keep] if k_keep else None
        return dataclasses.replace(self, **out)

    def pad_to_multiple(self, multiple: int | None) -> MicroBatch:
        """TRL's `pad_to_multiple_of`: prompt columns (left) and completion columns (right) padded so each width is a
        multiple of `multiple` (masks 0, ids 0, log-probs 0, kept sets empty); `None` or 1: unchanged."""
        if not multiple or multiple <= 1 or not len(self):
            return self
        P, T = self.prompt_ids.size(1), self.completion_ids.size(1)
        dp, dt = -P % multiple, -T % multiple
        if not (dp or dt):
            return self
        left = {"prompt_ids": self.prompt_ids, "prompt_mask": self.prompt_mask}
        out = {k: torch.nn.functional.pad(v, (dp, 0)) for k, v in left.items()}
        if self.vision is not None:
            out["vision"] = self.vision.pad_prompt(dp)
        for k, v in self.tensors().items():
            if k == "sampling_mask":  # [B, T, K]: a padded position keeps no set (−1)
                out[k] = torch.nn.functional.pad(v, (0, 0, 0, dt), value=-1)
            elif k == "routed_experts":  # [B, T, L, k]: a padded position was routed by nobody
                out[k] = pad_routing(v, T + dt)
            elif k in _PER_TOKEN or (k == "is_weights" and v.size(1) > 1):
                out[k] = torch.nn.functional.pad(v, (0, dt))
        return dataclasses.replace(self, **out)

    def to(self, device: torch.device | str) -> MicroBatch:
        vision = None if self.vision is None else self.vision.to(device)
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()}, vision=vision)

    def vision_inputs(self) -> dict[str, torch.Tensor]:
        """The model's vision keyword inputs for a forward pass over `prompt_ids + completion_ids` of these rows
        (`VisionRows.model_inputs`); empty without images."""
        if self.vision is None:
            return {}
        return self.vision.model_inputs(self.completion_ids.size(1), self.prompt_ids.size(1))

    # ---- TRL-style read access (`inputs["advantages"]`) ----------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key) if key in _FIELDS else None
        if value is None and self.vision is not None:  # a VLM's `inputs["pixel_values"]`, as TRL's forward takes it
            value = self.vision_inputs().get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        if key in _FIELDS:
            return getattr(self, key) is not None
        return self.vision is not None and key in self.vision_inputs()

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def keys(self) -> list[str]:
        return [k for k in _FIELDS if k in self]

    def items(self) -> list[tuple[str, Any]]:
        return [(k, getattr(self, k)) for k in self.keys()]


_FIELDS = tuple(f.name for f in dataclasses.fields(MicroBatch))
_PER_TOKEN = (
    "completion_ids",
    "completion_mask",
    "loss_mask",
    "rollout_logps",
    "old_logps",
    "ref_logps",
    "token_version",
    "sampling_mask",
    "support_log_mass",
    "routed_experts",
)


@dataclass
class Round:
    """One generated round: every process's rows plus what was measured producing it.

    Args:
        round_id (`int`): the request's round.
        policy_version (`int`): optimizer step of the oldest weights the sampler held while generating it (stream
            mode: the oldest token of the round's groups).
        batch (`MicroBatch`): `[R]` rows, without logps (the consumer adds them).
        metrics (`dict[str, float]`): rewards, lengths, timings of this round.
        samples (`dict`): prompts, completions and rewards for the completions table.
        generation_time (`float`): seconds the producer spent on the round (set by the `AsyncBatchGenerator`).
        rewards_per_func (`torch.Tensor`, *optional*): `[R, F]` each reward function's reward of each row (what the
            advantages were computed from; `pipeline/join.py` recomputes them over the rows of every rank).
    """

    round_id: int
    policy_version: int
    batch: MicroBatch
    metrics: dict[str, float] = field(default_factory=dict)
    samples: dict = field(default_factory=dict)
    generation_time: float = 0.0
    rewards_per_func: torch.Tensor | None = None  # [R, F]
