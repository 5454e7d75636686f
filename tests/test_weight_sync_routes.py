"""`grpo_async.weight_sync.routes.probe_store`, the check `/ws/init_broadcast` makes before the engine joins: it speaks
torch's store protocol to a real `TCPStore`, and refuses what is not one without waiting past its timeout."""

import asyncio
import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from grpo_async.net import free_port
from grpo_async.weight_sync.routes import probe_store


def _probe(port: int, timeout_s: float = 5.0) -> None:
    asyncio.run(probe_store("127.0.0.1", port, timeout_s))


def test_a_real_store_answers_and_still_serves_torchs_own_clients_after():
    """torch 2.13's `TCPStore` master (what the trainer hosts) passes the probe, several times, and a torch client
    then joins it and reads what the master wrote: the probe left the store as it found it."""
    master = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    master.set("written", "by the master")
    for _ in range(3):
        _probe(master.port)
    client = TCPStore("127.0.0.1", master.port, 2, is_master=False, timeout=timedelta(seconds=10))
    assert client.get("written") == b"by the master"
    assert master.num_keys() >= 1


@pytest.fixture
def listener():
    """A TCP listener that accepts connections and answers nothing itself: `(port, first)`, `first()` the first
    connection it accepted (waited for), for the test to act as the peer."""
    sock = socket.create_server(("127.0.0.1", 0))
    conns, connected = [], threading.Event()

    def accept():
        try:
            while True:
                conns.append(sock.accept()[0])
                connected.set()
        except OSError:
            return

    def first():
        assert connected.wait(10), "the probe never connected"
        return conns[0]

    threading.Thread(target=accept, daemon=True).start()
    yield sock.getsockname()[1], first
    sock.close()
    for c in conns:
        c.close()


def test_a_silent_peer_is_refused_at_the_timeout_not_later(listener):
    port, _ = listener
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer within 0.5 s"):
        _probe(port, timeout_s=0.5)
    assert time.monotonic() - start < 30  # bounded (a generous bound: only a hang would break it)


def test_a_peer_that_answers_something_else_is_not_a_store(listener):
    port, first = listener

    def answer_wrong():
        conn = first()
        conn.recv(64)
        conn.sendall(b"HTTP")  # 4 bytes, not the nonce

    threading.Thread(target=answer_wrong, daemon=True).start()
    with pytest.raises(ConnectionError, match="not a torch TCPStore"):
        _probe(port)


def test_a_peer_that_closes_the_connection_or_is_not_there_fails_at_once(listener):
    port, first = listener
    threading.Thread(target=lambda: first().close(), daemon=True).start()
    with pytest.raises(ConnectionError):  # reset, or closed before an answer
        _probe(port, timeout_s=60)
    with pytest.raises(OSError):
        _probe(free_port("127.0.0.1"), timeout_s=60)  # a port nothing listens on
