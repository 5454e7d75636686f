"""What every vLLM backend shares: sampling checks and their translation to vLLM (`SamplingParams`, the
`/v1/completions` body), the parse of a completions response, and the check that vLLM can serve a model.

Sampling means the same everywhere (`SamplingConfig`): `top_k = 0`, `top_p = 1`, `min_p = 0` are off, and every
completion carries the sampler's logprob of each token under the distribution it sampled from (vLLM runs with
`logprobs_mode="processed_logprobs"`: temperature and filters applied), comparable to the trainer's
`log_softmax(logits / T)` when no filter is on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from grpo_async.gc_tuning import collector_paused
from grpo_async.generation.base import Completion, SamplingConfig
from grpo_async.net import ServerError
from grpo_async.weight_sync.buckets import NamedTensors

#: module-grouped weights, as the publisher sends them: `(module, [(name, tensor), ...])` in order
Groups = Iterable[tuple[str, NamedTensors]]


def validate_sampling(s: SamplingConfig) -> SamplingConfig:
    """Raise `ValueError` naming the field of `SamplingConfig` that no backend can honour."""
    if not (isinstance(s.n, int) and s.n >= 1):
        raise ValueError(f"SamplingConfig.n must be an integer ≥ 1, got {s.n!r}")
    if not (isinstance(s.max_tokens, int) and s.max_tokens >= 1):
        raise ValueError(f"SamplingConfig.max_tokens must be an integer ≥ 1, got {s.max_tokens!r}")
    if not s.temperature >= 0:
        raise ValueError(f"SamplingConfig.temperature must be ≥ 0, got {s.temperature!r}")
    if not 0 < s.top_p <= 1:
        raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {s.top_p!r}")
    if not (isinstance(s.top_k, int) and s.top_k >= 0):
        raise ValueError(f"SamplingConfig.top_k must be an integer ≥ 0 (0 = off), got {s.top_k!r}")
    if not 0 <= s.min_p <= 1:
        raise ValueError(f"SamplingConfig.min_p must be in [0, 1], got {s.min_p!r}")
    if s.stop is not None and not (isinstance(s.stop, list) and all(isinstance(x, str) for x in s.stop)):
        raise ValueError(f"SamplingConfig.stop must be a list of strings or None, got {s.stop!r}")
    if not s.repetition_penalty > 0:
        raise ValueError(f"SamplingConfig.repetition_penalty must be > 0 (1.0 = off), got {s.repetition_penalty!r}")
    if s.extra is not None and not (isinstance(s.extra, dict) and all(isinstance(k, str) for k in s.extra)):
        raise ValueError(f"SamplingConfig.extra (generation_kwargs) must be a dict keyed by name, got {s.extra!r}")
    return s


def model_head_dim(config) -> int | None:
    """Attention head size of a HF config: `head_dim`, else `hidden_size // num_attention_heads`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d = getattr(text, "head_dim", None)
    if d is None and getattr(text, "hidden_size", None) and getattr(text, "num_attention_heads", None):
        d = text.hidden_size // text.num_attention_heads
    return d


def check_vllm_can_serve(config, where: str = "VLLMColocateBackend") -> None:
    """Refuse, before an engine is built, a model whose head size vLLM's CPU attention cannot serve (on GPU the
    attention backend is picked per model by vLLM itself, which then reports it)."""
    if torch.cuda.is_available():
        return
    d = model_head_dim(config)
    with collector_paused():  # the trainer's first import of vLLM (~6 CPU-s): see `gc_tuning`
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if d is not None and d not in sizes:
        raise ValueError(
            f"{where}: the model's attention head size is {d} (head_dim, or hidden_size / num_attention_heads), "
            f"which vLLM's CPU attention cannot serve; it supports head sizes {sizes}. Use generation_backend='hf' "
            "or a model with a supported head size."
        )


def check_prompts(prompt_ids) -> None:
    if not isinstance(prompt_ids, list) or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt_ids
    ):
        raise ValueError("prompt_ids must be a list of non-empty lists of token ids (int)")


def to_vllm_sampling_params(s: SamplingConfig):
    """`SamplingConfig` → `vllm.SamplingParams` with `logprobs=0` (the sampled token's logprob only)."""
    from vllm import SamplingParams

    validate_sampling(s)
    fields = dict(
        n=s.n,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,  # vLLM: 0 = off
        min_p=s.min_p,
        stop=s.stop,
        seed=s.seed,
        repetition_penalty=s.repetition_penalty,
        logprobs=0,
    )
    return SamplingParams(**{**fields, **(s.extra or {})})  # the extras override the fields (as in a request body)


