"""The live overlap metric (`grpo_async/pipeline/overlap.py`): its arithmetic from given timings, the window clock,
the job queue's busy seconds, and a trainer made generation-bound or training-bound on purpose (orderings only,
never absolute times)."""

import threading
import time
from types import SimpleNamespace

import pytest
from transformers import TrainerCallback

from grpo_async import AsyncBatchGenerator, BatchRequest, GRPOTrainer, RoundRequest
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.pipeline.overlap import StepWindow, overlap_metrics
from grpo_async.testing import tiny_config

SLOW = 1.2  # seconds a slow phase sleeps: far above what the tiny model's other work takes, even on a loaded machine
KEYS = ("async/overlap", "async/trainer_wait", "async/generator_idle", "async/bottleneck")


# ---------------------------------------------------------------------------------------------- arithmetic
def test_generation_bound_step():
    # 1.0 s step: the generator works 0.9 s, the trainer 0.6 s and waits 0.4 s
    m = overlap_metrics(wall=1.0, trainer_wait=0.4, generator_busy=0.9)
    assert m["async/overlap"] == pytest.approx(0.9)  # max(0.9, 0.6) / 1.0
    assert m["async/trainer_wait"] == pytest.approx(0.4)
    assert m["async/generator_idle"] == pytest.approx(0.1)
    assert m["async/bottleneck"] == 1.0


def batch(batch_id: int, rows: list) -> BatchRequest:
    """Seed 003's request: batch `batch_id`, a round of `rows`."""
    return BatchRequest(batch_id, RoundRequest(batch_id, rows))


def test_training_bound_step():
    # 2.0 s step: the trainer waits 0.1 s (works 1.9 s), the generator works 0.5 s
    m = overlap_metrics(wall=2.0, trainer_wait=0.1, generator_busy=0.5)
    assert m["async/overlap"] == pytest.approx(0.95)
    assert m["async/generator_idle"] == pytest.approx(1.5)
    assert m["async/bottleneck"] == 0.0


def test_balanced_step_hand_values():
    # 1.3 s step: the generator works 0.8 s, the trainer waits 0.5 s so it works 1.3 − 0.5 = 0.8 s too.
    # Synchronous: 0.8 + 0.8 = 1.6 s, speed-up 1.6 / 1.3 = 1.2308 of the best S* = 1.6 / 0.8 = 2.0:
    # overlap = 1.2308 / 2.0 = 0.8 / 1.3 = 0.61538; the generator idles 1.3 − 0.8 = 0.5 s
    m = overlap_metrics(wall=1.3, trainer_wait=0.5, generator_busy=0.8)
    assert m == pytest.approx(
        {
            "async/overlap": 0.615385,
            "async/trainer_wait": 0.5,
            "async/generator_idle": 0.5,
            "async/bottleneck": 1.0,  # a tie counts as generation-bound (T_gen >= T_train)
        },
        abs=1e-6,
    )


def test_a_synchronous_step_scores_one_over_s_star():
    # generate 0.6 s while the trainer waits, then train 0.4 s while the generator idles: S* = 1.0 / 0.6 = 1.667,
    # speed-up 1.0 (nothing overlapped) → overlap = 1 / 1.667 = 0.6
    m = overlap_metrics(wall=1.0, trainer_wait=0.6, generator_busy=0.6)
    assert m == pytest.approx(
        {"async/overlap": 0.6, "async/trainer_wait": 0.6, "async/generator_idle": 0.4, "async/bottleneck": 1.0}
    )


def test_timings_outside_the_window_are_clamped():
    m = overlap_metrics(wall=1.0, trainer_wait=1.2, generator_busy=1.1)  # clock reads a hair apart
    assert m["async/overlap"] == 1.0 and m["async/trainer_wait"] == 1.0 and m["async/generator_idle"] == 0.0
    m = overlap_metrics(wall=1.0, trainer_wait=-0.01, generator_busy=-0.01)
    assert m["async/trainer_wait"] == 0.0 and m["async/generator_idle"] == 1.0 and m["async/overlap"] == 1.0


