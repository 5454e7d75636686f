"""Module grouping, threshold bucketing and flat packing (pure; hand-worked expectations)."""

import json

import pytest
import torch

from grpo_async.weight_sync.buckets import (
    MB,
    bucket_layout,
    group_by_module,
    iter_buckets,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
    validate_layout,
)


def f32(n):
    return torch.arange(n, dtype=torch.float32)


def _groups():
    # module a: 16 B + 8 B = 24 B │ b: 16 B │ c: 40 B (alone above a 32 B threshold) │ d: 4 B
    sd = {"a.w": f32(4).view(2, 2), "a.b": f32(2), "b.w": f32(4), "c.w": f32(10), "d.w": f32(1)}
    return group_by_module(sd)


def names(buckets):
    return [[n for n, _ in b] for b in buckets]


def test_group_by_module_keeps_first_appearance_order_and_joins_interleaved_names():
    t = f32(1)
    groups = group_by_module({"x.w": t, "y.w": t, "x.b": t, "w": t})
    assert [(m, [n for n, _ in items]) for m, items in groups] == [
        ("x", ["x.w", "x.b"]),
        ("y", ["y.w"]),
        ("", ["w"]),
    ]


def test_threshold_32_bytes():
    # a (24) | b: 24+16=40 > 32 → close [a] | c: 16+40 > 32 → close [b] | c alone 40 > 32 (one module may exceed)
    # | d: 40+4 > 32 → close [c] | [d]
    assert names(iter_buckets(_groups(), 32 / MB)) == [["a.w", "a.b"], ["b.w"], ["c.w"], ["d.w"]]


def test_threshold_64_bytes():
    # a+b = 40 ≤ 64 | +c = 80 > 64 → close [a, b] | c+d = 44 ≤ 64
    assert names(iter_buckets(_groups(), 64 / MB)) == [["a.w", "a.b", "b.w"], ["c.w", "d.w"]]


def test_module_never_split_and_bucket_exceeds_only_for_single_module():
    torch.manual_seed(0)
    sd = {f"m{i}.p{j}": torch.randn(int(torch.randint(1, 300, ()))) for i in range(30) for j in range(3)}
    limit = 2000 / MB
    buckets = list(iter_buckets(group_by_module(sd), limit))
    seen = {}
    for k, b in enumerate(buckets):
        for n, _ in b:
            seen.setdefault(n.split(".")[0], set()).add(k)
        size = sum(t.numel() * 4 for _, t in b)
        if size > 2000:
            assert len({n.split(".")[0] for n, _ in b}) == 1
    assert all(len(ks) == 1 for ks in seen.values())
    assert [n for b in buckets for n, _ in b] == list(sd)  # order preserved, nothing lost


def test_bad_threshold():
    for bad in (0, -1, "64", None, True):
        with pytest.raises(ValueError, match="bucket_mb"):
            list(iter_buckets(_groups(), bad))


