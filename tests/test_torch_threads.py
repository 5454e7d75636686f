"""A process that set its own torch thread count (`torch.set_num_threads`) trains with the in-process vLLM engine.

OpenMP keeps a thread count per thread and vLLM's CPU attention reads the calling thread's before torch has applied
its setting there: the first round on the trainer's generator thread died with `Check failed:
input->metadata->thread_num == thread_num (2 vs. 1)` (`engine_loop.adopt_torch_threads`). Each run is a fresh
process (a fork of the warm interpreter, whose OpenMP default is its own: the cores), as a user's script would be.
"""

import os

import pytest
from support.warm_launch import run_script

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.vllm
@pytest.mark.parametrize("async_mode", ["rounds", "stream"])
def test_a_process_with_its_own_torch_thread_count_trains_with_in_process_vllm(tiny_model_path, tmp_path, async_mode):
    script = os.path.join(HERE, "torch_threads_train.py")
    proc = run_script(script, [tiny_model_path, tmp_path, async_mode], timeout=300)
    out = proc.stdout
    assert "Check failed" not in out, out[-3000:]
    assert proc.returncode == 0, out[-4000:]
    default, asked = (int(v.split("=")[1]) for v in out.split("THREADS ", 1)[1].split()[:2])
    assert default != asked  # the case under test: the torch setting differs from OpenMP's default
    assert "TRAINED 2" in out, out[-3000:]
