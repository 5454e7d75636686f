"""`RoundQueue`: the job queue — one background thread that turns `RoundRequest`s into `Round`s.

```
trainer thread                        generator thread "grpo-async-generator"
──────────────                        ─────────────────────────────────────────
submit(RoundRequest 0) ──▶ [queue] ──▶ producer(request 0) ──▶ completed[0]: Round 0
submit(RoundRequest 1) ──▶            producer(request 1) ──▶ completed[1]: Round 1
get(0)  ◀───────────────────────────── (waits at most `timeout`)
```

Guarantees: a request is never dropped (a full queue makes `submit` wait, then raise); every wait is bounded; an
exception in the producer reaches the caller of `get` as `RuntimeError("Async generation failed: ...")` chained from
the original; a dead thread is reported, not waited on.

Shutdown: `stop` interrupts the request in progress (`interrupt`, e.g. the backend's abort) and joins the thread
within its bound. A thread still running after that (a reward stuck in user code) is joined again at interpreter
exit (`atexit`), so the process never exits under a running torch thread (which aborts it: `terminate called
without an active exception`, exit code 134).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable

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
    `owner.generation_timeout`): `RoundQueue` and `GroupStream` register themselves when they start."""
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


class RoundQueue:
    """Owns the generator thread, its bounded request queue and the completed rounds.

    Args:
        generate_fn (`Callable[[RoundRequest], Round]`): produces the round of one request (the `RoundProducer`);
            the queue sets the returned round's `generation_time` to the seconds spent in it.
        max_queue_size (`int`, *optional*, defaults to `4`): most requests queued, running or completed-but-not-
            fetched at once. `submit` waits for room, up to `generation_timeout`, then raises.
        generation_timeout (`float`, *optional*, defaults to `600`): seconds any single wait may last.
        name (`str`, *optional*): thread name, also the prefix of its log lines.
        interrupt (`Callable[[], None]`, *optional*): called by `stop` (from the stopping thread) while a request
            is running, to make `generate_fn` return early (raising); e.g. `RoundProducer.abort`.
    """

    def __init__(
        self,
        generate_fn: Callable[[RoundRequest], Round],
        max_queue_size: int = 4,
        generation_timeout: float = 600.0,
        name: str = "grpo-async-generator",
        interrupt: Callable[[], None] | None = None,
    ):
        if not callable(generate_fn):
            raise TypeError(f"RoundQueue: generate_fn must be callable, got {type(generate_fn).__name__}")
        if not isinstance(max_queue_size, int) or max_queue_size < 1:
            raise ValueError(f"RoundQueue: max_queue_size must be an int >= 1, got {max_queue_size!r}")
        if not generation_timeout or generation_timeout <= 0 or generation_timeout == float("inf"):
            raise ValueError(
                f"RoundQueue: generation_timeout must be a finite number of seconds > 0, got {generation_timeout!r}"
            )
        self.generate_fn = generate_fn
        self.max_queue_size = max_queue_size
        self.generation_timeout = float(generation_timeout)
        self.name = name
        self.interrupt = interrupt
        self.started: list[int] = []  # round ids whose generation started, in order (what the backend generated)
        self.interrupted: list[int] = []  # round ids that ended with an error after `stop` (aborted at shutdown)
        self._requests: queue.Queue[RoundRequest] = queue.Queue()
        self._cond = threading.Condition()
        self._submitted: set[int] = set()
        self._pending: set[int] = set()  # queued or running
        self._completed: dict[int, Round | BaseException] = {}  # a failed request holds its exception
        self._busy = 0.0  # seconds spent in `generate_fn` by requests that finished
        self._busy_since: float | None = None  # perf_counter() at which the running request started
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> RoundQueue:
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
            self._cond.notify_all()
            busy = self._busy_since is not None
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
    def submit(self, request: RoundRequest, timeout: float | None = None) -> None:
        """Queue `request`. Waits for room (at most `timeout`, default `generation_timeout`), then raises."""
        if not isinstance(request, RoundRequest):
            raise TypeError(f"RoundQueue.submit expects a RoundRequest, got {type(request).__name__}")
        if self._thread is None:
            raise RuntimeError("RoundQueue.submit called before start()")
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            if request.round_id in self._submitted:
                raise ValueError(f"round {request.round_id} was already submitted")
            self._wait(
                lambda: len(self._pending) + len(self._completed) < self.max_queue_size,
                deadline,
                lambda: (
                    f"submit(round {request.round_id}): queue full ({len(self._pending)} pending, "
                    f"{len(self._completed)} completed not fetched, max_queue_size={self.max_queue_size}) "
                    f"for {timeout:.1f}s; the request was not queued"
                ),
            )
            self._submitted.add(request.round_id)
            self._pending.add(request.round_id)
        self._requests.put(request)

    # -- consumer side ---------------------------------------------------------------------------------------
    def get(self, round_id: int, timeout: float | None = None) -> Round:
        """Wait for round `round_id` (at most `timeout`, default `generation_timeout`) and return it.

        Raises:
            `RuntimeError`: "Async generation failed: ..." when `generate_fn` raised (chained) or the thread died.
            `TimeoutError`: when the round is not ready in time.
            `KeyError`: when `round_id` was never submitted.
        """
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            if round_id not in self._submitted:
                raise KeyError(f"get({round_id}): that round was never submitted")
            self._wait(
                lambda: round_id in self._completed,
                deadline,
                lambda: (
                    f"Async generation timed out: round {round_id} not ready after {timeout:.1f}s "
                    f"(pending={sorted(self._pending)}); raise `async_generation_timeout` if rounds are slow"
                ),
            )
            result = self._completed.pop(round_id)
            self._submitted.discard(round_id)
            self._cond.notify_all()
        if isinstance(result, BaseException):
            raise RuntimeError(
                f"Async generation failed: round {round_id}: {type(result).__name__}: {result}"
            ) from result
        return result

    def wait_until_idle(self, timeout: float | None = None) -> None:
        """Wait until no request is queued or running (at most `timeout`, default `generation_timeout`); completed
        rounds stay until fetched. Raises `TimeoutError`, or the thread's death as in `get`."""
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            self._wait(
                lambda: not self._pending,
                deadline,
                lambda: (
                    f"Async generation timed out: rounds {sorted(self._pending)} still running after "
                    f"{timeout:.1f}s; raise `async_generation_timeout` if rounds are slow"
                ),
            )

    def _wait(self, done, deadline: float, timeout_message) -> None:
        wait_for(self._cond, done, deadline, timeout_message, self.check_health)

    def get_pending_count(self) -> int:
        with self._cond:
            return len(self._pending)

    def get_completed_count(self) -> int:
        with self._cond:
            return len(self._completed)

    def busy_seconds(self) -> float:
        """Seconds the thread has spent in `generate_fn` since this generator was made, the request running now
        counted up to now (failed requests too): the rest of the time it sat idle, waiting for a request."""
        with self._cond:
            running = time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy + running

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    request = self._requests.get(timeout=0.1)
                except queue.Empty:
                    continue
                with self._cond:
                    if self._stop.is_set():  # stopped while it was queued: never started
                        break
                    start = self._busy_since = time.perf_counter()
                    self.started.append(request.round_id)
                try:
                    result = self.generate_fn(request)
                    result.generation_time = time.perf_counter() - start
                except Exception as e:  # raised to the trainer by get
                    if self._stop.is_set():
                        logger.info("[%s] round %d interrupted at shutdown: %r", self.name, request.round_id, e)
                        self.interrupted.append(request.round_id)
                    else:
                        logger.error("[%s] round %d failed: %r", self.name, request.round_id, e)
                    result = e
                with self._cond:
                    self._busy += time.perf_counter() - start  # monotonic with busy_seconds() read meanwhile
                    self._busy_since = None
                    self._pending.discard(request.round_id)
                    self._completed[request.round_id] = result
                    self._cond.notify_all()
        except BaseException as e:  # pragma: no cover - e.g. KeyboardInterrupt delivered to this thread
            self._fatal = e
            with self._cond:
                self._cond.notify_all()
            raise
