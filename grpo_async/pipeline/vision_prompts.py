"""Prompts with images, as TRL 1.16's `GRPOTrainer` takes them: a dataset row's `images` column (a list) or `image`
column (one image; `None`: none) goes into its conversational prompt, which the model's processor renders and
tokenizes with the images (each image token expanded to the image's patches).

```txt
row {"prompt": [{"role": "user", "content": "What colour?"}], "image": <PIL 40×40>}
 → messages [{"role": "user", "content": [{"type": "image", "image": <PIL>}, {"type": "text", "text": "What..."}]}]
 → text "<|user|><|vision_start|><|image_pad|><|vision_end|>What colour?<|end|><|assistant|>"
 → processor(images=[<PIL>], text=[text]) → input_ids [13] (<|image_pad|> × 1 after expansion), pixel_values [4, 1176],
   image_grid_thw [1, 3], mm_token_type_ids [1, 13]
```

An image may be a PIL image, a path, raw bytes, or the `{"bytes": ..., "path": ...}` dict of an undecoded
`datasets.Image` column; each is opened as an RGB PIL image.
"""

from __future__ import annotations

import io
import os

from ..generation.base import PromptImages

#: dataset columns that hold a row's images, in TRL's order of precedence
IMAGE_COLUMNS = ("images", "image")


def is_processor(processing_class) -> bool:
    """A multimodal processor (an image processor beside its tokenizer), not a plain tokenizer."""
    return getattr(processing_class, "image_processor", None) is not None and hasattr(processing_class, "tokenizer")


def as_pil(image):
    """An RGB PIL image from a PIL image, a path, bytes, or a `datasets.Image` dict (`bytes` / `path`)."""
    from PIL import Image

    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, (bytes, bytearray)):
        image = Image.open(io.BytesIO(image))
    elif isinstance(image, (str, os.PathLike)):
        image = Image.open(image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"an image must be a PIL image, a path, bytes or a datasets.Image dict, not {type(image)}")
    return image if image.mode == "RGB" else image.convert("RGB")


def row_images(row: dict) -> list | None:
    """The row's images as RGB PIL images (`images` column, else `image`), or `None` when it has none."""
    if "images" in row:
        images = row["images"]
    elif "image" in row:
        images = None if row["image"] is None else [row["image"]]
    else:
        return None
    return [as_pil(i) for i in images] if images else None


def multimodal_messages(messages: list[dict], images: list) -> list[dict]:
    """`messages` with every content a list of parts, holding `images` (TRL's `prepare_multimodal_messages`): the
    `{"type": "image"}` parts the messages already have are filled in order; a prompt without any gets one image part
    per image before the text of its first user message."""
    has_places = any(
        p.get("type") == "image" for m in messages if isinstance(m.get("content"), list) for p in m["content"]
    )
    queue, out, placed = iter(images), [], has_places
    for m in messages:
        parts = m.get("content")
        if isinstance(parts, str):
            parts = [{"type": "text", "text": parts}]
            if m["role"] == "user" and not placed:
                placed = True
                parts = [{"type": "image"} for _ in images] + parts
        if isinstance(parts, list):
            parts = [
                {**p, "image": next(queue)} if p.get("type") == "image" and "image" not in p else p for p in parts
            ]
            m = {**m, "content": parts}
        out.append(m)
    if next(queue, None) is not None:
        raise ValueError(f"a prompt has fewer image places than its row's {len(images)} images")
    return out


def tokenize_with_images(
    processor, prompt, images: list, template_kwargs: dict | None = None
) -> tuple[list[int], PromptImages]:
    """`(prompt token ids, PromptImages)` of a conversational `prompt` with `images` (RGB PIL): rendered by the
    processor's chat template, then tokenized by the processor with the images (image tokens expanded)."""
    from .producer import is_conversational

    if not is_conversational(prompt):
        raise ValueError(
            "a row with images needs a conversational prompt (a list of chat messages) so that the images have a "
            "place in it (as in TRL); got a plain string prompt"
        )
    messages = multimodal_messages(prompt, images)
    text = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )
    out = processor(images=images, text=[text], return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"][0].tolist()
    inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
    text_ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids, PromptImages(
        images=images,
        inputs=inputs,
        text=text,
        text_ids=list(text_ids),
        messages=messages,
        template_kwargs=dict(template_kwargs or {}),
    )


def call_images(backend, media: list | None, row: int, n: int, count: int, G: int) -> dict:
    """`generate`'s `images=` keyword for one call of `count` prompts whose first completion is request row `row`
    (prompt i of the call: completion row `row + i·n`, prompt `(row + i·n) // G` of the request), or `{}` without
    images. A backend that cannot take images (`takes_images`) is refused."""
    if media is None:
        return {}
    if not getattr(backend, "takes_images", False):
        raise ValueError(
            f"the dataset's rows have images, which {type(backend).__name__} cannot generate with: vision-language "
            "models generate with generation_backend 'hf', or 'vllm' for a family vLLM can load (docs/vlm.md)"
        )
    return {"images": [media[(row + i * n) // G] for i in range(count)]}


def with_vision(batch, per_row: list | None):
    """`batch` (a `MicroBatch` of `[R]` rows) with `vision` built from `per_row[r]`, row r's `PromptImages` (or None);
    unchanged when no row has images."""
    import dataclasses

    from ..algo.vision import VisionRows

    if not per_row or all(m is None for m in per_row):
        return batch
    lengths = batch.prompt_mask.sum(1).tolist()  # [R] each row's prompt tokens (left-padded to the widest)
    vision = VisionRows.from_prompts([None if m is None else m.inputs for m in per_row], lengths)
    return dataclasses.replace(batch, vision=vision.pad_prompt(batch.prompt_ids.size(1) - max(lengths)))


def png_images(media: PromptImages | None) -> list[bytes]:
    """A prompt's images as PNG bytes (the completions table's `images` column, `GRPOConfig.log_multimodal`)."""
    from ..generation.vllm_images import png_bytes

    return png_bytes(media.images) if media is not None else []
