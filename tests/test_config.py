"""Bad configuration is refused at construction, with a message naming the field."""

import pytest

from grpo_async import GRPOConfig

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
        ({"num_generations": 3}, "generation_batch_size"),  # 4 rows per round not divisible by 3
        ({"generation_batch_size": 6}, "generation_batch_size"),  # not a multiple of the micro batch 4
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
        ({"generation_backend": "vllm_server"}, "vllm_server_urls"),
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
    assert s.generation_backend == "vllm_server" and s.vllm_server_urls == ["http://127.0.0.1:8000"]
    c = GRPOConfig(**BASE, generation_batch_size=8)
    assert c.steps_per_generation == 2


def test_error_lists_valid_num_generations():
    with pytest.raises(ValueError, match=r"valid num_generations divide 4: \[2, 4\]"):
        GRPOConfig(**{**BASE, "num_generations": 3})
