import threading

import pytest

from grpo_async import AsyncDataLoaderWrapper


def test_iterates_like_the_dataloader_and_peeks_without_consuming():
    w = AsyncDataLoaderWrapper([10, 11, 12, 13], buffer_size=3)
    it = iter(w)
    assert w.peek_ahead(1) == 10
    assert w.peek_ahead(3) == 12
    assert next(it) == 10  # the peek consumed nothing
    assert w.peek_ahead(1) == 11
    assert w.peek_ahead(3) == 13
    assert [next(it), next(it), next(it)] == [11, 12, 13]
    assert w.peek_ahead(1) is None  # past the end
    with pytest.raises(StopIteration):
        next(it)
    assert list(w) == [10, 11, 12, 13]  # a new epoch starts over
    assert w.epoch == 1


def test_peek_past_end_is_none_and_limits():
    w = AsyncDataLoaderWrapper([1, 2], buffer_size=5)
    iter(w)
    assert w.peek_ahead(2) == 2
    assert w.peek_ahead(3) is None
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        w.peek_ahead(0)
    with pytest.raises(ValueError, match="buffer_size=5"):
        w.peek_ahead(6)


def test_batch_at_reads_history_and_future():
    w = AsyncDataLoaderWrapper(list(range(10)), buffer_size=4, history_size=2)
    it = iter(w)
    for _ in range(3):
        next(it)  # consumed 0, 1, 2
    assert w.batch_at(2) == 2 and w.batch_at(1) == 1
    assert w.batch_at(5) == 5
    with pytest.raises(IndexError, match="history_size=2"):
        w.batch_at(0)


def test_delegates_dataloader_attributes():
    class DL(list):
        sampler = "S"

        def set_epoch(self, e):
            self.e = e

    dl = DL([1, 2])
    w = AsyncDataLoaderWrapper(dl)
    w.set_epoch(3)
    assert dl.e == 3 and w.sampler == "S" and len(w) == 2


def test_thread_safe_peeks_and_nexts():
    w = AsyncDataLoaderWrapper(list(range(2000)), buffer_size=5)
    it = iter(w)
    seen, errors = [], []

    def peeker():
        try:
            for _ in range(2000):
                v = w.peek_ahead(5)
                assert v is None or isinstance(v, int)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=peeker)
    t.start()
    for v in it:
        seen.append(v)
    t.join()
    assert not errors
    assert seen == list(range(2000))


def test_skip_first_batches_keeps_look_ahead_and_history():
    w = AsyncDataLoaderWrapper(list(range(10)), buffer_size=3, history_size=2)
    assert w.skip_first_batches(4) is w
    it = iter(w)
    assert w.skipped == 4 and w.consumed == 4
    assert w.batch_at(3) == 3  # skipped batches stay readable (the Trainer pulls a GA window first)
    assert w.peek_ahead(1) == 4 and next(it) == 4
    assert [next(it) for _ in range(5)] == [5, 6, 7, 8, 9]
    with pytest.raises(StopIteration):
        next(it)
    iter(w)  # the next epoch starts at the beginning again
    assert w.skipped == 0 and next(w) == 0
    with pytest.raises(ValueError, match="num_batches must be an int >= 0"):
        w.skip_first_batches(-1)
