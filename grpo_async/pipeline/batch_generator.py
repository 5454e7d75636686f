"""`AsyncBatchGenerator`: the generator thread of seed 003 — one background thread that turns `BatchRequest`s (a
typed `RoundRequest` inside) into `BatchResult`s (a `Round` inside).

```
trainer thread                                  generator thread "grpo-async-generator"
──────────────                                  ─────────────────────────────────────────
submit_batch(BatchRequest 0) ──▶ [queue] ──▶ generate_fn(round request 0) ──▶ completed[0]: BatchResult 0
submit_batch(BatchRequest 1) ──▶            generate_fn(round request 1) ──▶ completed[1]: BatchResult 1
get_batch(0)  ◀──────────────────────────── (waits at most `timeout`)
```

Guarantees: a request is never dropped (a full queue makes `submit_batch` wait, then raise); every wait is bounded;
an exception in `generate_fn` reaches the caller of `get_batch` as `RuntimeError("Async generation failed: ...")`
chained from the original; a dead thread is reported, not waited on. `get_average_generation_time()` is the mean
seconds per batch so far (the scheduler logs it as `async/average_generation_time`).

A request submitted `inline` is not the thread's: the caller fetches it next and would only wait for it, so
`get_batch` (or `wait_until_idle`) runs `generate_fn` on the caller's thread instead. On a CPU, torch's OpenMP regions
run ~1.5× slower on a background thread than on the main one (2 OpenMP threads, SmolLM2's decode step: 8 × 576 ×
1536 matmuls at 0.40 vs 0.25 ms; equal with one OpenMP thread), so a round nothing runs beside (the first of a
`train()`, every round of sync mode) is generated faster there (`RoundScheduler` asks for it with backends whose
`generate` computes on the calling thread, `BackendSpec.runs_on_caller`). One request runs at a time, the thread's or
an inline one (an engine stepped from two threads at once would break): the thread does not start a request while an
inline one of a lower batch id waits for its caller (fetched first), an inline request waits for the thread's request
in progress, and `get_batch(i)` runs the inline requests up to `i` in order.

A weight load waits for sampling only: with `signals_sampled`, `generate_fn(request, on_sampled=...)` calls
`on_sampled()` once the request's completions are in (the backend released), and `wait_until_sampled` waits for that
instead of the whole request, so the load overlaps the rewards and advantages of the round that just sampled:

```
generator thread   round r: sample ──────────────▶ on_sampled ─ rewards, advantages ─▶ completed[r]
trainer thread     wait_until_sampled ─────────────────────────▶ load weights ─▶ get_batch(r) ─▶ submit r + 1
```

Shutdown: `stop` interrupts the request in progress (`interrupt`, e.g. the backend's abort) and joins the thread
within its bound. A thread still running after that (a reward stuck in user code) is joined again at interpreter
exit (`atexit`), so the process never exits under a running torch thread (which aborts it: `terminate called
without an active exception`, exit code 134).
"""

from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .types import Round, RoundRequest

logger = logging.getLogger(__name__)

#: generators whose thread may still run: joined at interpreter exit (`_join_at_exit`)
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _join_at_exit() -> None:
    """Interrupt and join every generator thread still alive (bounded by each one's `generation_timeout`): the
    interpreter must not finalize under a thread running torch code."""
    for generator in list(_LIVE):
        if generator.is_running():
            generator.stop(generator.generation_timeout)


def join_at_exit(owner) -> None:
    """Join `owner`'s threads at interpreter exit if they still run then (`owner.is_running()`, `owner.stop(t)`,
    `owner.generation_timeout`): `AsyncBatchGenerator` and `GroupStream` register themselves when they start."""
    _LIVE.add(owner)
    # (re-)registered last, so it runs first at exit: before the handlers of engines built since (vLLM's)
    atexit.unregister(_join_at_exit)
    atexit.register(_join_at_exit)


def joined(owner) -> None:
    """`owner`'s threads have exited: nothing to join at exit."""
    _LIVE.discard(owner)


