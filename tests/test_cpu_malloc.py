"""`grpo_async.cpu_malloc`: on CPU the trainer and `grpo-async serve` have glibc keep freed memory for the next
allocation instead of mapping it anew (and faulting its pages in again) each time."""

import json
import os
import subprocess
import sys

from grpo_async import GRPOTrainer, cpu_malloc
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.testing import tiny_config

#: 64 MiB allocated with glibc's malloc, written and freed, ten times: the minor page faults of the first time and of
#: the nine after it, with or without `keep_freed_memory` first (argv[1]: "keep" or "default")
_REUSE = r"""
import ctypes, json, os, resource, sys
from grpo_async import cpu_malloc
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = cpu_malloc.keep_freed_memory(os.environ) if sys.argv[1] == "keep" else None
size, faults = 64 * 2**20, []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
env = {key: os.environ.get(key) for key in cpu_malloc.ENV}
print(json.dumps({"applied": applied, "first": faults[0], "rest": sum(faults[1:]), "env": env}))
"""


def _glibc_defaults_env() -> dict[str, str]:
    """This environment without any glibc malloc setting (the suite's conftest sets `cpu_malloc.ENV`)."""
    return {k: v for k, v in os.environ.items() if not cpu_malloc.user_chose({k: v})}


def _reuse(mode: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", _REUSE, mode], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_freed_memory_is_reused_without_faulting_its_pages_in_again():
    env = _glibc_defaults_env()
    default = _reuse("default", env)
    # glibc's defaults: 64 MiB is above the mmap threshold, so each allocation is a new mapping, faulted in again
    assert default["first"] > 0 and default["rest"] >= 9 * default["first"] // 2, default
    kept = _reuse("keep", env)
    assert kept["applied"] is True, kept
    assert kept["rest"] <= kept["first"] // 10, kept  # the same pages, already there
    assert kept["env"] == cpu_malloc.ENV  # and what processes started from it read at their start


def test_a_choice_in_the_environment_is_left_alone():
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    for chosen in ({"MALLOC_ARENA_MAX": "2"}, tunables, {cpu_malloc.SWITCH: "0"}):
        environ = dict(chosen)
        assert cpu_malloc.keep_freed_memory(environ) is False
        assert environ == chosen
    off = _reuse("keep", {**_glibc_defaults_env(), cpu_malloc.SWITCH: "0"})
    assert off["applied"] is False and off["rest"] >= 9 * off["first"] // 2, off
    assert off["env"] == dict.fromkeys(cpu_malloc.ENV)


def test_a_trainer_on_cpu_keeps_freed_memory(tiny_model_path, tmp_path, monkeypatch):
    for key in cpu_malloc.ENV:
        monkeypatch.delenv(key, raising=False)
    trainer = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=tiny_config(tmp_path / "out"),
        train_dataset=make_dataset(64),
    )
    try:
        assert trainer.args.device.type == "cpu"
        assert {key: os.environ.get(key) for key in cpu_malloc.ENV} == cpu_malloc.ENV
    finally:
        trainer.close()
