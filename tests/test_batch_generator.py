"""`AsyncBatchGenerator` (`grpo_async/pipeline/batch_generator.py`), seed 003's generator thread: batches in, batches
out, every wait bounded, errors re-raised."""

import threading
import time
from types import SimpleNamespace

import pytest

from grpo_async import AsyncBatchGenerator, BatchRequest, RoundRequest


def batch(batch_id: int, rows: list) -> BatchRequest:
    """Seed 003's request: batch `batch_id`, a round of `rows`."""
    return BatchRequest(batch_id, RoundRequest(batch_id, rows))


def doubled(request):
    """A stand-in producer: the round of a request holds its rows doubled."""
    return SimpleNamespace(round_id=request.round_id, rows=[p * 2 for p in request.rows], generation_time=0.0)


def test_results_in_submission_order_and_counters():
    gen = AsyncBatchGenerator(doubled, max_queue_size=3, generation_timeout=10).start()
    try:
        for i in range(3):
            gen.submit_batch(batch(i, [i, i + 1]))
        gen.wait_until_idle()
        assert gen.get_pending_count() == 0 and gen.get_completed_count() == 3  # done, not yet fetched
        assert gen.get_batch(1).round.rows == [2, 4]  # out-of-order fetch is fine
        assert gen.get_batch(0).round.rows == [0, 2]
        assert gen.get_completed_count() == 1  # fetched rounds leave the queue
        result = gen.get_batch(2)
        assert result.batch_id == 2 and result.round.rows == [4, 6] and gen.started == [0, 1, 2]
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

    gen = AsyncBatchGenerator(work, generation_timeout=30).start()
    try:
        t0 = time.perf_counter()
        gen.submit_batch(batch(0, ["x"]))
        r0 = gen.get_batch(0).round
        wall0 = time.perf_counter() - t0
        assert HOLD <= r0.generation_time <= wall0
        gen.submit_batch(batch(1, ["x"]))
        r1 = gen.get_batch(1)
        assert 2 * HOLD <= r1.generation_time == r1.round.generation_time
        # seed 003's get_average_generation_time: the mean over the batches that succeeded
        assert gen.get_average_generation_time() == pytest.approx((r0.generation_time + r1.generation_time) / 2)
        gen.submit_batch(batch(2, ["x"]))
        with pytest.raises(RuntimeError, match="bad round"):
            gen.get_batch(2)
        assert gen.busy_seconds() >= 6 * HOLD  # the failed round's time counts as busy too
    finally:
        gen.stop()


def test_generate_fn_error_is_raised_chained_by_get():
    def boom(request):
        raise ValueError("bad prompt 7")

    gen = AsyncBatchGenerator(boom, generation_timeout=10).start()
    try:
        gen.submit_batch(batch(0, ["x"]))
        with pytest.raises(RuntimeError, match="Async generation failed: round 0: ValueError: bad prompt 7") as ei:
            gen.get_batch(0)
        assert isinstance(ei.value.__cause__, ValueError)
    finally:
        gen.stop()


def test_slow_generation_times_out_instead_of_hanging():
    release = threading.Event()
    gen = AsyncBatchGenerator(lambda r: release.wait(5), generation_timeout=10).start()
    try:
        gen.submit_batch(batch(0, ["x"]))
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="round 0 not ready after 0.3s"):
            gen.get_batch(0, timeout=0.3)
        assert time.monotonic() - start < 3
    finally:
        release.set()
        gen.stop()


def test_full_queue_refuses_instead_of_dropping():
    release = threading.Event()
    gen = AsyncBatchGenerator(
        lambda r: release.wait(5) and doubled(r), max_queue_size=2, generation_timeout=10
    ).start()
    try:
        gen.submit_batch(batch(0, ["a"]))
        gen.submit_batch(batch(1, ["b"]))
        with pytest.raises(TimeoutError, match="queue full.*the request was not queued"):
            gen.submit_batch(batch(2, ["c"]), timeout=0.2)
        release.set()
        assert gen.get_batch(0).round.rows == ["aa"]
        gen.submit_batch(batch(2, ["c"]))  # room again: accepted
        assert gen.get_batch(1).round.round_id == 1 and gen.get_batch(2).round.round_id == 2
    finally:
        release.set()
        gen.stop()


