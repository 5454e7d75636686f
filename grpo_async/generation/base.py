"""The one protocol every generation backend implements.

A backend is built on the main process and shared by the round producer (generator thread), the policy publisher
and evaluation, one at a time (`generation.shared.SharedBackend`). The publisher streams new weights into it with
`load_weights` only while no round is being sampled, so a round always finishes on the weights it started with
(except in the servers' in-flight mode, where the server freezes running requests around the load).

```
trainer thread                                   generator thread
──────────────                                   ────────────────
optimizer.step()  (version v)
publish: wait until no round runs,
         backend.load_weights(groups of live model, v)
submit round r    ─────────────────────────────▶ backend.generate(prompt_ids, sampling) → completions
```
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch


class GenerationAborted(RuntimeError):
    """A `generate` call ended early because `abort()` was called (shutdown); its completions are discarded."""


@dataclass
class SamplingConfig:
    """Sampling parameters that mean the same on every backend.

    `top_k = 0` and `top_p = 1.0` and `min_p = 0.0` disable those filters; `n` completions are drawn per prompt.
    """

    n: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] | None = None
    #: completion k of a generate call (prompt k // n, sample k % n) samples with seed `seed + k` (`for_prompt`);
    #: None: the sampler's own randomness
    seed: int | None = None
    repetition_penalty: float = 1.0  # > 1 penalises tokens already in the prompt or completion; 1.0 is off
    #: backend-native extras (TRL's `generation_kwargs`): `GenerationConfig` fields for hf, `SamplingParams` fields
    #: for the in-process engine, `/v1/completions` body fields for servers; they override the fields above
    extra: dict | None = None
    #: per prompt of the call, extras over `extra` (a dataset row's `generation_kwargs` column, e.g.
    #: `{"min_tokens": 40, "max_tokens": 40}`); None: the same sampling for every prompt
    per_prompt: list[dict | None] | None = None

    def for_prompt(self, i: int) -> SamplingConfig:
        """The sampling of prompt `i` of a call on its own: seed `seed + i·n`, so that its n samples take seeds
        `seed + i·n + j` (vLLM gives sample j of a request seed + j): every completion of the call has its own seed;
        its `per_prompt` extras merged over `extra`."""
        out = self if self.seed is None else replace(self, seed=self.seed + i * self.n)
        if self.per_prompt is not None:
            own = self.per_prompt[i] or {}
            out = replace(out, per_prompt=None, extra={**(self.extra or {}), **own} if own or self.extra else None)
        return out


#: seeds `derive_seed` returns stay below this, so that `seed + k` for a round's completions fits in 31 bits
SEED_SPAN = 2**31 - 2**20


def derive_seed(*parts) -> int:
    """A seed in `[0, SEED_SPAN)` that depends on every part (ints or strings) and nothing else: not on the process,
    the thread or the Python hash seed."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_SPAN


@dataclass
class Completion:
    """One sampled completion.

    `logprobs[i]` is the sampler's log-probability of `completion_ids[i]` under the distribution it actually sampled
    from (temperature applied), so that it can be compared with the trainer's `log_softmax(logits / T)`.
    """

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"  # "stop" (EOS or stop string) | "length"
    text: str | None = None
    extra: dict = field(default_factory=dict)
    #: `versions[i]`: the policy version of the weights that sampled `completion_ids[i]`, when the backend knows it
    #: per token (the in-process vLLM engine loop loads weights between two steps of a running request); None: the
    #: version the backend held when the call started, for every token
    versions: list[int] | None = None
    #: `sampling_mask[i]`: the set the sampler drew `completion_ids[i]` from where it cut the vocabulary (top-k,
    #: top-p, min-p, suppressed tokens), encoded by `algo.sampling_support.encode_support`; `None` at a position with
    #: no cut. The whole list `None`: the backend cannot tell (the trainer then applies the sampler's filter itself)
    sampling_mask: list[list[int] | None] | None = None
    #: `routed_experts[i, l]`: the experts the sampler ran `completion_ids[i]` through at MoE layer `l` (`[T, L, k]`,
    #: `algo.router_replay.routing_dtype`; `unrouted` where it ran none: the last token, which no step fed back in),
    #: recorded where `GRPOConfig.router_replay` asks for it; None: not recorded
    routed_experts: torch.Tensor | None = None


