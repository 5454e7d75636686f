"""`RoundQueue` (`grpo_async/pipeline/job_queue.py`): rounds in, rounds out, every wait bounded, errors re-raised."""

import threading
import time
from types import SimpleNamespace

import pytest

from grpo_async import RoundQueue, RoundRequest


def doubled(request):
    """A stand-in producer: the round of a request holds its rows doubled."""
    return SimpleNamespace(round_id=request.round_id, rows=[p * 2 for p in request.rows], generation_time=0.0)


def test_results_in_submission_order_and_counters():
    gen = RoundQueue(doubled, max_queue_size=3, generation_timeout=10).start()
    try:
        for i in range(3):
            gen.submit(RoundRequest(i, [i, i + 1]))
        gen.wait_until_idle()
        assert gen.get_pending_count() == 0 and gen.get_completed_count() == 3  # done, not yet fetched
        assert gen.get(1).rows == [2, 4]  # out-of-order fetch is fine
        assert gen.get(0).rows == [0, 2]
        assert gen.get_completed_count() == 1  # fetched rounds leave the queue
        r = gen.get(2)
        assert r.round_id == 2 and r.rows == [4, 6] and gen.started == [0, 1, 2]
        assert gen.get_pending_count() == 0 and gen.get_completed_count() == 0
    finally:
        gen.stop()
    assert not gen.is_running()


HOLD = 0.05  # seconds each request is held inside generate_fn (a lower bound of its generation_time, not a limit)


def test_generation_time_is_the_time_spent_in_generate_fn():
    """Each request is held in `generate_fn` at least `HOLD` s after it started, and its round's `generation_time`
    says so. Only bounds that hold on any machine: at least the hold, at most the wall time around the call."""

    def work(request):
        time.sleep(HOLD * (request.round_id + 1))  # request 0: >= 0.05 s, request 1: >= 0.10 s
        if request.round_id == 2:
            raise ValueError("bad round")
        return doubled(request)

    gen = RoundQueue(work, generation_timeout=30).start()
    try:
        t0 = time.perf_counter()
        gen.submit(RoundRequest(0, ["x"]))
        r0 = gen.get(0)
        wall0 = time.perf_counter() - t0
        assert HOLD <= r0.generation_time <= wall0
        gen.submit(RoundRequest(1, ["x"]))
        assert 2 * HOLD <= gen.get(1).generation_time
        gen.submit(RoundRequest(2, ["x"]))
        with pytest.raises(RuntimeError, match="bad round"):
            gen.get(2)
        assert gen.busy_seconds() >= 6 * HOLD  # the failed round's time counts as busy too
    finally:
        gen.stop()


def test_generate_fn_error_is_raised_chained_by_get():
    def boom(request):
        raise ValueError("bad prompt 7")

    gen = RoundQueue(boom, generation_timeout=10).start()
    try:
        gen.submit(RoundRequest(0, ["x"]))
        with pytest.raises(RuntimeError, match="Async generation failed: round 0: ValueError: bad prompt 7") as ei:
            gen.get(0)
        assert isinstance(ei.value.__cause__, ValueError)
    finally:
        gen.stop()


def test_slow_generation_times_out_instead_of_hanging():
    release = threading.Event()
    gen = RoundQueue(lambda r: release.wait(5), generation_timeout=10).start()
    try:
        gen.submit(RoundRequest(0, ["x"]))
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="round 0 not ready after 0.3s"):
            gen.get(0, timeout=0.3)
        assert time.monotonic() - start < 3
    finally:
        release.set()
        gen.stop()


def test_full_queue_refuses_instead_of_dropping():
    release = threading.Event()
    gen = RoundQueue(lambda r: release.wait(5) and doubled(r), max_queue_size=2, generation_timeout=10).start()
    try:
        gen.submit(RoundRequest(0, ["a"]))
        gen.submit(RoundRequest(1, ["b"]))
        with pytest.raises(TimeoutError, match="queue full.*the request was not queued"):
            gen.submit(RoundRequest(2, ["c"]), timeout=0.2)
        release.set()
        assert gen.get(0).rows == ["aa"]
        gen.submit(RoundRequest(2, ["c"]))  # room again: accepted
        assert gen.get(1).round_id == 1 and gen.get(2).round_id == 2
    finally:
        release.set()
        gen.stop()


def test_misuse_is_reported():
    gen = RoundQueue(lambda r: None, generation_timeout=5)
    with pytest.raises(RuntimeError, match="before start"):
        gen.submit(RoundRequest(0, []))
    gen.start()
    try:
        with pytest.raises(KeyError, match="never submitted"):
            gen.get(42)
        gen.submit(RoundRequest(0, []))
        with pytest.raises(ValueError, match="already submitted"):
            gen.submit(RoundRequest(0, []))
        with pytest.raises(TypeError, match="expects a RoundRequest"):
            gen.submit([{"prompt": "a"}])
    finally:
        gen.stop()
    with pytest.raises(ValueError, match="generation_timeout"):
        RoundQueue(lambda r: None, generation_timeout=float("inf"))
    with pytest.raises(ValueError, match="max_queue_size"):
        RoundQueue(lambda r: None, max_queue_size=0)


def test_dead_thread_is_reported_not_waited_on():
    def produce(request):
        if request.round_id == 1:  # not an Exception: escapes the per-request handler and kills the thread
            raise SystemExit("generator thread killed")
        return doubled(request)

    gen = RoundQueue(produce, generation_timeout=300).start()
    gen.submit(RoundRequest(0, []))
    assert gen.get(0).round_id == 0
    gen.submit(RoundRequest(1, []))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="died"):
        gen.get(1)  # would wait 300 s for a dead thread if death were not checked
    assert time.monotonic() - start < 60  # far below the 300 s a blind wait would take
    gen.stop(timeout=5)  # the dying thread may still be unwinding when its death is reported
    assert not gen.is_running()