def test_misuse_is_reported():
    gen = AsyncBatchGenerator(lambda r: None, generation_timeout=5)
    with pytest.raises(RuntimeError, match="before start"):
        gen.submit_batch(batch(0, []))
    gen.start()
    try:
        with pytest.raises(KeyError, match="never submitted"):
            gen.get_batch(42)
        gen.submit_batch(batch(0, []))
        with pytest.raises(ValueError, match="already submitted"):
            gen.submit_batch(batch(0, []))
        with pytest.raises(TypeError, match="expects a BatchRequest"):
            gen.submit_batch(RoundRequest(1, [{"prompt": "a"}]))
        with pytest.raises(ValueError, match="batch_id 3 but its round is 2"):
            BatchRequest(3, RoundRequest(2, []))
    finally:
        gen.stop()
    with pytest.raises(ValueError, match="generation_timeout"):
        AsyncBatchGenerator(lambda r: None, generation_timeout=float("inf"))
    with pytest.raises(ValueError, match="max_queue_size"):
        AsyncBatchGenerator(lambda r: None, max_queue_size=0)


def test_dead_thread_is_reported_not_waited_on():
    def produce(request):
        if request.round_id == 1:  # not an Exception: escapes the per-request handler and kills the thread
            raise SystemExit("generator thread killed")
        return doubled(request)

    gen = AsyncBatchGenerator(produce, generation_timeout=300).start()
    gen.submit_batch(batch(0, []))
    assert gen.get_batch(0).round.round_id == 0
    gen.submit_batch(batch(1, []))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="died"):
        gen.get_batch(1)  # would wait 300 s for a dead thread if death were not checked
    assert time.monotonic() - start < 60  # far below the 300 s a blind wait would take
    gen.stop(timeout=5)  # the dying thread may still be unwinding when its death is reported
    assert not gen.is_running()


def test_an_inline_request_runs_on_the_fetching_thread():
    """`submit_batch(..., inline=True)`: the request is pending but not the thread's; `get_batch` runs `generate_fn`
    on the caller's thread (the trainer would only wait: a CPU runs torch faster there), and it counts as generated
    work (pending, started, average generation time, busy seconds) as a thread-run request does; the next request,
    not inline, runs on the generator thread."""
    threads = {}

    def work(request):
        threads[request.round_id] = threading.current_thread().name
        time.sleep(HOLD)
        return doubled(request)

    gen = AsyncBatchGenerator(work, generation_timeout=30, name="gen-thread").start()
    try:
        gen.submit_batch(batch(0, [1]), inline=True)
        time.sleep(3 * HOLD)  # the thread would have taken it by now
        assert threads == {} and gen.get_pending_count() == 1 and gen.started == []
        result = gen.get_batch(0)
        assert result.round.rows == [2] and threads == {0: threading.current_thread().name}
        assert result.generation_time >= HOLD and gen.get_average_generation_time() >= HOLD
        assert gen.busy_seconds() >= HOLD and gen.get_pending_count() == 0 and gen.started == [0]
        gen.submit_batch(batch(1, [2]))
        assert gen.get_batch(1).round.rows == [4] and threads[1] == "gen-thread"
    finally:
        gen.stop()


def test_an_inline_request_fails_waits_and_stops_as_a_queued_one():
    """Its error reaches `get_batch` as "Async generation failed" chained from the cause; `wait_until_idle` runs a
    pending inline request (it would otherwise wait for it for ever); `stop` drops one never fetched."""
    ran = []

    def work(request):
        ran.append(request.round_id)
        if request.round_id == 0:
            raise ValueError("bad round")
        return doubled(request)

    gen = AsyncBatchGenerator(work, generation_timeout=5).start()
    try:
        gen.submit_batch(batch(0, [1]), inline=True)
        with pytest.raises(RuntimeError, match=r"Async generation failed: round 0: ValueError: bad round") as e:
            gen.get_batch(0)
        assert isinstance(e.value.__cause__, ValueError)
        gen.submit_batch(batch(1, [3]), inline=True)
        gen.wait_until_idle()
        assert ran == [0, 1] and gen.get_completed_count() == 1 and gen.get_batch(1).round.rows == [6]
        gen.submit_batch(batch(2, [5]), inline=True)
    finally:
        gen.stop()
    assert ran == [0, 1] and gen.get_pending_count() == 0


