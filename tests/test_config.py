"""Bad configuration is refused at construction, with a message naming the field."""

import copy
import dataclasses
import json
import pickle

import pytest

from grpo_async import GRPOConfig
from grpo_async.config import is_derived

BASE = dict(
    output_dir="/tmp/grpo-async-config-test",
    use_cpu=True,
    report_to=[],
    per_device_train_batch_size=4,
    num_generations=4,
)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"num_generations": 1}, "num_generations"),
        ({"num_generations": 3}, "num_generations"),  # 4 rows per round not divisible by 3; the user set G
        ({"generation_batch_size": 8, "num_generations": 3}, "generation_batch_size"),  # the user set the round
        ({"generation_batch_size": 6}, "generation_batch_size"),  # not a multiple of the micro batch 4
        ({"generation_batch_size": 8, "steps_per_generation": 3}, "generation_batch_size"),  # 8 rows = 2 steps
        ({"rollout_micro_batch_size": 3}, "rollout_micro_batch_size"),  # 4-row round in chunks of 3
        ({"ref_logps_micro_batch_size": 8}, "ref_logps_micro_batch_size"),  # 4 rows per process
        ({"old_logps_micro_batch_size": 3}, "old_logps_micro_batch_size"),
        ({"weight_sync_transport": "none", "max_staleness": 2}, "max_staleness"),  # sampler never updates
        ({"openai_base_url": "http://x", "max_staleness": 0}, "max_staleness"),  # openai + auto: no sync
        ({"vllm_server_urls": "http://s", "generation_backend": "vllm_server"}, "vllm_server_urls"),  # a str
        (
            {"importance_sampling_mode": "token_truncate", "importance_sampling_clip_max": None},
            "importance_sampling_clip_max",
        ),
        ({"num_batches_ahead": -1}, "num_batches_ahead"),
        ({"temperature": 0.0}, "temperature"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"max_prompt_length": -5}, "max_prompt_length"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"scale_rewards": "std"}, "scale_rewards"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"beta": -0.1}, "beta"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"async_generation_timeout": 0}, "async_generation_timeout"),
        ({"num_batches_ahead": 3, "async_max_queue_size": 2}, "async_max_queue_size"),
        ({"generation_backend": "tgi"}, "generation_backend"),
        ({"weight_sync_transport": "carrier-pigeon"}, "weight_sync_transport"),
        ({"openai_base_url": "http://x", "weight_sync_transport": "ipc"}, "weight_sync_transport"),
        ({"use_vllm": True, "weight_sync_transport": "broadcast"}, "weight_sync_transport"),  # in-process engine
        (
            {
                "vllm_server_urls": ["http://s"],
                "use_vllm": True,
                "vllm_mode": "server",
                "weight_sync_transport": "checkpoint_dir",
            },
            "weight_sync_transport",
        ),
        ({"weight_sync_transport": "ipc"}, "weight_sync_transport"),  # hf syncs in place
        ({"weight_sync_inflight": True}, "weight_sync_inflight"),  # hf cannot pause a generate call
        ({"vllm_max_concurrency": 0}, "vllm_max_concurrency"),
        ({"importance_sampling_mode": "tis"}, "importance_sampling_mode"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"importance_sampling_clip_min": 2.0, "importance_sampling_clip_max": 1.0}, "importance_sampling_clip_max"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"prompt_truncation": "middle"}, "prompt_truncation"),
    ],
)
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
        GRPOConfig(**{**BASE, **overrides})


