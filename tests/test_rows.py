"""Per-stage chunk slices and reuse order (`grpo_async/pipeline/rows.py`): hand-worked values of the two
functions the package uses (`chunk_slices` in the round producer's rollout calls, `reuse_order` in the scheduler).
That every stage then runs only full chunks of its own size in a real round is tested on the trainer
(`tests/test_trainer.py::test_every_stage_runs_only_full_chunks_of_its_own_size`)."""

import pytest

from grpo_async.pipeline.rows import REUSE_ORDERS, chunk_slices, reuse_order
from grpo_async.pipeline.scheduler import RoundScheduler, SchedulerSettings
from grpo_async.testing import tiny_config


def test_the_module_diagram_chunks_every_row_once_in_full_chunks():
    # the module diagram: a 12-row round in chunks of 2, 3 and 6 rows
    assert chunk_slices(12, 2) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8), slice(8, 10), slice(10, 12)]
    assert chunk_slices(12, 3) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    assert chunk_slices(12, 6) == [slice(0, 6), slice(6, 12)]
    for size in (2, 3, 6):  # the chunks cover rows 0..11 once each, in order
        assert [i for sl in chunk_slices(12, size) for i in range(12)[sl]] == list(range(12))


def test_chunk_slices_with_and_without_remainder():
    assert chunk_slices(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]  # 4 + 4 + 2 (forced remainder)
    assert chunk_slices(8, 4) == [slice(0, 4), slice(4, 8)]
    assert chunk_slices(3, 5) == [slice(0, 3)]  # one short chunk: 3 rows, not 5
    assert chunk_slices(1, 1) == [slice(0, 1)]
    assert chunk_slices(0, 4) == []
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        chunk_slices(4, 0)
    with pytest.raises(ValueError, match="size must be a positive int, got True"):
        chunk_slices(4, True)
    with pytest.raises(ValueError, match="size must be a positive int, got 2.5"):
        chunk_slices(4, 2.5)
    with pytest.raises(ValueError, match="total must be an int >= 0, got -1"):
        chunk_slices(-1, 2)


def test_reuse_order_both_orders():
    assert REUSE_ORDERS == ("epoch", "consecutive")
    assert reuse_order(["a", "b"], 2) == ["a", "b", "a", "b"]  # default epoch: a b | a b
    assert reuse_order(["a", "b"], 2, "epoch") == ["a", "b", "a", "b"]
    assert reuse_order(["a", "b"], 2, "consecutive") == ["a", "a", "b", "b"]  # a a b b
    assert reuse_order(["a", "b", "c"], 3, "consecutive") == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert reuse_order(["a", "b", "c"], 2) == ["a", "b", "c", "a", "b", "c"]
    assert reuse_order(["a", "b"], 1, "consecutive") == ["a", "b"]  # μ = 1: both orders are the production order
    assert reuse_order(["a", "b"], 1) == ["a", "b"]
    assert reuse_order(iter(["a", "b"]), 2) == ["a", "b", "a", "b"]  # any iterable, read once
    with pytest.raises(ValueError, match=r"order must be one of \('epoch', 'consecutive'\), got 'random'"):
        reuse_order(["a"], 2, "random")
    with pytest.raises(ValueError, match="num_iterations must be a positive int, got 0"):
        reuse_order(["a"], 0)


@pytest.mark.parametrize(
    "order,expected",
    [("epoch", [0, 1, 2, 0, 1, 2]), ("consecutive", [0, 0, 1, 1, 2, 2])],  # 3 micro-batches of a round, μ = 2
)
def test_the_scheduler_trains_micro_batches_in_the_configured_reuse_order(order, expected, tmp_path):
    """`GRPOConfig.reuse_order` → the scheduler's settings → the micro-batch index trained at each micro-step."""
    config = tiny_config(tmp_path, gradient_accumulation_steps=3, num_iterations=2, reuse_order=order)
    scheduler = RoundScheduler(SchedulerSettings.from_config(config), None, None, None, publisher=None, log=print)
    assert scheduler.order == expected