def _one_at_a_time(threads: dict, order: list, hold: float = HOLD):
    """A producer that records where and in what order each request ran, and fails the test if two run at once (an
    in-process engine stepped from two threads at once breaks)."""
    running = threading.Semaphore(1)

    def work(request):
        assert running.acquire(blocking=False), f"round {request.round_id} started while another ran"
        try:
            threads[request.round_id] = threading.current_thread().name
            order.append(request.round_id)
            time.sleep(hold)
            return doubled(request)
        finally:
            running.release()

    return work


def test_the_thread_waits_for_an_inline_request_fetched_before_its_own():
    """`end_step` submits the round fetched next inline and the rounds after it to the thread at once: the thread
    must not start round 1 while the inline round 0 waits for its caller (it would then wait a whole round more, or
    step the engine beside it); `get_batch(1)` runs the inline round 0 first."""
    threads, order = {}, []
    gen = AsyncBatchGenerator(_one_at_a_time(threads, order), generation_timeout=30, name="gen-thread").start()
    try:
        gen.submit_batch(batch(0, [1]), inline=True)
        gen.submit_batch(batch(1, [2]))
        time.sleep(3 * HOLD)  # the thread would have started round 1 by now
        assert order == [] and gen.started == []
        assert gen.get_batch(0).round.rows == [2] and threads[0] == threading.current_thread().name
        assert gen.get_batch(1).round.rows == [4] and threads[1] == "gen-thread" and order == [0, 1]
        gen.submit_batch(batch(2, [3]), inline=True)  # fetched out of turn: `get_batch(3)` runs 2 first
        gen.submit_batch(batch(3, [4]))
        assert gen.get_batch(3).round.rows == [8] and order == [0, 1, 2, 3]
        assert gen.get_batch(2).round.rows == [6] and threads[2] == threading.current_thread().name
    finally:
        gen.stop()


def test_an_inline_request_waits_for_the_threads_request_in_progress():
    """A round on the thread already running when an inline one is fetched: the inline one starts after it ends,
    never beside it; if it does not end within the fetch's timeout, `TimeoutError` names both and the inline round
    stays to be run by a later fetch."""
    threads, order = {}, []
    gen = AsyncBatchGenerator(_one_at_a_time(threads, order, hold=4 * HOLD), generation_timeout=30).start()
    try:
        gen.submit_batch(batch(0, [1]))
        deadline = time.monotonic() + 10
        while not gen.started and time.monotonic() < deadline:
            time.sleep(0.01)
        gen.submit_batch(batch(1, [2]), inline=True)
        with pytest.raises(TimeoutError, match=r"round 1 \(inline\) waited for round\(s\) \[0\] in progress"):
            gen.get_batch(1, timeout=HOLD)
        assert gen.get_batch(1).round.rows == [4] and order == [0, 1]
        assert threads[1] == threading.current_thread().name and gen.get_batch(0).round.rows == [2]
    finally:
        gen.stop()


def test_an_inline_request_past_its_timeout_is_interrupted_and_raises():
    """An inline round runs on the caller's thread, so no wait bounds it: a watchdog interrupts it (`interrupt`, the
    backend's abort) at the fetch's deadline and `get_batch` raises `InlineTimeout` (a `TimeoutError`), also when the
    round ends without heeding the interrupt (the backend stays aborted: the round cannot count). A round inside its
    timeout is not interrupted."""
    from grpo_async.pipeline.batch_generator import InlineTimeout

    aborted = threading.Event()
    interrupts = []

    def interrupt():
        interrupts.append(threading.current_thread().name)
        aborted.set()

    def work(request):
        if request.round_id == 0:  # heeds the abort, as a backend does between engine steps
            if not aborted.wait(30):
                raise AssertionError("never interrupted")
            raise RuntimeError("generation aborted")
        if request.round_id == 1:  # does not: finishes after the deadline
            time.sleep(4 * HOLD)
        return doubled(request)

    gen = AsyncBatchGenerator(work, generation_timeout=30, interrupt=interrupt).start()
    try:
        gen.submit_batch(batch(0, [1]), inline=True)
        overran = r"round 0, generated on the caller's thread \(inline\), ran past its timeout"
        with pytest.raises(InlineTimeout, match=overran) as e:
            gen.get_batch(0, timeout=HOLD)
        assert isinstance(e.value, TimeoutError) and "generation aborted" in str(e.value.__cause__)
        assert len(interrupts) == 1 and interrupts[0] != threading.current_thread().name  # the watchdog's thread
        gen.submit_batch(batch(1, [2]), inline=True)
        with pytest.raises(InlineTimeout):
            gen.get_batch(1, timeout=HOLD)
        assert len(interrupts) == 2 and gen.get_pending_count() == 0
        gen.submit_batch(batch(2, [3]), inline=True)
        assert gen.get_batch(2).round.rows == [6] and len(interrupts) == 2
    finally:
        gen.stop()


def test_wait_until_sampled_returns_while_a_sampled_round_is_scored():
    """With `signals_sampled`, `wait_until_sampled` (what a weight load waits for) returns once every request queued
    or running has called `on_sampled`, while the last one is still scored; a request queued behind it, or one
    sampling, holds it; a request that fails before sampling releases it. Without `signals_sampled` it waits for the
    whole request (`wait_until_idle`)."""
    sampling, scoring = {0: threading.Event(), 1: threading.Event()}, {0: threading.Event(), 1: threading.Event()}
    sampled_at = {}

    def work(request, on_sampled):
        i = request.round_id
        if i == 2:
            raise ValueError("fails before sampling")
        assert sampling[i].wait(30), "never released"
        sampled_at[i] = time.monotonic()
        on_sampled()
        assert scoring[i].wait(30), "never released"  # its rewards: the load need not wait for them
        return doubled(request)

    gen = AsyncBatchGenerator(work, generation_timeout=30, signals_sampled=True).start()
    try:
        gen.submit_batch(batch(0, [1]))
        gen.submit_batch(batch(1, [2]))  # queued behind round 0 (one request at a time)
        with pytest.raises(TimeoutError, match=r"rounds \[0, 1\] still sampling after"):
            gen.wait_until_sampled(timeout=HOLD)
        sampling[0].set()
        with pytest.raises(TimeoutError, match=r"rounds \[1\] still sampling"):  # round 0 scored, round 1 queued
            gen.wait_until_sampled(timeout=HOLD)
        scoring[0].set()
        sampling[1].set()
        gen.wait_until_sampled()  # round 1 sampled, not scored
        assert gen.get_pending_count() == 1 and 1 in sampled_at
        scoring[1].set()
        assert gen.get_batch(0).round.rows == [2] and gen.get_batch(1).round.rows == [4]
        gen.submit_batch(batch(2, [3]))
        gen.wait_until_sampled()  # failed before sampling: nothing left to wait for
        with pytest.raises(RuntimeError, match="fails before sampling"):
            gen.get_batch(2)
    finally:
        for e in (*sampling.values(), *scoring.values()):
            e.set()
        gen.stop()

    release = threading.Event()
    plain = AsyncBatchGenerator(lambda r: release.wait(30) and doubled(r), generation_timeout=30).start()
    try:
        plain.submit_batch(batch(0, [1]))
        with pytest.raises(TimeoutError, match=r"rounds \[0\] still sampling"):  # no signal: the whole request
            plain.wait_until_sampled(timeout=HOLD)
        release.set()
        plain.wait_until_sampled()
        assert plain.get_pending_count() == 0
    finally:
        release.set()
        plain.stop()
