"""`grpo_async.net`, the ground floor's loopback check: one rule for a server's URL (which weight-sync transport can
reach it: shared memory only on this machine) and for `grpo-async serve --host` (no API key needed on loopback)."""

import pytest

from grpo_async.net import is_loopback, is_loopback_host


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://127.0.0.2:8000", True),  # all of 127/8 is loopback (the old fixed list said no)
        ("http://localhost:8000/v1", True),
        ("http://[::1]:8000", True),
        ("http://10.1.2.3:8000", False),
        ("http://0.0.0.0:8000", False),  # every interface: not loopback
        ("https://example.invalid", False),  # does not resolve: not known to be local
    ],
)
def test_is_loopback_of_a_server_url(url, local):
    assert is_loopback(url) is local


def test_a_listening_host_is_loopback_only_when_every_address_is():
    assert is_loopback_host("127.0.0.1") and is_loopback_host("localhost") and is_loopback_host("[::1]")
    assert not is_loopback_host(None) and not is_loopback_host("") and not is_loopback_host("0.0.0.0")
