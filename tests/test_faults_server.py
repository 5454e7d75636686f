"""Servers that misbehave: garbage answers, answers too slow, a weight-sync peer that dies or never joins.

Each fault is injected by a real HTTP server on 127.0.0.1 (`faults_helpers.FakeServer`, http.server in a thread, or
a separate process for the broadcast peer) talking to the real backends and transports. The user must get an error
that names the server's URL within a bounded time, never a hang and never a silently wrong round.
"""

import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from faults_helpers import FakeServer, models_routes, reply_json

from grpo_async.generation.base import SamplingConfig
from grpo_async.generation.openai_remote import OpenAIRemoteBackend
from grpo_async.generation.vllm_server import VLLMServerBackend
from grpo_async.net import ServerClient, ServerError, free_port
from grpo_async.testing import push_state_dict

HERE = os.path.dirname(__file__)
SAMPLING = SamplingConfig(n=2, max_tokens=3)


def good_completion(_body):
    choice = {"text": "ab", "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
    return reply_json({"choices": [{**choice, "index": 0}, {**choice, "index": 1}]})


GARBAGE = {
    "not JSON": (lambda _: (200, b"{this is not json"), "body is not JSON"),
    "a JSON list": (lambda _: reply_json([1, 2]), "malformed /v1/completions answer: expected a JSON object"),
    "too few choices": (lambda _: reply_json({"choices": [{"index": 0}]}), "1 choices for n=2"),
    "token ids of the wrong type": (
        lambda _: reply_json({"choices": [{"token_ids": "ab", "logprobs": {"token_logprobs": []}}] * 2}),
        "token_ids is not a list of ints",
    ),
    "logprobs of the wrong length": (
        lambda _: reply_json({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}] * 2}),
        "2 token ids but logprobs",
    ),
    "NaN logprobs": (
        lambda _: (
            200,
            b'{"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [NaN]}}, '
            b'{"token_ids": [1], "logprobs": {"token_logprobs": [NaN]}}]}',
        ),
        "logprobs must be finite",
    ),
}


@pytest.fixture
def servers():
    made = []

    def make(routes):
        s = FakeServer(routes)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _backend(kind: str, url: str, timeout: float = 5.0):
    if kind == "vllm_server":
        return VLLMServerBackend([url], timeout=timeout)
    return OpenAIRemoteBackend(url, "tiny", timeout=timeout)


@pytest.mark.parametrize("kind", ["vllm_server", "openai"])
@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_answer_is_a_clear_error_naming_the_server(servers, kind, case):
    answer, message = GARBAGE[case]
    s = servers({**models_routes(), "POST /v1/completions": answer})
    backend = _backend(kind, s.url)
    try:
        with pytest.raises(RuntimeError) as err:
            backend.generate([[1, 2, 3]], SAMPLING)
        text = str(err.value)
        assert "no vLLM server left in rotation" in text and s.url in text and message in text, text
        assert backend.router.live_urls == []  # a server that answers garbage is not asked again
    finally:
        backend.close()


def test_a_garbage_server_leaves_the_rotation_and_the_round_completes_on_the_other(servers, caplog):
    bad = servers({**models_routes(), "POST /v1/completions": GARBAGE["not JSON"][0]})
    good = servers({**models_routes(), "POST /v1/completions": good_completion})
    backend = VLLMServerBackend([bad.url, good.url], timeout=5)
    try:
        out = backend.generate([[1, 2], [3, 4], [5, 6]], SAMPLING)
        assert [c.completion_ids for c in out] == [[5, 6]] * 6
        assert [c.logprobs for c in out] == [[-0.5, -0.25]] * 6
        assert backend.live_urls == [good.url]
        assert any(bad.url in r.getMessage() and "out of rotation" in r.getMessage() for r in caplog.records)
    finally:
        backend.close()


def test_garbage_model_list_is_refused_at_startup(servers):
    s = servers({"GET /health": lambda _: (200, b""), "GET /v1/models": lambda _: reply_json({"data": "x"})})
    with pytest.raises(RuntimeError, match="none of the servers .* answered /health"):
        VLLMServerBackend([s.url], timeout=5)
    with pytest.raises(ServerError, match=f"{s.url}/v1/models lists no model"):
        from grpo_async.generation.vllm_server import _model_name

        _model_name(ServerClient(s.url, timeout=5))


@pytest.mark.parametrize("kind", ["vllm_server", "openai"])
def test_server_slower_than_the_timeout_fails_within_the_timeout(servers, kind):
    release = threading.Event()

    def slow(_body):
        release.wait(60)  # far beyond the client's 2 s timeout
        return good_completion(_body)

    s = servers({**models_routes(), "POST /v1/completions": slow})
    backend = _backend(kind, s.url, timeout=2.0)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            backend.generate([[1, 2, 3]], SAMPLING)
        elapsed = time.monotonic() - start
        assert s.url in str(err.value) and "Timeout" in str(err.value), str(err.value)
        assert elapsed < 30, elapsed  # bounded by the timeout, not by the server (which would answer after 60 s)
    finally:
        release.set()
        backend.close()


# ---------------------------------------------------------------------------------------------- weight sync peer
@pytest.fixture(scope="module")
def state_dict(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_broadcast_peer_that_never_joins_fails_the_push_within_the_group_timeout(servers, state_dict):
    s = servers(
        {
            **models_routes(),
            "GET /ws/info": lambda _: reply_json({"world_size": 1, "version": None, "workers": []}),
            "POST /ws/init_broadcast": lambda _: reply_json({"ranks": [1]}),  # says yes, never joins
            "POST /ws/close_broadcast": lambda _: reply_json({"closed": True}),
        }
    )
    backend = VLLMServerBackend([s.url], timeout=10, transport="broadcast", group_timeout=3)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            push_state_dict(backend, state_dict, 1)
        text = str(err.value)
        assert "while pushing weights version 1" in text and s.url in text, text
        assert "did not join the broadcast group" in text and "group_timeout=3s" in text, text
        assert time.monotonic() - start < 60
        assert backend.live_urls == []
    finally:
        backend.close()


@pytest.mark.parametrize("mode", ["die_on_update", "stuck_on_update"])
def test_broadcast_peer_that_dies_or_hangs_mid_push_fails_the_push_naming_it(state_dict, mode):
    port = free_port()
    peer = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "faults_helpers.py"), "peer", str(port), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    backend = None
    try:
        assert "PEER ready" in peer.stdout.readline()
        backend = VLLMServerBackend([url], timeout=10, transport="broadcast", group_timeout=4)
        start = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            push_state_dict(backend, state_dict, 7)
        text = str(err.value)
        assert "while pushing weights version 7" in text and url in text, text
        assert f"weight sync to {url} failed mid-broadcast" in text, text
        if mode == "die_on_update":
            assert peer.wait(30) == 17  # the peer really crashed mid-push
        else:  # alive but never receiving: the gloo group gave up after its timeout
            assert "Timed out" in text and "group_timeout=4s" in text, text
        assert time.monotonic() - start < 60
        assert backend.live_urls == []
    finally:
        if backend is not None:
            backend.close()
        peer.kill()
        peer.wait(10)


def test_nan_check_helper_is_strict():
    # the parser treats ±inf like NaN: a sampler logprob of -inf would make the IS ratio infinite
    from grpo_async.generation.vllm_common import parse_completions_response

    resp = {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-math.inf]}}]}
    with pytest.raises(ServerError, match="http://x returned a malformed .* finite"):
        parse_completions_response(resp, 1, "http://x")