@dataclass
class PromptImages:
    """One prompt's images (a vision-language model's prompt): `images`, the RGB PIL images in the prompt's order
    (what an engine's `multi_modal_data` takes), and `inputs`, the processor's tensors for this prompt alone
    (`pixel_values`, `image_grid_thw`, `mm_token_type_ids` `[1, P]`, ...: what `model.generate` takes with its
    `input_ids`; `algo.vision.VisionRows.from_prompts` stacks them per row)."""

    images: list
    inputs: dict = field(default_factory=dict)
    #: the prompt as its chat template rendered it, image placeholders not expanded (what vLLM takes with the images)
    text: str | None = None
    #: `text`'s token ids (the processor's tokenizer alone: one placeholder per image, not expanded), what a vLLM
    #: server's token-in, token-out route takes with the images (`generation.vllm_common.to_generate_body`)
    text_ids: list[int] | None = None
    #: the chat messages `text` was rendered from, each image in its place (a `{"type": "image", "image": <PIL>}`
    #: part), and the chat template's extra arguments: what an OpenAI-compatible chat route takes
    #: (`generation.vllm_common.to_chat_body`)
    messages: list[dict] | None = None
    template_kwargs: dict = field(default_factory=dict)


@runtime_checkable
class GenerationBackend(Protocol):
    """Generates completions and receives new weights.

    `generate` returns `len(prompt_ids) * sampling.n` completions, grouped by prompt: the n completions of prompt 0,
    then those of prompt 1, and so on.
    """

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[Completion]: ...

    def load_weights(self, groups: Iterable[tuple[str, list[tuple[str, torch.Tensor]]]], version: int) -> None:
        """Load full HF-named weights (PEFT already merged), streamed as `(module, [(name, tensor), ...])` groups
        straight from the live model: consume each group before asking for the next (the tensors may be views of
        gathered parameters), keep nothing after returning. Called by the policy publisher while no round runs.
        The names and tensors are the checkpoint's (what `save_pretrained` writes and an engine loads: a
        mixture-of-experts model's experts one tensor per expert, `weight_sync.checkpoint_layout`), or the model's
        own parameters when the backend has `runtime_weight_names = True` (`HFBackend`)."""
        ...

    # Optional (the vLLM backends): `load_adapter(groups, config, version)` installs a LoRA adapter (groups of
    # PEFT-named lora_A / lora_B tensors, the adapter's config as a dict) as policy `version` on top of the base
    # weights the engine loaded, which never move; the policy publisher calls it instead of `load_weights` when
    # `GRPOConfig.vllm_lora_sync` resolves to "adapter" (`grpo_async.weight_sync.lora`).

    # Optional (backends with `takes_images = True`: `HFBackend`, `VLLMColocateBackend`, `VLLMServerBackend`,
    # `OpenAIRemoteBackend`): `generate(prompt_ids, sampling, images=...)` takes `images[i]`, a `PromptImages` or
    # None, for prompt i: a vision-language model generates with prompt i's images (its `prompt_ids[i]` already hold
    # the expanded image tokens). The producer refuses images for other backends.

    # Optional (every built-in backend): `abort()` is called from another thread at shutdown while `generate` may be
    # running; that call (and every later one) then raises `GenerationAborted` as soon as the backend can stop (vLLM
    # aborts its requests, hf stops at the next token, servers stop waiting for their answers), until `resume()`.

    def close(self) -> None: ...


def check_completions(completions: list[Completion], num_prompts: int, n: int, backend: str) -> list[Completion]:
    """Raise a clear error when a backend returned the wrong number of completions or mismatched logprobs."""
    if len(completions) != num_prompts * n:
        raise RuntimeError(
            f"{backend} returned {len(completions)} completions for {num_prompts} prompts × n={n} "
            f"(expected {num_prompts * n})"
        )
    for i, c in enumerate(completions):
        if len(c.logprobs) != len(c.completion_ids):
            raise RuntimeError(
                f"{backend} completion {i} has {len(c.completion_ids)} tokens but {len(c.logprobs)} logprobs"
            )
    return completions
