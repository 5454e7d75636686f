"""`AsyncDataLoaderWrapper`: iterate a dataloader like usual, and look at future batches without consuming them.

The trainer iterates the wrapper; the async pipeline calls `peek_ahead(n)` to read the prompts of rounds that have
not been trained yet, so their completions can be generated while the current round trains (seed 003 §1.1, §3).

```
consumed:  b0 b1 b2 | b3 b4 b5 b6 ...
                    ^ next() returns b3
peek_ahead(1) → b3, peek_ahead(3) → b5   (nothing consumed; None past the end of the epoch)
```
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Any


class AsyncDataLoaderWrapper:
    """Wraps a dataloader (or any re-iterable) with a look-ahead buffer.

    Args:
        dataloader: the object to iterate; each `iter(wrapper)` starts a new epoch of it.
        buffer_size (`int`, *optional*, defaults to `5`): the furthest `peek_ahead` may look. Batches are read
            from the dataloader only when a peek or a `next()` needs them.
        history_size (`int`, *optional*, defaults to `0`): how many already-consumed batches `batch_at` can still
            return (the HF Trainer pulls a whole gradient-accumulation window before training on it).

    Attributes not defined here (`set_epoch`, `sampler`, `dataset`, ...) are those of the wrapped dataloader.
    All methods are thread-safe.
    """

    def __init__(self, dataloader, buffer_size: int = 5, history_size: int = 0):
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"AsyncDataLoaderWrapper: buffer_size must be a positive int, got {buffer_size!r}")
        self.dataloader = dataloader
        self.buffer_size = buffer_size
        self.history_size = history_size
        self._lock = threading.RLock()
        self._iterator = None
        self._buffer: deque = deque()
        self._history: deque = deque(maxlen=max(history_size, 1))
        self._exhausted = False
        self.consumed = 0  # batches returned by next() in the current epoch
        self.epoch = -1  # incremented by each iter()
        self.skipped = 0  # batches the current epoch started past (resume)
        self._skip_next = 0

    # -- iteration -------------------------------------------------------------------------------------------
    def __iter__(self):
        with self._lock:
            self._iterator = iter(self.dataloader)
            self._buffer.clear()
            self._history.clear()
            self._exhausted = False
            self.consumed = 0
            self.epoch += 1
            self.skipped, self._skip_next = self._skip_next, 0
            for _ in range(self.skipped):  # resume: consumed without training, still readable by batch_at
                if not self._fill(1):
                    raise ValueError(f"cannot skip {self.skipped} batches: the epoch has only {self.consumed}")
                self._history.append(self._buffer.popleft())
                self.consumed += 1
        return self

    def skip_first_batches(self, num_batches: int) -> AsyncDataLoaderWrapper:
        """Start the next epoch `num_batches` batches in (resuming mid-epoch); returns `self`, so peeking keeps
        working. Replaces accelerate's `skip_first_batches`, which would build a new dataloader without look-ahead."""
        if not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"skip_first_batches: num_batches must be an int >= 0, got {num_batches!r}")
        with self._lock:
            self._skip_next = num_batches
        return self

    def __next__(self):
        with self._lock:
            if self._iterator is None:
                self.__iter__()
            if not self._fill(1):
                raise StopIteration
            batch = self._buffer.popleft()
            self._history.append(batch)
            self.consumed += 1
            return batch

    def __len__(self) -> int:
        return len(self.dataloader)  # TypeError for a stream (IterableDataset), as the dataloader's own

    def __bool__(self) -> bool:
        return True  # a wrapper is always there, even over a stream without a length

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the wrapper: delegate to the dataloader.
        if name in ("dataloader", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    # -- look-ahead ------------------------------------------------------------------------------------------
    def _fill(self, n: int) -> bool:
        """Read until the buffer holds `n` batches; False when the epoch ends first."""
        while len(self._buffer) < n and not self._exhausted:
            try:
                self._buffer.append(next(self._iterator))
            except StopIteration:
                self._exhausted = True
        return len(self._buffer) >= n

    def peek_ahead(self, n: int = 1):
        """Return, without consuming, the batch that the `n`-th next `next()` will return; `None` past the end.

        Args:
            n (`int`): 1 = the very next batch. Must satisfy `1 <= n <= buffer_size`.
        """
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"peek_ahead(n): n must be an int >= 1, got {n!r}")
        if n > self.buffer_size:
            raise ValueError(f"peek_ahead({n}) looks further than buffer_size={self.buffer_size}")
        with self._lock:
            if self._iterator is None:
                self.__iter__()
            return self._buffer[n - 1] if self._fill(n) else None

    def batch_at(self, index: int):
        """The batch at position `index` of the current epoch: consumed recently (history), or ahead (peek).

        Returns `None` past the end of the epoch; raises if it was consumed longer ago than `history_size`.
        """
        with self._lock:
            if index >= self.consumed:
                return self.peek_ahead(index - self.consumed + 1)
            back = self.consumed - index
            if back > len(self._history) or back > self.history_size:
                raise IndexError(
                    f"batch {index} was consumed {back} batches ago; history_size={self.history_size} keeps fewer"
                )
            return self._history[-back]


@contextlib.contextmanager
def wrapper_skips_batches():
    """While it is open, transformers' `skip_first_batches` (what `Trainer` calls to resume mid-epoch) lets an
    `AsyncDataLoaderWrapper` skip the batches itself (`AsyncDataLoaderWrapper.skip_first_batches`): accelerate's would
    rebuild a plain dataloader, and the pipeline could no longer peek at the rounds ahead on the same stream."""
    import transformers.trainer as hf_trainer

    original = hf_trainer.skip_first_batches

    def skip(dataloader, num_batches=0):
        if isinstance(dataloader, AsyncDataLoaderWrapper):
            return dataloader.skip_first_batches(num_batches)
        return original(dataloader, num_batches)

    hf_trainer.skip_first_batches = skip
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original
