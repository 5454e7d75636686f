"""`exit_with_parent`: a process started by `multiprocessing` (vLLM's engine core and workers) exits when the process
that forked it dies. Ground floor (no other module of the package): the weight-sync worker extension calls it in every
process vLLM starts, and `generation.server_process` documents it for the servers it launches."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

_parent_watch: threading.Thread | None = None


def exit_with_parent(interval: float = 0.5, grace: float = 10.0) -> bool:
    """In a process started by `multiprocessing` (vLLM's engine core and workers): watch the parent and exit when it
    dies, so an API server or trainer killed by SIGKILL or the OOM killer leaves no engine holding memory and
    `/dev/shm`. Does nothing (returns False) in a process not started by `multiprocessing`, or when already watching.

    A named daemon thread polls `os.getppid()` every `interval` seconds; once the parent is gone (the process was
    re-parented) it sends this process SIGTERM (vLLM's handlers shut the engine down), then SIGKILL after `grace`
    seconds if it is still alive. A poll rather than `prctl(PR_SET_PDEATHSIG)`, which fires when the *thread* that
    started the process ends, e.g. a trainer's generation thread, not the process.
    """
    import multiprocessing

    global _parent_watch
    if multiprocessing.parent_process() is None or _parent_watch is not None:
        return False
    # the process that forked this one: `parent_process()` names the one that asked for it, which under the
    # forkserver start method is not the parent (the fork server is)
    ppid = os.getppid()

    def watch() -> None:
        while os.getppid() == ppid:
            time.sleep(interval)
        logger.warning("exit-with-parent: parent process %d is gone; pid %d exits", ppid, os.getpid())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os.kill(os.getpid(), signal.SIGKILL)

    _parent_watch = threading.Thread(target=watch, name=f"exit-with-parent-{ppid}", daemon=True)
    _parent_watch.start()
    return True
