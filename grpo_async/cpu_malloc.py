"""glibc's allocator on CPU: keep freed memory for the next allocation instead of handing it back to the kernel.

A training step on CPU allocates and frees the same large buffers over and over: the `[N, V]` logits and their
log-softmax, the gradients, vLLM's sampler outputs. glibc's `malloc` serves a block at or above its mmap threshold
(128 KiB at start, raised by each such block freed, to at most 32 MiB) with a fresh `mmap` and unmaps it on `free`,
and gives the top of its heap back once more than its trim threshold is free there. The next step's buffers are then
new pages: one page fault each, which the kernel fills with zeros. On this machine that was system time as large
as the work: `pytest tests/test_trl_qwen3_tools.py` (Qwen3's 151,936-token vocabulary, logits of 40-110 MB) took
user 48 + sys 36-37 busy CPU-s (66.7 / 68.3 s) with glibc's defaults and user 48-51 + sys 4-5 (46.1 / 43.3 s) with
the settings below (alternated, 2 runs each, 2026-11-30); a log-softmax of 128 x 49,152 plus a 512 x 49,152 tensor, 50
times: sys 4.6 -> 0.2 CPU-s, minor faults 1.27 M -> 80 k.

`keep_freed_memory()` sets the mmap threshold to `MMAP_THRESHOLD` (fixed: glibc no longer moves it) and the trim
threshold to `TRIM_THRESHOLD` in this process (`mallopt`), and `ENV` carries the same to processes started from it
(glibc reads `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` at start; a fork keeps its parent's settings).
What it costs: memory freed inside the heap stays mapped to the process, so its resident size stays near its peak
(plus up to `TRIM_THRESHOLD` free at the heap's top) instead of shrinking between steps; blocks of `MMAP_THRESHOLD`
and more are still mapped and unmapped one by one. Vendors ship the same trade for PyTorch on CPU in another form
(vLLM's and Intel's CPU guides preload TCMalloc or jemalloc).

The trainer applies it when it trains on CPU, `grpo-async serve` when its engine runs on CPU. A process whose
environment already names a glibc malloc setting (`MALLOC_*` or `GLIBC_TUNABLES` with `glibc.malloc.`), or sets
`GRPO_ASYNC_CPU_MALLOC=0`, is left as it is: that is how to choose other values or glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Mapping

#: blocks this large or larger are still mapped on their own (model weights loaded at once, a CPU KV cache)
MMAP_THRESHOLD = 2**30
#: the free memory at the heap's top that glibc keeps before giving it back (`mallopt` takes a C int)
TRIM_THRESHOLD = 2**31 - 1
#: what a process started from here reads at start (glibc's environment names)
ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
#: `mallopt`'s parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: the variable that turns this off ("0")
SWITCH = "GRPO_ASYNC_CPU_MALLOC"


def user_chose(environ: Mapping[str, str]) -> bool:
    """Whether `environ` already says how glibc's malloc should behave, or turns this tuning off.

    >>> user_chose({}), user_chose({"MALLOC_ARENA_MAX": "2"}), user_chose({"GRPO_ASYNC_CPU_MALLOC": "0"})
    (False, True, True)
    >>> user_chose({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}), user_chose({"GLIBC_TUNABLES": "glibc.rtld.x=1"})
    (True, False)
    """
    if environ.get(SWITCH, "1") == "0":
        return True
    if any(key.startswith("MALLOC_") for key in environ):
        return True
    return "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


@functools.cache
def _mallopt():
    """glibc's `mallopt`, or None where the C library is another (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        gnu_get_libc_version = libc.gnu_get_libc_version  # glibc's alone
    except (OSError, AttributeError):
        return None
    del gnu_get_libc_version
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def keep_freed_memory(environ: dict[str, str]) -> bool:
    """Set this process's mmap and trim thresholds (`MMAP_THRESHOLD`, `TRIM_THRESHOLD`) and add `ENV` to `environ`
    (the environment its children inherit) unless `user_chose(environ)`; True when set. A C library other than
    glibc is left as it is (False)."""
    if user_chose(environ):
        return False
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    environ.update(ENV)
    return True