def wait_for(cond: threading.Condition, done, deadline: float, timeout_message, check_health) -> None:
    """With `cond` held: wait until `done()`, calling `check_health()` (which re-raises a worker thread's death) at
    least every 0.5 s, or raise `TimeoutError(timeout_message())` at `deadline` (`time.monotonic()`)."""
    while not done():
        check_health()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(timeout_message())
        cond.wait(min(left, 0.5))


class InlineTimeout(TimeoutError):
    """A round generated on the caller's thread (inline) ran past its fetch's timeout and was interrupted."""


@dataclass
class BatchRequest:
    """What the trainer asks the generator for (seed 003's `BatchRequest`, typed): batch `batch_id` (a round: the
    pipeline counts rounds, and `batch_id` is the round's id) and the `RoundRequest` of its rows (`[R]` dataset rows
    of every process, each prompt's G copies consecutive)."""

    batch_id: int
    round: RoundRequest

    def __post_init__(self):
        if not isinstance(self.round, RoundRequest):
            raise TypeError(f"BatchRequest.round must be a RoundRequest, got {type(self.round).__name__}")
        if self.round.round_id != self.batch_id:
            raise ValueError(f"BatchRequest: batch_id {self.batch_id} but its round is {self.round.round_id}")


@dataclass
class BatchResult:
    """A generated batch (seed 003's `BatchResult`, typed): `round` holds the rows, rewards and advantages (`Round`
    `[R]`), `generation_time` the seconds `generate_fn` took. A failed batch never comes back as a result:
    `get_batch` raises its error."""

    batch_id: int
    round: Round
    generation_time: float


class AsyncBatchGenerator:
    """Owns the generator thread, its bounded request queue and the completed batches.

    Args:
        generate_fn (`Callable[[RoundRequest], Round]`): produces the round of one request (the `RoundProducer`);
            the generator sets the returned round's `generation_time` to the seconds spent in it.
        max_queue_size (`int`, *optional*, defaults to `4`): most requests queued, running or completed-but-not-
            fetched at once. `submit` waits for room, up to `generation_timeout`, then raises.
        generation_timeout (`float`, *optional*, defaults to `600`): seconds any single wait may last.
        name (`str`, *optional*): thread name, also the prefix of its log lines.
        interrupt (`Callable[[], None]`, *optional*): called by `stop` (from the stopping thread) while a request
            is running, to make `generate_fn` return early (raising); e.g. `RoundProducer.abort`.
        signals_sampled (`bool`, *optional*, defaults to `False`): `generate_fn` takes `on_sampled`, a callable it
            calls once its request has sampled (`RoundProducer`); `wait_until_sampled` then waits for that only.
    """

    def __init__(
        self,
        generate_fn: Callable[[RoundRequest], Round],
        max_queue_size: int = 4,
        generation_timeout: float = 600.0,
        name: str = "grpo-async-generator",
        interrupt: Callable[[], None] | None = None,
        signals_sampled: bool = False,
    ):
        if not callable(generate_fn):
            raise TypeError(f"AsyncBatchGenerator: generate_fn must be callable, got {type(generate_fn).__name__}")
        if not isinstance(max_queue_size, int) or max_queue_size < 1:
            raise ValueError(f"AsyncBatchGenerator: max_queue_size must be an int >= 1, got {max_queue_size!r}")
        if not generation_timeout or generation_timeout <= 0 or generation_timeout == float("inf"):
            raise ValueError(
                "AsyncBatchGenerator: generation_timeout must be a finite number of seconds > 0, got "
                f"{generation_timeout!r}"
            )
        self.generate_fn = generate_fn
        self.max_queue_size = max_queue_size
        self.generation_timeout = float(generation_timeout)
        self.name = name
        self.interrupt = interrupt
        self.signals_sampled = signals_sampled
        self.started: list[int] = []  # round ids whose generation started, in order (what the backend generated)
        self.interrupted: list[int] = []  # round ids that ended with an error after `stop` (aborted at shutdown)
        self._requests: queue.Queue[RoundRequest] = queue.Queue()
        self._inline: dict[int, RoundRequest] = {}  # submitted `inline`: run by the thread that fetches them
        self._cond = threading.Condition()
        self._submitted: set[int] = set()
        self._pending: set[int] = set()  # queued or running
        self._sampled: set[int] = set()  # running, past sampling (`on_sampled` called): being scored
        self._completed: dict[int, Round | BaseException] = {}  # a failed request holds its exception
        self._busy = 0.0  # seconds spent in `generate_fn` by requests that finished
        self._generated = 0  # requests that finished successfully (get_average_generation_time)
        self._generation_seconds = 0.0  # their seconds in `generate_fn`
        #: round id → perf_counter() at which it started, for the requests running now (the thread's; an inline one)
        self._running: dict[int, float] = {}
        self._overrun: set[int] = set()  # inline requests interrupted past their deadline (`_overran`)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> AsyncBatchGenerator:
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        join_at_exit(self)
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the thread: queued requests are dropped, the one in progress is interrupted (`interrupt`); join at
        most `timeout` seconds. Returns whether the thread has exited (if not, it is joined again at exit)."""
        self._stop.set()
        with self._cond:
            self._pending.difference_update(self._inline)  # never started: dropped as the queued ones
            self._inline.clear()
            self._cond.notify_all()
            busy = bool(self._running)
        if busy and self.interrupt is not None:
            try:
                self.interrupt()
            except Exception as e:  # noqa: BLE001 - the join below still bounds the wait
                logger.warning("[%s] interrupting the running request failed: %r", self.name, e)
        if self._thread is None:
            return True
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning(
                "[%s] still running after %.1fs (interrupted: %s); it is joined again at exit",
                self.name,
                timeout,
                self.interrupt is not None,
            )
            return False
        joined(self)
        return True

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check_health(self) -> None:
        """Raise if the thread died outside of a request (requests' own errors are raised by `get`)."""
        if self._fatal is not None:
            raise RuntimeError(f"Async generation failed: thread {self.name} died: {self._fatal!r}") from self._fatal
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError(f"Async generation failed: thread {self.name} exited unexpectedly")

    # -- producer side ---------------------------------------------------------------------------------------
    def submit_batch(self, request: BatchRequest, timeout: float | None = None, inline: bool = False) -> None:
        """Queue `request`. Waits for room (at most `timeout`, default `generation_timeout`), then raises.
        `inline`: the caller fetches it next (nothing to do meanwhile): `get_batch` runs it on the caller's thread
        instead of the generator thread (see the module docstring)."""
        if not isinstance(request, BatchRequest):
            raise TypeError(f"AsyncBatchGenerator.submit_batch expects a BatchRequest, got {type(request).__name__}")
        if self._thread is None:
            raise RuntimeError("AsyncBatchGenerator.submit_batch called before start()")
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        batch_id = request.batch_id
        with self._cond:
            if batch_id in self._submitted:
                raise ValueError(f"batch {batch_id} was already submitted")
            self._wait(
                lambda: len(self._pending) + len(self._completed) < self.max_queue_size,
                deadline,
                lambda: (
                    f"submit_batch(batch {batch_id}): queue full ({len(self._pending)} pending, "
                    f"{len(self._completed)} completed not fetched, max_queue_size={self.max_queue_size}) "
                    f"for {timeout:.1f}s; the request was not queued"
                ),
            )
            self._submitted.add(batch_id)
            self._pending.add(batch_id)
            if inline:
                self._inline[batch_id] = request.round
                return
        self._requests.put(request.round)

    # -- consumer side ---------------------------------------------------------------------------------------
    def get_batch(self, batch_id: int, timeout: float | None = None) -> BatchResult:
        """Wait for batch `batch_id` (at most `timeout`, default `generation_timeout`) and return it.

        Raises:
            `RuntimeError`: "Async generation failed: ..." when `generate_fn` raised (chained) or the thread died.
            `TimeoutError`: when the batch is not ready in time.
            `KeyError`: when `batch_id` was never submitted.
            `InlineTimeout` (a `TimeoutError`): when the batch, generated on this thread (`inline`), ran past the
            timeout; it was interrupted (`interrupt`).
        """
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._run_inlines(deadline, up_to=batch_id)  # the thread may wait for those fetched before it
        with self._cond:
            if batch_id not in self._submitted:
                raise KeyError(f"get_batch({batch_id}): that batch was never submitted")
            self._wait(
                lambda: batch_id in self._completed,
                deadline,
                lambda: (
                    f"Async generation timed out: round {batch_id} not ready after {timeout:.1f}s "
                    f"(pending={sorted(self._pending)}); raise `async_generation_timeout` if rounds are slow"
                ),
            )
            result = self._completed.pop(batch_id)
            self._submitted.discard(batch_id)
            self._cond.notify_all()
        if isinstance(result, InlineTimeout):  # an inline round past its timeout (`_produce`)
            raise result
        if isinstance(result, BaseException):
            raise RuntimeError(
                f"Async generation failed: round {batch_id}: {type(result).__name__}: {result}"
            ) from result
        return BatchResult(batch_id, result, result.generation_time)

    def wait_until_idle(self, timeout: float | None = None) -> None:
        """Wait until no request is queued or running (at most `timeout`, default `generation_timeout`); completed
        rounds stay until fetched. Raises `TimeoutError`, or the thread's death as in `get`."""
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._run_inlines(deadline)
        with self._cond:
            self._wait(
                lambda: not self._pending,
                deadline,
                lambda: (
                    f"Async generation timed out: rounds {sorted(self._pending)} still running after "
                    f"{timeout:.1f}s; raise `async_generation_timeout` if rounds are slow"
                ),
            )

    def wait_until_sampled(self, timeout: float | None = None) -> None:
        """Wait until every request queued or running has sampled (`on_sampled` called, or finished): no request will
        use the backend's weights again, those still running only score. Without `signals_sampled` that is
        `wait_until_idle`. Bounded and raising as `wait_until_idle`."""
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._run_inlines(deadline)
        with self._cond:
            self._wait(
                lambda: self._pending <= self._sampled,
                deadline,
                lambda: (
                    f"Async generation timed out: rounds {sorted(self._pending - self._sampled)} still sampling "
                    f"after {timeout:.1f}s; raise `async_generation_timeout` if rounds are slow"
                ),
            )

    def _mark_sampled(self, round_id: int) -> None:
        with self._cond:
            if round_id in self._running:
                self._sampled.add(round_id)
                self._cond.notify_all()

    def _wait(self, done, deadline: float, timeout_message) -> None:
        wait_for(self._cond, done, deadline, timeout_message, self.check_health)

    def get_pending_count(self) -> int:
        with self._cond:
            return len(self._pending)

    def get_completed_count(self) -> int:
        with self._cond:
            return len(self._completed)

    def get_average_generation_time(self) -> float:
        """Mean seconds `generate_fn` took per batch that finished successfully (0.0 before the first)."""
        with self._cond:
            return self._generation_seconds / self._generated if self._generated else 0.0

    def busy_seconds(self) -> float:
        """Seconds spent in `generate_fn` since this generator was made, by the thread or inline on a caller's (the
        requests running now counted up to now, failed ones too): the rest of the time no request ran."""
        with self._cond:
            now = time.perf_counter()
            running = sum(now - start for start in self._running.values())
            return self._busy + running

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    request = self._requests.get(timeout=0.1)
                except queue.Empty:
                    continue
                if not self._produce(self._thread_turn(request)):  # stopped while it was queued: never started
                    break
        except BaseException as e:  # pragma: no cover - e.g. KeyboardInterrupt delivered to this thread
            self._fatal = e
            with self._cond:
                self._cond.notify_all()
            raise

    def _thread_turn(self, request: RoundRequest) -> Callable[[], RoundRequest]:
        """The thread's `take` of `request`: waits while an inline request runs or one fetched before it waits."""

        def take() -> RoundRequest:
            while not self._stop.is_set() and (self._running or any(i < request.round_id for i in self._inline)):
                self._cond.wait(0.5)
            return request

        return take

    def _run_inlines(self, deadline: float, up_to: float = float("inf")) -> None:
        """Run on this (the caller's) thread, in order, the inline requests not run yet whose id is at most `up_to`."""
        with self._cond:
            ids = sorted(i for i in self._inline if i <= up_to)
        for batch_id in ids:
            self._run_inline(batch_id, deadline)

    def _run_inline(self, batch_id: int, deadline: float) -> None:
        """Run request `batch_id` on this (the caller's) thread if it was submitted `inline` and has not run, once the
        thread's request in progress (if any) ended; `TimeoutError` at `deadline`, the request left inline."""

        def take() -> RoundRequest | None:
            if batch_id not in self._inline:  # already run, or dropped by `stop`
                return None
            self._wait(
                lambda: not self._running or self._stop.is_set(),
                deadline,
                lambda: (
                    f"Async generation timed out: round {batch_id} (inline) waited for round(s) "
                    f"{sorted(self._running)} in progress; raise `async_generation_timeout` if rounds are slow"
                ),
            )
            return self._inline.pop(batch_id, None)

        self._produce(take, deadline)

    def _overran(self, round_id: int) -> None:
        """The watchdog of an inline request past its fetch's deadline: interrupt it (`interrupt`, the backend's
        abort), if it still runs; its batch becomes a `TimeoutError` (`_produce`)."""
        with self._cond:
            if round_id not in self._running:
                return
            self._overrun.add(round_id)
        logger.error("[%s] round %d (inline) ran past its timeout: interrupting it", self.name, round_id)
        if self.interrupt is not None:
            self.interrupt()

    def _produce(self, take: Callable[[], RoundRequest | None], deadline: float | None = None) -> bool:
        """Run `generate_fn` on this thread on the request `take()` gives (called with the lock held, it waits for
        its turn) and complete its batch (the result, or the exception it raised); False, running nothing, when
        `take` gives none or once stopped. With `deadline` (an inline request: its caller waits on nothing else) a
        watchdog interrupts it at that `time.monotonic()`, and its batch is then an `InlineTimeout` whatever
        it returned (the backend stays aborted until the scheduler's `stop` resumes it)."""
        with self._cond:
            request = take()
            if request is None or self._stop.is_set():
                return False
            start = self._running[request.round_id] = time.perf_counter()
            self.started.append(request.round_id)
        watchdog = None
        if deadline is not None:
            watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), self._overran, (request.round_id,))
            watchdog.daemon = True
            watchdog.start()
        result: Round | BaseException | None = None  # None: ended by a BaseException (e.g. Ctrl-C inline): no batch
        try:
            if self.signals_sampled:
                result = self.generate_fn(request, on_sampled=functools.partial(self._mark_sampled, request.round_id))
            else:
                result = self.generate_fn(request)
            result.generation_time = time.perf_counter() - start
        except Exception as e:  # raised to the trainer by get
            if self._stop.is_set():
                logger.info("[%s] round %d interrupted at shutdown: %r", self.name, request.round_id, e)
                self.interrupted.append(request.round_id)
            else:
                logger.error("[%s] round %d failed: %r", self.name, request.round_id, e)
            result = e
        finally:
            if watchdog is not None:
                watchdog.cancel()
            with self._cond:
                self._busy += time.perf_counter() - start  # monotonic with busy_seconds() read meanwhile
                self._running.pop(request.round_id, None)
                if request.round_id in self._overrun:
                    self._overrun.discard(request.round_id)
                    timeout = InlineTimeout(
                        f"Async generation timed out: round {request.round_id}, generated on the caller's thread "
                        f"(inline), ran past its timeout and was interrupted; raise `async_generation_timeout` if "
                        "rounds are slow"
                    )
                    timeout.__cause__ = result if isinstance(result, BaseException) else None
                    result = timeout
                if result is not None and not isinstance(result, BaseException):  # average time: successes only
                    self._generated += 1
                    self._generation_seconds += result.generation_time
                self._pending.discard(request.round_id)
                self._sampled.discard(request.round_id)
                if result is not None:
                    self._completed[request.round_id] = result
                self._cond.notify_all()
        return True
