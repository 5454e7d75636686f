"""A failed `GET /health` says which of two things happened: nothing answered (nothing listening on that port, or no
answer in time) or something answered with an error status (another program on the port, or a vLLM server whose
engine is not healthy). Before, a server answering 404 was reported as "not answering". Real sockets on 127.0.0.1:
an `http.server` in a thread, and a free port with nothing listening."""

import http.server
import threading
from types import SimpleNamespace

import pytest

from grpo_async.net import free_port, health_problem, probe_health


@pytest.fixture
def answering():
    """`answering(status)`: the URL of a real HTTP server on 127.0.0.1 that answers every GET with `status`."""
    servers = []

    def start(status: int) -> str:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                body = b"<h1>Not Found</h1>" if status == 404 else b'{"error": "the engine is dead"}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def nothing_listening():
    return f"http://127.0.0.1:{free_port()}"


def test_an_error_status_and_no_answer_are_told_apart(answering, nothing_listening):
    url = answering(404)
    error = probe_health(url)
    assert error is not None and error.answered and error.http_status == 404
    said = health_problem(url, error)
    assert said.startswith(f"{url} answered GET /health with HTTP 404: is this a vLLM / grpo-async server?"), said
    assert "Not Found" in said and "not answering" not in said

    error = probe_health(nothing_listening)
    assert error is not None and not error.answered and error.status is None
    said = health_problem(nothing_listening, error)
    port = nothing_listening.rsplit(":", 1)[1]
    assert said == (
        f"{nothing_listening} is not answering GET /health: connection refused: nothing is listening on "
        f"127.0.0.1:{port}"
    )

    url = answering(503)  # a vLLM / grpo-async server whose engine died: up, not healthy
    said = health_problem(url, probe_health(url))
    assert said.startswith(f"{url} answered GET /health with HTTP 503: the server is up but not healthy"), said
    assert "the engine is dead" in said


def test_the_server_backend_names_what_each_server_did(answering, nothing_listening):
    from grpo_async.generation.vllm_server import VLLMServerBackend

    url = answering(404)
    with pytest.raises(RuntimeError) as e:
        VLLMServerBackend([url, nothing_listening], transport="none", timeout=5)
    message = str(e.value)
    assert message.startswith(f"VLLMServerBackend: none of the servers {[url, nothing_listening]} answered /health")
    assert f"{url} answered GET /health with HTTP 404: is this a vLLM / grpo-async server?" in message
    assert f"{nothing_listening} is not answering GET /health: connection refused" in message
    assert f"{url} is not answering" not in message


def test_waiting_for_a_server_says_what_the_last_probe_got(answering, nothing_listening):
    from grpo_async.generation.server_process import wait_ready
    from grpo_async.trl_async import AsyncGRPOTrainer

    url = answering(404)
    stopped = []
    server = SimpleNamespace(url=url, api_key=None, alive=True, stop=lambda: stopped.append(1), log_tail=lambda: "")
    with pytest.raises(TimeoutError, match=rf"last probe: {url} answered GET /health with HTTP 404: is this a vLLM"):
        wait_ready(server, timeout=1.0)
    assert stopped == [1]

    def waiting(server_url):  # AsyncGRPOTrainer.train()'s wait (TRL's vllm_server_timeout), on its own
        args = SimpleNamespace(generation_backend="vllm_server", server_urls=[server_url], vllm_api_key=None)
        AsyncGRPOTrainer.wait_for_servers(SimpleNamespace(args=args, server_ready_timeout=0.5), poll_interval_s=0.1)

    with pytest.raises(TimeoutError) as e:
        waiting(url)
    assert "answered GET /health with HTTP 404" in str(e.value) and "Check vllm_server_base_url" in str(e.value)
    with pytest.raises(TimeoutError) as e:
        waiting(nothing_listening)
    assert "is not answering GET /health: connection refused" in str(e.value)
    assert "Start it" in str(e.value) and "vllm_server_timeout" in str(e.value)
