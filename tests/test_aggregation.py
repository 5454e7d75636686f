"""Per-stage chunk sizes and reuse order (`grpo_async/pipeline/aggregation.py`): hand-worked values. That every
stage then runs only full chunks of its own size in a real round is tested on the trainer
(`tests/test_trainer.py::test_every_stage_runs_only_full_chunks_of_its_own_size`)."""

import pytest

from grpo_async.pipeline.aggregation import REUSE_ORDERS, chunk_slices, lcm, reuse_order, service_target_bs


def test_lcm_target_gives_every_stage_full_chunks():
    # the module diagram: stage sizes (2, 3, 6) over a 12-row round: 6 chunks of 2, 4 of 3, 2 of 6, none short
    assert service_target_bs(2, 3, 6) == 6
    for size, chunks in ((2, 6), (3, 4), (6, 2)):
        slices = chunk_slices(12, size)
        assert len(slices) == chunks and all(s.stop - s.start == size for s in slices)


def test_lcm_and_service_target_hand_values():
    # 4 = 2², 6 = 2·3, 8 = 2³ → 2³·3 = 24
    assert lcm(4, 6, 8) == 24
    assert lcm(7) == 7
    assert lcm(2, 3, 6) == 6  # 6 already a multiple of 2 and 3
    assert service_target_bs(4, 6, 8) == 24
    assert service_target_bs(3, 4, 5) == 60  # pairwise coprime → product
    assert service_target_bs(8, 8, 8) == 8


def test_lcm_rejects_bad_values_and_names_them():
    with pytest.raises(ValueError, match="at least one size"):
        lcm()
    with pytest.raises(ValueError, match=r"sizes\[1\] must be a positive int, got 0"):
        lcm(4, 0)
    with pytest.raises(ValueError, match=r"sizes\[0\] must be a positive int, got 2.5"):
        lcm(2.5, 4)
    with pytest.raises(ValueError, match="got True"):
        lcm(True)
    with pytest.raises(ValueError, match="ref_logps must be a positive int, got -1"):
        service_target_bs(4, -1, 8)


def test_chunk_slices_with_and_without_remainder():
    assert chunk_slices(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]  # 4 + 4 + 2 (forced remainder)
    assert chunk_slices(8, 4) == [slice(0, 4), slice(4, 8)]
    assert chunk_slices(3, 5) == [slice(0, 3)]
    assert chunk_slices(0, 4) == []
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        chunk_slices(4, 0)
    with pytest.raises(ValueError, match="total must be an int >= 0, got -1"):
        chunk_slices(-1, 2)


def test_reuse_order_both_orders():
    assert REUSE_ORDERS == ("epoch", "consecutive")
    assert reuse_order(["a", "b"], 2) == ["a", "b", "a", "b"]  # default epoch: a b | a b
    assert reuse_order(["a", "b"], 2, "consecutive") == ["a", "a", "b", "b"]  # a a b b
    assert reuse_order(["a", "b", "c"], 3, "consecutive") == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert reuse_order(["a", "b"], 1, "consecutive") == reuse_order(["a", "b"], 1) == ["a", "b"]
    with pytest.raises(ValueError, match=r"order must be one of \('epoch', 'consecutive'\), got 'random'"):
        reuse_order(["a"], 2, "random")
    with pytest.raises(ValueError, match="num_iterations must be a positive int, got 0"):
        reuse_order(["a"], 0)
