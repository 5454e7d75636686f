"""Multi-node, on loopback: 2 "machines" × 1 training process (accelerate's multi-machine launch, as on a cluster),
2 `grpo-async serve` servers reached only over HTTP and the broadcast transport (no shared memory, no IPC, as if they
were on other hosts), weights pushed after every step, one server killed from outside after step 1.

`multinode_train.py` checks, after every step and after the final `sync_weights()`, that every server in rotation
holds the version published last and returns the trainer's logprobs for that version; this test reads its results.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from vllm_utils import API_KEY, running_servers

from grpo_async.net import ServerError, address_seen_by, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def machine(rank: int, port: int, script_args: list[str], log_path: str) -> subprocess.Popen:
    """Machine `rank` of 2 as on a cluster: `accelerate launch` with the shipped 2-machine config (1 process each,
    rendezvous at 127.0.0.1), only the rank and a free port passed on the command line."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "recipes", "accelerate_configs", "multi_node_cpu.yaml"),
        "--machine_rank",
        str(rank),
        "--main_process_port",
        str(port),
        os.path.join(HERE, "multinode_train.py"),
        *script_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_two_machines_two_remote_servers_one_killed(tiny_model_path, tmp_path):
    out = str(tmp_path)
    with running_servers(tiny_model_path, 2) as servers:
        urls = [s.url for s in servers]
        port = free_port()
        logs = [os.path.join(out, f"machine{r}.log") for r in range(2)]
        procs = [machine(r, port, [tiny_model_path, out, *urls, API_KEY], logs[r]) for r in range(2)]
        deadline = time.monotonic() + 480
        killed = False
        try:
            while any(p.poll() is None for p in procs):
                assert time.monotonic() < deadline, "the 2-machine run did not finish within 8 minutes"
                if not killed and os.path.exists(os.path.join(out, "kill.request")):
                    servers[1].kill()
                    servers[1].proc.wait(30)
                    open(os.path.join(out, "killed"), "w").close()
                    killed = True
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        tails = "\n".join(f"--- machine {r}\n" + open(logs[r]).read()[-4000:] for r in range(2))
        assert [p.returncode for p in procs] == [0, 0], tails
        assert killed, "the run never reached the end of step 1"
        assert not servers[1].alive

    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    # two machines of one process each: global ranks 0 and 1, each the only process (local rank 0) of its node
    assert [(r["rank"], r["world"], r["node"], r["local_rank"]) for r in ranks] == [(0, 2, 0, 0), (1, 2, 1, 0)], tails
    assert [r["steps"] for r in ranks] == [3, 3]
    assert ranks[0]["param_checksum"] == pytest.approx(ranks[1]["param_checksum"], rel=0, abs=1e-9)
    assert len(ranks[0]["rewards"]) == 3

    main = ranks[0]
    assert main["transport"] == "broadcast"
    assert main["live_urls"] == [urls[0]], "the killed server must have left the rotation"
    checks = main["checks"]
    # after steps 1, 2, 3 and the final sync: versions 0, 1, 2, 3; both servers before the kill, the survivor after
    assert [(c["after_step"], c["url"]) for c in checks] == [(1, urls[0]), (1, urls[1])] + [
        (s, urls[0]) for s in (2, 3, 3)
    ], checks
    assert [c["expected_version"] for c in checks] == [0, 0, 1, 2, 3]
    for c in checks:
        assert c["version"] == c["expected_version"], f"a server holds the wrong version: {c}"
        assert c["worst"] < 1e-4, f"sampler and trainer logprobs differ by {c['worst']:.2e}: {c}"
        # each step moved the weights: a push that never landed would leave the previous version's logprobs
        assert c["version"] == 0 or c["moved"] > 1e-2, f"the weights did not change between versions: {c}"
        # every bucket came over the broadcast group: nothing through shared memory or CUDA IPC
        assert c["received"]["broadcast"] > 0 and c["received"]["shm"] == c["received"]["cuda_ipc"] == 0, c
    # the survivor received every version: the buckets of 4 pushes, counted once each
    assert checks[-1]["received"]["broadcast"] == 4 * checks[0]["received"]["broadcast"], checks


def _own_addresses(family=socket.AF_INET) -> list[str]:
    """This machine's non-loopback (and, for IPv6, not link-local) addresses of `family`."""
    import psutil

    addrs = (a.address for nic in psutil.net_if_addrs().values() for a in nic if a.family == family)
    return sorted(a for a in addrs if not a.startswith(("127.", "fe80")) and a != "::1")


def test_the_store_address_is_the_one_each_server_can_reach():
    """`vllm_master_address` unset: loopback servers get 127.0.0.1; a server on another address gets this machine's
    address on the route to it (here: one of this machine's own addresses, the only non-loopback host reachable)."""
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"):
        assert address_seen_by(url) == "127.0.0.1"
    own = _own_addresses()
    if not own:
        pytest.skip("this machine has no non-loopback address")
    assert address_seen_by(f"http://{own[0]}:8000") == own[0]


def test_an_unresolvable_server_host_names_the_setting_to_use():
    with pytest.raises(ServerError, match=r"no-such-host\.invalid.*vllm_master_address"):
        address_seen_by("http://no-such-host.invalid:8000")


def test_an_ipv6_server_gets_an_ipv6_store_address_with_a_free_port():
    own = _own_addresses(socket.AF_INET6)
    if not own:
        pytest.skip("this machine has no global IPv6 address")
    address = address_seen_by(f"http://[{own[0]}]:8000")
    assert address == own[0]
    port = free_port(address)  # the store's port is looked up on that address family, and is free there:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as server:  # a store can listen on it at that address
        server.bind((address, port))
        server.listen(1)
        with socket.create_connection((address, port), timeout=10) as client:  # and be reached there over IPv6
            assert client.family == socket.AF_INET6 and client.getpeername()[:2] == (address, port)
