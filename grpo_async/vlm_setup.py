"""What a vision-language model changes at trainer construction (`trainer_setup.prepare_models` calls
`check_vision_model`): the features that cannot isolate a row's images are refused by name, or turned off.

| feature | with a VLM |
|---|---|
| `generation_backend` | `"hf"`, `"vllm_server"`, `"openai"`; `"vllm"` for a family vLLM loads (not Qwen-VL / Gemma3) |
| `weight_sync_inflight` with `"vllm"` or `"vllm_server"` | refused (a load resets the image-encoder cache) |
| `padding_free` | `True` refused (packed bins cannot carry each row's images); `None` (default) → padded |
| `share_prompt_prefix` | off, one warning (`algo.prefix_sharing.unsupported_reason`) |
| `ref_server_url` | refused (the reference server scores token ids, it takes no images) |
"""

from __future__ import annotations

import logging

from .vision_processor import is_vision_config

logger = logging.getLogger(__name__)


def check_vision_model(args, model) -> None:
    """Refuse (`ValueError` naming the field) what cannot train `model`, a vision-language model, and set
    `args.padding_free` to False where it was left to the trainer (None); nothing for a text model."""
    config = getattr(model, "config", None)
    if config is None or not is_vision_config(config):
        return
    name = type(model).__name__
    backend = args.generation_backend
    if backend not in ("hf", "vllm", "vllm_server", "openai"):
        raise ValueError(
            f"GRPOConfig.generation_backend={backend!r}: {name} is a vision-language model, whose images only the "
            "hf backend, the in-process vLLM engine ('vllm'), vLLM servers ('vllm_server') and OpenAI-compatible "
            "chat servers ('openai') generate with here (docs/vlm.md)"
        )
    if backend in ("vllm", "vllm_server") and args.weight_sync_inflight:
        raise ValueError(
            f"GRPOConfig.weight_sync_inflight=True: {name} is a vision-language model, whose weights vLLM loads with "
            "no request running (a load resets the engine's image-encoder cache, which a request running across it "
            "would still read); leave weight_sync_inflight=False (stream mode then holds the stream for each load: "
            "the running groups finish on the old weights first)"
        )
    if backend == "vllm":
        from .generation.vllm_images import vllm_vision_support

        why = vllm_vision_support(config)
        if why is not None:
            raise ValueError(
                f"GRPOConfig.generation_backend='vllm': {name} is a vision-language model that vLLM cannot load "
                f"here: {why}. Use generation_backend='hf' (docs/vlm.md)"
            )
    if args.ref_server_url is not None:
        raise ValueError(
            f"GRPOConfig.ref_server_url: {name} is a vision-language model, and a reference server scores token ids "
            "without their images; leave ref_server_url None (the reference is then a local frozen copy)"
        )
    if args.padding_free:
        raise ValueError(
            f"GRPOConfig.padding_free=True: {name} is a vision-language model, and packed bins cannot carry each "
            "row's images (pixel_values, image_grid_thw); leave padding_free None or False"
        )
    if args.padding_free is None:
        logger.info("GRPOConfig.padding_free=None: %s is a vision-language model, forward passes are padded", name)
        args.padding_free = False
