"""LCM batch aggregation (seed 000): hand-worked sizes, merges, repeats, chunks, buffer and reuse order."""

import pytest
import torch

from grpo_async.pipeline.aggregation import (
    REUSE_ORDERS,
    MicroBatchBuffer,
    apply_in_chunks,
    check_stage_sizes,
    chunk_slices,
    lcm,
    merge,
    repeat_rows,
    reuse_order,
    service_target_bs,
    sizes_that_fit,
    split_back,
)

T = torch.tensor


def _micro_batches():
    """Micro-batches a, b, c of 2, 3, 1 rows with ragged prompt (left-padded) and completion (right-padded) ids."""
    a = {
        "prompt_ids": T([[11, 12], [13, 14]]),  # [2, 2]
        "completion_ids": T([[1, 2, 3], [4, 5, 0]]),  # [2, 3]
        "completion_mask": T([[1, 1, 1], [1, 1, 0]]),  # [2, 3]
        "reward": T([1.0, 2.0]),  # [2]
        "text": ["a0", "a1"],
        "step": 7,
        "meta": {"version": 3},
    }
    b = {
        "prompt_ids": T([[21, 22, 23], [24, 25, 26], [27, 28, 29]]),  # [3, 3]
        "completion_ids": T([[6], [7], [8]]),  # [3, 1]
        "completion_mask": T([[1], [1], [1]]),  # [3, 1]
        "reward": T([3.0, 4.0, 5.0]),  # [3]
        "text": ["b0", "b1", "b2"],
        "step": 7,
        "meta": {"version": 3},
    }
    c = {
        "prompt_ids": T([[31]]),  # [1, 1]
        "completion_ids": T([[9, 10, 11, 12, 13]]),  # [1, 5]
        "completion_mask": T([[1, 1, 1, 1, 1]]),  # [1, 5]
        "reward": T([6.0]),  # [1]
        "text": ["c0"],
        "step": 7,
        "meta": {"version": 3},
    }
    return [a, b, c]


MERGE_KW = {"pad_values": {"prompt_ids": 99, "completion_ids": -1}, "left_padded": {"prompt_ids"}}


# ---------------------------------------------------------------------------------------------- sizes
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


def test_sizes_that_fit_hand_worked():
    # gbs 16, sizes (4, 6, 8):
    #   rollout   partners lcm(6, 8) = 24 → never divides 16 → []
    #   ref_logps partners lcm(4, 8) = 8  → lcm(v, 8) | 16 ⇔ v | 16 → [1, 2, 4, 8, 16]
    #   old_logps partners lcm(4, 6) = 12 → 16 % 12 != 0 → []
    assert sizes_that_fit(16, 4, 6, 8) == {"rollout": [], "ref_logps": [1, 2, 4, 8, 16], "old_logps": []}
    # gbs 24 = the LCM: every divisor of 24 fits in every stage
    divisors = [1, 2, 3, 4, 6, 8, 12, 24]
    assert sizes_that_fit(24, 4, 6, 8) == {"rollout": divisors, "ref_logps": divisors, "old_logps": divisors}


def test_check_stage_sizes_error_lists_the_sizes_that_fit():
    assert check_stage_sizes(24, 4, 6, 8) == 24
    assert check_stage_sizes(48, 4, 6, 8) == 24
    # lcm(4, 6, 8) = 24 > 12. Only old_logps can move alone: partners lcm(4, 6) = 12, lcm(v, 12) | 12 ⇔ v | 12
    with pytest.raises(ValueError) as err:
        check_stage_sizes(12, 4, 6, 8)
    msg = str(err.value)
    assert "lcm(rollout=4, ref_logps=6, old_logps=8) = 24" in msg
    assert "generation_batch_size=12" in msg
    assert "rollout: none; ref_logps: none; old_logps: [1, 2, 3, 4, 6, 12]" in msg
    # gbs 10: partners 24, 8, 12 → none divides 10 → nothing fits
    with pytest.raises(ValueError, match="no single stage change is enough"):
        check_stage_sizes(10, 4, 6, 8)
    # lcm 24 < 36 but 36 % 24 = 12: still refused
    with pytest.raises(ValueError, match="= 24 does not divide generation_batch_size=36"):
        check_stage_sizes(36, 4, 6, 8)
    with pytest.raises(ValueError, match="generation_batch_size must be a positive int, got 0"):
        check_stage_sizes(0, 4, 6, 8)


