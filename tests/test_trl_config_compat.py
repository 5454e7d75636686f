"""Every field of the installed `trl.GRPOConfig` is accepted by ours with TRL's meaning and default."""

import dataclasses
import warnings

import pytest

trl = pytest.importorskip("trl")

from grpo_async import GRPOConfig  # noqa: E402
from grpo_async.algo.loss import LOSS_TYPES  # noqa: E402
from grpo_async.config import (  # noqa: E402
    DEFAULT_DIFFERENCES,
    TRL_ALIASES,
    TRL_DEPRECATED,
    TRL_LOSS_TYPES,
    UNSUPPORTED_TRL_FIELDS,
)

BASE = dict(use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=4)

#: fields whose values are set in BASE or that describe where this test runs, not the method
SKIP = {"output_dir", "use_cpu", "report_to", "per_device_train_batch_size", "num_generations"}


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


TRL_FIELDS = {f.name: f for f in dataclasses.fields(trl.GRPOConfig) if f.init}
OUR_FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}

#: a value other than TRL's default for each TRL field of GRPOConfig itself (TrainingArguments' own are TA's business)
NON_DEFAULT = {
    "router_aux_loss_coef": 0.01,
    "cast_lm_head_to_fp32": True,
    "num_generations_eval": 2,
    "ds3_gather_for_generation": False,
    "pad_to_multiple_of": 64,
    "generation_kwargs": {"suppress_tokens": [5]},
    "chat_template_kwargs": {"enable_thinking": False},
    "repetition_penalty": 1.1,
    "cache_implementation": "static",
    "vllm_model_impl": "transformers",
    "vllm_enable_sleep_mode": True,
    "vllm_structured_outputs_regex": "[0-9]+",
    "vllm_server_host": "10.0.0.1",
    "vllm_server_port": 9000,
    "vllm_group_port": 51217,
    "vllm_tensor_parallel_size": 2,
    "delta": 1.5,
    "sapo_temperature_neg": 2.0,
    "sapo_temperature_pos": 2.0,
    "vespo_k_pos": 1.0,
    "vespo_lambda_pos": 1.0,
    "vespo_k_neg": 1.0,
    "vespo_lambda_neg": 1.0,
    "importance_sampling_level": "sequence",
    "multi_objective_aggregation": "normalize_then_sum",
    "sync_ref_model": True,
    "ref_model_mixup_alpha": 0.5,
    "ref_model_sync_steps": 10,
    "top_entropy_quantile": 0.2,
    "entropy_coef": 0.01,
    "use_adaptive_entropy": True,
    "entropy_coef_min": 0.1,
    "entropy_coef_max": 0.5,
    "entropy_coef_delta": 0.01,
    "entropy_target": 1.0,
    "max_tool_calling_iterations": 3,
    "vllm_importance_sampling_correction": False,
    "vllm_importance_sampling_mode": "token_truncate",
    "vllm_importance_sampling_clip_max": 2.0,
    "vllm_importance_sampling_clip_min": 0.5,
    "off_policy_mask_threshold": 0.5,
    "use_bias_correction_kl": False,
    "log_multimodal": False,
    "log_unique_prompts": True,
    "log_completions_hub_repo": "me/completions",
    "use_transformers_continuous_batching": True,
    "transformers_continuous_batching_config": {"max_batch_tokens": 256},
    "use_transformers_paged": True,
    "vllm_importance_sampling_cap": 2.0,
    "use_liger_kernel": True,
    "learning_rate": 1e-5,
    "logging_steps": 5,
    "gradient_checkpointing": True,
    "disable_dropout": False,
    "remove_unused_columns": True,
    "model_init_kwargs": {"dtype": "float32"},
    "trust_remote_code": True,
    "max_completion_length": 64,
    "shuffle_dataset": False,
    "generation_batch_size": 8,
    "steps_per_generation": 2,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "use_vllm": True,
    "vllm_mode": "server",
    "vllm_server_base_url": "http://127.0.0.1:8000",
    "vllm_server_timeout": 10.0,
    "vllm_gpu_memory_utilization": 0.5,
    "vllm_max_model_length": 1024,
    "beta": 0.04,
    "num_iterations": 2,
    "epsilon": 0.3,
    "epsilon_high": 0.28,
    "scale_rewards": False,
    "loss_type": "grpo",
    "mask_truncated_completions": True,
    "reward_weights": [1.0],
    "log_completions": True,
    "num_completions_to_print": 2,
    "bf16": False,
    "lr_scheduler_kwargs": {"num_cycles": 1},
    "torch_empty_cache_steps": 10,
}
#: TRL fields whose non-default value this trainer honours (the rest of NON_DEFAULT must raise NotImplementedError):
#: a field that is neither honoured nor refused would be silently ignored
HONOURED = {
    "vllm_server_host",  # → server_urls
    "vllm_server_port",  # → server_urls
    "vllm_importance_sampling_correction",  # aliases of our importance_sampling_* knobs
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",  # deprecated: sets importance_sampling_clip_max
    "use_bias_correction_kl",  # the loss family (tests/test_loss_trl_parity.py)
    "router_aux_loss_coef",
    "delta",
    "sapo_temperature_neg",
    "sapo_temperature_pos",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "importance_sampling_level",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "entropy_coef_min",
    "entropy_coef_max",
    "entropy_coef_delta",
    "entropy_target",
    "off_policy_mask_threshold",
    "log_multimodal",  # text-only trainer: nothing multimodal to log either way
    "num_generations_eval",  # completions per eval prompt (tests/test_trl_features.py)
    "multi_objective_aggregation",  # GDPO advantages (tests/test_trl_features.py)
    "sync_ref_model",  # TR-DPO reference updates (tests/test_trl_features.py)
    "ref_model_mixup_alpha",  # used by sync_ref_model, as in TRL
    "ref_model_sync_steps",
    "generation_kwargs",  # passed to the sampler (tests/test_trl_dropin.py)
    "cast_lm_head_to_fp32",  # float32 LM head (tests/test_trl_dropin.py)
    "log_unique_prompts",  # one console row per prompt (tests/test_trl_dropin.py)
    "chat_template_kwargs",  # every apply_chat_template call (tests/test_trl_dropin.py)
    "max_tool_calling_iterations",  # tools= / environment_factory turn bound (tests/test_trl_dropin.py)
    "repetition_penalty",  # passed to the sampler (tests/test_trl_dropin.py)
    "learning_rate",
    "logging_steps",
    "gradient_checkpointing",
    "disable_dropout",
    "remove_unused_columns",
    "model_init_kwargs",
    "trust_remote_code",
    "max_completion_length",
    "shuffle_dataset",
    "generation_batch_size",
    "steps_per_generation",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "use_vllm",
    "vllm_mode",
    "vllm_server_base_url",
    "vllm_server_timeout",
    "vllm_gpu_memory_utilization",
    "vllm_max_model_length",
    "beta",
    "num_iterations",
    "epsilon",
    "epsilon_high",
    "scale_rewards",
    "loss_type",
    "mask_truncated_completions",
    "reward_weights",
    "log_completions",
    "num_completions_to_print",
    "bf16",
    "lr_scheduler_kwargs",
    "torch_empty_cache_steps",
}
#: the value a TRL-set field reads back as here, when it is not the value itself (TRL translates these too)
READ_BACK = {"scale_rewards": "none"}


