"""Every field of the installed `trl.GRPOConfig` is accepted by ours with TRL's meaning and default. A value other
than TRL's default is refused (`NotImplementedError`) or honoured, and an honoured one is observed where it acts: in
what the trainer's components receive (`wiring`), on the model `prepare_models` returns, or on a real trainer."""

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
#: Honoured TRL fields, each with where its effect is observed. `WIRED`: what the trainer's components receive, built
#: by the trainer's own construction helpers (`wiring` below): field → (key of `wiring(config)`, the value the probe
#: `NON_DEFAULT[field]`, or the third element when given, puts there; the same config with the field at TRL's default
#: puts something else there).
WIRED = {
    # the sampler's parameters and the round producer (ProducerSettings.from_config)
    "temperature": ("producer.sampling.temperature", 0.7),
    "top_p": ("producer.sampling.top_p", 0.9),
    "top_k": ("producer.sampling.top_k", 20),
    "min_p": ("producer.sampling.min_p", 0.05),
    "repetition_penalty": ("producer.sampling.repetition_penalty", 1.1),
    "generation_kwargs": ("producer.sampling.extra.suppress_tokens", [5]),
    "max_completion_length": ("producer.sampling.max_tokens", 64),
    "chat_template_kwargs": ("producer.chat_template_kwargs.enable_thinking", False),
    "scale_rewards": ("producer.scale_rewards", "none"),  # TRL's False
    "multi_objective_aggregation": ("producer.multi_objective_aggregation", "normalize_then_sum"),
    "num_generations_eval": ("producer.num_generations_eval", 2),  # TRL's None: num_generations (4)
    "mask_truncated_completions": ("producer.mask_truncated_completions", True),
    # importance sampling against the sampler (ConsumerSettings.from_config), TRL's names of our knobs
    "vllm_importance_sampling_correction": ("importance_sampling.on", False),
    "vllm_importance_sampling_mode": ("consumer.importance_sampling_mode", "token_truncate"),
    "vllm_importance_sampling_clip_max": ("consumer.importance_sampling_clip_max", 2.0),
    "vllm_importance_sampling_clip_min": ("consumer.importance_sampling_clip_min", 0.5),
    "vllm_importance_sampling_cap": ("consumer.importance_sampling_clip_max", 2.0),  # deprecated name of clip_max
    # the round schedule (SchedulerSettings.from_config): 4 rows per micro-step, so 8 rows = 2 micro-steps
    "generation_batch_size": ("scheduler.steps_per_generation", 2),
    "steps_per_generation": ("scheduler.steps_per_generation", 2),
    "num_iterations": ("scheduler.num_iterations", 2),
    # the loss (PolicyObjective.from_config, as the trainer builds it)
    "beta": ("loss.beta", 0.04),
    "epsilon": ("loss.epsilon_low", 0.3),
    "epsilon_high": ("loss.epsilon_high", 0.28),
    "loss_type": ("loss.loss_type", "grpo"),
    "delta": ("loss.delta", 1.5),
    "sapo_temperature_neg": ("loss.sapo_temperature_neg", 2.0),
    "sapo_temperature_pos": ("loss.sapo_temperature_pos", 2.0),
    "vespo_k_pos": ("loss.vespo_k_pos", 1.0),
    "vespo_lambda_pos": ("loss.vespo_lambda_pos", 1.0),
    "vespo_k_neg": ("loss.vespo_k_neg", 1.0),
    "vespo_lambda_neg": ("loss.vespo_lambda_neg", 1.0),
    "importance_sampling_level": ("loss.importance_sampling_level", "sequence"),
    "off_policy_mask_threshold": ("loss.off_policy_mask_threshold", 0.5),
    "use_bias_correction_kl": ("loss.use_bias_correction_kl", False),
    "top_entropy_quantile": ("entropy.top_entropy_quantile", 0.2),
    "entropy_coef": ("entropy.coef", 0.01),
    "use_adaptive_entropy": ("entropy.adaptive", True),
    "entropy_coef_min": ("entropy.coef_min", 0.1),
    "entropy_coef_max": ("entropy.coef_max", 0.5),
    "entropy_coef_delta": ("entropy.delta", 0.01),
    "entropy_target": ("entropy.target", 1.0),
    "router_aux_loss_coef": ("aux_loss.coef", 0.01),  # TRL's None: the MoE model config's own (0.001 here)
    # the reward weights (trainer_setup.reward_weights_tensor), one reward function: probed with [2.0], since the
    # NON_DEFAULT probe [1.0] is also what TRL's None means for one function
    "reward_weights": ("rewards.weights", [2.0], [2.0]),
    # the generation backend and its servers (TRL's switches)
    "use_vllm": ("backend.name", "vllm_server"),  # with vllm_mode='server'
    "vllm_mode": ("backend.name", "vllm_server"),  # with use_vllm=True ('colocate': 'vllm')
    "vllm_server_host": ("backend.urls", ["http://10.0.0.1:8000"]),
    "vllm_server_port": ("backend.urls", ["http://0.0.0.0:9000"]),
    "vllm_server_base_url": ("backend.urls", ["http://127.0.0.1:8000"]),
    # TR-DPO reference updates (the trainer adds RefModelSyncCallback.from_config when sync_ref_model)
    "sync_ref_model": ("ref_sync.on", True),
    "ref_model_mixup_alpha": ("ref_sync.alpha", 0.5),
    "ref_model_sync_steps": ("ref_sync.sync_steps", 10),
    # tools= (trainer_setup.make_environment): 3 tool calls = 4 assistant turns (TRL's None: max_completion_length)
    "max_tool_calling_iterations": ("tools.max_turns", 4),
}
#: honoured fields whose effect shows on the model `trainer_setup.prepare_models` returns (`test_model_fields_*`)
MODEL = ("disable_dropout", "cast_lm_head_to_fp32", "model_init_kwargs")
#: honoured fields whose effect shows on a real `GRPOTrainer` (`test_trainer_fields_*`)
TRAINER = ("learning_rate", "lr_scheduler_kwargs", "remove_unused_columns", "shuffle_dataset")
#: honoured fields whose effect another test observes, on a path that needs an engine, a server or a training run
ELSEWHERE = {
    "log_completions": "tests/test_logging.py::test_console_table_names_each_reward_and_the_policy_version",
    "log_unique_prompts": "tests/test_trl_dropin.py::test_log_unique_prompts_prints_one_completion_per_prompt",
    "trust_remote_code": "tests/test_security.py::test_model_with_custom_code_is_refused_and_its_code_never_runs",
    "vllm_server_timeout": "tests/test_vllm_training.py::"
    "test_killing_the_only_server_mid_training_fails_clearly_within_the_timeout",
    "pad_to_multiple_of": "tests/test_trl_last_mile.py::"
    "test_pad_to_multiple_of_pads_the_trained_micro_batches_and_trains_the_same",
}
#: honoured fields no test here observes yet, and why (TrainingArguments' own, applied by `transformers.Trainer`, or
#: an effect the CPU build cannot show)
NOT_OBSERVED = {
    "logging_steps": "TrainingArguments: applied by transformers.Trainer during train()",
    "gradient_checkpointing": "TrainingArguments: applied by transformers.Trainer when train() starts",
    "bf16": "TrainingArguments: mixed precision set up by transformers.Trainer / accelerate",
    "torch_empty_cache_steps": "TrainingArguments: empties the CUDA/XPU/MPS cache; nothing to observe on CPU",
    "vllm_gpu_memory_utilization": "the in-process engine's memory share; observing it needs a vLLM engine",
    "vllm_max_model_length": "the in-process engine's max_model_len; observing it needs a vLLM engine (tests/"
    "test_determinism.py runs one with it set, but does not check it)",
    "num_completions_to_print": "rows of the console table; observing it needs a training run's console",
}
#: TRL fields accepted at any value because they mean nothing for this text-only trainer: the config's help says
#: "no effect", and every component receives the same with either value
NO_EFFECT = ("log_multimodal",)
HONOURED = set(WIRED) | set(MODEL) | set(TRAINER) | set(ELSEWHERE) | set(NOT_OBSERVED)


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
        # the reason opens with both defaults, as they are: "<ours> here (TRL: <TRL's>"
        ours, theirs = _default(OUR_FIELDS[name]), _default(TRL_FIELDS[name])
        assert DEFAULT_DIFFERENCES[name].startswith(f"{ours} here (TRL: {theirs}"), (name, ours, theirs)
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
            GRPOConfig(output_dir=str(tmp_path), **BASE, **kw)
    except NotImplementedError as e:
        assert f"GRPOConfig.{name}" in str(e), str(e)
        assert name in UNSUPPORTED_TRL_FIELDS or name == "use_bias_correction_kl", name
        return
    assert name not in UNSUPPORTED_TRL_FIELDS, f"{name} is listed unsupported but {NON_DEFAULT[name]!r} was accepted"
    assert name in HONOURED or name in NO_EFFECT, (
        f"{name}={NON_DEFAULT[name]!r} was accepted but nothing honours it: refuse it instead"
    )


