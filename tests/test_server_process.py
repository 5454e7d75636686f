"""Shared-memory cleanup after a server is killed: its own orphaned segments go, nobody else's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from multiprocessing import shared_memory

from grpo_async.generation.server_process import _shm_names, group_shm, remove_orphan_shm

#: a stand-in for a server's engine: its own session, a shared-memory segment it maps and never unlinks
HOLDER = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
seg = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(seg._name, "shared_memory")  # a SIGKILLed engine never unlinks: nothing else will
print(seg.name, flush=True)
time.sleep(600)
"""


def test_a_killed_groups_segments_are_removed_and_no_one_elses():
    before = frozenset(_shm_names())
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    foreign = None
    try:
        name = holder.stdout.readline().strip()  # e.g. psm_1a2b3c
        assert name in _shm_names()
        # another program's segment, unmapped for the moment (a semaphore its child has not opened yet looks so)
        foreign = shared_memory.SharedMemory(create=True, size=4096)
        foreign.close()
        owned = group_shm(holder.pid)
        assert name in owned and foreign.name not in owned
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        time.sleep(0.1)
        removed = remove_orphan_shm(before, owned)
        assert removed == [name]
        assert name not in _shm_names(), "the killed group's segment is still there"
        assert foreign.name in _shm_names(), "another program's segment was unlinked"
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
        if foreign is not None:
            foreign.unlink()


def _watching_child(path: str) -> None:
    from grpo_async.parent_watch import exit_with_parent

    assert exit_with_parent(interval=0.05, grace=1.0)
    time.sleep(1.0)  # twenty polls of the watch
    with open(path, "w") as f:
        f.write(str(os.getppid()))


def test_exit_with_parent_watches_the_real_parent_under_forkserver(tmp_path):
    """Under the forkserver start method the process that asked for the child is not its parent (the fork server
    is): the watch must not take the one for the other and kill the child at its first poll (it did: exit -15)."""
    # the suite's fork server (one per process: started once, preloaded)
    from support.warm_launch import _context

    p = _context().Process(target=_watching_child, args=(str(tmp_path / "alive"),))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    assert int((tmp_path / "alive").read_text()) != os.getpid()  # its parent was the fork server
