"""`OpenAIRemoteBackend(base_url, model)`: generation on any OpenAI-compatible `/v1/completions` (a vision-language
model's prompts with images: `/v1/chat/completions`, images as `image_url` parts); weights: none, or
`"checkpoint_dir"` (writes safetensors for the remote's operator).
"""

from __future__ import annotations

import os
from typing import Literal

from grpo_async.generation.base import Completion, SamplingConfig
from grpo_async.generation.vllm_common import CHAT_ROUTE, Groups
from grpo_async.generation.vllm_server import CompletionsRouter
from grpo_async.net import ServerClient
from grpo_async.weight_sync.buckets import iter_buckets


class OpenAIRemoteBackend:
    """Generation on any OpenAI-compatible `/v1/completions` server (vLLM, SGLang, TGI, a hosted API).

    Remote engines cannot take IPC handles or join our process group: `weight_sync` is `"none"` (generation only;
    `load_weights` raises) or `"checkpoint_dir"` (each update is written as `checkpoint_dir/version-<v>/
    model.safetensors` plus `latest` pointing at it, for the remote's operator to reload).

    Args:
        base_url (`str`): e.g. `"http://host:8000"` or `"http://host:8000/v1"`.
        model (`str`): model name sent with each request.
        api_key (`str`, *optional*): bearer token.
        weight_sync (`str`, *optional*, defaults to `"none"`): `"none"` or `"checkpoint_dir"` (the names of
            `weight_sync.names`); `"broadcast"`, `"shm"`, `"cuda_ipc"` and any other value raise `ValueError`.
        checkpoint_dir (`str`, *optional*): required with `weight_sync="checkpoint_dir"`.
        timeout (`float`, *optional*, defaults to 120): seconds per request.
        max_concurrency (`int`, *optional*, defaults to 8): requests in flight.
        bad_words (`list[str]`, *optional*): words no request may sample (vLLM's `bad_words`): a vision-language
            model's image placeholders (`vision_processor.placeholder_words`); empty for a text model.

    Sampler logprobs are what the remote returns; only a vLLM started with `--logprobs-mode processed_logprobs`
    returns temperature-scaled ones.

    A vision-language model's prompts with images go to `/v1/chat/completions` as their chat messages, each image an
    `image_url` part (a PNG data URL): the server renders them with its chat template and expands the images with its
    processor. It must return the token ids of the completions and of the expanded prompt (vLLM's `return_token_ids`),
    which must equal the trainer's prompt ids (`check_engine_prompts`: a server whose template or processor renders
    the prompt otherwise is refused, naming the prompt); `bad_words` (vLLM's extension) keeps the image placeholders
    from being sampled.
    """

    takes_per_prompt_sampling = True  # `SamplingConfig.per_prompt` honoured
    #: `generate(..., images=)`: prompts with images go to the chat route as chat messages with image parts
    takes_images = True

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        weight_sync: Literal["none", "checkpoint_dir"] = "none",
        checkpoint_dir: str | None = None,
        timeout: float = 120.0,
        max_concurrency: int = 8,
        bad_words: list[str] | tuple[str, ...] = (),
    ):
        if weight_sync not in ("none", "checkpoint_dir"):
            raise ValueError(
                f"OpenAIRemoteBackend cannot sync weights with {weight_sync!r}: a remote OpenAI-compatible engine "
                "takes neither IPC handles (shm/cuda_ipc) nor a process-group broadcast. Use weight_sync='none' "
                "(generation only), weight_sync='checkpoint_dir', or VLLMServerBackend with a grpo-async serve server."
            )
        if weight_sync == "checkpoint_dir" and not checkpoint_dir:
            raise ValueError("OpenAIRemoteBackend(weight_sync='checkpoint_dir') needs checkpoint_dir=<folder>")
        if not model:
            raise ValueError("OpenAIRemoteBackend needs the model name to send (model=...)")
        base = base_url.rstrip("/")
        base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.router = CompletionsRouter(
            [ServerClient(base, api_key=api_key, timeout=timeout)],
            model,
            max_concurrency,
            "OpenAIRemoteBackend",
            bad_words,
            image_route=CHAT_ROUTE,
        )
        self.weight_sync = weight_sync
        self.checkpoint_dir = checkpoint_dir
        self.version: int | None = None

    def start_streaming(self) -> None:
        """Stream mode: as `VLLMServerBackend.start_streaming` (concurrent calls are already safe)."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, images=None) -> list[Completion]:
        """`images[k]` (`PromptImages` or None): prompt k's images, for a vision-language model."""
        return self.router.generate(prompt_ids, sampling, images)

    def load_weights(self, groups: Groups, version: int) -> None:
        """`checkpoint_dir`: write `version-<v>/` as safetensors shards (one per bucket, with the standard
        `model.safetensors.index.json`), then point `latest` at it."""
        if self.weight_sync == "none":
            raise RuntimeError(
                "OpenAIRemoteBackend(weight_sync='none') is generation-only and cannot receive weights; "
                "use weight_sync='checkpoint_dir' or a VLLMServerBackend"
            )
        import json

        from safetensors.torch import save_file

        folder = os.path.join(self.checkpoint_dir, f"version-{version}")
        os.makedirs(folder, exist_ok=True)
        weight_map, total = {}, 0
        for i, bucket in enumerate(iter_buckets(groups, 1024.0)):
            name = f"model-{i + 1:05d}.safetensors"
            save_file({k: v.detach().contiguous().cpu() for k, v in bucket}, os.path.join(folder, name))
            weight_map.update(dict.fromkeys((k for k, _ in bucket), name))
            total += sum(v.numel() * v.element_size() for _, v in bucket)
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        tmp = os.path.join(self.checkpoint_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(f"version-{version}\n")
        os.replace(tmp, os.path.join(self.checkpoint_dir, "latest"))
        self.version = version

    def abort(self) -> None:
        """As `VLLMServerBackend.abort`."""
        self.router.aborted.set()

    def resume(self) -> None:
        self.router.aborted.clear()

    def close(self) -> None:
        self.router.close()
