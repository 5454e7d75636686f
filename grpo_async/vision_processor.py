"""Loading a vision-language model's processor, with or without torchvision.

`AutoProcessor.from_pretrained` builds every sub-processor a processor class declares. Qwen2-VL / Qwen2.5-VL
processors declare a video processor, and every transformers video processor needs torchvision, which a CPU vLLM
install does not have (its PyPI wheel is a CUDA build that breaks `import vllm`; `make install` removes it). For those
families `load_processor` then builds the same processor without the video part: `image_only_processor_class(cls)` is
`cls` with a constructor that takes `(image_processor, tokenizer, chat_template)`; everything the trainer uses
(`apply_chat_template`, `__call__` with `images=` and `text=`, `batch_decode`, the image token) is the real class's
code. Videos are refused (there is no video processor to process them).

```python
processor = load_processor("Qwen/Qwen2-VL-2B-Instruct")  # AutoProcessor when it can, else the image-only one
```
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)

#: model types whose processor always loads a video processor (torchvision), and their processor class
VIDEO_PROCESSOR_FAMILIES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}


@functools.cache
def image_only_processor_class(base: type) -> type:
    """`base` (a `ProcessorMixin` subclass with a video processor) as a processor of images and text only: its
    sub-processors are `image_processor` and `tokenizer`, so building it needs no video processor. The class keeps
    `base`'s name (vLLM and TRL check `isinstance(p, base)`, which holds)."""
    from transformers.processing_utils import ProcessorMixin

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        tokenizer_attrs = ("image_token", "video_token")
        self.image_token = getattr(tokenizer, tokenizer_attrs[0], None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, tokenizer_attrs[1], None) or "<|video_pad|>"
        self.image_token_id = getattr(tokenizer, "image_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.image_token
        )
        self.video_token_id = getattr(tokenizer, "video_token_id", None) or tokenizer.convert_tokens_to_ids(
            self.video_token
        )
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def _process_videos(self, *args, **kwargs):
        raise ValueError(f"{base.__name__} was loaded without a video processor (no torchvision): videos are refused")

    return type(base.__name__, (base,), {"__init__": __init__, "_process_videos": _process_videos})


def load_processor(name_or_path: str, **kwargs):
    """The processor of a vision-language model: `AutoProcessor.from_pretrained(name_or_path, **kwargs)`, or for a
    Qwen-VL family without torchvision the image-only processor (`image_only_processor_class`) built from the
    folder's image processor, tokenizer and chat template."""
    from transformers import AutoConfig, AutoProcessor

    try:
        return AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        model_type = getattr(AutoConfig.from_pretrained(name_or_path, **kwargs), "model_type", None)
        if model_type not in VIDEO_PROCESSOR_FAMILIES:
            raise
        first_error = e
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    base = getattr(transformers, VIDEO_PROCESSOR_FAMILIES[model_type])
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    image_processor = AutoImageProcessor.from_pretrained(name_or_path, **kwargs)
    logger.info(
        "%s: AutoProcessor failed (%s: %s); loaded %s for images and text only (no video processor: torchvision is "
        "not installed)",
        name_or_path,
        type(first_error).__name__,
        str(first_error)[:120],
        base.__name__,
    )
    return image_only_processor_class(base)(image_processor, tokenizer, chat_template=tokenizer.chat_template)


def is_vision_config(config) -> bool:
    """A model config of a vision-language model (it has a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def vision_placeholder_ids(config) -> list[int]:
    """A vision-language model's image / video placeholder token ids (the tokens its processor expands into an
    image's patches); empty for a text model. A completion must not hold them: scoring it, the model would take them
    for images without pixels."""
    if not is_vision_config(config):
        return []
    keys = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
    return sorted({v for k in keys if isinstance(v := getattr(config, k, None), int) and v >= 0})


def placeholder_words(config, tokenizer) -> list[str]:
    """`vision_placeholder_ids(config)` as token strings (what vLLM's `SamplingParams.bad_words` takes); empty for a
    text model. `tokenizer` may be a processor (its `tokenizer` is used)."""
    ids = vision_placeholder_ids(config)
    return getattr(tokenizer, "tokenizer", tokenizer).convert_ids_to_tokens(ids) if ids else []
