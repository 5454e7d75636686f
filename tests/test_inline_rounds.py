"""Which thread generates a round (`SchedulerSettings.inline_waited_round`, `AsyncBatchGenerator.submit_batch(inline=
True)`): with the hf backend and the in-process vLLM engine, whose `generate` computes on the calling thread, a round
the trainer fetches right after its submission — a `train()`'s first, the round the first step defers to its end,
every round of sync mode — is generated on the trainer's own thread; a round generated ahead, beside a training step,
on the generator thread.
Real trainer runs on the tiny model; the backend's `generate` is wrapped only to record the thread it ran on."""

from __future__ import annotations

import threading

import pytest

from grpo_async import GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.generation.hf import HFBackend
from grpo_async.testing import tiny_config


@pytest.fixture()
def generating_threads(monkeypatch):
    """The name of the thread each `HFBackend.generate` call ran on, in call order."""
    names: list[str] = []
    generate = HFBackend.generate

    def recorded(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(HFBackend, "generate", recorded)
    return names


def _train(tiny_model_path, tmp_path, **overrides) -> GRPOTrainer:
    # one generate call per round of one optimizer step: 4 prompts × G = 4 rows
    args = tiny_config(tmp_path, **{"max_steps": 4, "rollout_micro_batch_size": 16, **overrides})
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    trainer.train()
    assert trainer.state.global_step == 4
    return trainer


def test_async_rounds_the_trainer_waits_for_run_on_its_thread(tiny_model_path, tmp_path, generating_threads):
    """num_batches_ahead=1: round 0 (fetched at once) and round 1 (deferred to the first step's end, fetched at the
    next micro-step) on the main thread; rounds 2 and 3, each submitted ahead beside a step, on the generator
    thread."""
    trainer = _train(tiny_model_path, tmp_path)
    main = threading.main_thread().name
    assert generating_threads == [main, main, "grpo-async-generator", "grpo-async-generator"], generating_threads
    assert trainer.rounds.generator is None or not trainer.rounds.generator.is_running()


def test_sync_mode_generates_every_round_on_the_trainers_thread(tiny_model_path, tmp_path, generating_threads):
    _train(tiny_model_path, tmp_path, num_batches_ahead=0)
    assert generating_threads == [threading.main_thread().name] * 4, generating_threads


def test_a_round_generated_ahead_of_a_later_boundary_stays_on_the_generator_thread(
    tiny_model_path, tmp_path, generating_threads
):
    """steps_per_generation=2 (a round trains 2 optimizer steps): the round the first step defers is fetched two steps
    later, not at the next micro-step, so it is generated on the generator thread beside step 2."""
    _train(tiny_model_path, tmp_path, steps_per_generation=4, rollout_micro_batch_size=32)  # a call per round
    assert generating_threads == [threading.main_thread().name, "grpo-async-generator"], generating_threads


@pytest.mark.vllm
def test_in_process_vllm_steps_a_waited_round_on_the_trainers_thread_and_one_round_at_a_time(
    tiny_model_path, tmp_path, monkeypatch
):
    """The in-process vLLM engine (rounds mode steps it on the calling thread) with num_batches_ahead=2: round 0 and
    round 1 (the first step's deferred round, fetched at the next micro-step) on the trainer's thread, rounds 2 and 3
    on the generator thread, never two at once: at the first step's end round 2 goes to the thread together with the
    inline round 1, and the thread waits for it (an engine stepped from two threads at once breaks)."""
    from grpo_async.generation.vllm_colocate import VLLMColocateBackend

    calls: list[tuple[str, int]] = []  # (thread, rounds running when it started)
    running = [0]
    generate = VLLMColocateBackend.generate

    def recorded(self, *args, **kwargs):
        running[0] += 1
        calls.append((threading.current_thread().name, running[0]))
        try:
            return generate(self, *args, **kwargs)
        finally:
            running[0] -= 1

    monkeypatch.setattr(VLLMColocateBackend, "generate", recorded)
    trainer = _train(
        tiny_model_path, tmp_path, generation_backend="vllm", num_batches_ahead=2, vllm_max_model_length=128
    )
    main, gen = threading.main_thread().name, "grpo-async-generator"
    assert calls == [(main, 1), (main, 1), (gen, 1), (gen, 1)], calls
    assert all(r["reward"] == r["reward"] for r in trainer.state.log_history if "reward" in r)


def test_a_waited_round_past_async_generation_timeout_is_interrupted(tiny_model_path, tmp_path):
    """A round generated on the trainer's thread is not bounded by a wait (the trainer itself is generating): a
    watchdog aborts it at `async_generation_timeout` (the hf backend stops at its next token) and `train()` raises
    `TimeoutError` naming the inline round, instead of generating for as long as the round takes."""
    args = tiny_config(
        tmp_path,
        max_steps=2,
        num_batches_ahead=0,
        rollout_micro_batch_size=16,
        max_completion_length=200,
        generation_kwargs={"min_new_tokens": 200},  # 200 decode steps of 16 rows: far past the timeout below
        async_generation_timeout=0.2,
    )
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    with pytest.raises(TimeoutError, match=r"round 0, generated on the caller's thread \(inline\), ran past"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_publish_waits_for_the_sampling_of_the_rounds_in_flight_not_their_rewards(tiny_model_path, tmp_path):
    """A publish waits until the rounds in flight have *sampled* (the weights they use), not for their rewards: the
    reward of each round generated ahead on the generator thread (rounds 2 and 3; rounds 0 and 1 run on the trainer's
    thread, see above) blocks until the next weights are published, which it sees only because the publish overlaps
    its scoring (waiting for the whole round, the reward would wait out its 20 s here and see none). Each round still
    samples on the weights it was submitted with: staleness 1 from round 1 on, as without the overlap."""
    import time

    seen: list[tuple[int | None, int | None]] = []  # per reward call (one per round): published at entry, at return
    trainer: list[GRPOTrainer] = []

    def waits_for_a_publish(prompts, completions, **kwargs):
        # round i >= 2 samples on version i - 1; it waits here for version i, published at the next step's start
        # (whether that publish came before this call began is the threads' timing: only what it sees by return counts)
        publisher, i = trainer[0].rounds.publisher, len(seen)
        entry = publisher.published
        deadline = time.monotonic() + 20
        while i >= 2 and (publisher.published or 0) < i and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append((entry, publisher.published))
        return letter_reward(prompts, completions, **kwargs)

    args = tiny_config(tmp_path, max_steps=4, rollout_micro_batch_size=16, reward_timeout=60)
    trainer.append(
        GRPOTrainer(model=tiny_model_path, reward_funcs=waits_for_a_publish, args=args, train_dataset=make_dataset(64))
    )
    trainer[0].train()
    assert [back for _, back in seen[2:]] == [2, 3], seen  # waiting for the whole round: [1, 2], after 20 s each
    assert all(entry in (i + 1, i + 2) for i, (entry, _) in enumerate(seen[2:])), seen
    staleness = [r["async/staleness"] for r in trainer[0].state.log_history if "async/staleness" in r]
    assert staleness == [0, 1, 1, 1], staleness


def test_reward_functions_run_one_call_at_a_time_evaluation_included(tiny_model_path, tmp_path):
    """An evaluation at a step's end generates and scores once the round in flight is scored too (its publish waits
    for that round's sampling only): a reward function is never called from two threads at once, and its calls come
    in the schedule's order (training round, eval round: `tests/test_determinism.py` records them)."""
    import time

    active, overlaps, calls = [0], [], []
    lock = threading.Lock()

    def slow_reward(prompts, completions, **kwargs):
        with lock:
            active[0] += 1
            overlaps.append(active[0])
        calls.append(len(prompts))
        time.sleep(0.3)  # the round's scoring outlasts the trainer's step: an eval beside it would overlap here
        with lock:
            active[0] -= 1
        return letter_reward(prompts, completions, **kwargs)

    args = tiny_config(
        tmp_path,
        max_steps=3,
        rollout_micro_batch_size=16,
        eval_strategy="steps",
        eval_steps=1,
        per_device_eval_batch_size=8,
    )
    trainer = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=slow_reward,
        args=args,
        train_dataset=make_dataset(64),
        eval_dataset=make_dataset(4, seed=1),
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert len(calls) >= 6 and max(overlaps) == 1, (overlaps, calls)
