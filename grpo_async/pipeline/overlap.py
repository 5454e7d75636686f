"""How well one optimizer step overlapped generation with training: `async/overlap`, `async/trainer_wait`,
`async/generator_idle`, `async/bottleneck` (logged every step by `RoundScheduler.end_step`).

```txt
step window   |<──────────────────────────── wall ────────────────────────────>|
trainer       | train ██████████████████ | wait for the round ░░░░ | push ███ |   T_train = wall − trainer_wait
generator     | gen ████████████████████████████████████ | idle ░░░░░░░░░░░░░░ |   T_gen   = wall − generator_idle
```
"""

from __future__ import annotations

import time
from collections.abc import Callable


def overlap_metrics(wall: float, trainer_wait: float, generator_busy: float) -> dict[str, float]:
    """The overlap metrics of one optimizer step, from the run's own timings of that step.

    A step's window runs from the end of the previous optimizer step's last `training_step` to the end of this
    one's (so it holds the previous step's optimizer update, logging and any checkpoint or evaluation; the first
    window of a `train()` starts at its first round fetch). In that window, on the main process:

    - `T_gen` = seconds the generator thread spent producing rounds (generate, rewards, advantages; a round running
      across the window's edges counts with the part inside); `generator_idle = wall − T_gen`;
    - `T_train` = seconds the trainer thread did anything but wait for the generator (forward/backward, old/ref
      logps, optimizer step, weight push, logging); `trainer_wait` = seconds it waited for a round, for the
      generator to go idle before a push, or for room in the queue, so `T_train = wall − trainer_wait`.

    A synchronous step would take `T_gen + T_train`; this step took `wall`, a speed-up of `(T_gen + T_train) / wall`
    out of the best possible `S* = (T_gen + T_train) / max(T_gen, T_train)`, so

        async/overlap = speed-up / S* = max(T_gen, T_train) / wall = 1 − min(trainer_wait, generator_idle) / wall

    which is in [0, 1]: 1 when the slower side never idles (the step is as short as its bottleneck allows), lower
    by the share of the step in which both sides idled or waited (the weight push, which the generator waits out,
    hand-offs). `async/bottleneck` is 1 when generation is the slower side (`T_gen ≥ T_train`: the trainer waits
    for it), 0 when training is; its mean over a logging window is the share of generation-bound steps.

    What it does not see: `T_gen` and `T_train` are the phases' times *while running side by side*. When they slow
    each other down (shared CPU cores or GPU, other jobs on the machine), both grow and the overlap can stay near 1
    while the step got slower; compare `timing/generation` and `timing/train_step` with a synchronous run
    (`num_batches_ahead=0`) to see that. `bench/overlap.py` measures each phase alone and reports both numbers.

    >>> m = overlap_metrics(wall=1.0, trainer_wait=0.4, generator_busy=0.9)   # trains 0.6 s, generates 0.9 s
    >>> {k: round(v, 3) for k, v in m.items()}
    {'async/overlap': 0.9, 'async/trainer_wait': 0.4, 'async/generator_idle': 0.1, 'async/bottleneck': 1.0}
    """
    wall = max(wall, 1e-9)
    trainer_wait = min(max(trainer_wait, 0.0), wall)
    generator_busy = min(max(generator_busy, 0.0), wall)
    trainer_busy = wall - trainer_wait
    return {
        "async/overlap": max(generator_busy, trainer_busy) / wall,
        "async/trainer_wait": trainer_wait,
        "async/generator_idle": wall - generator_busy,
        "async/bottleneck": 1.0 if generator_busy >= trainer_busy else 0.0,
    }


class StepWindow:
    """The clock of one step's window: when it opened, the trainer's waits in it, the generator's busy seconds when
    it opened. Owned by the `RoundScheduler` (it times the waits and holds the generator).

    Args:
        generator_busy (`Callable[[], float]`): the generator thread's busy seconds so far (0 when there is none).
        clock (`Callable[[], float]`, *optional*): seconds; `time.perf_counter` by default.
    """

    def __init__(self, generator_busy: Callable[[], float], clock: Callable[[], float] = time.perf_counter):
        self.generator_busy, self.clock = generator_busy, clock
        self.start: float | None = None
        self.waited = 0.0
        self.busy_at_start = 0.0

    def open(self) -> None:
        """Start a window now, unless one is open."""
        if self.start is None:
            self.start, self.waited, self.busy_at_start = self.clock(), 0.0, self.generator_busy()

    def add_wait(self, seconds: float) -> None:
        if self.start is not None:
            self.waited += seconds

    def close(self) -> dict[str, float] | None:
        """The window's `overlap_metrics`, and the next window opens now; `None` when none was open."""
        if self.start is None:
            return None
        now, busy = self.clock(), self.generator_busy()
        metrics = overlap_metrics(now - self.start, self.waited, busy - self.busy_at_start)
        self.start, self.waited, self.busy_at_start = now, 0.0, busy
        return metrics

    def reset(self) -> None:
        """No window open (the generator stopped: its busy seconds start again from 0 with the next one)."""
        self.start = None
