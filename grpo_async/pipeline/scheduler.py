"""`RoundScheduler`: decides, at every micro-step, which round is trained and which rounds are generated next.

It owns the pipeline's position (the next round to train, the rounds submitted ahead, the micro-step within the
epoch) and the job-queue thread; it calls the publisher, the producer (through the job queue) and the consumer, and
knows nothing of the Trainer: the trainer hands it the collectives, the loader it peeks into, and at each micro-step
the policy (the unwrapped model) with its version, which the scheduler publishes at each round boundary.

Worked example, `steps_per_generation=2`, `num_iterations=1`, `num_batches_ahead=1` (a round is 2 micro-steps):

```txt
micro-step 0: round 0 not submitted → publish v0 ─▶ submit r0 (this batch), r1 (loader.batch_at(2)) ─▶ wait r0
              ─▶ consumer(r0) → micro-batches [a, b] → train a
micro-step 1: train b
micro-step 2: r1 submitted → publish v1 once r1 sampled ─▶ fetch r1 ─▶ submit r2 (batch_at(4)) ─▶ consumer(r1) → a'
```
Round r + k is generated from the weights the trainer had when round r started: staleness, in policy versions
(optimizer steps), ≤ ceil(k × steps_per_round) when its round starts. With an engine in the training process, r1 is
submitted by `end_step` at micro-step 1's end instead, still on v0 (`SchedulerSettings.first_round_alone`).

The horizon: a round ahead is submitted only if the trainer will train it. `steps_left()` (the trainer's
`max_steps - global_step`: optimizer steps still to run, the one in progress included) bounds the micro-steps of the
epoch that will run; a round starting at or past that bound (or past the epoch's end: `loader.batch_at` is `None`)
is not generated, so a run never generates, and waits at exit for, a round it throws away:

```txt
GA = 2, steps_per_generation = 2, μ = 1, k = 1, max_steps = 2 (epoch micro-steps 0..3 run)
micro-step 0: submit r0 and r1 (starts at micro-step 2 < 4) │ micro-step 2: r2 would start at 4 ≥ 4: not submitted
```
Every rank computes the same horizon from the same state (the trainer's global step, the epoch micro-step), so the
gathers of `_submit` stay matched. Every process calls `next_micro_batch` at the same micro-step; the gathers and the
broadcast of rounds happen there.

Staleness pacing (`staleness_policy="pace"`, with a staleness limit `M`: `GRPOConfig.staleness_limit`): the generator
does not start work whose rows would lag more than `M` policy versions when their round starts training; it waits for
the trainer's next weights instead ([`StalenessPacer`] holds the clock). Rounds mode paces here, at submission: round
`j` submitted at the boundary of round `r` is generated from the weights published there, `s_r` (a publish waits until
no round samples, so a round never starts on other weights), and trained from `s_j`; it is submitted only if
`s_j − s_r ≤ M`, else at a later boundary (at the latest at its own, synchronously: staleness 0), so rounds mode never
drops a row under pacing and cannot deadlock (the round the trainer waits for is always submitted):

```txt
num_batches_ahead = 2, one optimizer step per round, M = 1
boundary 0 (s = 0): submit r0, r1 (s_1 − 0 = 1 ≤ 1); r2 held (s_2 − 0 = 2 > 1)   drop policy: r2 submitted here,
boundary 1 (s = 1): submit r2 (2 − 1 = 1); r3 held                                  trained at 2 from v0: dropped
```
Stream mode paces each prompt group's start (`GroupStream`: its docstring works the bound out).

Two ways to spread a round over N processes:
```txt
main process generates (servers, OpenAI, rollout_func, 1 process):   an engine on every rank (`join` given):
  every rank ─gather rows─▶ main: producer([R]) ─broadcast─▶ [R]       rank i: producer(its rows [L], first_row=i·L)
                                                                       ─gather parts─▶ join → [R] on every rank
```
With `join` (the `hf` backend and in-process vLLM with several processes, `build.generates_on_every_rank`) every rank
runs its own job queue and engine on its own rows; at fetch the parts are gathered on every rank and joined
(`pipeline/join.py`: advantages over the whole round); the consumer then takes this rank's rows as before.
The trainer calls `end_step` after the last micro-step of each optimizer step: the scheduler times the trainer's waits
for the generator and the generator's busy seconds, and logs how well the step overlapped them (`pipeline/overlap.py`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..generation.registry import backend_spec
from .batch_generator import AsyncBatchGenerator, BatchRequest
from .collectives import AcceleratorCollectives
from .consumer import RoundConsumer
from .group_stream import GroupStream
from .overlap import StepWindow
from .producer import RoundProducer
from .publisher import PolicyPublisher
from .rows import reuse_order
from .staleness import StalenessPacer
from .types import MicroBatch, Round, RoundRequest

logger = logging.getLogger(__name__)


@dataclass
class SchedulerSettings:
    steps_per_generation: int  # micro-batches per round (per process)
    num_iterations: int  # μ: passes over a round
    rounds_ahead: int  # rounds submitted ahead of the one being trained (`GRPOConfig.rounds_ahead`)
    reuse_order: str  # "epoch" (a b | a b) or "consecutive" (a a b b)
    max_queue_size: int
    generation_timeout: float
    gradient_accumulation_steps: int = 1  # micro-steps per optimizer step (the last one of an epoch may be shorter)
    async_mode: str = "rounds"  # "rounds": AsyncBatchGenerator, a round at a time; "stream": GroupStream, by groups
    num_generations: int = 1  # G (stream mode splits requests into prompt groups)
    max_inflight_groups: int = 1  # stream mode: groups generating or being scored at once
    staleness_limit: int | None = None  # policy versions a trained row may lag (`GRPOConfig.staleness_limit`)
    staleness_policy: str = "drop"  # "pace": hold back starts that would exceed the limit; "drop": the consumer drops
    #: an engine in the training process: the rounds ahead of a `train()`'s first round are submitted at the end of
    #: its first step (`end_step`), not beside it, still on v0 (docs/async_pipeline.md, "The first step")
    first_round_alone: bool = False
    #: `BackendSpec.runs_on_caller`, rounds: a round fetched right after its submission (a `train()`'s first, sync
    #: mode's, the one `first_round_alone` defers) is generated on the trainer's thread (`submit_batch(inline=True)`)
    inline_waited_round: bool = False

    @classmethod
    def from_config(cls, a) -> SchedulerSettings:
        """From a `GRPOConfig`."""
        return cls(
            steps_per_generation=a.steps_per_generation,
            num_iterations=a.num_iterations,
            rounds_ahead=a.rounds_ahead,
            reuse_order=a.reuse_order,
            max_queue_size=a.async_max_queue_size,
            generation_timeout=a.async_generation_timeout,
            gradient_accumulation_steps=a.gradient_accumulation_steps,  # the horizon: rounds past max_steps never made
            async_mode=a.async_mode,
            num_generations=a.num_generations,
            max_inflight_groups=a.max_inflight_groups,
            staleness_limit=a.staleness_limit,  # pacing: starts whose rows would exceed it wait (staleness_policy)
            staleness_policy=a.staleness_policy,
            first_round_alone=a.async_mode == "rounds" and backend_spec(a.generation_backend).in_process,
            inline_waited_round=a.async_mode == "rounds" and backend_spec(a.generation_backend).runs_on_caller,
        )


class RoundScheduler:
    """Feeds the trainer one micro-batch per micro-step.

    Args:
        settings (`SchedulerSettings`).
        collectives (`AcceleratorCollectives`): `is_main`, `gather(list) -> list` (every rank's items, rank order, on
            every rank), `broadcast(obj) -> obj` (the main process's object, on every rank).
        producer (`RoundProducer`): run in the job-queue thread (main process only).
        consumer (`RoundConsumer`): turns a round into this process's micro-batches.
        publisher (`PolicyPublisher`): publishes the policy's weights at each round boundary (every process; a
            no-op when the version is unchanged); the scheduler first waits until no round samples unless the
            publisher pushes while rounds run (`inflight`).
        log (`Callable[[str, float], None]`): records a metric.
        steps_left (`Callable[[], int]`, *optional*): optimizer steps the trainer will still run, the one in
            progress included (`max_steps - global_step`); rounds past them are never generated. `None`: no bound
            but the epoch's end.
        join (`Callable[[list[Round]], Round]`, *optional*): given when every rank generates its own rows with its
            own engine (`pipeline/join.py: RoundJoiner`): joins the ranks' parts of a round into the whole round.
            `None`: the main process generates every row.
    """

    def __init__(
        self,
        settings: SchedulerSettings,
        collectives: AcceleratorCollectives,
        producer: RoundProducer,
        consumer: RoundConsumer,
        publisher: PolicyPublisher,
        log: Callable[[str, float], None],
        steps_left: Callable[[], int] | None = None,
        join: Callable[[list[Round]], Round] | None = None,
        assemble: Callable[[list[Round]], Round] | None = None,
    ):
        self.s = settings
        self.steps_left = steps_left
        self.dist = collectives
        self.producer, self.consumer = producer, consumer
        self.publisher, self.log = publisher, log
        self.join = join
        self.assemble = assemble  # stream mode: joins ready prompt groups into a training round
        self.generate_every = settings.steps_per_generation * settings.num_iterations  # micro-steps per round
        # micro-batch index trained at each micro-step of a round: a b | a b ("epoch") or a a b b ("consecutive")
        self.order = reuse_order(
            list(range(settings.steps_per_generation)), settings.num_iterations, settings.reuse_order
        )
        self.loader = None  # the AsyncDataLoaderWrapper of the current train() (peeked for rounds ahead)
        self.generator: AsyncBatchGenerator | GroupStream | None = None
        self.round = 0  # index of the next round to train (global, across epochs)
        self.submitted: set[int] = set()  # round ids submitted and not yet trained (tracked on every rank)
        self._epoch_seen = None
        self._epoch_call = 0  # micro-steps in the current epoch
        self._buffered: list[MicroBatch] | None = None
        self._first_of_train = True  # the next round fetched is a `train()`'s first (`first_round_alone`)
        self._deferred: tuple[int, int, float] | None = None  # `first_round_alone`: `_rounds_ahead`'s arguments
        self._waited = 0.0  # seconds spent waiting for the generator since the last `take_wait`
        self._window = StepWindow(lambda: self.generator.busy_seconds() if self.generator is not None else 0.0)
        self.last_samples: dict | None = None  # the newest round's completions (for the completions table)
        # main process: rounds taken from the job queue before their turn (a checkpoint saves them), or restored from
        # a checkpoint; a round that failed holds its error, raised when the round is fetched
        self._ready: dict[int, Round | BaseException] = {}
        # engine on every rank (`join`): whole rounds joined before their turn (a checkpoint joins the rounds ahead)
        # or restored from a checkpoint, on every rank alike
        self._joined: dict[int, Round | BaseException] = {}
        self._busy_mark = (0.0, 0.0)  # (perf_counter(), generator.busy_seconds()) at the previous fetch
        # staleness pacing (`staleness_policy="pace"` with a limit): the clock, and the time starts were held back
        self.pacer: StalenessPacer | None = None
        if settings.staleness_policy == "pace" and settings.staleness_limit is not None:
            self.pacer = StalenessPacer(
                settings.staleness_limit, self.generate_every, settings.gradient_accumulation_steps
            )
        self._pace_hold: tuple[int, float, float] | None = None  # rounds mode: (round held, perf_counter, busy s)
        self._pace_waited = 0.0  # rounds mode: generator seconds idle while a round was held, not yet logged
        self._pace_mark = 0.0  # stream mode: `GroupStream.pace_seconds()` at the previous fetch

    @property
    def generates(self) -> bool:
        """Whether this process runs a job queue and an engine: the main process, or every rank with `join`."""
        return self.join is not None or self.dist.is_main

    # ---- the trainer's calls -------------------------------------------------------------------------------
    def attach(self, loader) -> None:
        """The look-ahead loader of the coming `train()`."""
        self.loader = loader
        self._first_of_train, self._deferred = True, None

    def next_micro_batch(self, generation_batch: list[dict], version: int, policy: nn.Module) -> MicroBatch:
        """The micro-batch of this micro-step; at a round boundary fetches the round (generating it first if it was
        not submitted ahead), publishes `policy`'s weights as `version` and submits the rounds ahead."""
        self._window.open()  # the first step of a `train()` starts here
        loader = self.loader
        if loader is not None and loader.epoch != self._epoch_seen:  # a new epoch (resumed: started `skipped` in)
            self._epoch_seen, self._epoch_call = loader.epoch, loader.skipped
        if self._epoch_call % self.generate_every == 0 or self._buffered is None:
            self._buffered = self._next_round(generation_batch, version, policy)
        batch = self._buffered[self.order[self._epoch_call % self.generate_every]]
        self._epoch_call += 1
        return batch

    def take_wait(self) -> float:
        """Seconds spent waiting for the generator (a round, its going idle, room in its queue) since the last call."""
        waited, self._waited = self._waited, 0.0
        return waited

    def end_step(self) -> dict[str, float] | None:
        """The trainer finished an optimizer step's micro-steps: log and return `async/overlap`,
        `async/trainer_wait`, `async/generator_idle` and `async/bottleneck` of the window since the previous call
        (`pipeline/overlap.py: overlap_metrics` defines them); `None` before the first micro-step."""
        if self._deferred is not None:  # `first_round_alone`: the first step's rounds ahead, now
            (base, first, horizon), self._deferred = self._deferred, None
            todo = self._rounds_ahead(base, first, horizon)  # the first inline if the next micro-step fetches it
            nxt = first + self.generate_every == self._epoch_call and todo and todo[0][0] == base + 1  # fetched next
            self._send(todo[:1] if nxt else [], inline=self.s.inline_waited_round)
            self._send(todo[1:] if nxt else todo)
        metrics = self._window.close()
        for k, v in (metrics or {}).items():
            self.log(k, v)
        return metrics

    def wait_until_idle(self, sampled: bool = False) -> None:
        """Block until no round is queued or being generated; `sampled`: until none will sample again, those still
        running only score (`AsyncBatchGenerator.wait_until_sampled`: what a publish waits for)."""
        if self.generator is not None:
            start = time.perf_counter()
            try:
                (self.generator.wait_until_sampled if sampled else self.generator.wait_until_idle)()
            finally:
                self._add_wait(time.perf_counter() - start)

    def publish(self, policy: nn.Module, version: int) -> float:
        """Publish `policy`'s weights as `version` (every process; nothing when `version` is already published):
        first wait until no round samples, so a round in flight samples on the weights it started with (its rewards
        are computed meanwhile), unless the publisher pushes while rounds run. Stream mode: no group starts until the
        weights are loaded, and the groups running finish first (`GroupStream.held`), unless the publisher pushes
        while they run (in-flight: each token then records its version). Logs `timing/weight_sync`."""
        held = contextlib.nullcontext()
        if self.publisher.due(version) and not self.publisher.inflight:
            if isinstance(self.generator, GroupStream):
                held = self._held()
            else:
                self.wait_until_idle(sampled=True)
        with held:
            seconds = self.publisher.publish(policy, version)
        if seconds:
            self.log("timing/weight_sync", seconds)
        return seconds

    @contextlib.contextmanager
    def _held(self):  # `GroupStream.held`, its wait for the running groups counted as the trainer's wait
        start = time.perf_counter()
        with self.generator.held():
            self._add_wait(time.perf_counter() - start)
            yield

    def _add_wait(self, seconds: float) -> None:
        self._waited += seconds
        self._window.add_wait(seconds)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the job-queue thread: rounds still queued are dropped, the round in progress is interrupted (the
        producer's `abort`: the backend aborts its requests) and joined within `timeout` seconds; the next `train()`
        starts a new thread and submits again. Returns whether the thread was still busy after `timeout` (stuck in
        user code, e.g. a reward; it is joined again at interpreter exit)."""
        busy = False
        if self.generator is not None:
            busy = not self.generator.stop(timeout)
            logger.info(  # what a run generated and threw away shows here (tests/test_clean_exit.py reads it)
                "generator stopped; rounds started: %s, interrupted: %s",
                self.generator.started,
                self.generator.interrupted,
            )
            self.generator = None
            if not busy:
                self.producer.resume()  # the backend serves again (evaluation, the next train())
        self._window.reset()  # the next `train()` opens a new one
        self._pace_hold, self._pace_waited = None, 0.0
        self.submitted.clear()
        self._ready.clear()
        self._joined.clear()
        self._buffered = None
        return busy

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The pipeline's position; on the main process during training also `in_flight`: the rounds generated ahead
        and not yet trained (`Round`s, waited for: at most `generation_timeout` each), which a checkpoint saves so
        that a resumed run trains exactly them, generated from the older weights they were generated from (with
        `num_batches_ahead = k`, round r + k was generated before the checkpoint's last k rounds were trained). A
        round that failed is left out (it is generated again on resume, and the error is raised here when trained)."""
        state = {
            "round": self.round,  # next round to train
            "submitted_rounds": sorted(self.submitted),  # generated ahead, not trained
        }
        if self.join is not None and self.generator is not None:  # every rank: the parts are gathered and joined
            start = time.perf_counter()
            try:
                done = [self._joined_round(round_id) for round_id in sorted(self.submitted)]
            finally:
                self._add_wait(time.perf_counter() - start)
            if self.dist.is_main:
                state["in_flight"] = [r for r in done if isinstance(r, Round)]
        elif self.dist.is_main and self.generator is not None:
            done = [self._finish(round_id) for round_id in sorted(self.submitted)]
            state["in_flight"] = [r for r in done if isinstance(r, Round)]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the rounds of `in_flight` (restored by `checkpointing.read_pipeline_state`) are
        trained as saved, the other rounds ahead are generated again (from the current weights)."""
        self.round = state["round"]
        self.submitted.clear()
        self._ready.clear()
        self._joined.clear()
        self._buffered = None
        for rnd in state.get("in_flight") or []:  # whole rounds, whichever way they were generated
            self.submitted.add(rnd.round_id)  # every rank: the gathers of `_submit` stay matched
            if self.join is not None:  # every rank holds the whole round, as if joined
                self._joined[rnd.round_id] = rnd
            elif self.dist.is_main:
                self._ready[rnd.round_id] = rnd

    def _finish(self, round_id: int) -> Round | BaseException:
        """Round `round_id` (submitted ahead), waited for and kept in `_ready` until its turn (the process that
        generated it: main, or with `join` every rank its own part)."""
        if round_id not in self._ready:
            start = time.perf_counter()
            try:
                self._ready[round_id] = self._collect(round_id)
            except Exception as e:  # raised when the round is fetched for training
                self._ready[round_id] = e
            finally:
                self._add_wait(time.perf_counter() - start)
        return self._ready[round_id]

    def _collect(self, round_id: int) -> Round:
        return self.generator.get_batch(round_id).round

    def _joined_round(self, round_id: int) -> Round | BaseException:
        """With `join` (every rank, at the same point): round `round_id` whole, kept in `_joined` until its turn:
        this rank's part (waited for), every rank's parts gathered, joined. A part that failed fails the round on
        every rank (its error, or a `RuntimeError` naming the rank that failed)."""
        if round_id not in self._joined:
            part = self._ready.pop(round_id) if round_id in self._ready else self._part(round_id)
            mine = f"{type(part).__name__}: {part}" if isinstance(part, BaseException) else part
            parts = self.dist.gather([mine])  # [N] every rank's part (or error text), rank order
            failed = [(i, p) for i, p in enumerate(parts) if isinstance(p, str)]
            if isinstance(part, BaseException):
                self._joined[round_id] = part
            elif failed:
                i, text = failed[0]
                self._joined[round_id] = RuntimeError(f"Async generation failed on process {i}: {text}")
            else:
                try:
                    self._joined[round_id] = self.join(parts)
                except Exception as e:  # every rank joins the same parts: every rank fails alike
                    self._joined[round_id] = e
        return self._joined[round_id]

    def _part(self, round_id: int) -> Round | BaseException:
        """This rank's part of round `round_id` (waited for; the caller counts the wait), or its error."""
        try:
            return self._collect(round_id)
        except Exception as e:
            return e

    # ---- one round ------------------------------------------------------------------------------------------
    def _next_round(self, generation_batch: list[dict], version: int, policy: nn.Module) -> list[MicroBatch]:
        first, self._first_of_train = self._first_of_train, False
        if self.generates and self.generator is None:
            self.producer.build_engine()  # here, on every rank that generates (see `RoundProducer.build_engine`)
            self.generator = self._start_generator()
        fetched, t0 = self.round in self.submitted, time.perf_counter()  # generated ahead: scored while publishing
        pushed = self.publish(policy, version)  # the weights of this step, for the rounds submitted next
        rnd = self._fetch(time.perf_counter() - t0 - pushed) if fetched else None  # + its sampling waited for
        if self.pacer is not None:
            self._advance_clock(version, fetched=fetched)
        self._submit(generation_batch, ahead=not (first and self.s.first_round_alone))
        if rnd is None:
            rnd = self._fetch()
        self.submitted.discard(self.round)
        self.round += 1
        return self.consumer(rnd, version)

    def _advance_clock(self, version: int, fetched: bool) -> None:
        """The pacer's clock at this boundary: round `self.round` starts training at `version` (its first epoch
        micro-step), the sampler holds the version just published; the generator next assembles the first round
        after it (this one if not `fetched` yet) that is not already held whole (restored from a checkpoint, or
        assembled early for one)."""
        nxt = self.round + 1 if fetched else self.round
        while nxt in self._ready or nxt in self._joined:
            nxt += 1
        published = self.publisher.published if self.publisher.published is not None else version
        first = self._epoch_call - self._epoch_call % self.generate_every
        self.pacer.advance(self.round, nxt, version, first, published)
        if isinstance(self.generator, GroupStream):
            self.generator.wake()  # held groups check the new clock

    def _start_generator(self) -> AsyncBatchGenerator | GroupStream:
        """The generator of this `train()`: rounds (`AsyncBatchGenerator`) or prompt groups (`GroupStream`, stream
        mode: the backend first takes concurrent calls, `RoundProducer.start_streaming`)."""
        if self.s.async_mode == "stream":
            self.producer.start_streaming()
            if self.assemble is None:
                raise ValueError("RoundScheduler: async_mode='stream' needs `assemble` (a RoundJoiner)")
            stream = GroupStream(
                functools.partial(self.producer, concurrent=True),
                self.assemble,
                num_generations=self.s.num_generations,
                max_inflight_groups=self.s.max_inflight_groups,
                max_queue_size=self.s.max_queue_size,
                generation_timeout=self.s.generation_timeout,
                interrupt=self.producer.abort,
                pacer=self.pacer,
            )
            self._busy_mark = (time.perf_counter(), 0.0)
            self._pace_mark = 0.0
            return stream.start()
        queue = AsyncBatchGenerator(
            self.producer,
            max_queue_size=self.s.max_queue_size,
            generation_timeout=self.s.generation_timeout,
            interrupt=self.producer.abort,
            signals_sampled=True,  # a publish waits for the rounds' sampling, not their rewards
        )
        self._busy_mark = (time.perf_counter(), 0.0)
        return queue.start()

    def horizon(self) -> float:
        """The epoch micro-step the trainer stops before (the epoch's end aside): with `s = steps_left()` optimizer
        steps to run from the one in progress, `(s + current // GA) × GA`; infinite without `steps_left`."""
        if self.steps_left is None:
            return float("inf")
        ga = self.s.gradient_accumulation_steps
        return (self.steps_left() + self._epoch_call // ga) * ga

    def _submit(self, generation_batch: list[dict], ahead: bool = True) -> None:
        """Submit the current round if needed and up to `rounds_ahead` rounds after it that the trainer will train
        (`horizon`; every rank); without `ahead` the rounds after it wait for `end_step` (`first_round_alone`)."""
        todo = [] if self.round in self.submitted else [(self.round, generation_batch)]
        first = self._epoch_call - self._epoch_call % self.generate_every  # this round's first epoch micro-step
        ahead_args = (self.round, first, self.horizon())
        self._send(todo, inline=self.s.inline_waited_round)  # fetched next: nothing for the trainer to do meanwhile
        self._send(self._rounds_ahead(*ahead_args) if ahead else [])
        self._deferred = None if ahead else ahead_args

    def _rounds_ahead(self, base: int, first: int, horizon: float) -> list[tuple[int, list[dict]]]:
        """`(id, rows)` of the rounds after `base` (which starts at epoch micro-step `first`) to submit: up to
        `rounds_ahead`, before `horizon`, not submitted yet; a round the pacer holds back ends the list."""
        todo, held = [], None
        for j in range(1, self.s.rounds_ahead + 1):
            if base + j in self.submitted:
                continue
            start = first + j * self.generate_every  # the epoch micro-step round base + j starts at
            if start >= horizon:  # past the last step: never trained, so never generated
                break
            if self._paces_rounds and not self.pacer.allows(base + j):  # too stale by its turn: later
                held = base + j
                break
            future = self.loader.batch_at(start) if self.loader else None
            if future is None:  # end of the epoch: that round is generated when its epoch starts
                break
            todo.append((base + j, future))
        if self._paces_rounds:
            self._hold_round(held)
        return todo

    def _send(self, todo: list[tuple[int, list[dict]]], inline: bool = False) -> None:
        """Submit each `(round id, this rank's rows)` (every rank: gathered to main, or its own engine), `inline`."""
        for round_id, rows in todo:
            if self.join is not None:  # this rank's rows, on its own engine: rows [i·L, (i+1)·L) of the round
                request = RoundRequest(round_id, list(rows), first_row=self.dist.process_index * len(rows))
            else:
                all_rows = self.dist.gather(list(rows))  # every rank's rows, rank order
                request = RoundRequest(round_id, all_rows) if self.dist.is_main else None
            self.submitted.add(round_id)
            if request is not None:
                start = time.perf_counter()  # waits when the queue is full
                try:
                    self.generator.submit_batch(BatchRequest(round_id, request), inline=inline)
                finally:
                    self._add_wait(time.perf_counter() - start)

    @property
    def _paces_rounds(self) -> bool:
        """Rounds mode paces whole rounds here, at submission (stream mode paces groups in `GroupStream`)."""
        return self.pacer is not None and self.s.async_mode != "stream"

    def _hold_round(self, round_id: int | None) -> None:
        """Rounds mode: round `round_id` was held back at this boundary (`None`: none was). Counts the generator's
        idle seconds while a round is held (wall time minus its busy seconds), for `async/pace_wait_s`."""
        self._flush_pace_hold()
        if round_id is None or self.generator is None:
            self._pace_hold = None
            return
        if self._pace_hold is None or self._pace_hold[0] != round_id:
            c = self.pacer.clock
            logger.info(
                "pacing: round %d held back at step %d: generated now (weights v%d) it would start training at "
                "step %d, %d versions later (max_staleness %d); it is submitted at a later round boundary",
                round_id,
                c.step,
                c.published,
                self.pacer.step_at(round_id),
                self.pacer.lag(round_id),
                self.pacer.limit,
            )
            self._pace_hold = (round_id, time.perf_counter(), self.generator.busy_seconds())

    def _flush_pace_hold(self) -> None:
        if self._pace_hold is not None and self.generator is not None:
            round_id, then, busy_then = self._pace_hold
            now, busy = time.perf_counter(), self.generator.busy_seconds()
            self._pace_waited += max(0.0, (now - then) - (busy - busy_then))
            self._pace_hold = (round_id, now, busy)

    def _take_pace_wait(self) -> float:
        """Seconds the generator was held back by pacing since the previous call: stream mode, wall seconds with a
        group waiting, a worker free and its start refused (`GroupStream.pace_seconds`); rounds mode, the
        generator's idle seconds while a round was held back."""
        if isinstance(self.generator, GroupStream):
            total = self.generator.pace_seconds()
            waited, self._pace_mark = total - self._pace_mark, total
            return waited
        self._flush_pace_hold()
        waited, self._pace_waited = self._pace_waited, 0.0
        return waited

    def _fetch(self, waited: float = 0.0) -> Round:
        """The current round, from the job queue (main) to every rank; an error on main reaches every rank. `waited`:
        seconds already waited for it (its sampling, by the publish), logged with the wait here."""
        rnd, err = None, None
        start = time.perf_counter()
        if self.join is not None:  # every rank: its part, every rank's parts gathered and joined
            rnd = self._joined.pop(self.round) if self.round in self._joined else self._joined_round(self.round)
            if isinstance(rnd, BaseException):
                raise rnd
            return self._received(rnd, time.perf_counter() - start, before=waited)
        if self.dist.is_main:
            try:
                rnd = self._ready.pop(self.round) if self.round in self._ready else self._collect(self.round)
                if isinstance(rnd, BaseException):
                    raise rnd
            except Exception as e:  # tell the other ranks before raising, so they don't wait in the broadcast
                err, rnd = e, f"{type(e).__name__}: {e}"
        wait = time.perf_counter() - start
        self._add_wait(wait)
        rnd = self.dist.broadcast(rnd)
        if err is not None:
            raise err
        if isinstance(rnd, str):
            raise RuntimeError(f"Async generation failed on the main process: {rnd}")
        return self._received(rnd, wait, counted=True, before=waited)

    def _received(self, rnd: Round, wait: float, counted: bool = False, before: float = 0.0) -> Round:
        """Log the round's metrics and timings; seconds waited for it: `wait` (added unless `counted`) + `before`."""
        if not counted:
            self._add_wait(wait)
        for k, v in rnd.metrics.items():
            self.log(k, v)
        self.log("timing/generation", rnd.generation_time)
        self.log("timing/wait_generation", wait + before)
        if self.generator is not None:
            self.log("async/pending", float(self.generator.get_pending_count()))
            self.log("async/completed", float(self.generator.get_completed_count()))
            self.log("async/average_generation_time", self.generator.get_average_generation_time())
            now, busy = time.perf_counter(), self.generator.busy_seconds()
            (then, busy_then), self._busy_mark = self._busy_mark, (now, busy)
            if now > then:  # share of the wall time since the previous fetch the generator had work
                self.log("async/engine_busy", min(1.0, (busy - busy_then) / (now - then)))
            if self.pacer is not None:
                self.log("async/pace_wait_s", self._take_pace_wait())
        self.last_samples = rnd.samples
        return rnd
