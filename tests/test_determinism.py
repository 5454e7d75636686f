"""Two full runs with the same `seed` log the same losses and rewards and sample the same completions, whatever the
thread timing (README: Reproducibility): hf and the in-process vLLM engine, `num_batches_ahead` 0 and 1, and 2
processes. One run of each pair sleeps at random (its own unseeded RNG) in the trainer thread and in the generator
thread, so a dependence on which thread gets where first would show; another seed samples other completions.

Also runnable as a script, the 2-process worker: `accelerate launch tests/test_determinism.py MODEL OUT JITTER`.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import pytest
import torch
from transformers import TrainerCallback

from grpo_async import GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.testing import tiny_config
from grpo_async.testing.warm_launch import run_2cpu  # noqa: E402


class Jitter(TrainerCallback):
    """Sleeps a random time (an RNG seeded from the OS: never the same twice) at every step, in the trainer thread."""

    def __init__(self, rng: random.Random, most: float = 0.15):
        self.rng, self.most = rng, most

    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(self.rng.uniform(0, self.most))

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.rng.uniform(0, self.most))


def _recording_reward(seen: list, rng: random.Random | None):
    """`letter_reward` that appends each call's completion ids to `seen` (and, with `rng`, first sleeps a random
    time in the generator thread)."""

    def letter(prompts, completions, completion_ids, **kwargs):
        if rng is not None:
            time.sleep(rng.uniform(0, 0.15))
        seen.append([list(map(int, c)) for c in completion_ids])
        return letter_reward(prompts, completions, completion_ids, **kwargs)

    return letter


def _run(model, out, jitter: bool = False, **overrides) -> dict:
    """Train the tiny model; what must repeat: per-step losses and rewards, every call's completions (training and
    evaluation rounds), the final weights."""
    rng = random.Random(os.urandom(8)) if jitter else None
    seen: list = []
    fields = dict(
        max_steps=4,
        shuffle_dataset=False,  # the prompts do not depend on the seed: only the sampling does
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=8,
    )
    args = tiny_config(out, **{**fields, **overrides})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_recording_reward(seen, rng),
        args=args,
        train_dataset=make_dataset(64),
        eval_dataset=make_dataset(4, seed=1),
        callbacks=[Jitter(rng)] if jitter else [],
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    history = trainer.state.log_history
    return {
        "loss": [h["loss"] for h in history if "loss" in h],
        "reward": [h["reward"] for h in history if "reward" in h],
        "eval_reward": [h["eval_reward"] for h in history if "eval_reward" in h],
        "completions": seen,
        "weights": torch.cat([p.detach().flatten() for p in trainer.model.parameters()]),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert len(a["loss"]) == 4 and len(a["eval_reward"]) == 2
    assert len(a["completions"]) == len(b["completions"]) >= 4
    for i, (x, y) in enumerate(zip(a["completions"], b["completions"], strict=True)):
        assert x == y, f"reward call {i}: different completions"
    assert a["reward"] == b["reward"]
    assert a["eval_reward"] == b["eval_reward"]
    assert a["loss"] == b["loss"]
    assert torch.equal(a["weights"], b["weights"])


@pytest.mark.parametrize("ahead", [0, 1])
def test_hf_same_seed_same_run(tiny_model_path, tmp_path, ahead):
    first = _run(tiny_model_path, tmp_path / "a", num_batches_ahead=ahead)
    second = _run(tiny_model_path, tmp_path / "b", jitter=True, num_batches_ahead=ahead)
    _assert_same(first, second)
    if ahead == 1:  # the test can fail: another seed samples other completions (the prompts are the same)
        other = _run(tiny_model_path, tmp_path / "c", num_batches_ahead=ahead, seed=1)
        assert other["completions"][0] != first["completions"][0]
        assert other["completions"][: len(first["completions"])] != first["completions"]


def test_seeded_samples_do_not_depend_on_chunking(tiny_model_path, tmp_path):
    """Row r of a round samples with its own seed: one generate call per round or one per group gives the same
    completions (hf: up to the floating-point effects of padding; the tiny model's prompts all have one length)."""
    whole = _run(tiny_model_path, tmp_path / "a", num_batches_ahead=1, max_steps=2, rollout_micro_batch_size=16)
    groups = _run(tiny_model_path, tmp_path / "b", num_batches_ahead=1, max_steps=2, rollout_micro_batch_size=4)
    flat = [c for call in whole["completions"] for c in call]
    assert flat == [c for call in groups["completions"] for c in call]


@pytest.mark.vllm
@pytest.mark.parametrize("ahead", [0, 1])
def test_vllm_in_process_same_seed_same_run(tiny_model_path, tmp_path, ahead):
    kw = dict(generation_backend="vllm", num_batches_ahead=ahead, vllm_max_model_length=128)
    first = _run(tiny_model_path, tmp_path / "a", **kw)
    second = _run(tiny_model_path, tmp_path / "b", jitter=True, **kw)
    _assert_same(first, second)


@pytest.mark.vllm
def test_serve_turns_chunked_prefill_off_on_cpu():
    """vLLM CPU cannot rewind a seeded request's generator after a partial prefill: `grpo-async serve` on CPU turns
    chunked prefill off unless the user chose (or set a token budget, which may need chunks)."""
    from vllm.platforms import current_platform

    from grpo_async.generation.serve import _default_cpu_chunked_prefill, make_parser

    for argv, want in (
        ([], False if current_platform.is_cpu() else None),
        (["--enable-chunked-prefill"], True),
        (["--max-num-batched-tokens", "64"], None),
    ):
        args = make_parser().parse_args(["--model", "m", *argv])
        _default_cpu_chunked_prefill(args, ["--model", "m", *argv])
        assert args.enable_chunked_prefill is want, argv


# ---- 2 processes ----------------------------------------------------------------------------------------------------
def _launch(model: str, out: str, jitter: bool) -> list[dict]:
    proc = run_2cpu(__file__, [model, out, int(jitter)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


@pytest.mark.multiprocess
def test_two_processes_same_seed_same_run(tiny_model_path, tmp_path):
    first = _launch(tiny_model_path, str(tmp_path / "a"), jitter=False)
    second = _launch(tiny_model_path, str(tmp_path / "b"), jitter=True)
    for rank in range(2):
        a, b = first[rank], second[rank]
        assert len(a["loss"]) == 3 and a["completions"]
        assert a["completions"] == b["completions"]  # main process: every round of both processes
        assert a["loss"] == b["loss"] and a["reward"] == b["reward"]
        assert a["weights_sum"] == b["weights_sum"]
    assert first[0]["weights_sum"] == first[1]["weights_sum"]


def _worker(model: str, out: str, jitter: bool) -> None:
    """One process of the 2-process run (hf backend, one round ahead, 3 steps): writes `rank<r>.json`."""
    import gc

    import torch.distributed as dist

    rng = random.Random(os.urandom(8)) if jitter else None
    seen: list = []
    args = tiny_config(
        out,
        per_device_train_batch_size=4,
        max_completion_length=6,
        max_steps=3,
        num_batches_ahead=1,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_recording_reward(seen, rng),
        args=args,
        train_dataset=make_dataset(64),
        callbacks=[Jitter(rng)] if jitter else [],
    )
    trainer.train()
    trainer.close()
    rank = trainer.accelerator.process_index
    history = trainer.state.log_history
    weights = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "loss": [h["loss"] for h in history if "loss" in h],
                "reward": [h["reward"] for h in history if "reward" in h],
                "completions": seen if rank == 0 else [[[0]]],  # the main process generates every round
                "weights_sum": float(weights.double().sum()),
            },
            f,
        )
    del trainer
    gc.collect()  # free the DDP reducer before the process group (see tests/mp_train.py)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], bool(int(sys.argv[3])))