def test_step_window_counts_what_happened_inside_it():
    now, busy = [10.0], [3.0]
    w = StepWindow(lambda: busy[0], clock=lambda: now[0])
    w.add_wait(5.0)  # before any window: not counted
    assert w.close() is None
    w.open()
    now[0], busy[0] = 11.0, 3.7  # the generator worked 0.7 s of this 1 s step
    w.add_wait(0.2)
    w.open()  # already open: keeps its start
    m = w.close()
    assert m["async/overlap"] == pytest.approx(0.8)  # trainer busy 0.8 s
    assert m["async/trainer_wait"] == pytest.approx(0.2)
    assert m["async/generator_idle"] == pytest.approx(0.3)
    now[0], busy[0] = 13.0, 5.7  # the next window opened at 11.0: generator busy all of its 2 s
    m = w.close()
    assert m["async/trainer_wait"] == 0.0 and m["async/generator_idle"] == pytest.approx(0.0, abs=1e-9)
    w.reset()
    assert w.close() is None


def test_job_queue_busy_seconds_count_the_running_request():
    started, release = threading.Event(), threading.Event()

    def work(request):
        started.set()
        release.wait(10)
        return SimpleNamespace(round_id=request.round_id, generation_time=0.0)

    gen = AsyncBatchGenerator(work, generation_timeout=10).start()
    try:
        assert gen.busy_seconds() == 0.0  # idle: nothing submitted
        gen.submit_batch(batch(0, ["x"]))
        assert started.wait(10)
        first = gen.busy_seconds()
        time.sleep(0.01)
        second = gen.busy_seconds()
        assert 0.0 < first < second  # the request in progress counts up to now
        release.set()
        result = gen.get_batch(0).round
        done = gen.busy_seconds()
        assert done >= result.generation_time and done >= second
        time.sleep(0.01)
        assert gen.busy_seconds() == done  # idle again: no longer grows
    finally:
        release.set()
        gen.stop()


# ---------------------------------------------------------------------------------------------- the trainer
def slow_reward(prompts, completions, **kw):
    """Makes every round slow to generate (the reward is part of the generator's round)."""
    time.sleep(SLOW)
    return letter_reward(prompts, completions, **kw)


class SlowStep(TrainerCallback):
    """Makes every optimizer step slow on the trainer's side (between steps, as an optimizer would be)."""

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(SLOW)


def _train(tmp_path, tiny_model_path, reward, callbacks=(), ahead=1, steps=4):
    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=reward,
        args=tiny_config(tmp_path / "out", num_batches_ahead=ahead, max_steps=steps),
        train_dataset=make_dataset(64),
        callbacks=list(callbacks),
    )
    t.train()
    logs = [h for h in t.state.log_history if "loss" in h]
    assert len(logs) == steps
    for h in logs:  # every step logs all four, in range
        assert all(k in h for k in KEYS), sorted(h)
        assert 0.0 <= h["async/overlap"] <= 1.0 + 1e-9
        assert h["async/trainer_wait"] >= 0.0 and h["async/generator_idle"] >= 0.0
        assert h["async/bottleneck"] in (0.0, 1.0)
    return logs[1:]  # the first step also waits for the pipeline to fill: 3 steps (an odd count: a median step)


def _mean(logs, key):
    return sum(h[key] for h in logs) / len(logs)


def _median(logs, key):  # robust to one step slowed down by other jobs on the machine
    import statistics

    return statistics.median(h[key] for h in logs)


def test_generation_bound_run_shows_the_trainer_waiting(tiny_model_path, tmp_path):
    logs = _train(tmp_path, tiny_model_path, slow_reward)
    assert _median(logs, "async/trainer_wait") > _median(logs, "timing/train_step")  # waits more than it trains
    assert _median(logs, "async/trainer_wait") > _median(logs, "async/generator_idle")
    assert _mean(logs, "async/bottleneck") > 0.5


def test_training_bound_run_shows_the_generator_idle(tiny_model_path, tmp_path):
    logs = _train(tmp_path, tiny_model_path, letter_reward, callbacks=[SlowStep()])
    assert _median(logs, "async/generator_idle") > _median(logs, "async/trainer_wait")
    assert _mean(logs, "async/bottleneck") < 0.5


def test_synchronous_run_overlaps_less_than_asynchronous(tiny_model_path, tmp_path):
    """Balanced phases (SLOW seconds of reward, SLOW of step): the synchronous run does them one after the other, so
    its slower phase fills about half of each step; the asynchronous run hides one behind the other."""
    sync = _train(tmp_path / "sync", tiny_model_path, slow_reward, [SlowStep()], ahead=0)
    asyn = _train(tmp_path / "async", tiny_model_path, slow_reward, [SlowStep()], ahead=1)
    assert _mean(sync, "async/overlap") < _mean(asyn, "async/overlap")
    # synchronous: the trainer waits for each whole round, the generator idles through each whole step
    assert _mean(sync, "async/trainer_wait") > 0.5 * _mean(sync, "timing/generation")
