"""The config's declarative validation (`grpo_async/config/checks.py`, `rules.py`): every cross-field rule of
`RULES` and every per-field constraint is refused with an error naming the fields."""

import dataclasses
import re

import pytest

from grpo_async import GRPOConfig
from grpo_async.config import RULES
from grpo_async.config.checks import InstanceOf, Number, OneOf, field_check

BASE = dict(output_dir="/tmp/grpo-async-config-rules", use_cpu=True, report_to=[], per_device_train_batch_size=4)

#: a config violating each rule (and only that one), added to BASE
VIOLATIONS = {
    "round_is_whole_micro_steps": {"generation_batch_size": 6, "num_generations": 2},  # micro-step: 4 rows
    "round_and_steps_agree": {"generation_batch_size": 8, "steps_per_generation": 3},  # 8 rows = 2 micro-steps
    "round_holds_whole_groups": {"num_generations": 3},  # 4 rows per round
    "rollout_chunks_full": {"num_generations": 4, "rollout_micro_batch_size": 3},
    "ref_logps_chunks_full": {"num_generations": 4, "ref_logps_micro_batch_size": 8},
    "old_logps_chunks_full": {"num_generations": 4, "old_logps_micro_batch_size": 3},
    "clip_bounds_ordered": {"importance_sampling_clip_min": 2.0, "importance_sampling_clip_max": 1.0},
    "truncation_has_a_bound": {"importance_sampling_mode": "token_truncate", "importance_sampling_clip_max": None},
    "queue_holds_the_rounds_ahead": {"num_batches_ahead": 3, "async_max_queue_size": 2},
    "stream_needs_a_streaming_backend": {"async_mode": "stream"},  # hf generates round by round
    "stream_queue_holds_the_inflight_groups": {  # 2 groups a round: 8 in flight = 4 rounds ahead, 5 held
        "async_mode": "stream",
        "use_vllm": True,
        "vllm_mode": "colocate",
        "max_inflight_groups": 8,
        "async_max_queue_size": 2,
    },
    "entropy_coef_bounds_ordered": {"entropy_coef_min": 0.5, "entropy_coef_max": 0.1},
    "vespo_takes_token_ratios": {"loss_type": "vespo", "use_vllm": True},
    "inflight_needs_a_server": {"weight_sync_inflight": True},  # hf cannot pause a generate call
    "lora_adapter_needs_vllm": {"vllm_lora_sync": "adapter"},  # hf
    "transport_fits_backend": {"weight_sync_transport": "ipc"},  # hf syncs in place
    "delta_needs_a_server_push": {"weight_sync_delta": True},  # hf syncs in place: nothing moves
    "openai_needs_a_url": {"generation_backend": "openai"},
    "router_replay_needs_a_recording_backend": {
        "router_replay": "rollout",
        "generation_backend": "vllm_server",
        "vllm_server_urls": ["http://s:1"],
    },
    "router_replay_without_checkpointing": {"router_replay": "rollout", "gradient_checkpointing": True},
    "ref_server_is_http": {"beta": 0.1, "ref_server_url": "ftp://ref"},
    "ref_server_needs_beta": {"ref_server_url": "http://ref:1"},
    "ref_server_is_not_a_generation_server": {
        "beta": 0.1,
        "generation_backend": "vllm_server",
        "vllm_server_urls": ["http://s:1"],
        "ref_server_url": "http://s:1/",
    },
    "staleness_needs_a_weight_sync": {"weight_sync_transport": "none", "max_staleness": 2},
    "stream_pacing_fits_a_round": {  # one optimizer step a round: a stream round's groups lag at least 1
        "async_mode": "stream",
        "use_vllm": True,
        "vllm_mode": "colocate",
        "max_staleness": 0,
    },
    "eval_batch_holds_whole_groups": {"num_generations_eval": 3, "eval_strategy": "steps", "eval_steps": 1},
    "ref_sync_needs_beta": {"sync_ref_model": True},
    "ref_sync_needs_a_local_reference": {"sync_ref_model": True, "beta": 0.1, "ref_server_url": "http://ref:1"},
    "ref_sync_alpha_in_unit_interval": {"sync_ref_model": True, "beta": 0.1, "ref_model_mixup_alpha": 1.5},
    "ref_sync_steps_positive": {"sync_ref_model": True, "beta": 0.1, "ref_model_sync_steps": 0},
}


def test_every_rule_has_a_violation_and_names_are_unique():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    assert set(names) == set(VIOLATIONS), "add a violating config for each rule (and none for a removed one)"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule_refuses_its_violation_naming_its_fields(rule):
    kw = {"num_generations": 2, **VIOLATIONS[rule.name]}
    with pytest.raises(rule.error) as e:
        GRPOConfig(**{**BASE, **kw})
    message = str(e.value)
    assert re.match(rf"GRPOConfig\.({'|'.join(rule.fields)})[:=]", message), message  # blames one of its fields
    for name in rule.fields:  # and names every field it relates
        assert name in message, (name, message)
    # the rule passes on the base config: it refuses the violation, not everything
    assert rule.check(GRPOConfig(**BASE, num_generations=2)) is None


