"""A vision-language model's prompts for the in-process vLLM engine (`multi_modal_data`), and which VLMs vLLM can
load here.

vLLM 0.32 applies its own image-token expansion to every prompt with `multi_modal_data`, token prompts included: the
trainer's prompt ids, whose image tokens its processor already expanded, would be expanded a second time (measured on
Idefics3: `<image>`×4 became `<fake><global-img><image>`×4... around each). So a prompt with images goes to the engine
as the text its chat template rendered (`PromptImages.text`) with its images; the engine's processor tokenizes and
expands it, and `check_engine_prompts` holds its token ids to the trainer's, prompt by prompt.

```txt
prompt k, trainer:  ids [5, 7, 10, 8, 8, 8, 8, 7, ...]            (processor(text, images))
engine request k:   {"prompt": text, "multi_modal_data": {"image": <PIL>}}
engine output k:    prompt_token_ids == ids, else RuntimeError naming k and both lengths
```
"""

from __future__ import annotations

import importlib


def engine_prompts(prompt_ids: list[list[int]], images: list | None) -> list[dict]:
    """vLLM prompts: token ids for a prompt without images, the rendered text and its images for one with
    (`images[k]`: prompt k's `PromptImages`, or None)."""
    if images is None:
        return [{"prompt_token_ids": p} for p in prompt_ids]
    out = []
    for p, m in zip(prompt_ids, images, strict=True):
        if m is None:
            out.append({"prompt_token_ids": p})
            continue
        if not m.text:
            raise ValueError("a prompt with images reaches vLLM as its rendered text, which this PromptImages lacks")
        out.append({"prompt": m.text, "multi_modal_data": {"image": m.images if len(m.images) > 1 else m.images[0]}})
    return out


def check_engine_prompts(prompt_token_ids: list[list[int]], prompt_ids: list[list[int]], images: list | None) -> None:
    """Raise when the engine tokenized a prompt with images otherwise than the trainer (its completions would be
    scored after other prompt tokens than they were sampled after)."""
    if images is None:
        return
    for k, (got, want, m) in enumerate(zip(prompt_token_ids, prompt_ids, images, strict=True)):
        if m is not None and list(got) != list(want):
            raise RuntimeError(
                f"vLLM tokenized prompt {k} with its images into {len(got)} tokens, the trainer's processor into "
                f"{len(want)} (first difference at token "
                f"{next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}): the "
                "engine's processor expands the images otherwise (a different processor config or special tokens)"
            )


def png_bytes(images: list) -> list[bytes]:
    """Each PIL image as PNG bytes (what a server request carries, and the completions table's `images` column)."""
    import io

    out = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out.append(buffer.getvalue())
    return out


def vllm_vision_support(config) -> str | None:
    """Why vLLM cannot load this vision-language model here (its model module fails to import, e.g. for want of
    torchvision), or None when it can."""
    try:
        from vllm.model_executor.models.registry import _VLLM_MODELS
    except ImportError as e:  # pragma: no cover - vLLM is a dependency
        return f"vLLM is not importable ({e})"
    for arch in getattr(config, "architectures", None) or []:
        if arch in _VLLM_MODELS:
            module = _VLLM_MODELS[arch][0]
            try:
                importlib.import_module(f"vllm.model_executor.models.{module}")
            except ImportError as e:
                return f"vLLM's {module} module (for {arch}) does not import here: {e}"
            return None
    return f"vLLM has no model class for {getattr(config, 'architectures', None)}"


def engine_placeholder_words(llm) -> list[str]:
    """The engine's model's image / video placeholder tokens as strings (`vllm.SamplingParams.bad_words`), empty for a
    text model: a VLM must not sample them (`vision_processor.placeholder_words`)."""
    from ..vision_processor import placeholder_words

    return placeholder_words(llm.llm_engine.model_config.hf_config, llm.get_tokenizer())


def suppress_words(params, words: list[str]):
    """`params` (one `SamplingParams` or a list) with `words` added to their `bad_words` (their logits set to -inf
    by the sampler: the kept set the trainer replays excludes them)."""
    if not words:
        return params
    for p in params if isinstance(params, list) else [params]:
        p.bad_words = list(dict.fromkeys([*(p.bad_words or []), *words]))
    return params


def reset_vision_caches(llm) -> None:
    """After new weights, a multimodal engine's cached image features are stale (the old vision tower made them).
    The weight-sync worker clears the model runner's encoder cache (`weight_sync.worker`), but vLLM 0.32's scheduler
    keeps believing those features are cached: a prompt with an image seen before the push then fails with "Encoder
    cache miss" (measured: round 1 of a run whose images recur). `LLMEngine.reset_encoder_cache` resets both sides;
    the processed-input cache goes in step (`LLM.reset_mm_cache`). No-op for a text model."""
    if not llm.llm_engine.model_config.is_multimodal_model:
        return
    llm.llm_engine.reset_encoder_cache()
    llm.reset_mm_cache()
