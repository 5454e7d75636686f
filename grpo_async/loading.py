"""Loading a model or tokenizer by name or path, and checking lengths against the model, with errors a user can act on.

`from_pretrained` answers a missing local folder with `Repo id must be in the form ...`, and a misspelled Hub id
with a minute of retries when the network is unreachable. Here:

- a path (absolute, `./…`, `../…`, `~…`, or a name that is not a valid Hub id) that does not exist:
  `FileNotFoundError: model folder '<path>' does not exist`;
- a Hub id that is not in the local cache while offline (`HF_HUB_OFFLINE=1`, or huggingface.co unreachable within a
  few seconds): `OSError` naming the id and saying that we are offline, at once.

The trainer calls `load_model`, `load_tokenizer` and `check_lengths(config, model_config)` when it is given a name;
the recipes call `check_lengths(args, load_model_config(name))` before building it.
"""

from __future__ import annotations

import os
import re
import socket
from urllib.parse import urlparse

#: a Hub repo id: `name` or `owner/name` (letters, digits, `-`, `_`, `.`; no `--`/`..`; ≤ 96 characters)
_REPO_ID = re.compile(r"^(?:[\w\-.]+/)?[\w\-.]+$")


def _is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and "--" not in name and ".." not in name and len(name) <= 96


def _looks_like_path(name: str) -> bool:
    return (
        os.path.isabs(name)
        or name.startswith(("./", "../", "~", ".\\", "..\\"))
        or name in (".", "..")
        or not _is_repo_id(name)
    )


def _offline_env() -> bool:
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE") for k in ("HF_HUB_OFFLINE",))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub endpoint (`HF_ENDPOINT`, default huggingface.co) accepts a TCP connection within `timeout`."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def _in_cache(repo_id: str, filename: str, revision: str | None = None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, filename, revision=revision)
    except Exception:  # noqa: BLE001  (a malformed id: treat as not cached)
        return False
    return isinstance(found, str)


def resolve_name_or_path(name_or_path, what: str = "model", filename: str = "config.json", revision=None):
    """Check that `name_or_path` can be loaded without waiting on the network; returns it unchanged.

    Args:
        name_or_path (`str` or `os.PathLike`): a local folder or a Hugging Face Hub id.
        what (`str`): "model" or "tokenizer", for the messages.
        filename (`str`): a file the Hub repo must have in the local cache to count as available offline.
        revision (`str`, *optional*): the Hub revision.

    Raises:
        FileNotFoundError: a path that does not exist (or is not a folder).
        OSError: a Hub id not in the cache while offline (HF_HUB_OFFLINE=1 or the Hub unreachable).
    """
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        return name_or_path
    if os.path.exists(name):
        raise FileNotFoundError(f"{what} path {name!r} is a file, not a folder: give the folder with config.json")
    if _looks_like_path(name):
        parent = os.path.dirname(os.path.abspath(os.path.expanduser(name)))
        hint = "" if os.path.isdir(parent) else f" (nor does its parent folder {parent!r})"
        raise FileNotFoundError(
            f"{what} folder {name!r} does not exist{hint}; give an existing local folder or a Hub id like 'owner/name'"
        )
    if _in_cache(name, filename, revision):
        return name_or_path
    if _offline_env():
        raise OSError(
            f"{what} {name!r} is not a local folder and not in the Hugging Face cache, and we are offline "
            f"(HF_HUB_OFFLINE=1): check the spelling, download it first (`hf download " + name + "`), or give a path"
        )
    if not hub_reachable():
        endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        raise OSError(
            f"{what} {name!r} is not a local folder and not in the Hugging Face cache, and we are offline "
            f"({endpoint} is unreachable): check the spelling, connect, or give a local path"
        )
    return name_or_path


def load_model(name_or_path, **from_pretrained_kwargs):
    """`AutoModelForCausalLM.from_pretrained(name_or_path, **from_pretrained_kwargs)` after `resolve_name_or_path`
    (a missing folder or an offline, uncached Hub id fails at once with a message naming it); a vision-language
    model (a config with a `vision_config`) with `AutoModelForImageTextToText`, vision tower included."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from .vision_processor import is_vision_config

    resolve_name_or_path(name_or_path, "model", revision=from_pretrained_kwargs.get("revision"))
    keys = ("revision", "trust_remote_code", "gguf_file", "subfolder", "token", "cache_dir", "local_files_only")
    config = from_pretrained_kwargs.get("config")
    if config is None:
        config = load_model_config(name_or_path, **{k: v for k, v in from_pretrained_kwargs.items() if k in keys})
    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    return auto.from_pretrained(name_or_path, **from_pretrained_kwargs)


def load_processing_class(name_or_path, **kwargs):
    """The tokenizer (`load_tokenizer`), or for a vision-language model its processor
    (`vision_processor.load_processor`: images and text, as TRL's `processing_class`)."""
    from .vision_processor import is_vision_config, load_processor

    if is_vision_config(load_model_config(name_or_path, **kwargs)):
        return load_processor(name_or_path, **kwargs)
    return load_tokenizer(name_or_path, **kwargs)


def load_tokenizer(name_or_path, **kwargs):
    """`AutoTokenizer.from_pretrained(name_or_path, **kwargs)` after `resolve_name_or_path` (see `load_model`)."""
    from transformers import AutoTokenizer

    resolve_name_or_path(name_or_path, "tokenizer", filename="tokenizer_config.json", revision=kwargs.get("revision"))
    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_model_config(name_or_path, **kwargs):
    """`AutoConfig.from_pretrained(name_or_path, **kwargs)` after `resolve_name_or_path` (see `load_model`)."""
    from transformers import AutoConfig

    resolve_name_or_path(name_or_path, "model", revision=kwargs.get("revision"))
    return AutoConfig.from_pretrained(name_or_path, **kwargs)


def model_max_positions(model_config) -> int | None:
    """The model's position budget (`max_position_embeddings`, or `n_positions` / `max_sequence_length`)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(model_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    text = getattr(model_config, "text_config", None)
    return model_max_positions(text) if text is not None and text is not model_config else None


def check_lengths(config, model_config) -> None:
    """Refuse a prompt + completion budget the model cannot hold, at start rather than mid-run in vLLM.

    Args:
        config (`GRPOConfig`): reads `max_prompt_length`, `max_completion_length` and `vllm_max_model_length`.
        model_config (`transformers.PretrainedConfig`): reads `max_position_embeddings` (or equivalent).

    Raises:
        ValueError: naming max_prompt_length, max_completion_length and the model's max_position_embeddings.
    """
    positions = model_max_positions(model_config)
    if positions is None:
        return
    prompt, completion = getattr(config, "max_prompt_length", None), getattr(config, "max_completion_length", None)
    if prompt is not None and completion is not None and prompt + completion > positions:
        raise ValueError(
            f"max_prompt_length={prompt} + max_completion_length={completion} = {prompt + completion} tokens exceeds "
            f"the model's max_position_embeddings={positions}: lower them so that their sum is at most {positions}"
        )
    if prompt is None and completion is not None and completion >= positions:
        raise ValueError(
            f"max_completion_length={completion} leaves no room for the prompt in the model's "
            f"max_position_embeddings={positions} (max_prompt_length=None)"
        )
    vllm_len = getattr(config, "vllm_max_model_length", None)
    if vllm_len is not None and vllm_len > positions:
        raise ValueError(f"vllm_max_model_length={vllm_len} exceeds the model's max_position_embeddings={positions}")
