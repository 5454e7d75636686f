"""One of two training processes dies or stalls: the survivor must exit with a clear error, never wait forever.

The two processes are started directly (RANK/WORLD_SIZE/MASTER_* environment, gloo on CPU; forked from the warm
interpreter by `test_faults.Proc`, each ending as a fresh interpreter does), not by `accelerate launch` / `torchrun`:
their agent kills the survivor as soon as one worker fails, which would hide what the survivor itself does.
`ddp_timeout=15` bounds every collective (torch's gloo default is 30 minutes).
"""

import os
import time

import pytest
from test_faults import Proc

from grpo_async.net import free_port

HERE = os.path.dirname(__file__)

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("mode,marker", [("rank_dies", "RANK 1 DIES"), ("rank_hangs", "RANK 1 HANGS")])
def test_survivor_fails_clearly_when_the_other_process_dies_or_stalls(tiny_model_path, tmp_path, mode, marker):
    port = str(free_port())
    procs = []
    try:
        for rank in (0, 1):
            env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            script = os.path.join(HERE, "faults_worker.py")
            procs.append(Proc([script, mode, str(tiny_model_path), str(tmp_path / "out")], env=env))
        procs[1].wait_for(marker, 300)
        start = time.monotonic()
        rc = procs[0].p.wait(120)  # 15 s of ddp_timeout plus the exit; without a bound this would be 30 minutes
        elapsed = time.monotonic() - start
        procs[0].drained.wait(5)  # every line it wrote, read
        out = procs[0].output
        assert rc != 0, out[-3000:]
        assert "process 0 of 2: a collective with the other training processes failed" in out, out[-3000:]
        assert "a peer process died, or did not answer within ddp_timeout=15s" in out
        assert elapsed < 120
        if mode == "rank_hangs":
            assert "Timed out" in out  # the collective gave up after ddp_timeout
            assert procs[1].p.poll() is None  # the stalled process really was alive the whole time
    finally:
        for p in procs:
            p.kill()
