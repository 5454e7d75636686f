import threading
import time

import pytest

from grpo_async import AsyncBatchGenerator, BatchRequest


def test_results_in_submission_order_and_counters():
    gen = AsyncBatchGenerator(lambda r: [p * 2 for p in r.prompts], max_queue_size=3, generation_timeout=10).start()
    try:
        for i in range(3):
            gen.submit_batch(BatchRequest(i, [i, i + 1]))
        gen.wait_until_idle()
        assert gen.get_pending_count() == 0 and gen.get_completed_count() == 3  # done, not yet fetched
        assert gen.get_batch(1).processed_results == [2, 4]  # out-of-order fetch is fine
        assert gen.get_batch(0).processed_results == [0, 2]
        assert gen.get_completed_count() == 1  # fetched results leave the generator
        r = gen.get_batch(2)
        assert r.batch_id == 2 and r.processed_results == [4, 6] and r.error is None
        assert gen.get_pending_count() == 0 and gen.get_completed_count() == 0
    finally:
        gen.stop()
    assert not gen.is_running()


HOLD = 0.05  # seconds each request is held inside generate_fn (a lower bound of its generation_time, not a limit)


def test_generation_time_is_the_time_spent_in_generate_fn():
    """Each request is held in `generate_fn` at least `HOLD` s after it started; a failed one is left out of the
    average. Only bounds that hold on any machine: at least the hold, at most the wall time around the call."""

    def work(request):
        time.sleep(HOLD * (request.batch_id + 1))  # request 0: >= 0.05 s, request 1: >= 0.10 s
        if request.batch_id == 2:
            raise ValueError("bad round")
        return request.batch_id

    gen = AsyncBatchGenerator(work, generation_timeout=30).start()
    try:
        assert gen.get_average_generation_time() == 0.0  # nothing finished yet
        t0 = time.perf_counter()
        gen.submit_batch(BatchRequest(0, ["x"]))
        r0 = gen.get_batch(0)
        wall0 = time.perf_counter() - t0
        assert HOLD <= r0.generation_time <= wall0
        gen.submit_batch(BatchRequest(1, ["x"]))
        r1 = gen.get_batch(1)
        assert 2 * HOLD <= r1.generation_time
        assert gen.get_average_generation_time() == pytest.approx((r0.generation_time + r1.generation_time) / 2)
        gen.submit_batch(BatchRequest(2, ["x"]))
        with pytest.raises(RuntimeError, match="bad round"):
            gen.get_batch(2)
        # the failed round (>= 0.15 s) is not averaged in
        assert gen.get_average_generation_time() == pytest.approx((r0.generation_time + r1.generation_time) / 2)
    finally:
        gen.stop()


def test_generate_fn_error_is_raised_chained_by_get_batch():
    def boom(request):
        raise ValueError("bad prompt 7")

    gen = AsyncBatchGenerator(boom, generation_timeout=10).start()
    try:
        gen.submit_batch(BatchRequest(0, ["x"]))
        with pytest.raises(RuntimeError, match="Async generation failed: batch 0: ValueError: bad prompt 7") as ei:
            gen.get_batch(0)
        assert isinstance(ei.value.__cause__, ValueError)
    finally:
        gen.stop()


def test_slow_generation_times_out_instead_of_hanging():
    release = threading.Event()
    gen = AsyncBatchGenerator(lambda r: release.wait(5), generation_timeout=10).start()
    try:
        gen.submit_batch(BatchRequest(0, ["x"]))
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="batch 0 not ready after 0.3s"):
            gen.get_batch(0, timeout=0.3)
        assert time.monotonic() - start < 3
    finally:
        release.set()
        gen.stop()


def test_full_queue_refuses_instead_of_dropping():
    release = threading.Event()
    gen = AsyncBatchGenerator(lambda r: release.wait(5), max_queue_size=2, generation_timeout=10).start()
    try:
        gen.submit_batch(BatchRequest(0, ["a"]))
        gen.submit_batch(BatchRequest(1, ["b"]))
        with pytest.raises(TimeoutError, match="queue full.*the request was not queued"):
            gen.submit_batch(BatchRequest(2, ["c"]), timeout=0.2)
        release.set()
        assert gen.get_batch(0).processed_results is True
        gen.submit_batch(BatchRequest(2, ["c"]))  # room again: accepted
        assert gen.get_batch(1).batch_id == 1 and gen.get_batch(2).batch_id == 2
    finally:
        release.set()
        gen.stop()


def test_misuse_is_reported():
    gen = AsyncBatchGenerator(lambda r: None, generation_timeout=5)
    with pytest.raises(RuntimeError, match="before start"):
        gen.submit_batch(BatchRequest(0, []))
    gen.start()
    try:
        with pytest.raises(KeyError, match="never submitted"):
            gen.get_batch(42)
        gen.submit_batch(BatchRequest(0, []))
        with pytest.raises(ValueError, match="already submitted"):
            gen.submit_batch(BatchRequest(0, []))
    finally:
        gen.stop()
    with pytest.raises(ValueError, match="generation_timeout"):
        AsyncBatchGenerator(lambda r: None, generation_timeout=float("inf"))
    with pytest.raises(ValueError, match="max_queue_size"):
        AsyncBatchGenerator(lambda r: None, max_queue_size=0)


def test_dead_thread_is_reported_not_waited_on():
    def produce(request):
        if request.batch_id == 1:  # not an Exception: escapes the per-request handler and kills the thread
            raise SystemExit("generator thread killed")
        return request.batch_id

    gen = AsyncBatchGenerator(produce, generation_timeout=300).start()
    gen.submit_batch(BatchRequest(0, []))
    assert gen.get_batch(0).processed_results == 0
    gen.submit_batch(BatchRequest(1, []))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="died"):
        gen.get_batch(1)  # would wait 300 s for a dead thread if death were not checked
    assert time.monotonic() - start < 60  # far below the 300 s a blind wait would take
    gen.stop(timeout=5)  # the dying thread may still be unwinding when its death is reported
    assert not gen.is_running()