# ---- honoured means: the trainer's components receive it ---------------------------------------------------------
def _add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first integer
        b: second integer
    """
    return a + b


def _moe_config():
    """A tiny Mixture-of-Experts model config (never instantiated): the MoE load-balancing loss reads it."""
    from transformers import MixtralConfig

    return MixtralConfig(num_hidden_layers=1, hidden_size=8, intermediate_size=8, num_local_experts=4)


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def wiring(c) -> dict:
    """What the trainer's components receive from config `c`, built with the trainer's own construction helpers."""
    import torch

    from grpo_async.algo.objective import InForwardImportanceSampling, PolicyObjective, SingleProcess
    from grpo_async.algo.ref_sync import RefModelSyncCallback
    from grpo_async.pipeline.consumer import ConsumerSettings
    from grpo_async.pipeline.producer import ProducerSettings
    from grpo_async.pipeline.scheduler import SchedulerSettings
    from grpo_async.trainer_setup import make_environment, reward_weights_tensor

    objective = PolicyObjective.from_config(c, _moe_config(), SingleProcess())
    entropy = objective.entropy
    ref_sync = RefModelSyncCallback.from_config(c, torch.nn.Linear(1, 1), lambda: None)
    return _flat(
        {
            "producer": dataclasses.asdict(ProducerSettings.from_config(c)),
            "consumer": dataclasses.asdict(ConsumerSettings.from_config(c)),
            "scheduler": dataclasses.asdict(SchedulerSettings.from_config(c)),
            "loss": dataclasses.asdict(objective.settings),
            "entropy": {
                "top_entropy_quantile": objective.top_entropy_quantile,
                **{k: getattr(entropy, k) for k in ("coef", "adaptive", "coef_min", "coef_max", "delta", "target")},
            },
            "aux_loss": {"coef": objective.aux_loss_coef, "router": objective.router},
            # π_old / π_sampler weighs the rows: the consumer's (after its π_old pass) or the training objective's
            "importance_sampling": {
                "on": ConsumerSettings.from_config(c).importance_sampling_correction
                or InForwardImportanceSampling.from_config(c) is not None
            },
            "backend": {"name": c.generation_backend, "urls": c.server_urls},
            "ref_sync": {"on": c.sync_ref_model, "alpha": ref_sync.alpha, "sync_steps": ref_sync.sync_steps},
            "tools": {"max_turns": make_environment(None, [_add], args=c).max_turns},
            "rewards": {"weights": reward_weights_tensor(c.reward_weights, 1).tolist()},
        }
    )


def _config(tmp_path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return GRPOConfig(output_dir=str(tmp_path), **BASE, **kw)


@pytest.mark.parametrize("name", sorted(WIRED))
def test_honoured_field_reaches_the_trainers_components(name, tmp_path):
    """The probe value lands where `WIRED` says; the same config with the field at TRL's default does not put it
    there (so the probe, not the rest of the config, made the difference)."""
    key, want, *value = WIRED[name]
    kw = {**_probe_kwargs(name), **({name: value[0]} if value else {})}
    probe = wiring(_config(tmp_path, **kw))
    at_default = wiring(_config(tmp_path, **{**kw, name: _default(TRL_FIELDS[name])}))
    assert key in probe and probe[key] == want, (name, key, probe.get(key))
    assert at_default.get(key) != want, (name, key, at_default.get(key))


def test_no_effect_fields_say_so_and_change_nothing(tmp_path):
    for name in NO_EFFECT:
        assert "no effect" in OUR_FIELDS[name].metadata["help"].lower(), name
        default = _default(TRL_FIELDS[name])
        assert wiring(_config(tmp_path, **{name: not default})) == wiring(_config(tmp_path, **{name: default}))


def test_every_honoured_field_has_one_observation():
    groups = [set(WIRED), set(MODEL), set(TRAINER), set(ELSEWHERE), set(NOT_OBSERVED)]
    assert sum(len(g) for g in groups) == len(HONOURED), "a field is listed in two groups"
    assert not HONOURED & set(NO_EFFECT)
    assert not HONOURED & set(UNSUPPORTED_TRL_FIELDS)


@pytest.mark.parametrize("name", sorted(ELSEWHERE))
def test_elsewhere_names_a_test_that_sets_the_field(name):
    """The named test exists, and the field is set in its file (the test observes the effect, not this one)."""
    import ast
    import os

    path, test = ELSEWHERE[name].split("::")
    src = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)).read()
    assert test in {n.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)}, ELSEWHERE[name]
    assert name in src, (name, path)


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
    c = GRPOConfig(output_dir=str(tmp_path), **BASE, loss_type=loss, importance_sampling_mode=mode)
    assert wiring(c)["loss.loss_type"] == loss  # the loss the trainer's objective computes


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
    assert wiring(c)[f"consumer.{ours}"] == value  # what the round consumer's importance sampling receives
    # one knob, one field: a copy carries it once, and changing our name changes what TRL's name reads
    assert trl_name not in {f.name for f in dataclasses.fields(c)}
    assert getattr(dataclasses.replace(c), ours) == value
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
    assert wiring(c)["producer.scale_rewards"] == ours  # how the round producer normalises the advantages
    assert dataclasses.replace(c).scale_rewards == ours  # a copy keeps our name of it


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


# ---- honoured fields seen on the model and on a real trainer ------------------------------------------------------
def _prepared(model, tokenizer, config):
    """The policy as the trainer prepares it (`trainer_setup.prepare_models`, called by `GRPOTrainer.__init__`)."""
    from grpo_async.trainer_setup import prepare_models

    return prepare_models(model, config, tokenizer, None)[0]


def test_model_fields_disable_dropout(tiny_model_path, tmp_path):
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)

    def dropout_ps(disable_dropout: bool) -> set[float]:
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=1, n_positions=64, vocab_size=len(tokenizer)))
        model = _prepared(gpt2, tokenizer, _config(tmp_path, disable_dropout=disable_dropout))
        return {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}

    assert dropout_ps(False) == {0.1}  # TRL's default: GPT-2's dropout (0.1 everywhere) stays
    assert dropout_ps(True) == {0.0}


def test_model_fields_model_init_kwargs_and_cast_lm_head_to_fp32(tiny_model_path, tmp_path):
    import torch

    def dtypes(**kw) -> tuple[torch.dtype, torch.dtype]:
        """(a decoder layer's weights, the LM head's weights) of the tiny Llama loaded by name."""
        model = _prepared(tiny_model_path, None, _config(tmp_path, **kw))
        return model.model.layers[0].mlp.up_proj.weight.dtype, model.get_output_embeddings().weight.dtype

    bf16 = {"dtype": "bfloat16"}
    assert dtypes() == (torch.float32, torch.float32)  # TRL's defaults: the float32 checkpoint as saved
    assert dtypes(model_init_kwargs=bf16) == (torch.bfloat16, torch.bfloat16)  # from_pretrained(dtype=bfloat16)
    assert dtypes(model_init_kwargs=bf16, cast_lm_head_to_fp32=True) == (torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def trl_default_and_probe_trainers(tiny_model_path, tmp_path_factory):
    """Two real trainers on the tiny model: `TRAINER`'s fields at TRL's defaults, and at probe values."""
    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    at = {
        "default": {f: _default(TRL_FIELDS[f]) for f in TRAINER},
        "probe": {
            "learning_rate": 1e-5,
            "lr_scheduler_kwargs": {"num_cycles": 2},
            "remove_unused_columns": True,
            "shuffle_dataset": False,
        },
    }
    trainers = {}
    for which, fields in at.items():
        args = tiny_config(tmp_path_factory.mktemp(which), lr_scheduler_type="cosine_with_restarts", **fields)
        trainers[which] = GRPOTrainer(
            model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64)
        )
    yield trainers
    for t in trainers.values():
        t.close()


def test_trainer_fields_learning_rate_and_lr_scheduler_kwargs(trl_default_and_probe_trainers):
    for which, lr, half_way in (("default", 1e-6, 0.5), ("probe", 1e-5, 1.0)):
        t = trl_default_and_probe_trainers[which]
        optimizer = t.create_optimizer()
        assert optimizer.param_groups[0]["lr"] == lr, which
        scheduler = t.create_scheduler(num_training_steps=10, optimizer=optimizer)
        # cosine with hard restarts, no warm-up, step 5 of 10: 0.5 · (1 + cos(π · ((cycles · 0.5) mod 1)))
        # 1 cycle (TRL's default: no kwargs): 0.5 · (1 + cos(π/2)) = 0.5; 2 cycles: 0.5 · (1 + cos(0)) = 1.0
        assert scheduler.lr_lambdas[0](5) == pytest.approx(half_way), which


def test_trainer_fields_remove_unused_columns_and_shuffle_dataset(trl_default_and_probe_trainers):
    from grpo_async.demo_task import make_dataset

    prompts = make_dataset(64)["prompt"]
    first = {w: next(iter(t.get_train_dataloader())) for w, t in trl_default_and_probe_trainers.items()}
    # the first round: 8 rows × 2 micro-steps = 16 rows = 4 prompts × G 4
    assert {k for row in first["default"] for k in row} == {"prompt", "letter"}  # TRL's default keeps the columns
    assert {k for row in first["probe"] for k in row} == {"prompt"}  # the reward's `letter` column is dropped
    assert [row["prompt"] for row in first["probe"]] == [p for p in prompts[:4] for _ in range(4)]  # in order
    assert [row["prompt"] for row in first["default"]][::4] != prompts[:4]  # shuffled (seed 0)
