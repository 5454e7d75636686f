"""`RepeatSampler`: the index stream GRPO needs (seed 003 §1.2), identical to TRL's for the same arguments."""

from __future__ import annotations

from collections.abc import Sized

import torch
from torch.utils.data import Sampler


class RepeatSampler(Sampler):
    """Repeats each index `mini_repeat_count` times and each chunk of `batch_size` indices `repeat_count` times.

    Args:
        data_source (`Sized`): dataset to sample from.
        mini_repeat_count (`int`): consecutive repeats of each index (= `num_generations`, G).
        batch_size (`int`, *optional*, defaults to `1`): unique indices per chunk (= global generation batch / G).
        repeat_count (`int`, *optional*, defaults to `1`): repeats of each whole chunk (= μ · steps_per_generation).
        shuffle (`bool`, *optional*, defaults to `True`): draw a fresh permutation each epoch.
        seed (`int`, *optional*): seed of this sampler's own generator (the global RNG is never touched).

    Incomplete final chunks are dropped. With 7 prompts, `mini_repeat_count=2, batch_size=3, repeat_count=2`:

    ```txt
           mini_repeat_count = 2
            -  -
           [4, 4, 3, 3, 0, 0,    |  chunk [4, 3, 0]
            4, 4, 3, 3, 0, 0,    |  repeat_count = 2
            1, 1, 2, 2, 6, 6,    |  chunk [1, 2, 6]
            1, 1, 2, 2, 6, 6]    |      (prompt 5 is dropped: incomplete chunk)
    ```

    Every process builds the same stream (same seed); accelerate shards it into per-process batches, so the G
    copies of a prompt are consecutive in the global batch and advantages can be computed on whole groups.
    """

    def __init__(
        self,
        data_source: Sized,
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int | None = None,
    ):
        for name, value in (
            ("mini_repeat_count", mini_repeat_count),
            ("batch_size", batch_size),
            ("repeat_count", repeat_count),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RepeatSampler: {name} must be a positive int, got {value!r}")
        self.data_source = data_source
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.num_samples = len(data_source)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0  # permutations drawn so far (the epoch the next __iter__ yields)
        if shuffle:
            self.generator = torch.Generator()
            if seed is not None:
                self.generator.manual_seed(seed)

    def set_epoch(self, epoch: int) -> None:
        """Make the next `__iter__` yield epoch `epoch`'s order: the one an uninterrupted run would yield then.

        With a seed, the generator is re-seeded and advanced past `epoch` permutations, so a run resumed in epoch
        `e` sees exactly the stream it would have seen (the Trainer calls this before each epoch). Without a seed
        the order is not reproducible anyway and this only records the epoch.
        """
        if epoch == self.epoch:
            return
        if self.shuffle and self.seed is not None:
            self.generator.manual_seed(self.seed)
            for _ in range(epoch):
                torch.randperm(self.num_samples, generator=self.generator)
        self.epoch = epoch

    def __iter__(self):
        self.epoch += 1
        if self.shuffle:
            indexes = torch.randperm(self.num_samples, generator=self.generator).tolist()
        else:
            indexes = list(range(self.num_samples))
        chunks = [indexes[i : i + self.batch_size] for i in range(0, len(indexes), self.batch_size)]
        for chunk in chunks:
            if len(chunk) != self.batch_size:
                continue
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index

    def __len__(self) -> int:
        return (self.num_samples // self.batch_size) * self.batch_size * self.mini_repeat_count * self.repeat_count


def repeat_iterable(dataset, mini_repeat_count: int, batch_size: int = 1, repeat_count: int = 1):
    """The streaming counterpart of `RepeatSampler` for a `datasets.IterableDataset` (which has no indices): the
    stream itself is reordered into exactly the rows `RepeatSampler(shuffle=False)` would index, an incomplete final
    chunk dropped. Shuffling is left to an upstream `dataset.shuffle(seed=...)` (buffered); the transform stays
    chained to it, so `set_epoch` reshuffles each epoch. TRL 1.16's `repeat_iterable_dataset` yields the same order.

    >>> from datasets import IterableDataset
    >>> ds = IterableDataset.from_generator(lambda: ({"x": i} for i in range(5)))
    >>> [r["x"] for r in repeat_iterable(ds, mini_repeat_count=2, batch_size=2, repeat_count=2)]
    [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    """
    import copy

    for name, value in (
        ("mini_repeat_count", mini_repeat_count),
        ("batch_size", batch_size),
        ("repeat_count", repeat_count),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"repeat_iterable: {name} must be a positive int, got {value!r}")

    def repeat_chunk(chunk: dict) -> dict:
        keys = list(chunk)
        if len(chunk[keys[0]]) < batch_size:  # the incomplete last chunk, dropped like RepeatSampler drops it
            return {key: [] for key in keys}
        rows = list(zip(*(chunk[key] for key in keys), strict=True))
        out = {key: [] for key in keys}
        for _ in range(repeat_count):
            for row in rows:
                for _ in range(mini_repeat_count):
                    for key, value in zip(keys, row, strict=True):
                        out[key].append(copy.deepcopy(value))  # repeats are independent objects, as indexing gives
        return out

    return dataset.map(repeat_chunk, batched=True, batch_size=batch_size)