def test_derived_fields_and_trl_style_switches():
    c = GRPOConfig(**BASE, gradient_accumulation_steps=3)
    assert c.steps_per_generation == 3 and c.generation_batch_size == 12
    assert c.epsilon_high == c.epsilon == 0.2
    assert c.async_max_queue_size == c.num_batches_ahead + 2
    assert c.generation_backend == "hf"
    assert GRPOConfig(**BASE, use_vllm=True).generation_backend == "vllm"
    s = GRPOConfig(**BASE, use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:8000")
    assert s.generation_backend == "vllm_server" and s.server_urls == ["http://127.0.0.1:8000"]
    c = GRPOConfig(**BASE, generation_batch_size=8)
    assert c.steps_per_generation == 2


def test_server_urls_keep_user_fields_and_deduplicate():
    c = GRPOConfig(
        **BASE,
        generation_backend="vllm_server",
        vllm_server_urls=["http://a:1", "http://b:2/"],
        vllm_server_base_url="http://b:2",
    )
    assert c.vllm_server_urls == ["http://a:1", "http://b:2/"]  # what the user gave, not rewritten
    assert c.server_urls == ["http://a:1", "http://b:2/"]
    # TRL's host/port apply only when no URL was given
    c = GRPOConfig(**BASE, use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.5", vllm_server_port=9000)
    assert c.server_urls == ["http://10.0.0.5:9000"] and c.vllm_server_urls is None
    assert GRPOConfig(**BASE, use_vllm=True, vllm_mode="server").server_urls == ["http://0.0.0.0:8000"]
    assert GRPOConfig(**BASE).server_urls == []  # hf backend: no servers


@pytest.mark.parametrize(
    "overrides,syncs",
    [
        ({}, True),
        ({"weight_sync_transport": "none"}, False),
        ({"use_vllm": True}, True),
        ({"openai_base_url": "http://x"}, False),  # auto with openai: no sync
        ({"openai_base_url": "http://x", "weight_sync_transport": "checkpoint_dir"}, True),
        ({"openai_base_url": "http://x", "weight_sync_transport": "none"}, False),
    ],
)
def test_syncs_weights(overrides, syncs):
    assert GRPOConfig(**BASE, **overrides).syncs_weights is syncs


def test_staleness_limit_in_policy_versions():
    # 2 rounds ahead, 3 micro-steps per round, μ = 2, 2 micro-steps per optimizer step: 3 steps per round
    c = GRPOConfig(
        **BASE, num_batches_ahead=2, steps_per_generation=3, num_iterations=2, gradient_accumulation_steps=2
    )
    assert c.steps_per_round == 3.0 and c.staleness_limit == 6 and c.max_staleness is None
    # a fractional round (3 micro-steps, 2 per step): 1.5 steps per round, 1 round ahead → ceil = 2
    c = GRPOConfig(**BASE, steps_per_generation=3, gradient_accumulation_steps=2)
    assert c.steps_per_round == 1.5 and c.staleness_limit == 2
    assert GRPOConfig(**BASE, num_batches_ahead=0).staleness_limit == 0  # synchronous
    assert GRPOConfig(**BASE, max_staleness=5).staleness_limit == 5  # explicit wins
    assert GRPOConfig(**BASE, weight_sync_transport="none").staleness_limit is None  # never updates: no limit
    with pytest.raises(ValueError, match="never receives the trainer's weights"):
        GRPOConfig(**BASE, weight_sync_transport="none", max_staleness=3)


class _TwoProcesses(GRPOConfig):
    """Two training processes, without launching them: the stage checks only read `world_size`."""

    @property
    def world_size(self):
        return 2


def test_stage_micro_batches_are_checked_against_their_own_rows():
    # 2 processes × 4 rows × 2 steps = 16 rows per round; each process scores 8 of them
    kw = dict(BASE, gradient_accumulation_steps=2)
    c = _TwoProcesses(**kw, rollout_micro_batch_size=16)  # one generate call per round: accepted
    assert c.generation_batch_size == 16 and c.rollout_micro_batch_size == 16
    _TwoProcesses(**kw, ref_logps_micro_batch_size=8, old_logps_micro_batch_size=2, beta=0.1)
    with pytest.raises(ValueError, match=r"GRPOConfig.ref_logps_micro_batch_size: 16 does not divide the 8 rows"):
        _TwoProcesses(**kw, ref_logps_micro_batch_size=16)
    with pytest.raises(
        ValueError, match=r"GRPOConfig.rollout_micro_batch_size: 6 .* divisor of 16: \[1, 2, 4, 8, 16\]"
    ):
        _TwoProcesses(**kw, rollout_micro_batch_size=6)


def test_misspelled_field_suggests_the_closest():
    with pytest.raises(TypeError, match="did you mean num_generations"):
        GRPOConfig(**BASE, num_generation=4)
    with pytest.raises(TypeError, match="did you mean rollout_micro_batch_size"):
        GRPOConfig(**BASE, rollout_micro_batchsize=4)


def test_subclass_keeps_the_suggestions_and_its_own_fields():
    from dataclasses import dataclass, field

    @dataclass
    class MyConfig(GRPOConfig):
        my_knob: int = field(default=3)

    c = MyConfig(**BASE, my_knob=5, vllm_importance_sampling_mode="token_mask")
    assert c.my_knob == 5 and c.importance_sampling_mode == "token_mask" and c.generation_batch_size == 4
    with pytest.raises(TypeError, match="did you mean my_knob"):
        MyConfig(**BASE, my_knb=5)


def test_batch_error_names_what_the_user_set():
    with pytest.raises(ValueError) as e:
        GRPOConfig(**{**BASE, "num_generations": 3}, gradient_accumulation_steps=2)
    msg = str(e.value)
    assert "per_device_train_batch_size=4" in msg and "gradient_accumulation_steps=2" in msg
    assert "num_generations=3" in msg and "generation_batch_size" not in msg
    with pytest.raises(ValueError, match="steps_per_generation=3"):
        GRPOConfig(**{**BASE, "num_generations": 8}, steps_per_generation=3)


# ---- a config is a value ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "user,values,derived,given",
    [
        # GA 2: 2 micro-steps per round of 4 rows each → 8 rows; ε_high = ε; hf backend; queue = 1 ahead + 2
        (
            {"gradient_accumulation_steps": 2},
            {"steps_per_generation": 2, "generation_batch_size": 8, "epsilon_high": 0.2, "async_max_queue_size": 3},
            ("steps_per_generation", "generation_batch_size", "epsilon_high", "generation_backend"),
            (),
        ),
        # TRL's switches: the backend is derived from use_vllm / vllm_mode, the URL list from the base URL
        (
            {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "http://s:1"},
            {"generation_backend": "vllm_server", "server_urls": ["http://s:1"], "vllm_server_urls": None},
            ("generation_backend",),
            (),
        ),
        # the user set the round (8 rows = 2 micro-steps of 4) and ε_high: given, not derived
        (
            {"generation_batch_size": 8, "epsilon_high": 0.28, "rollout_micro_batch_size": 8},
            {"steps_per_generation": 2, "generation_batch_size": 8, "epsilon_high": 0.28},
            ("steps_per_generation",),
            ("generation_batch_size", "epsilon_high", "rollout_micro_batch_size"),
        ),
    ],
)
def test_replace_without_change_keeps_values_and_what_was_derived(user, values, derived, given):
    copied = dataclasses.replace(GRPOConfig(**BASE, **user))
    for name, value in values.items():  # hand-worked values, read from the copy
        assert getattr(copied, name) == value, name
    for name in derived:  # still derived in the copy: the next change derives it again
        assert is_derived(copied, name), name
    for name in given:  # what the user set stays the user's
        assert not is_derived(copied, name), name
    assert copied == GRPOConfig(**BASE, **user)  # and equal to a config built afresh from the same arguments


@pytest.mark.parametrize(
    "change",
    [{"per_device_train_batch_size": 8}, {"gradient_accumulation_steps": 4}, {"num_generations": 2}],
)
@pytest.mark.parametrize(
    "user", [{}, {"epsilon_high": 0.28, "rollout_micro_batch_size": 2}, {"steps_per_generation": 2}]
)
def test_replace_rederives_like_a_fresh_config(change, user):
    c = GRPOConfig(**BASE, **user)
    copied = dataclasses.replace(c, **change)
    fresh = GRPOConfig(**{**BASE, **user, **change})
    assert copied == fresh
    for name in (
        "generation_batch_size",
        "steps_per_generation",
        "rollout_micro_batch_size",
        "ref_logps_micro_batch_size",
        "old_logps_micro_batch_size",
        "async_max_queue_size",
    ):
        assert getattr(copied, name) == getattr(fresh, name), name


def test_replace_num_generations_four():
    c = GRPOConfig(**{**BASE, "num_generations": 2}, gradient_accumulation_steps=2)
    assert dataclasses.replace(c, num_generations=4) == GRPOConfig(**BASE, gradient_accumulation_steps=2)


def test_replace_rederives_epsilon_high_and_backend():
    c = GRPOConfig(**BASE)
    assert dataclasses.replace(c, epsilon=0.3).epsilon_high == 0.3
    assert dataclasses.replace(c, use_vllm=True).generation_backend == "vllm"
    assert dataclasses.replace(c, num_batches_ahead=3).async_max_queue_size == 5


def test_pickle_deepcopy_dict_and_json_round_trips():
    c = GRPOConfig(**BASE, gradient_accumulation_steps=2, epsilon_high=0.28)
    for copied in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
        assert copied == c
        # still a value: a copy of the copy re-derives
        assert dataclasses.replace(copied, per_device_train_batch_size=8).generation_batch_size == 16
    d = c.to_dict()
    d.pop("hub_token")  # TrainingArguments.to_dict masks it
    assert GRPOConfig(**d) == c
    loaded = json.loads(c.to_json_string())
    assert loaded["generation_batch_size"] == 8 and loaded["epsilon_high"] == 0.28
    loaded.pop("hub_token")
    assert GRPOConfig(**loaded) == c  # derived values read back as given: consistent, so accepted


def test_error_lists_valid_num_generations():
    with pytest.raises(ValueError, match=r"valid num_generations divide 4: \[2, 4\]"):
        GRPOConfig(**{**BASE, "num_generations": 3})
