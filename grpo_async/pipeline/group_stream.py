"""`GroupStream`: the generator of stream mode (`GRPOConfig.async_mode="stream"`): prompt groups in, training rounds
assembled from the groups that finished first out.

```txt
trainer thread                     worker threads "grpo-async-stream-<i>" (max_inflight_groups of them)
──────────────                     ───────────────────────────────────────────────────────────────────
submit(RoundRequest r: R rows) ──▶ [groups r/0 .. r/(R/G − 1)] ──▶ producer(group, concurrent=True):
                                                                  generate G completions ─▶ rewards ─▶ advantages
get(k) ◀── Round k = the first R/G groups ready (any request) ◀── [ready groups, in order of readiness]
```

Each worker takes the next group (request order) and runs it through the producer on its own: the engine holds up to
`max_inflight_groups` groups at once and a group is ready when its G completions are scored, whatever the other
groups still generate. Training round k is assembled (`assemble`) from the first `R / G` ready groups, so a
straggler delays only the round that finally takes it, never the groups ready before it:

```txt
G = 2, R = 4 (2 groups a round), 2 rounds submitted: groups a b (round 0), c d (round 1); b is 10× longer
ready order: a c d b      →  round 0 = [a, c]   round 1 = [d, b]
```
Every group submitted is trained exactly once: a request's groups stay in the stream until a round takes them (the
scheduler only submits rounds the trainer trains, so the groups of the submitted requests fill exactly the rounds
submitted); a checkpoint assembles the rounds submitted and saves them (`RoundScheduler.state_dict`). Rounds
are assembled by `assemble` (the `RoundJoiner` of `pipeline/join.py`): advantages over the round's joined rewards
(per group for `scale_rewards="group"`, over the round for `"batch"`, as in rounds mode).

A publish that must not run under generating groups (no in-flight updates) holds the stream (`held`): no new group
starts, the running ones finish, the weights load, the stream goes on. With in-flight updates the engine loads between
two steps instead and every token records its version (`generation/engine_loop.py`).

Staleness pacing (`pacer`, `staleness_policy="pace"` with a limit M; the clock is the scheduler's
`StalenessPacer`): a worker does not start the next group if the round it would be trained in would make its rows
lag more than M policy versions; it waits for the trainer's next weights instead. What is knowable when a group
starts:

- its version v: the weights the sampler holds now, `published` (a group starts on them; with in-flight updates its
  first token may be sampled on newer ones: v only grows, so the bound errs on the safe side);
- its turn: rounds take groups in order of readiness, `R / G` each. The groups ready and those running were started
  before it; if they finish first it is trained in round `j = next + ⌊(ready + running) / (R / G)⌋`, `next` the next
  round to assemble. It is trained earlier only if it overtakes a running straggler (then fresher), later only if
  it straggles itself;
- the step round j starts training at, s_j (the trainer's clock: `StalenessPacer.step_at`).

It starts iff `s_j − v ≤ M`. Worked example (G = 4, R = 16: 4 groups a round, one optimizer step per round, M = 1,
num_batches_ahead = 1 so 8 groups in flight; group a is 10× longer than the others):

```txt
step 0, v0 published, next = 0: groups a b c d (round 0), e f g h (round 1) start: turns 0, 0, 0, 0, 1, 1, 1, 1;
       round 2's groups: ready + running = 8 → j = 2, s_2 − v0 = 2 > 1: held (the generator waits)
round 0 = [b c d e] (ready first) trains; next = 1, ready f g h + running a = 4 → j = 2: still held
step 1: round 1 waits for a (the trainer waits for the straggler) = [f g h a], staleness 1 − 0 = 1: trained;
       v1 published → j = 2, s_2 − v1 = 1: round 2's groups start        drop policy: they started at step 0 on
                                                                          v0; a lands in round 2: 2 − 0 > 1, dropped
```
A group already running cannot be held back: when it straggles, the groups started after it overtake it and fill the
rounds (with in-flight weight updates nothing else stops them), so starts alone leave it to go stale, and the long
completions are the ones that straggle (`bench/streaming.py` measured exactly that: pacing starts alone, M = 2,
dropped 23 % of the rows, trained mean length 0.39× the generated). So the assembly paces too: `get(j)` takes
first the ready groups for which j is the last round within M (`s_{j+1} − v > M`), and waits for the running ones
in that case (the trainer waits for the straggler instead of training without it and dropping it later). What the
consumer's guard still drops (and counts, `async/dropped_stale`): more such groups than a round holds, and a group
started late by the two bounds below. Never a deadlock: when the trainer waits (`get`) for the round a
held group would be trained in, no newer weights can come before that round is ready, so the group starts anyway
(a warning says its rows will be dropped: only a max_staleness below one round's steps does this); and no group is
held longer than `generation_timeout`. `pace_seconds` counts the wall time a start was held back
(`async/pace_wait_s`).

The generator protocol of `AsyncBatchGenerator` (`batch_generator.py`): `submit_batch(BatchRequest)`,
`get_batch(batch_id) -> BatchResult`, the same bounded waits, error propagation and shutdown: `get_batch`,
`submit_batch` and `held` wait
at most `generation_timeout`; a failed group fails the round that takes it (`RuntimeError("Async generation failed:
...")` chained from the error); `stop` interrupts the running groups (`interrupt`: the producer's abort) and joins
the threads within its timeout, the rest at interpreter exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .batch_generator import BatchRequest, BatchResult, join_at_exit, joined, wait_for
from .types import Round, RoundRequest

logger = logging.getLogger(__name__)


@dataclass
class ReadyGroup:
    """A prompt group scored and ready to train: its `Round` of G rows, and when it ran."""

    group: Round  # [G] rows, round_id = the request's round
    started: float  # perf_counter() when a worker took it
    finished: float  # perf_counter() when it was scored


class GroupStream:
    """Owns the worker threads, the groups waiting for one, and the ready groups.

    Args:
        produce (`Callable[[RoundRequest], Round]`): scores one group (`RoundProducer` with `concurrent=True`).
        assemble (`Callable[[list[Round]], Round]`): joins ready groups (relabelled as the training round) into one
            round (`pipeline/join.py: RoundJoiner`: rows concatenated and re-padded, advantages over the joined
            rewards, metrics over the joined rows; each row keeps its request's `round_id` and `row_index`).
        num_generations (`int`): G, the rows of a group.
        max_inflight_groups (`int`): worker threads: most groups generating or being scored at once.
        max_queue_size (`int`, *optional*, defaults to `4`): rounds (of groups) queued, running or ready at once;
            `submit` waits for room, up to `generation_timeout`, then raises.
        generation_timeout (`float`, *optional*, defaults to `600`): seconds any single wait may last.
        name (`str`, *optional*): thread-name prefix, also the prefix of log lines.
        interrupt (`Callable[[], None]`, *optional*): called by `stop` while groups run (the producer's abort).
        pacer (`StalenessPacer`, *optional*): staleness pacing (`staleness.StalenessPacer`, the trainer's clock);
            `None`: groups start whenever a worker is free.
    """

    def __init__(
        self,
        produce: Callable[[RoundRequest], Round],
        assemble: Callable[[list[Round]], Round],
        *,
        num_generations: int,
        max_inflight_groups: int,
        max_queue_size: int = 4,
        generation_timeout: float = 600.0,
        name: str = "grpo-async-stream",
        interrupt: Callable[[], None] | None = None,
        pacer=None,
    ):
        if not isinstance(max_inflight_groups, int) or max_inflight_groups < 1:
            raise ValueError(f"GroupStream: max_inflight_groups must be an int >= 1, got {max_inflight_groups!r}")
        if not generation_timeout or generation_timeout <= 0 or generation_timeout == float("inf"):
            raise ValueError(
                f"GroupStream: generation_timeout must be a finite number of seconds > 0, got {generation_timeout!r}"
            )
        self.produce = produce
        self.G = num_generations
        self.max_inflight_groups = max_inflight_groups
        self.max_queue_size = max_queue_size
        self.generation_timeout = float(generation_timeout)
        self.assemble = assemble
        self.name = name
        self.interrupt = interrupt
        self.started: list[int] = []  # request rounds whose first group started (what the backend generated)
        self.interrupted: list[int] = []  # request rounds with a group ended by `stop`
        self._cond = threading.Condition()
        self._waiting: deque[RoundRequest] = deque()  # groups no worker took yet, in request order
        self._running = 0
        self._ready: deque[ReadyGroup | BaseException] = deque()  # in order of readiness; a failed group: its error
        self._submitted: set[int] = set()
        self._groups_per_round: int | None = None
        self._held = 0  # publishes holding the stream (no group starts)
        self._last_round: int | None = None  # the training round last assembled
        self._last_take = time.perf_counter()  # when the last round was assembled (or the stream started)
        self._delivered, self._delivery_seconds = 0, 0.0  # rounds assembled, their seconds (average generation time)
        self._busy = 0.0  # seconds with at least one group running
        self._busy_since: float | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._fatal: BaseException | None = None
        self.pacer = pacer
        self._wanted: int | None = None  # the round the trainer waits for in `get` (pacing never holds its groups)
        self._pace_since: float | None = None  # perf_counter() since which a start is held back
        self._pace_total = 0.0  # seconds starts were held back, holds that ended
        self._forced: int | None = None  # the last round whose groups started despite the pacer (warned once)
        self._versions: dict[int, int] = {}  # pacing: running groups (id of the request) → the version they started on

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> GroupStream:
        if any(t.is_alive() for t in self._threads):
            return self
        self._stop.clear()
        self._threads = [
            threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True)
            for i in range(self.max_inflight_groups)
        ]
        for t in self._threads:
            t.start()
        join_at_exit(self)
        return self

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the workers: groups not started are dropped, running ones interrupted (`interrupt`); join within
        `timeout` seconds in all. Returns whether every thread has exited (if not, they are joined again at exit)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            busy = self._running > 0
        if busy and self.interrupt is not None:
            try:
                self.interrupt()
            except Exception as e:  # noqa: BLE001 - the join below still bounds the wait
                logger.warning("[%s] interrupting the running groups failed: %r", self.name, e)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            logger.warning("[%s] %s still running after %.1fs; joined again at exit", self.name, alive, timeout)
            return False
        joined(self)
        return True

    def is_running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def check_health(self) -> None:
        """Raise if a worker died outside of a group (groups' own errors fail the round that takes them)."""
        if self._fatal is not None:
            raise RuntimeError(f"Async generation failed: a {self.name} thread died: {self._fatal!r}") from self._fatal
        if self._threads and not self._stop.is_set() and not all(t.is_alive() for t in self._threads):
            raise RuntimeError(f"Async generation failed: a {self.name} thread exited unexpectedly")

    # -- trainer side ----------------------------------------------------------------------------------------
    def submit_batch(self, batch: BatchRequest, timeout: float | None = None, inline: bool = False) -> None:
        """Queue the prompt groups of `batch.round` (`R / G` groups of G consecutive rows). Waits for room (at most
        `timeout`, default `generation_timeout`), then raises `TimeoutError`. `inline` (`AsyncBatchGenerator`'s: run
        on the fetching thread) is refused: a stream's groups run on its workers."""
        if not isinstance(batch, BatchRequest):
            raise TypeError(f"GroupStream.submit_batch expects a BatchRequest, got {type(batch).__name__}")
        if inline:
            raise ValueError("GroupStream.submit_batch: inline=True is for rounds mode (groups run on workers)")
        if not self._threads:
            raise RuntimeError("GroupStream.submit_batch called before start()")
        request = batch.round
        R, G = len(request.rows), self.G
        if R == 0 or R % G:
            raise ValueError(f"round {request.round_id}: {R} rows are not whole groups of num_generations={G}")
        first = request.first_row  # the request's rows are rows [first, first + R) of its round
        groups = [RoundRequest(request.round_id, request.rows[g : g + G], first_row=first + g) for g in range(0, R, G)]
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            if request.round_id in self._submitted:
                raise ValueError(f"round {request.round_id} was already submitted")
            if self._groups_per_round is None:
                self._groups_per_round = len(groups)
            elif len(groups) != self._groups_per_round:
                raise ValueError(
                    f"round {request.round_id} has {len(groups)} groups, earlier rounds {self._groups_per_round}: "
                    "stream mode assembles rounds of one size"
                )
            room = self.max_queue_size * len(groups)
            self._wait(
                lambda: self._held_groups() + len(groups) <= room,
                deadline,
                lambda: (
                    f"submit_batch(round {request.round_id}): stream full ({self._held_groups()} groups waiting, "
                    f"running or ready; room for {room}) for {timeout:.1f}s; the request was not queued"
                ),
            )
            self._submitted.add(request.round_id)
            self._waiting.extend(groups)
            self._cond.notify_all()

    def get_batch(self, round_id: int, timeout: float | None = None) -> BatchResult:
        """Training round `round_id`: the first `R / G` groups ready, waited for at most `timeout` (default
        `generation_timeout`). Rounds are assembled in increasing `round_id` (the order the trainer trains them).

        Raises:
            `RuntimeError`: "Async generation failed: ..." when a group it takes failed (chained), or a worker died.
            `TimeoutError`: when the groups are not ready in time.
        """
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._last_round is not None and round_id <= self._last_round:
                raise KeyError(
                    f"get_batch({round_id}): round {self._last_round} was already assembled (rounds go in order)"
                )
            need = self._groups_per_round
            if need is None:
                raise KeyError(f"get_batch({round_id}): nothing was submitted")
            self._wanted = round_id
            self._cond.notify_all()  # a worker held by the pacer re-checks: the trainer now waits for this round
            last_chance = self._last_chance(round_id)
            if last_chance and last_chance():
                logger.info(
                    "[%s] pacing: round %d waits for %d running group(s) that would lag more than max_staleness %d "
                    "in a later round",
                    self.name,
                    round_id,
                    len(last_chance()),
                    self.pacer.limit,
                )
            try:
                self._wait(
                    lambda: len(self._ready) >= need and not (last_chance and last_chance()),
                    deadline,
                    lambda: (
                        f"Async generation timed out: round {round_id}: {len(self._ready)} of {need} groups ready "
                        f"after {timeout:.1f}s ({self._running} running, {len(self._waiting)} waiting); raise "
                        "`async_generation_timeout` if groups are slow"
                    ),
                )
            finally:
                self._wanted = None
            taken = self._take(round_id, need)
            self._last_round = round_id
            now, since = time.perf_counter(), self._last_take
            self._last_take = now
            running = self._running
            self._cond.notify_all()
        for item in taken:
            if isinstance(item, BaseException):
                raise RuntimeError(
                    f"Async generation failed: round {round_id}: {type(item).__name__}: {item}"
                ) from item
        rnd = self.assemble([dataclasses.replace(g.group, round_id=round_id) for g in taken])
        latency = torch.tensor([g.finished - g.started for g in taken])  # [R / G] seconds, started → scored
        rnd.metrics.update(
            {
                "async/inflight_groups": float(running),
                "async/group_latency/p50": latency.quantile(0.5).item(),
                "async/group_latency/p90": latency.quantile(0.9).item(),
            }
        )
        rnd.generation_time = now - since  # the wall time the stream took to deliver this round
        with self._cond:
            self._delivered += 1
            self._delivery_seconds += rnd.generation_time
        return BatchResult(round_id, rnd, rnd.generation_time)

    def get_average_generation_time(self) -> float:
        """Mean wall seconds the stream took to deliver a round, over the rounds delivered (0.0 before the first)."""
        with self._cond:
            return self._delivery_seconds / self._delivered if self._delivered else 0.0

    @contextlib.contextmanager
    def held(self, timeout: float | None = None) -> Iterator[None]:
        """No group starts inside the block, and the block starts once no group runs (waited for at most `timeout`,
        default `generation_timeout`): a weight load that must not run under generating groups."""
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            self._held += 1
        try:
            with self._cond:
                self._wait(
                    lambda: self._running == 0,
                    deadline,
                    lambda: f"Async generation timed out: {self._running} groups still running after {timeout:.1f}s",
                )
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    def wait_until_idle(self, timeout: float | None = None) -> None:
        """Wait until no group is waiting or running (at most `timeout`, default `generation_timeout`)."""
        timeout = self.generation_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            self._wait(
                lambda: not self._waiting and not self._running,
                deadline,
                lambda: f"Async generation timed out: groups still running after {timeout:.1f}s",
            )

    def get_pending_count(self) -> int:
        """Groups waiting for a worker or running."""
        with self._cond:
            return len(self._waiting) + self._running

    def get_completed_count(self) -> int:
        """Groups ready, not yet taken by a round."""
        with self._cond:
            return len(self._ready)

    def busy_seconds(self) -> float:
        """Seconds with at least one group running (generating or being scored), counted up to now."""
        with self._cond:
            since = self._busy_since
            return self._busy + (time.perf_counter() - since if since is not None else 0.0)

    def wake(self) -> None:
        """The pacer's clock moved (the trainer's new weights): held workers check again."""
        with self._cond:
            self._cond.notify_all()

    def pace_seconds(self) -> float:
        """Wall seconds during which a group was waiting, a worker free and the pacer refused its start, counted up
        to now."""
        with self._cond:
            since = self._pace_since
            return self._pace_total + (time.perf_counter() - since if since is not None else 0.0)

    def _pace_refuses(self) -> bool:
        """With `_cond` held and a group waiting: whether the pacer holds its start back (the module docstring)."""
        pacer = self.pacer
        clock = pacer.clock if pacer is not None else None
        if clock is None or not self._groups_per_round:
            return False
        nxt = clock.next_round if self._last_round is None else max(clock.next_round, self._last_round + 1)
        turn = nxt + (len(self._ready) + self._running) // self._groups_per_round
        if pacer.allows(turn):
            return False
        lag = pacer.lag(turn)
        if self._wanted is not None and turn <= self._wanted:  # the trainer cannot move before this round: start
            if self._forced != turn:
                self._forced = turn
                logger.warning(
                    "[%s] pacing: the trainer waits for round %d, whose next group would lag %d policy versions "
                    "(max_staleness %d, weights v%d); started anyway (the consumer drops the rows beyond the limit)",
                    self.name,
                    turn,
                    lag,
                    pacer.limit,
                    clock.published,
                )
            return False
        now = time.perf_counter()
        if self._pace_since is None:
            logger.info(
                "[%s] pacing: holding the groups of round %d: trained in round %d at step %d they would lag %d "
                "policy versions behind the weights they would start on (v%d; max_staleness %d)",
                self.name,
                self._waiting[0].round_id,
                turn,
                pacer.step_at(turn, clock),
                lag,
                clock.published,
                pacer.limit,
            )
            self._pace_since = now
        elif now - self._pace_since > self.generation_timeout:  # bounded: start rather than wait any longer
            logger.warning(
                "[%s] pacing: a group held for %.1fs (async_generation_timeout); started anyway (lag %d > "
                "max_staleness %d: the consumer drops its rows)",
                self.name,
                now - self._pace_since,
                lag,
                pacer.limit,
            )
            return False
        return True

    def _overdue(self, round_id: int):
        """With pacing: `version -> bool`, whether rows of that version lag more than the limit if trained after
        round `round_id` (in round `round_id + 1`, from step s_{round_id+1}); `None` without pacing."""
        clock = self.pacer.clock if self.pacer is not None else None
        if clock is None:
            return None
        after = self.pacer.step_at(round_id + 1, clock)
        return lambda version: after - version > self.pacer.limit

    def _last_chance(self, round_id: int):
        """With `_cond` held: `None` without pacing, else a callable listing the running groups for which round
        `round_id` is the last one that trains them within the limit (the round waits for them: the trainer waits
        for a straggler rather than let it go stale, when only its start could not be paced)."""
        overdue = self._overdue(round_id)
        if overdue is None:
            return None
        return lambda: [v for v in self._versions.values() if overdue(v)]

    def _take(self, round_id: int, need: int) -> list:
        """With `_cond` held: the `need` ready groups round `round_id` takes: first (pacing) those it is the last
        round to train within the limit, then the others in order of readiness."""
        overdue = self._overdue(round_id)
        ready = list(self._ready)
        first = [g for g in ready if overdue and isinstance(g, ReadyGroup) and overdue(g.group.policy_version)]
        taken = first[:need]
        taken += [g for g in ready if not any(g is t for t in taken)][: need - len(taken)]
        self._ready = deque(g for g in ready if not any(g is t for t in taken))
        return taken

    def _end_pacing(self) -> None:
        """With `_cond` held: no start is held back (any more)."""
        if self._pace_since is not None:
            held = time.perf_counter() - self._pace_since
            self._pace_total += held
            self._pace_since = None
            clock = self.pacer.clock
            logger.info("[%s] pacing: released after %.3fs (weights v%d)", self.name, held, clock.published)

    def _held_groups(self) -> int:
        return len(self._waiting) + self._running + len(self._ready)

    def _wait(self, done, deadline: float, timeout_message) -> None:
        wait_for(self._cond, done, deadline, timeout_message, self.check_health)

    # -- the workers -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop.is_set() and (self._held or not self._waiting or self._pace_refuses()):
                        if not self._waiting:  # nothing held back (a publish's hold keeps a pacing hold on)
                            self._end_pacing()
                        self._cond.wait(0.5)
                    if self._stop.is_set():
                        return
                    self._end_pacing()
                    request = self._waiting.popleft()
                    if self.pacer is not None and self.pacer.clock is not None:  # the weights it starts on
                        self._versions[id(request)] = self.pacer.clock.published
                    start = time.perf_counter()
                    if self._running == 0:
                        self._busy_since = start
                    self._running += 1
                    if request.round_id not in self.started:
                        self.started.append(request.round_id)
                try:
                    item: ReadyGroup | BaseException = ReadyGroup(self.produce(request), start, time.perf_counter())
                except Exception as e:  # raised to the trainer when a round takes it
                    if self._stop.is_set():
                        logger.info("[%s] round %d group interrupted at shutdown: %r", self.name, request.round_id, e)
                        self.interrupted.append(request.round_id)
                    else:
                        logger.error("[%s] round %d group failed: %r", self.name, request.round_id, e)
                    item = e
                with self._cond:
                    self._running -= 1
                    self._versions.pop(id(request), None)
                    if self._running == 0 and self._busy_since is not None:
                        self._busy += time.perf_counter() - self._busy_since
                        self._busy_since = None
                    self._ready.append(item)
                    self._cond.notify_all()
        except BaseException as e:  # pragma: no cover - e.g. KeyboardInterrupt delivered to this thread
            self._fatal = e
            with self._cond:
                self._cond.notify_all()
            raise