def test_layout_mixed_dtypes_hand_worked():
    tensors = [
        ("x.w", torch.zeros(2, dtype=torch.float32)),  # float32 buffer [0, 8)
        ("x.h", torch.zeros(3, dtype=torch.float16)),  # float16 buffer [0, 6)
        ("x.v", torch.zeros(1, 1, dtype=torch.float32)),  # float32 buffer [8, 12)
    ]
    layout = bucket_layout(tensors)
    assert layout == {
        "buffers": {"float32": 12, "float16": 6},
        "tensors": [
            {"name": "x.w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8},
            {"name": "x.h", "dtype": "float16", "shape": [3], "offset": 0, "nbytes": 6},
            {"name": "x.v", "dtype": "float32", "shape": [1, 1], "offset": 8, "nbytes": 4},
        ],
    }
    assert json.loads(json.dumps(layout)) == layout


def test_pack_writes_exact_bytes():
    # 1.0f = 0x3F800000 → little-endian bytes 00 00 80 3F; 2.0f = 0x40000000 → 00 00 00 40
    layout, bufs = pack_bucket([("a", torch.tensor([1.0, 2.0]))])
    assert list(bufs) == ["float32"]
    assert bufs["float32"].tolist() == [0, 0, 128, 63, 0, 0, 0, 64]
    assert layout["buffers"] == {"float32": 8}


def test_roundtrip_bit_identical_for_awkward_tensors():
    torch.manual_seed(0)
    nan_payload = torch.tensor([0x7FC00001, 0x7F800001, -0], dtype=torch.int32).view(torch.float32)
    tensors = [
        ("m.nan", nan_payload),
        ("m.negzero", torch.tensor([-0.0, 0.0])),
        ("m.bf16", torch.randn(5, 3).to(torch.bfloat16)),
        ("m.f16", torch.randn(7).to(torch.float16)),
        ("m.i64", torch.tensor([2**62, -1, 0])),
        ("m.bool", torch.tensor([True, False, True])),
        ("m.scalar", torch.tensor(3.5)),
        ("m.empty", torch.zeros(0, 4)),
        ("m.noncontig", torch.randn(4, 6).t()),
        ("m.f64", torch.randn(2, dtype=torch.float64)),
    ]
    layout, bufs = pack_bucket(tensors)
    out = unpack_bucket(json.loads(json.dumps(layout)), bufs)
    assert [n for n, _ in out] == [n for n, _ in tensors]
    for (_, a), (_, b) in zip(tensors, out):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_pack_into_preallocated_buffers():
    t = [("a", torch.tensor([1.0, -1.0]))]
    out = {"float32": torch.full((16,), 7, dtype=torch.uint8)}
    layout, bufs = pack_bucket(t, out=out)
    assert bufs["float32"] is out["float32"]
    assert torch.equal(unpack_bucket(layout, bufs)[0][1], t[0][1])
    with pytest.raises(ValueError, match="at least 8 bytes"):
        pack_bucket(t, out={"float32": torch.zeros(4, dtype=torch.uint8)})


def test_plan_buckets_counts_bytes():
    plans = plan_buckets(_groups(), 64 / MB)
    assert [p.nbytes for p in plans] == [40, 44]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda lay: lay["buffers"].update({"complex64": 8}), "not supported"),
        (lambda lay: lay["tensors"][0].update({"nbytes": 4}), "nbytes=4"),
        (lambda lay: lay["tensors"][0].update({"offset": 4}), "overflow"),
        (lambda lay: lay["tensors"][0].update({"offset": 2}), "multiple of 4"),
        (lambda lay: lay["tensors"][0].update({"shape": [2, -1]}), "shape"),
        (lambda lay: lay["tensors"][0].update({"dtype": "int8"}), "no buffer"),
        (lambda lay: lay["tensors"][0].pop("name"), "exactly the keys"),
        (lambda lay: lay.update({"extra": 1}), "exactly the keys"),
    ],
)
def test_validate_layout_names_the_problem(mutate, match):
    layout = bucket_layout([("a.w", torch.zeros(2))])
    mutate(layout)
    with pytest.raises(ValueError, match=match):
        validate_layout(layout)


def test_unpack_refuses_short_buffer():
    layout, bufs = pack_bucket([("a", torch.zeros(4))])
    with pytest.raises(ValueError, match="at least 16 bytes"):
        unpack_bucket(layout, {"float32": bufs["float32"][:8]})


def test_state_dict_values_must_be_tensors():
    with pytest.raises(TypeError, match="state_dict\\['a'\\]"):
        group_by_module({"a": [1.0]})


SHM_CHILD = """
import multiprocessing as mp
from multiprocessing import shared_memory


def child(name):
    from grpo_async.weight_sync.requests import AttachedSegment

    seg = AttachedSegment(name)
    assert bytes(seg.buf[:3]) == b"abc" and seg.size >= 16
    seg.buf[3:6] = b"xyz"
    seg.close()


if __name__ == "__main__":
    shm = shared_memory.SharedMemory(create=True, size=16)
    shm.buf[:3] = b"abc"
    p = mp.get_context("spawn").Process(target=child, args=(shm.name.lstrip("/"),))
    p.start()
    p.join()
    assert p.exitcode == 0
    assert bytes(shm.buf[3:6]) == b"xyz"
    shm.close()
    shm.unlink()
    print("done")
"""


def test_a_worker_in_a_child_process_attaches_without_breaking_the_trainers_tracker(tmp_path):
    """An engine process started by `multiprocessing` shares the trainer's resource tracker: the worker maps the
    trainer's segment without touching that tracker, so the trainer's own `unlink` stays clean (no `KeyError`
    traceback from the tracker at exit, no "leaked" warning) and the bytes written on either side are seen on the
    other."""
    import subprocess
    import sys

    script = tmp_path / "shm_child.py"
    script.write_text(SHM_CHILD)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert "KeyError" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr
