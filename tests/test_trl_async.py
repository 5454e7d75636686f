"""TRL 1.16's `trl.experimental.async_grpo` ports by changing the import: every field of the installed TRL
`AsyncGRPOConfig` is accepted by ours (at TRL's default, and at another value where one means something) or refused
with a `ValueError` naming it; `AsyncGRPOTrainer` has TRL's constructor; and TRL's documentation example, with only
the import swapped (a local model and dataset instead of the Hub's), trains against a real `grpo-async serve`."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import warnings

import pytest

async_grpo = pytest.importorskip("trl.experimental.async_grpo")

from grpo_async import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from grpo_async.config.derived import is_derived  # noqa: E402

BASE = dict(use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=4)
TRL_FIELDS = {f.name: f for f in dataclasses.fields(async_grpo.AsyncGRPOConfig) if f.init}


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _config(tmp_path, **kwargs) -> AsyncGRPOConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AsyncGRPOConfig(**{"output_dir": str(tmp_path), **BASE, **kwargs})


#: a value other than TRL's default, for the fields of TRL's AsyncGRPOConfig itself (TrainingArguments' own are
#: transformers' business: they are checked at TRL's default), and what it must become here (a check of the config),
#: or `REFUSED`
REFUSED = "refused"
NON_DEFAULT = {
    "model_init_kwargs": ({"attn_implementation": "eager"}, lambda c: c.model_init_kwargs["attn_implementation"]),
    "dtype": ("bfloat16", lambda c: c.dtype == "bfloat16"),
    "trust_remote_code": (True, lambda c: c.trust_remote_code is True),
    "router_aux_loss_coef": (0.01, lambda c: c.router_aux_loss_coef == 0.01),
    "learning_rate": (1e-5, lambda c: c.learning_rate == 1e-5),
    "logging_steps": (5, lambda c: c.logging_steps == 5),
    "lr_scheduler_type": ("cosine", lambda c: c.lr_scheduler_type == "cosine"),
    "ignore_data_skip": (False, lambda c: c.ignore_data_skip is False),
    "gradient_checkpointing": (False, lambda c: c.gradient_checkpointing is False),
    "bf16": (False, lambda c: c.bf16 is False),
    "use_liger_kernel": (True, REFUSED),
    "num_generations": (2, lambda c: c.num_generations == 2),
    "max_completion_length": (64, lambda c: c.max_completion_length == 64),
    "temperature": (0.7, lambda c: c.temperature == 0.7),
    "top_p": (0.9, lambda c: c.top_p == 0.9),
    "top_k": (5, lambda c: c.top_k == 5),
    "min_p": (0.05, lambda c: c.min_p == 0.05),
    "repetition_penalty": (1.1, lambda c: c.repetition_penalty == 1.1),
    "chat_template_kwargs": (
        {"enable_thinking": False},
        lambda c: c.chat_template_kwargs == {"enable_thinking": False},
    ),
    "max_tool_calling_iterations": (3, lambda c: c.max_tool_calling_iterations == 3),
    "fork_threshold_tokens": (256, REFUSED),
    "vllm_server_base_url": ("http://10.0.0.2:8001", lambda c: c.server_urls == ["http://10.0.0.2:8001"]),
    "vllm_server_timeout": (30.0, lambda c: c.vllm_server_timeout == 30.0),
    "request_timeout": (60, lambda c: c.request_timeout == 60),
    "weight_sync_timeout": (60, REFUSED),
    "epsilon": (0.3, lambda c: c.epsilon == 0.3 and c.epsilon_high == 0.3),
    "epsilon_high": (0.28, lambda c: c.epsilon_high == 0.28),
    "token_budget": (4096, lambda c: c.token_budget == 4096),
    "max_inflight_tasks": (16, lambda c: c.max_inflight_groups == 4),  # 16 completions = 4 groups of 4
    "max_staleness": (2, lambda c: c.staleness_limit == 2 and c.staleness_policy == "pace"),
    "queue_maxsize": (64, REFUSED),
    "weight_sync_steps": (2, lambda c: c.steps_per_round == 2 and is_derived(c, "steps_per_generation")),
    "heartbeat_stale_after_s": (60.0, REFUSED),
    "log_completions": (True, lambda c: c.log_completions is True),
    "num_completions_to_print": (2, lambda c: c.num_completions_to_print == 2),
    "torch_empty_cache_steps": (10, lambda c: c.torch_empty_cache_steps == 10),
    "lr_scheduler_kwargs": ({"num_cycles": 1}, lambda c: c.lr_scheduler_kwargs == {"num_cycles": 1}),
}


def test_the_non_default_table_names_only_trl_fields():
    assert set(NON_DEFAULT) <= set(TRL_FIELDS)
    own = set(inspect.get_annotations(async_grpo.AsyncGRPOConfig))  # the fields TRL's class declares itself
    assert own <= set(NON_DEFAULT), (
        f"fields of TRL's AsyncGRPOConfig without a non-default case: {own - set(NON_DEFAULT)}"
    )


@pytest.mark.parametrize("name", sorted(TRL_FIELDS))
def test_every_trl_field_is_accepted_or_refused_by_name(name, tmp_path):
    f = TRL_FIELDS[name]
    default = _default(f)
    if name != "output_dir" and default is not dataclasses.MISSING:
        batch = {"per_device_train_batch_size": 8} if name == "num_generations" else {}  # TRL's 8 × 1 rows a round
        cfg = _config(tmp_path, **{name: default}, **batch)  # TRL's default is always accepted
        assert hasattr(cfg, name)
    if name not in NON_DEFAULT:
        return
    value, expect = NON_DEFAULT[name]
    if expect == REFUSED:
        with pytest.raises(ValueError, match=name):
            _config(tmp_path, **{name: value})
    else:
        cfg = _config(tmp_path, **{name: value})
        assert getattr(cfg, name) == value or name == "token_budget"
        assert expect(cfg), f"{name}={value!r} is not honoured: {getattr(cfg, name)!r}"


def test_trl_defaults_map_onto_a_streamed_vllm_server(tmp_path):
    cfg = _config(tmp_path)
    assert cfg.generation_backend == "vllm_server" and cfg.async_mode == "stream"
    assert cfg.vllm_server_base_url == "http://localhost:8000" and cfg.server_urls == ["http://localhost:8000"]
    assert cfg.max_staleness == 4 and cfg.staleness_limit == 4 and cfg.staleness_policy == "pace"
    # TRL's auto: max(max_staleness, 1) × per_device_train_batch_size × GA × processes = 16 completions = 4 groups
    assert cfg.max_inflight_tasks == -1 and cfg.max_inflight_groups == 4 and is_derived(cfg, "max_inflight_groups")
    assert cfg.rounds_ahead == 4 and cfg.async_max_queue_size == 6
    assert cfg.max_completion_length == 2048 and cfg.max_prompt_length is None
    assert cfg.logging_steps == 1 and cfg.lr_scheduler_type == "constant" and cfg.learning_rate == 1e-6
    # ours name the servers: TRL's default URL is not added to them; a copy re-derives
    mine = _config(tmp_path, vllm_server_urls=["http://10.0.0.3:8000"])
    assert mine.server_urls == ["http://10.0.0.3:8000"]
    assert dataclasses.replace(cfg, vllm_server_urls=["http://10.0.0.3:8000"]).server_urls == ["http://10.0.0.3:8000"]
    # TRL: token_budget <= 0 disables budgeting
    assert _config(tmp_path, token_budget=0).token_budget is None


def test_weight_sync_steps_sets_the_round_and_inflight_tasks_the_groups(tmp_path):
    cfg = _config(tmp_path, weight_sync_steps=2, gradient_accumulation_steps=2, max_inflight_tasks=10)
    assert cfg.steps_per_generation == 4 and cfg.generation_batch_size == 16 and cfg.steps_per_round == 2
    assert cfg.max_inflight_groups == math.ceil(10 / 4)
    back = dataclasses.replace(cfg, weight_sync_steps=1)  # derived, so a copy derives it again
    assert back.steps_per_round == 1 and back.generation_batch_size == 8
    with pytest.raises(ValueError, match="weight_sync_steps"):
        _config(tmp_path, weight_sync_steps=2, steps_per_generation=1)
    with pytest.raises(ValueError, match="max_inflight_tasks"):
        _config(tmp_path, max_inflight_tasks=0)
    with pytest.raises(ValueError, match="max_inflight_tasks"):
        _config(tmp_path, max_inflight_tasks=16, max_inflight_groups=2)


def test_the_trainer_has_trls_constructor():
    ours = inspect.signature(AsyncGRPOTrainer.__init__).parameters
    trl = inspect.signature(async_grpo.AsyncGRPOTrainer.__init__).parameters
    assert list(ours) == list(trl)
    assert [p.default for p in ours.values()] == [p.default for p in trl.values()]


@pytest.mark.parametrize("argument", ["rollout_worker", "weight_transfer"])
def test_trl_plug_ins_are_refused_with_what_to_use_instead(argument):
    with pytest.raises(NotImplementedError, match=f"{argument}=.*register_backend"):
        AsyncGRPOTrainer(model="unused", reward_funcs=[], **{argument: object()})


def test_trainer_copy_of_the_config_and_the_server_wait(tiny_model_path, tmp_path):
    """The trainer's args: request_timeout is the per-request timeout, the model loads in `dtype`; the user's config is
    left as it was. train() waits `vllm_server_timeout` seconds for a server that never answers, then raises."""
    from datasets import Dataset

    from grpo_async.net import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = _config(
        tmp_path, vllm_server_base_url=url, vllm_server_timeout=1.0, request_timeout=77, max_completion_length=8
    )

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    dataset = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"]})
    trainer = AsyncGRPOTrainer(model=tiny_model_path, reward_funcs=zero, args=args, train_dataset=dataset)
    try:
        assert trainer.args.vllm_server_timeout == 77.0 and args.vllm_server_timeout == 1.0
        assert trainer.args.model_init_kwargs["dtype"] == "float32" and args.model_init_kwargs is None
        assert str(trainer.model.dtype) == "torch.float32"
        with pytest.raises(TimeoutError, match="vllm_server_timeout"):
            trainer.train()
    finally:
        trainer.close()


# ---- TRL's documentation example, import swapped, against a real server ---------------------------------------------
#: TRL's AsyncGRPOTrainer docstring example, with `from grpo_async import ...` instead of `from
#: trl.experimental.async_grpo import ...`, the tiny local model instead of Qwen2.5-0.5B, a `datasets.Dataset` built
#: here instead of `load_dataset("trl-lib/DeepMath-103K")` (nothing is downloaded), a reward that varies on an
#: untrained model instead of `trl.rewards.accuracy_reward`, and an AsyncGRPOConfig of TRL's fields sized for a CPU
TRL_EXAMPLE = """
import json
import sys

import torch
from datasets import Dataset

from grpo_async import AsyncGRPOConfig, AsyncGRPOTrainer  # was: from trl.experimental.async_grpo import ...

model, server, output_dir = sys.argv[1:4]


def reward_func(completions, **kwargs):
    return [sum(map(ord, c[-1]["content"])) % 7 / 7 for c in completions]


dataset = Dataset.from_dict(
    {
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(16)],
        "solution": [str(2 * i) for i in range(16)],
    }
)
args = AsyncGRPOConfig(
    output_dir=output_dir,
    vllm_server_base_url=server,
    max_steps=3,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    learning_rate=1e-2,
    report_to="none",
)
trainer = AsyncGRPOTrainer(
    model=model,
    reward_funcs=reward_func,
    args=args,
    train_dataset=dataset,
)
before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
trainer.train()
changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach().cpu(), before[n].cpu())]
result = {"step": trainer.state.global_step, "changed": changed, "logs": trainer.state.log_history}
print("RESULT " + json.dumps(result))
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_trls_example_with_the_import_swapped_trains_on_a_real_server(tiny_model_path, tmp_path):
    from support.warm_launch import run_script
    from vllm_utils import running_servers

    script = tmp_path / "trl_async_example.py"
    script.write_text(TRL_EXAMPLE)
    out = tmp_path / "out"
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    with running_servers(tiny_model_path, 1, api_key=None) as (server,):  # TRL's config has no API key
        proc = run_script(str(script), [tiny_model_path, server.url, str(out)], env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["step"] == 3
    assert result["changed"], "no weight changed: nothing was trained"
    steps = [r for r in result["logs"] if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3], result["logs"]  # logging_steps=1 (TRL async's default)
    assert all("reward" in r and math.isfinite(r["loss"]) for r in steps), steps
    logged = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "reward" in r] == [1, 2, 3]
