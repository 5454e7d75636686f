"""TRL 1.16 compatibility of `GRPOConfig`: the tables (aliases, deprecated names, default differences, fields accepted
only at TRL's default), the keyword translation, and the check of TRL fields this trainer does not implement.

A TRL config ports by changing the import: every field of `trl.GRPOConfig` is accepted. TRL's names of knobs called
otherwise here (`TRL_ALIASES`) are translated when the config is constructed, by the metaclass [`TRLKeywords`] (the
one place keyword arguments are read before the dataclass `__init__`), and read back through alias properties:

```txt
GRPOConfig(vllm_importance_sampling_mode="token_mask")   →  importance_sampling_mode="token_mask"
cfg.vllm_importance_sampling_mode                        →  cfg.importance_sampling_mode
GRPOConfig(num_generation=4)                             →  TypeError ... (did you mean num_generations?)
```
The translation runs before `__init__` because `dataclasses.replace` passes every field: a TRL name given to
`replace` is the change asked for, and only the full keyword set tells that apart from our name's old value.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import warnings
from typing import Any

from ..algo.loss import LOSS_TYPES

#: loss types TRL 1.16 has (all in `LOSS_TYPES`; a missing one would raise `NotImplementedError`, not `ValueError`)
TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")

#: TRL 1.16 field name → the field of this config that holds the same knob (same values, same meaning). Accepted as
#: keyword arguments and readable (and settable) as attributes; not separate dataclass fields, so a copy never
#: carries two values of one knob.
TRL_ALIASES = {
    "vllm_importance_sampling_correction": "importance_sampling_correction",
    "vllm_importance_sampling_mode": "importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min": "importance_sampling_clip_min",
}
#: deprecated TRL names, accepted as keyword arguments with a `FutureWarning` (TRL 1.16 warns the same way)
TRL_DEPRECATED = {"vllm_importance_sampling_cap": "importance_sampling_clip_max"}

#: fields whose default differs from TRL 1.16's `GRPOConfig`, and why. TRL's value is accepted for each.
DEFAULT_DIFFERENCES = {
    "disable_dropout": "True here (TRL: False). The old-policy logps, the training pass and the sampler must score "
    "the same function; with dropout on, the ratio π/π_old is noise even on-policy and the importance-sampling "
    "correction against the sampler (which never uses dropout) is biased.",
    "gradient_checkpointing": "False here (TRL: True). The training passes are packed without padding "
    "(`padding_free`), which already keeps activation memory low; checkpointing costs about 20% of the step. Set "
    "it to True for large models.",
    "bf16": "False here (TRL: None, which means True unless fp16). Training runs in float32 by default so the "
    "trainer's logps match the sampler's; bf16=None is accepted with TRL's meaning.",
    "min_p": "0.0 here (TRL: None); both mean off. None is accepted and read back as 0.0.",
    "num_completions_to_print": "4 here (TRL: None = every completion of the round). None prints them all.",
}

#: TRL 1.16 fields this trainer accepts only at TRL's default: field → what to do instead
UNSUPPORTED_TRL_INSTEAD = {
    "ds3_gather_for_generation": "the policy weights are always gathered for generation under DeepSpeed ZeRO-3; "
    "leave it True",
    "cache_implementation": "the hf backend uses the model's default cache; leave it None",
    "vllm_model_impl": "the vllm backend uses vLLM's own model implementation; leave it 'vllm'",
    "vllm_enable_sleep_mode": "the in-process engine stays resident; lower vllm_gpu_memory_utilization or generate "
    "on a server (generation_backend='vllm_server') to free trainer memory",
    "vllm_structured_outputs_regex": "structured outputs are not passed to the sampler; leave it None",
    "vllm_group_port": "the broadcast weight sync picks a free port itself; leave it 51216",
    "vllm_tensor_parallel_size": "the in-process engine runs on one device; for tensor parallelism start "
    "`grpo-async serve` with it and use generation_backend='vllm_server'",
    "log_completions_hub_repo": "completions are written to output_dir/completions/ as parquet; upload that folder",
    "use_transformers_continuous_batching": "use generation_backend='vllm' (or use_vllm=True) for batched generation",
    "transformers_continuous_batching_config": "use generation_backend='vllm' (or use_vllm=True) for batched "
    "generation",
    "use_transformers_paged": "use generation_backend='vllm' (or use_vllm=True) for batched generation",
    "use_liger_kernel": "TRL 1.16 deprecates it (a FutureWarning naming the Hub kernels) and applies only Liger's "
    "layer kernels with it, which are Triton GPU kernels; as TRL's warning says, load the model with "
    "model_init_kwargs={'use_kernels': True} to patch its layers with fused kernels",
}
#: TRL 1.16 fields accepted only at TRL's default (`NotImplementedError` otherwise): the README's table
UNSUPPORTED_TRL_FIELDS = tuple(UNSUPPORTED_TRL_INSTEAD)


def check_trl_fields(config: Any) -> None:
    """TRL 1.16 fields this trainer does not implement must keep TRL's default (`NotImplementedError` naming what
    to do instead), and a TRL loss type must be one this trainer has."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    for name, instead in UNSUPPORTED_TRL_INSTEAD.items():
        value, f = getattr(config, name), fields[name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if value != default:
            raise NotImplementedError(
                f"GRPOConfig.{name}={value!r} is a TRL GRPOConfig option this trainer does not implement: {instead}."
            )
    pad = config.pad_to_multiple_of
    if isinstance(pad, str) and pad.strip().lower() in ("none", "null"):
        config.pad_to_multiple_of = None
    elif isinstance(pad, str) and pad.strip().isdigit():  # from a command line
        config.pad_to_multiple_of = int(pad)
    elif not (pad is None or pad == "auto" or (isinstance(pad, int) and not isinstance(pad, bool) and pad >= 1)):
        raise ValueError(f"GRPOConfig.pad_to_multiple_of: must be an int >= 1, 'auto' or None; got {pad!r}")
    if config.loss_type in TRL_LOSS_TYPES and config.loss_type not in LOSS_TYPES:
        raise NotImplementedError(
            f"GRPOConfig.loss_type={config.loss_type!r} is a TRL loss type this trainer does not implement; "
            f"choose one of {LOSS_TYPES}."
        )


# ---- keyword arguments: TRL's names, misspellings ----------------------------------------------------------------
def _init_field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def translate_trl_names(cls: type, kwargs: dict) -> dict:
    """`kwargs` with TRL's names of our knobs (`TRL_ALIASES`, `TRL_DEPRECATED`) renamed to ours; a `TypeError` with
    the closest field name for an unknown keyword."""
    out = dict(kwargs)
    names = _init_field_names(cls)
    # dataclasses.replace passes every field: there, a TRL name is the change asked for and our name the old value
    full_copy = names <= out.keys()
    for trl_name, ours in TRL_DEPRECATED.items():
        if trl_name in out:
            value = out.pop(trl_name)
            if value is not None:
                warnings.warn(
                    f"GRPOConfig: `{trl_name}` is deprecated (TRL removes it in v2.0.0); use `{ours}`.",
                    FutureWarning,
                    stacklevel=3,
                )
                out[ours] = value  # TRL: the deprecated cap overrides the clip_max
    for trl_name, ours in TRL_ALIASES.items():
        if trl_name not in out:
            continue
        value = out.pop(trl_name)
        if ours in out and out[ours] != value and not full_copy:
            raise TypeError(
                f"GRPOConfig got both {trl_name}={value!r} (TRL's name) and {ours}={out[ours]!r}, which are the same "
                "setting; pass only one"
            )
        out[ours] = value
    unknown = [k for k in out if k not in names]
    if unknown:
        known = sorted(names | set(TRL_ALIASES) | set(TRL_DEPRECATED))
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, known, n=1, cutoff=0.6)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]}?)" if close else ""))
        raise TypeError(f"{cls.__name__} got unexpected keyword argument(s): {', '.join(hints)}")
    return out


class TRLKeywords(type):
    """Metaclass of `GRPOConfig` (and its subclasses): construction accepts TRL's names (`translate_trl_names`) and
    answers a misspelled field with a suggestion; `inspect.signature(cls)` shows the dataclass fields."""

    def __call__(cls, *args, **kwargs):
        return super().__call__(*args, **translate_trl_names(cls, kwargs))

    @property
    def __signature__(cls) -> inspect.Signature:
        sig = inspect.signature(cls.__init__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])


def alias_property(ours: str) -> property:
    """A read/write attribute under TRL's name of the field `ours` (one value, either name)."""

    def get(self):
        return getattr(self, ours)

    def set_(self, value):
        setattr(self, ours, value)

    return property(get, set_, doc=f"TRL's name of `{ours}` (same value).")