#: a value each per-field constraint refuses (checked against the constraint itself below)
def _violation(check):
    if isinstance(check, OneOf):
        return "no-such-choice"
    if isinstance(check, InstanceOf):
        return "a string" if str not in (check.types if isinstance(check.types, tuple) else (check.types,)) else 3
    if check.ge is not None:
        return check.ge - 1
    if check.gt is not None:
        return check.gt
    return check.le + 1 if check.le is not None else check.lt


CHECKED = [(f.name, field_check(f)) for f in dataclasses.fields(GRPOConfig) if field_check(f) is not None]


def test_constraints_are_declared_for_the_fields_they_guard():
    names = {name for name, _ in CHECKED}
    for name in ("temperature", "num_generations", "loss_type", "weight_sync_transport", "prompt_truncation"):
        assert name in names, name
    assert len(CHECKED) >= 50


@pytest.mark.parametrize("name,check", CHECKED, ids=[name for name, _ in CHECKED])
def test_field_constraint_refuses_a_bad_value_naming_the_field(name, check):
    bad = _violation(check)
    assert not check.accepts(bad)
    with pytest.raises(ValueError, match=rf"^GRPOConfig\.{name}: must be "):
        GRPOConfig(**{**BASE, "num_generations": 2, name: bad})


@pytest.mark.parametrize("check", [Number(ge=1, integer=True), Number(gt=0)])
def test_numbers_refuse_bools_and_strings(check):
    assert not check.accepts(True) and not check.accepts("1") and not check.accepts(None)
    assert Number(ge=1, integer=True).accepts(1) and not Number(ge=1, integer=True).accepts(1.0)


def test_reuse_orders_match_the_pipeline():
    from grpo_async.config.pipeline import REUSE_ORDERS
    from grpo_async.pipeline.rows import REUSE_ORDERS as IMPLEMENTED

    assert REUSE_ORDERS == IMPLEMENTED


def test_registered_backend_is_accepted_by_name_only_after_registration():
    from grpo_async.generation import register_backend, unregister_backend

    with pytest.raises(ValueError, match=r"GRPOConfig\.generation_backend: must be one of .*register_backend"):
        GRPOConfig(**BASE, num_generations=2, generation_backend="my_engine")
    register_backend("my_engine", lambda *a: None, weight_sync=("auto", "none"))
    try:
        assert GRPOConfig(**BASE, num_generations=2, generation_backend="my_engine").generation_backend == "my_engine"
        with pytest.raises(ValueError, match=r"GRPOConfig\.weight_sync_transport: 'ipc' is not possible"):
            GRPOConfig(**BASE, num_generations=2, generation_backend="my_engine", weight_sync_transport="ipc")
        with pytest.raises(ValueError, match=r"async_mode: 'stream' needs a backend that runs prompt groups"):
            GRPOConfig(**BASE, num_generations=2, generation_backend="my_engine", async_mode="stream")
    finally:
        unregister_backend("my_engine")


def test_a_registered_backend_that_declares_it_streams_is_taken_in_stream_mode():
    """Issue 42: a backend added with `register_backend` is not refused in stream mode when it says it streams (its
    spec, the one place the config reads), and its `in_process` flag is what the wiring reads."""
    from grpo_async.generation import backend_spec, register_backend, unregister_backend
    from grpo_async.pipeline.build import generates_on_every_rank

    register_backend("my_streaming_engine", lambda *a: None, ("auto", "none"), streams=True, in_process=True)
    try:
        c = GRPOConfig(**BASE, num_generations=2, generation_backend="my_streaming_engine", async_mode="stream")
        assert c.async_mode == "stream" and backend_spec("my_streaming_engine").streams
        assert generates_on_every_rank(c, num_processes=2) == (c.generation_batch_size // 2 % 2 == 0)
    finally:
        unregister_backend("my_streaming_engine")
    with pytest.raises(ValueError, match="my_streaming_engine' is not available; registered:"):
        backend_spec("my_streaming_engine")


def test_stream_mode_derives_its_bound_and_takes_inflight_updates_on_the_in_process_engine():
    kw = {**BASE, "num_generations": 2, "async_mode": "stream", "use_vllm": True, "vllm_mode": "colocate"}
    c = GRPOConfig(**kw, num_batches_ahead=2)  # a round: 4 rows = 2 groups; 3 rounds held
    assert c.max_inflight_groups == 6
    assert (c.rounds_ahead, c.async_max_queue_size) == (3, 5)  # the stream keeps 6 groups: 3 rounds ahead
    assert (GRPOConfig(**{**kw, "async_mode": "rounds"}, num_batches_ahead=2).rounds_ahead) == 2
    one = GRPOConfig(**kw, max_inflight_groups=1)
    assert (one.max_inflight_groups, one.rounds_ahead) == (1, 1)  # never fewer than num_batches_ahead
    assert GRPOConfig(**kw, max_inflight_groups=5).rounds_ahead == 3  # ceil(5 / 2)
    assert GRPOConfig(**kw, weight_sync_inflight=True).weight_sync_inflight  # the engine loop loads between steps
    with pytest.raises(ValueError, match=r"GRPOConfig\.weight_sync_inflight: .*async_mode='rounds'"):
        GRPOConfig(**{**kw, "async_mode": "rounds"}, weight_sync_inflight=True)
    with pytest.raises(ValueError, match=r"GRPOConfig\.async_mode: 'stream' needs .*generation_backend='hf'"):
        GRPOConfig(**BASE, num_generations=2, async_mode="stream")
