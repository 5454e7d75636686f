"""Launched by tests/test_torch_threads.py (a fresh process): asks torch for a thread count other than OpenMP's
default, then trains 2 steps with the in-process vLLM engine, whose rounds run on the trainer's generator thread
(`async_mode` "rounds") or its engine-loop thread ("stream").

argv: MODEL OUT_DIR ASYNC_MODE. Prints `THREADS default=<n> asked=<k>` and `TRAINED <steps>`.
"""

import sys

import torch

from grpo_async import GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.testing import tiny_config


def main(model: str, out: str, async_mode: str) -> None:
    default = torch.get_num_threads()  # OpenMP's default here: OMP_NUM_THREADS, else the cores
    asked = 2 if default == 1 else 1
    torch.set_num_threads(asked)
    print(f"THREADS default={default} asked={asked}", flush=True)
    args = tiny_config(
        out, generation_backend="vllm", async_mode=async_mode, vllm_max_model_length=128, max_steps=2, beta=0.0
    )
    trainer = GRPOTrainer(model=model, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(32))
    trainer.train()
    print(f"TRAINED {trainer.state.global_step}", flush=True)
    trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