def _trl_own_fields():
    """TRL's GRPOConfig fields (and its base config's overrides of TrainingArguments), not TrainingArguments' own."""
    from transformers import TrainingArguments

    ta = {f.name: _default(f) for f in dataclasses.fields(TrainingArguments)}
    return sorted(n for n, f in TRL_FIELDS.items() if n not in ta or ta[n] != _default(f) or n == "use_liger_kernel")


def test_every_trl_field_has_a_non_default_probe():
    missing = [n for n in _trl_own_fields() if n not in NON_DEFAULT and n not in SKIP]
    assert not missing, f"TRL fields without a probe value in NON_DEFAULT: {missing}"


@pytest.mark.parametrize("name", sorted(set(TRL_FIELDS) - SKIP))
def test_trl_default_is_accepted(name, tmp_path):
    """(a) every TRL field is accepted at TRL's default, and (b) means the same as our default unless documented."""
    trl_default = _default(TRL_FIELDS[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        c = GRPOConfig(output_dir=str(tmp_path), **BASE, **{name: trl_default})
    if name in TRL_DEPRECATED:
        return  # input-only: TRL's default (None) means "not given"
    ours = TRL_ALIASES.get(name, name)
    if name in DEFAULT_DIFFERENCES:
        assert _default(OUR_FIELDS[ours]) != trl_default, f"{name} is listed in DEFAULT_DIFFERENCES but matches TRL"
        return
    if name in TRL_ALIASES:
        assert _default(OUR_FIELDS[ours]) == trl_default
        assert getattr(c, name) == getattr(c, ours) == trl_default
        return
    assert name in OUR_FIELDS
    # a field TRL resolves in __post_init__ (generation_batch_size, steps_per_generation, epsilon_high, ...) is
    # resolved here too; compare the declared defaults
    assert _default(OUR_FIELDS[name]) == trl_default, (
        f"{name}: ours {_default(OUR_FIELDS[name])!r} vs TRL {trl_default!r}; add it to DEFAULT_DIFFERENCES "
        "with the reason, or match TRL"
    )


def test_default_differences_name_real_fields_and_trl_values_still_work(tmp_path):
    for name in DEFAULT_DIFFERENCES:
        assert name in TRL_FIELDS and name in OUR_FIELDS, name
        assert DEFAULT_DIFFERENCES[name].strip()
    c = GRPOConfig(output_dir=str(tmp_path), **BASE, bf16=None, min_p=None, num_completions_to_print=None)
    assert c.bf16 is True and c.min_p == 0.0 and c.num_completions_to_print is None  # TRL's meanings


def _probe_kwargs(name):
    value = NON_DEFAULT[name]
    extra = {}
    if name in ("use_vllm", "vllm_mode", "vllm_server_host", "vllm_server_port", "vllm_server_base_url"):
        extra = {"use_vllm": True, "vllm_mode": "server"}
    if name == "sync_ref_model":  # TRL refuses it with beta=0 (no reference model to synchronize)
        extra = {"beta": 0.04}
    return {name: value, **extra}


@pytest.mark.parametrize("name", sorted(n for n in NON_DEFAULT if n in TRL_FIELDS))
def test_trl_non_default_works_or_raises_not_implemented(name, tmp_path):
    """(c) a value other than TRL's default is honoured or refused with NotImplementedError naming the field."""
    kw = _probe_kwargs(name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            c = GRPOConfig(output_dir=str(tmp_path), **BASE, **kw)
    except NotImplementedError as e:
        assert f"GRPOConfig.{name}" in str(e), str(e)
        assert name in UNSUPPORTED_TRL_FIELDS or name == "use_bias_correction_kl", name
        return
    assert name not in UNSUPPORTED_TRL_FIELDS, f"{name} is listed unsupported but {NON_DEFAULT[name]!r} was accepted"
    assert name in HONOURED, f"{name}={NON_DEFAULT[name]!r} was accepted but nothing honours it: refuse it instead"
    want = READ_BACK.get(name, NON_DEFAULT[name])
    if name == "vllm_importance_sampling_cap":
        assert c.importance_sampling_clip_max == NON_DEFAULT[name]
        return
    assert getattr(c, name) == want, (name, getattr(c, name), want)


@pytest.mark.parametrize("name", UNSUPPORTED_TRL_FIELDS)
def test_unsupported_fields_say_what_to_do(name, tmp_path):
    with pytest.raises(NotImplementedError, match=rf"GRPOConfig\.{name}=.*does not implement: \S"):
        GRPOConfig(output_dir=str(tmp_path), **BASE, **{name: NON_DEFAULT[name]})


def test_use_liger_kernel_is_refused_not_ignored(tmp_path):
    with pytest.raises(NotImplementedError, match="use_liger_kernel.*use_kernels"):
        GRPOConfig(output_dir=str(tmp_path), **BASE, use_liger_kernel=True)


def test_bias_corrected_kl_is_trls_default_with_and_without_kl(tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path), **BASE, beta=0.1).use_bias_correction_kl is True
    assert not GRPOConfig(
        output_dir=str(tmp_path), **BASE, use_bias_correction_kl=False, beta=0.1
    ).use_bias_correction_kl


@pytest.mark.parametrize("loss", TRL_LOSS_TYPES)
def test_every_trl_loss_type_is_implemented(loss, tmp_path):
    assert loss in LOSS_TYPES
    mode = "token_mask" if loss == "vespo" else "sequence_mask"  # VESPO takes token-level IS ratios (as TRL)
    assert (
        GRPOConfig(output_dir=str(tmp_path), **BASE, loss_type=loss, importance_sampling_mode=mode).loss_type == loss
    )


# ---- TRL's names of our knobs ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "trl_name,value,other",
    [
        ("vllm_importance_sampling_correction", False, True),
        ("vllm_importance_sampling_mode", "token_mask", "token_truncate"),
        ("vllm_importance_sampling_clip_max", 5.0, 4.0),
        ("vllm_importance_sampling_clip_min", 0.1, None),
    ],
)
def test_trl_alias_lands_in_our_knob(trl_name, value, other, tmp_path):
    ours = TRL_ALIASES[trl_name]
    c = GRPOConfig(output_dir=str(tmp_path), **BASE, **{trl_name: value})
    assert getattr(c, ours) == value and getattr(c, trl_name) == value
    # one knob, one field: a copy carries it once, and changing our name changes what TRL's name reads
    assert trl_name not in {f.name for f in dataclasses.fields(c)}
    assert dataclasses.replace(c) == c
    assert getattr(dataclasses.replace(c, **{ours: other}), trl_name) == other
    assert getattr(dataclasses.replace(c, **{trl_name: other}), ours) == other  # TRL users copy with TRL's names
    c.__setattr__(trl_name, other)  # TRL's name is settable too
    assert getattr(c, ours) == other


def test_trl_alias_and_our_name_together_must_agree(tmp_path):
    GRPOConfig(
        output_dir=str(tmp_path),
        **BASE,
        importance_sampling_mode="token_mask",
        vllm_importance_sampling_mode="token_mask",
    )
    with pytest.raises(TypeError, match="vllm_importance_sampling_mode.*importance_sampling_mode.*same setting"):
        GRPOConfig(
            output_dir=str(tmp_path),
            **BASE,
            importance_sampling_mode="token_mask",
            vllm_importance_sampling_mode="sequence_truncate",
        )


def test_deprecated_cap_sets_clip_max_with_a_warning(tmp_path):
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap"):
        c = GRPOConfig(output_dir=str(tmp_path), **BASE, vllm_importance_sampling_cap=2.5)
    assert c.importance_sampling_clip_max == c.vllm_importance_sampling_clip_max == 2.5


@pytest.mark.parametrize("value,ours", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_scale_rewards_accepts_trl_booleans(value, ours, tmp_path):
    c = GRPOConfig(output_dir=str(tmp_path), **BASE, scale_rewards=value)
    assert c.scale_rewards == ours
    assert dataclasses.replace(c) == c


def test_trl_server_host_and_port_become_the_server_url(tmp_path):
    c = GRPOConfig(output_dir=str(tmp_path), **BASE, use_vllm=True, vllm_mode="server", vllm_server_port=8123)
    assert c.generation_backend == "vllm_server" and c.server_urls == ["http://0.0.0.0:8123"]
    c = GRPOConfig(
        output_dir=str(tmp_path), **BASE, use_vllm=True, vllm_mode="server", vllm_server_base_url="http://h:1"
    )
    assert c.server_urls == ["http://h:1"]  # TRL: the base URL wins over host/port


def test_generation_batch_size_and_steps_per_generation_follow_trl(tmp_path):
    """TRL: either may be set, not both (we accept both when they agree: a saved config reads back)."""
    ours = GRPOConfig(output_dir=str(tmp_path), **BASE, generation_batch_size=8)
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), **BASE, generation_batch_size=8)
    assert (ours.generation_batch_size, ours.steps_per_generation) == (
        theirs.generation_batch_size,
        theirs.steps_per_generation,
    )
    ours = GRPOConfig(output_dir=str(tmp_path), **BASE, steps_per_generation=3)
    theirs = trl.GRPOConfig(output_dir=str(tmp_path), **BASE, steps_per_generation=3)
    assert (
        (ours.generation_batch_size, ours.steps_per_generation)
        == (12, 3)
        == (
            theirs.generation_batch_size,
            theirs.steps_per_generation,
        )
    )