def _sampling_fields(s: SamplingConfig, bad_words: list[str] | None) -> dict:
    """The sampling fields of a request body (vLLM's `SamplingParams` names; filters that are off are left out)."""
    validate_sampling(s)
    fields = {"n": s.n, "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p, "logprobs": 0}
    if s.top_k > 0:
        fields["top_k"] = s.top_k
    if s.min_p > 0:
        fields["min_p"] = s.min_p
    if s.stop:
        fields["stop"] = s.stop
    if s.seed is not None:
        fields["seed"] = s.seed
    if s.repetition_penalty != 1.0:
        fields["repetition_penalty"] = s.repetition_penalty  # vLLM extension
    if bad_words:
        fields["bad_words"] = list(bad_words)  # vLLM extension: a VLM's image placeholders are never sampled
    return fields


def to_completions_body(model: str, prompt: list[int], s: SamplingConfig, bad_words: list[str] | None = None) -> dict:
    """`/v1/completions` body for one tokenized prompt; filters that are off are left out (portable)."""
    body = {
        "model": model,
        "prompt": prompt,
        **_sampling_fields(s, bad_words),
        "return_token_ids": True,  # vLLM extension
        "return_tokens_as_token_ids": True,  # fallback: tokens come back as "token_id:<id>"
    }
    body.update(s.extra or {})
    return body


#: vLLM's token-in, token-out route (vLLM >= 0.32; `vllm serve --enable-scale-out`, on by default in `grpo-async
#: serve`): token ids plus raw images, which the server's processor expands as for a text prompt
GENERATE_ROUTE = "/inference/v1/generate"


def image_data_urls(media) -> list[str]:
    """A prompt's images (`media`: its `PromptImages`) as PNG data URLs, in the prompt's order."""
    import base64

    from .vllm_images import png_bytes

    return ["data:image/png;base64," + base64.b64encode(b).decode("ascii") for b in png_bytes(media.images)]


def to_generate_body(model: str, media, s: SamplingConfig, bad_words: list[str] | None = None) -> dict:
    """`GENERATE_ROUTE` body for one prompt with images (`media`: its `PromptImages`): the rendered prompt's token ids
    with one placeholder per image (`media.text_ids`; the server expands them, as it would the text) and each image
    as a PNG data URL, in the prompt's order. `return_token_ids` asks for the prompt's ids after the expansion, which
    `parse_generate_response` returns so that they can be held to the trainer's."""
    if not media.text_ids:
        raise ValueError("a prompt with images reaches a vLLM server as its rendered text's ids, which it lacks")
    sampling = {**_sampling_fields(s, bad_words), **(s.extra or {})}
    return {
        "model": model,
        "token_ids": list(media.text_ids),
        "content_parts": [{"type": "image_url", "url": url} for url in image_data_urls(media)],
        "sampling_params": sampling,
        "return_token_ids": True,
    }


#: the OpenAI chat route: a prompt with images goes to an OpenAI-compatible server as its chat messages
CHAT_ROUTE = "/v1/chat/completions"


def to_chat_body(model: str, media, s: SamplingConfig, bad_words: list[str] | None = None) -> dict:
    """`CHAT_ROUTE` body for one prompt with images (`media`: its `PromptImages`): the chat messages it was rendered
    from, each image an `image_url` part holding a PNG data URL (the OpenAI format), rendered by the server's chat
    template with a generation prompt, as the trainer's processor rendered them. vLLM's extensions ask for the token
    ids of the completions and of the prompt as the server expanded it (`parse_generate_response` reads both)."""
    if not media.messages:
        raise ValueError(
            "a prompt with images reaches an OpenAI-compatible server as its chat messages, which it lacks"
        )
    urls = iter(image_data_urls(media))
    messages = []
    for m in media.messages:
        parts = m.get("content")
        if isinstance(parts, list):
            parts = [
                {"type": "image_url", "image_url": {"url": next(urls)}} if p.get("type") == "image" else p
                for p in parts
            ]
        messages.append({**m, "content": parts})
    if next(urls, None) is not None:
        raise ValueError(f"a prompt's messages hold fewer image parts than its {len(media.images)} images")
    fields = _sampling_fields(s, bad_words)
    body = {
        "model": model,
        "messages": messages,
        **{k: v for k, v in fields.items() if k != "logprobs"},
        "logprobs": True,  # the chat route's logprobs are a flag, each sampled token's log-prob in `content`
        "add_generation_prompt": True,
        "return_token_ids": True,  # vLLM extension: the completion's and the expanded prompt's token ids
        "return_tokens_as_token_ids": True,  # fallback: tokens come back as "token_id:<id>"
    }
    if media.template_kwargs:
        body["chat_template_kwargs"] = dict(media.template_kwargs)
    body.update(s.extra or {})
    return body


def parse_generate_response(
    resp, n: int, where: str, route: str = GENERATE_ROUTE
) -> tuple[list[Completion], list[int]]:
    """The `n` choices of one `GENERATE_ROUTE` (or `CHAT_ROUTE`) answer, in choice-index order, and the prompt's token
    ids as the server expanded them. Raises `ServerError` (status None: the server is broken) on an answer of another
    shape."""

    def bad(what: str):
        return ServerError(f"{where} returned a malformed {route} answer: {what}")

    if not isinstance(resp, dict) or not isinstance(resp.get("choices"), list):
        raise bad(f"expected a JSON object with a 'choices' list, got {str(resp)[:200]!r}")
    prompt = resp.get("prompt_token_ids")
    if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
        raise bad("no prompt_token_ids (the request had vLLM's return_token_ids=true)")
    choices = []
    for c in resp["choices"]:
        content = (c.get("logprobs") or {}).get("content") if isinstance(c, dict) else None
        if not isinstance(c, dict) or not isinstance(content, list) or not all(isinstance(x, dict) for x in content):
            raise bad(f"a choice without logprobs content: {str(c)[:200]!r}")
        # the shape `parse_completions_response` reads: token ids (else "token_id:<id>" tokens) beside their log-probs
        ids = c.get("token_ids")
        if ids is None and all("token_id" in x for x in content):
            ids = [x["token_id"] for x in content]
        message = c.get("message")
        choices.append(
            {
                "index": c.get("index", 0),
                "token_ids": ids,
                "logprobs": {
                    "tokens": [x.get("token") for x in content],
                    "token_logprobs": [x.get("logprob") for x in content],
                },
                "finish_reason": c.get("finish_reason"),
                "text": message.get("content") if isinstance(message, dict) else c.get("text"),
            }
        )
    return parse_completions_response({"choices": choices}, n, where, route), list(prompt)


def parse_completions_response(resp, n: int, where: str, route: str = "/v1/completions") -> list[Completion]:
    """The `n` choices of one `/v1/completions` answer, in choice-index order.

    Raises `ServerError` (status `None`, i.e. "the server is broken") naming `where` when the answer does not have the
    documented shape: the router then takes that server out of rotation instead of training on garbage.
    """

    def bad(what: str):
        return ServerError(f"{where} returned a malformed {route} answer: {what}")

    if not isinstance(resp, dict) or not isinstance(resp.get("choices"), list):
        raise bad(f"expected a JSON object with a 'choices' list, got {str(resp)[:200]!r}")
    if not all(isinstance(c, dict) for c in resp["choices"]):
        raise bad("'choices' holds something other than objects")
    choices = sorted(resp["choices"], key=lambda c: c.get("index", 0) if isinstance(c.get("index"), int) else 0)
    if len(choices) != n:
        raise bad(f"{len(choices)} choices for n={n}")
    out = []
    for c in choices:
        lp = c.get("logprobs") or {}
        if not isinstance(lp, dict):
            raise bad(f"'logprobs' is a {type(lp).__name__}, not an object")
        ids = c.get("token_ids")
        if ids is None:
            toks = lp.get("tokens") or []
            if not all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
                raise bad("no token ids (needs vLLM's return_token_ids or return_tokens_as_token_ids)")
            ids = [int(t.split(":", 1)[1]) for t in toks]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad(f"token_ids is not a list of ints: {str(ids)[:100]!r}")
        logprobs = lp.get("token_logprobs")
        if logprobs is None:
            raise bad("no logprobs (the request had logprobs=0)")
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            raise bad(f"{len(ids)} token ids but logprobs {str(logprobs)[:100]!r}")
        try:
            logprobs = [float(x) for x in logprobs]
        except (TypeError, ValueError) as e:
            raise bad(f"logprobs are not numbers ({e})") from None
        if not all(math.isfinite(x) and x <= 1e-3 for x in logprobs):  # NaN, ±inf, or a log-probability above 0
            raise bad(f"logprobs must be finite and <= 0, got {logprobs[:8]}")
        finish = c.get("finish_reason") or "stop"
        out.append(
            Completion(
                completion_ids=list(ids),
                logprobs=logprobs,
                finish_reason="length" if finish == "length" else "stop",
                text=c.get("text") if isinstance(c.get("text"), str) else None,
            )
        )
    return out
