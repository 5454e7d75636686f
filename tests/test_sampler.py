import pytest
from trl.trainer.utils import RepeatSampler as TRLRepeatSampler

from grpo_async import RepeatSampler


def test_docstring_example_hand_worked():
    # 7 prompts, chunks of 3 → prompt left over is dropped; no shuffle for a hand-checkable order
    s = RepeatSampler(list("abcdefg"), mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=False)
    assert list(s) == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 3, 3, 4, 4, 5, 5]
    assert len(s) == 24


@pytest.mark.parametrize(
    "n,mini,bs,rep,shuffle,seed",
    [(7, 2, 3, 4, True, 42), (16, 4, 4, 2, True, 0), (10, 3, 1, 1, False, None), (33, 8, 4, 3, True, 7)],
)
def test_same_index_stream_as_trl(n, mini, bs, rep, shuffle, seed):
    ours = RepeatSampler(range(n), mini, bs, rep, shuffle, seed)
    trl = TRLRepeatSampler(range(n), mini, bs, rep, shuffle, seed)
    for _epoch in range(3):  # the generator advances across epochs identically
        assert list(ours) == list(trl)
    assert len(ours) == len(trl)


@pytest.mark.parametrize("kw", [{"mini_repeat_count": 0}, {"batch_size": 0}, {"repeat_count": -1}])
def test_bad_arguments_name_the_field(kw):
    args = {"mini_repeat_count": 2, "batch_size": 1, "repeat_count": 1, **kw}
    with pytest.raises(ValueError, match=next(iter(kw))):
        RepeatSampler(range(4), **args)


def test_set_epoch_reproduces_the_uninterrupted_stream():
    # a run resumed in epoch 2 builds a fresh sampler and calls set_epoch(2): it must see the third permutation
    straight = RepeatSampler(range(7), mini_repeat_count=2, batch_size=3, repeat_count=2, seed=5)
    epochs = [list(straight) for _ in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    resumed = RepeatSampler(range(7), mini_repeat_count=2, batch_size=3, repeat_count=2, seed=5)
    resumed.set_epoch(2)
    assert list(resumed) == epochs[2]
    resumed.set_epoch(1)  # and back
    assert list(resumed) == epochs[1]
