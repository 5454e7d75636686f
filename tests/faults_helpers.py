"""Fault injection for the `test_faults*` family: a real HTTP server on 127.0.0.1 that misbehaves on demand.

`FakeServer(routes)` runs `http.server` in a thread; `routes` maps `"GET /path"` to a function returning
`(status, body_bytes)` (or sleeping, or exiting the process). It stands in for a vLLM server only where a real one
cannot fail on demand: answering garbage, answering too slowly, dying in the middle of a weight broadcast.

Run as a script (`python faults_helpers.py peer PORT MODE`) it is a separate "server" process that speaks just
enough of `grpo-async serve`'s protocol for a broadcast weight sync: `/health`, `/v1/models`, `/ws/info`,
`/ws/init_broadcast` (joins the gloo group as rank 1 unless MODE is `never_join`) and `/ws/update`, where MODE
`die_on_update` exits the process at once (a server crash mid-push).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def reply_json(obj, status: int = 200):
    return status, json.dumps(obj).encode()


class FakeServer:
    """`http.server` on 127.0.0.1 in a daemon thread; `url`, `hits` (paths requested), `close()`."""

    def __init__(self, routes: dict, port: int = 0):
        self.routes = routes
        self.hits: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self, method: str):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                key = f"{method} {self.path}"
                outer.hits.append(key)
                fn = outer.routes.get(key)
                if fn is None:
                    status, data = 404, b'{"detail": "not found"}'
                else:
                    status, data = fn(json.loads(body) if body.startswith(b"{") else body)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout test)
                    pass

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="fake-server", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def models_routes(model: str = "tiny") -> dict:
    """`/health` and `/v1/models` as `grpo-async serve` answers them (enough for VLLMServerBackend to start)."""
    return {
        "GET /health": lambda _: (200, b""),
        "GET /v1/models": lambda _: reply_json({"object": "list", "data": [{"id": model}]}),
    }


def _peer_main(port: int, mode: str) -> None:
    """A "server" process for broadcast weight sync that joins the trainer's gloo group, then fails as `mode` says."""
    from datetime import timedelta

    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    keep = {}

    def init(body):
        if mode != "never_join":
            timeout = timedelta(seconds=body.get("timeout_s", 30))
            store = TCPStore(body["host"], body["port"], body["world_size"], is_master=False, timeout=timeout)
            keep["pg"] = ProcessGroupGloo(PrefixStore(body["group_name"], store), 1, body["world_size"], timeout)
            keep["store"] = store
        return reply_json({"ranks": [1]})

    def update(body):
        print("PEER got /ws/update", flush=True)
        if mode == "die_on_update":
            os._exit(17)  # a crash: sockets closed by the kernel, no answer
        time.sleep(3600)  # "stuck": never receives, never answers
        return reply_json({})

    routes = {
        **models_routes(),
        "GET /ws/info": lambda _: reply_json({"world_size": 1, "version": None, "workers": []}),
        "POST /ws/init_broadcast": init,
        "POST /ws/update": update,
        "POST /ws/close_broadcast": lambda _: reply_json({"closed": True}),
    }
    server = FakeServer(routes, port)
    print(f"PEER ready {server.url}", flush=True)
    server.thread.join()


if __name__ == "__main__":
    if sys.argv[1] == "peer":
        _peer_main(int(sys.argv[2]), sys.argv[3])