def test_chunk_slices_with_and_without_remainder():
    assert chunk_slices(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]  # 4 + 4 + 2 (forced remainder)
    assert chunk_slices(8, 4) == [slice(0, 4), slice(4, 8)]
    assert chunk_slices(3, 5) == [slice(0, 3)]
    assert chunk_slices(0, 4) == []
    with pytest.raises(ValueError, match="size must be a positive int, got 0"):
        chunk_slices(4, 0)
    with pytest.raises(ValueError, match="total must be an int >= 0, got -1"):
        chunk_slices(-1, 2)


# ---------------------------------------------------------------------------------------------- merge
def test_merge_uneven_ragged_micro_batches():
    merged = merge(_micro_batches(), **MERGE_KW)
    # prompt_ids widths 2, 3, 1 → 3, left-padded with 99
    torch.testing.assert_close(
        merged["prompt_ids"],
        T([[99, 11, 12], [99, 13, 14], [21, 22, 23], [24, 25, 26], [27, 28, 29], [99, 99, 31]]),
    )
    # completion_ids widths 3, 1, 5 → 5, right-padded with -1
    torch.testing.assert_close(
        merged["completion_ids"],
        T(
            [
                [1, 2, 3, -1, -1],
                [4, 5, 0, -1, -1],
                [6, -1, -1, -1, -1],
                [7, -1, -1, -1, -1],
                [8, -1, -1, -1, -1],
                [9, 10, 11, 12, 13],
            ]
        ),
    )
    # completion_mask has no pad value given → right-padded with 0
    torch.testing.assert_close(
        merged["completion_mask"],
        T([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]),
    )
    torch.testing.assert_close(merged["reward"], T([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    assert merged["text"] == ["a0", "a1", "b0", "b1", "b2", "c0"]
    assert merged["step"] == 7 and merged["meta"] == {"version": 3}  # non-row values carried once


def test_merge_pads_only_dim_1_of_3d_tensors():
    # [1, 1, 2] and [1, 2, 2] → [2, 2, 2]; the trailing dim must agree
    out = merge([{"x": T([[[1, 2]]])}, {"x": T([[[3, 4], [5, 6]]])}])
    torch.testing.assert_close(out["x"], T([[[1, 2], [0, 0]], [[3, 4], [5, 6]]]))
    with pytest.raises(ValueError, match="'x': trailing dims differ"):
        merge([{"x": T([[[1, 2]]])}, {"x": T([[[3, 4, 5]]])}])


def test_merge_errors_name_the_key():
    a, b, _ = _micro_batches()
    with pytest.raises(ValueError, match="'step' is not row-aligned and differs"):
        merge([a, {**b, "step": 8}])
    with pytest.raises(ValueError, match="batch 1 has keys"):
        merge([a, {k: v for k, v in b.items() if k != "text"}])
    with pytest.raises(ValueError, match="'text' mixes tensors and lists"):
        merge([a, {**b, "text": T([0, 1, 2])}])
    with pytest.raises(ValueError, match="at least one batch"):
        merge([])


# ---------------------------------------------------------------------------------------------- repeat + split
def test_repeat_rows_interleaves():
    out = repeat_rows({"x": T([[1, 2], [3, 4]]), "s": ["a", "b"], "k": 5}, 2)
    torch.testing.assert_close(out["x"], T([[1, 2], [1, 2], [3, 4], [3, 4]]))  # [a, a, b, b]
    assert out["s"] == ["a", "a", "b", "b"] and out["k"] == 5
    with pytest.raises(ValueError, match="times must be a positive int, got 0"):
        repeat_rows({"x": T([1])}, 0)


def test_repeat_and_split_back_uneven_sizes():
    sizes = [2, 3, 1]
    merged = merge(_micro_batches(), **MERGE_KW)
    repeated = repeat_rows(merged, 4)  # 6 rows → 24
    pieces = split_back(repeated, sizes, repeat=4)
    assert [len(p["text"]) for p in pieces] == [8, 12, 4]  # sizes × 4
    # piece 0 = rows 0..8 of the repeated batch: a0 ×4, a1 ×4
    assert pieces[0]["text"] == ["a0"] * 4 + ["a1"] * 4
    torch.testing.assert_close(pieces[0]["reward"], T([1.0] * 4 + [2.0] * 4))
    # piece 1 = rows 8..20: b0 ×4, b1 ×4, b2 ×4
    assert pieces[1]["text"] == ["b0"] * 4 + ["b1"] * 4 + ["b2"] * 4
    torch.testing.assert_close(pieces[1]["reward"], T([3.0] * 4 + [4.0] * 4 + [5.0] * 4))
    # piece 2 = rows 20..24: c0 ×4, prompt left-padded to the merged width 3
    assert pieces[2]["text"] == ["c0"] * 4
    torch.testing.assert_close(pieces[2]["prompt_ids"], T([[99, 99, 31]] * 4))
    torch.testing.assert_close(pieces[2]["completion_ids"], T([[9, 10, 11, 12, 13]] * 4))
    assert all(p["step"] == 7 and p["meta"] == {"version": 3} for p in pieces)


def test_split_back_without_repeat_round_trips():
    batches = _micro_batches()
    pieces = split_back(merge(batches, **MERGE_KW), [2, 3, 1])
    for piece, original in zip(pieces, batches):
        assert piece["text"] == original["text"]
        torch.testing.assert_close(piece["reward"], original["reward"])
    # b had the widest prompts (3) → its piece is unchanged; a's completion gained two -1 columns
    torch.testing.assert_close(pieces[1]["prompt_ids"], batches[1]["prompt_ids"])
    torch.testing.assert_close(pieces[0]["completion_ids"], T([[1, 2, 3, -1, -1], [4, 5, 0, -1, -1]]))


def test_split_back_rejects_sizes_that_do_not_add_up():
    repeated = repeat_rows(merge(_micro_batches(), **MERGE_KW), 4)  # 24 rows
    with pytest.raises(ValueError, match=r"sizes \[2, 3\] sum to 5, × repeat=4 = 20 rows, but the batch has 24"):
        split_back(repeated, [2, 3], repeat=4)
    with pytest.raises(ValueError, match=r"sizes\[1\] must be an int >= 0, got -3"):
        split_back(repeated, [2, -3, 7], repeat=4)


# ---------------------------------------------------------------------------------------------- per-stage chunks
def test_apply_in_chunks_with_remainder_pads_ragged_results():
    batch = {"x": torch.arange(10), "tag": "t"}
    seen = []

    def fn(sub):
        seen.append(sub["x"].tolist())
        assert sub["tag"] == "t"  # non-row values reach every chunk
        b = sub["x"].size(0)
        return sub["x"].unsqueeze(1).expand(b, b)  # [b, b]: row i = x_i repeated b times

    out, n_chunks = apply_in_chunks(fn, batch, 4, pad_value=-1)
    assert n_chunks == 3
    assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # chunks 4, 4, 2
    # chunks of width 4, 4, 2 → [10, 4]; the last two rows right-padded with -1
    expected = [[i] * 4 for i in range(8)] + [[8, 8, -1, -1], [9, 9, -1, -1]]
    torch.testing.assert_close(out, T(expected))


def test_apply_in_chunks_dict_results_merge():
    batch = {"x": T([1.0, 2.0, 3.0]), "name": ["p", "q", "r"]}

    def fn(sub):
        return {"y": sub["x"] * 10, "name": [n.upper() for n in sub["name"]], "stage": "ref"}

    out, n_chunks = apply_in_chunks(fn, batch, 2)  # chunks [1, 2], [3]
    assert n_chunks == 2
    torch.testing.assert_close(out["y"], T([10.0, 20.0, 30.0]))
    assert out["name"] == ["P", "Q", "R"] and out["stage"] == "ref"
    with pytest.raises(ValueError, match="batch has no rows"):
        apply_in_chunks(fn, {"x": torch.zeros(0)}, 2)


def test_lcm_target_gives_every_stage_full_chunks():
    # the module diagram: stage sizes (2, 3, 6), micro-batches 2, 3, 1 rows, sample_repeat 2 → 12 rows
    sizes = {"rollout": 2, "ref_logps": 3, "old_logps": 6}
    assert service_target_bs(**sizes) == 6
    repeated = repeat_rows(merge(_micro_batches(), **MERGE_KW), 2)
    seen = {stage: [] for stage in sizes}
    n_chunks = {}
    for stage, size in sizes.items():

        def fn(sub, stage=stage):
            seen[stage].append(len(sub["text"]))
            return sub["reward"]

        out, n_chunks[stage] = apply_in_chunks(fn, repeated, size)
        torch.testing.assert_close(out, repeated["reward"])  # chunked compute + concat = whole-batch compute
    assert n_chunks == {"rollout": 6, "ref_logps": 4, "old_logps": 2}
    # 12 / 2 = 6 chunks of 2, 12 / 3 = 4 chunks of 3, 12 / 6 = 2 chunks of 6: no short chunk anywhere
    assert seen == {"rollout": [2] * 6, "ref_logps": [3] * 4, "old_logps": [6] * 2}


# ---------------------------------------------------------------------------------------------- buffer
def _rows(n, start):
    return {"x": torch.arange(start, start + n), "id": [f"r{i}" for i in range(start, start + n)]}


def test_micro_batch_buffer_fills_to_target_and_flushes_remainder():
    buf = MicroBatchBuffer(service_target_bs(2, 3, 6))  # target 6
    buf.add(_rows(2, 0))
    buf.add(_rows(3, 2))
    assert buf.rows == 5 and buf.sizes == [2, 3] and not buf.ready()
    assert buf.take() is None and buf.rows == 5  # not ready: kept
    buf.add(_rows(1, 5))
    assert buf.ready()
    merged, sizes = buf.take()
    assert sizes == [2, 3, 1]
    torch.testing.assert_close(merged["x"], torch.arange(6))
    assert buf.rows == 0 and buf.sizes == [] and len(buf) == 0
    # overshoot: 4 + 3 = 7 ≥ 6 → taken whole (the buffer never splits a micro-batch)
    buf.add(_rows(4, 6))
    buf.add(_rows(3, 10))
    merged, sizes = buf.take()
    assert sizes == [4, 3] and merged["id"] == [f"r{i}" for i in range(6, 13)]
    # end of iteration: 1 row left, only a forced take releases it
    buf.add(_rows(1, 13))
    assert not buf.ready() and buf.take() is None
    assert buf.ready(force=True)
    merged, sizes = buf.take(force=True)
    assert sizes == [1] and merged["id"] == ["r13"]
    assert not buf.ready(force=True) and buf.take(force=True) is None  # empty: nothing to force


def test_micro_batch_buffer_passes_merge_kwargs_and_validates():
    buf = MicroBatchBuffer(3, **MERGE_KW)
    a, b, _ = _micro_batches()
    buf.add(a)
    buf.add(b)
    merged, sizes = buf.take()
    assert sizes == [2, 3]
    torch.testing.assert_close(merged["prompt_ids"][:2], T([[99, 11, 12], [99, 13, 14]]))  # left-padded with 99
    with pytest.raises(ValueError, match="target must be a positive int, got 0"):
        MicroBatchBuffer(0)
    with pytest.raises(ValueError, match="batch has no rows"):
        buf.add({"x": torch.zeros(0)})


# ---------------------------------------------------------------------------------------------- reuse order
def test_reuse_order_both_orders():
    assert REUSE_ORDERS == ("epoch", "consecutive")
    assert reuse_order(["a", "b"], 2) == ["a", "b", "a", "b"]  # default epoch: a b | a b
    assert reuse_order(["a", "b"], 2, "consecutive") == ["a", "a", "b", "b"]  # seed 000: a a b b
    assert reuse_order(["a", "b", "c"], 3, "consecutive") == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert reuse_order(["a", "b"], 1, "consecutive") == reuse_order(["a", "b"], 1) == ["a", "b"]
    with pytest.raises(ValueError, match=r"order must be one of \('epoch', 'consecutive'\), got 'random'"):
        reuse_order(["a"], 2, "random")
    with pytest.raises(ValueError, match="num_iterations must be a positive int, got 0"):
        reuse_order(["a"], 0)


def test_seed_000_main_loop_end_to_end():
    # seed 000's loop: micro-batches of 2, 3, 1, 4, 1 rows, target lcm(2, 3, 6) = 6, sample_repeat 2,
    # proceed_num_steps 5, batch_repeat (μ) 2 in "consecutive" order
    buf = MicroBatchBuffer(service_target_bs(2, 3, 6))
    produced = []
    lengths = [2, 3, 1, 4, 1]
    start = 0
    for step, n in enumerate(lengths, start=1):
        buf.add(_rows(n, start))
        start += n
        force = step == len(lengths)
        taken = buf.take(force=force)
        if taken is not None:
            merged, sizes = taken
            big = repeat_rows(merged, 2)
            big["x"] = big["x"] * 10  # stand-in for generate + advantage on the whole service batch
            produced.extend(split_back(big, sizes, repeat=2))
    # flush 1 at step 3 (rows 2 + 3 + 1 = 6): micro-batches [0,1], [2,3,4], [5]
    # flush 2 forced at step 5 (rows 4 + 1 = 5 < 6): [6,7,8,9], [10]
    assert [p["id"][::2] for p in produced] == [
        ["r0", "r1"],
        ["r2", "r3", "r4"],
        ["r5"],
        ["r6", "r7", "r8", "r9"],
        ["r10"],
    ]
    torch.testing.assert_close(produced[1]["x"], T([20, 20, 30, 30, 40, 40]))  # rows 2, 3, 4 each ×2, ×10
    queue = reuse_order(produced, 2, "consecutive")
    assert [q["id"][0] for q in queue] == ["r0", "r0", "r2", "r2", "r5", "r5", "r6", "r6", "r10", "r10"]
