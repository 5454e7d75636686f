"""The one HTTP client for every call to a server: generation (`/v1/completions`, `/v1/models`, `/health`), weight
sync (`/ws/*` on `grpo-async serve`, vLLM's RL routes on a stock server) and reference logprobs (`/ws/logprobs`).

JSON bodies only (nothing is pickled); an error answer becomes `ServerError` (`status` = the HTTP code, None when the
server did not answer in time), a refused API key `ServerAuthError`. Also the address helpers the callers share:
`free_port`, `is_loopback`, `address_seen_by`.
"""

from __future__ import annotations

import json
import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (an IPv4 or IPv6 address)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def is_loopback(url: str) -> bool:
    """Whether the server at `url` is on this machine, reached over loopback."""
    from urllib.parse import urlparse

    return urlparse(url).hostname in LOOPBACK_HOSTS


def address_seen_by(url: str) -> str:
    """This machine's address on the route to the server at `url`: where the server's workers can reach the
    trainer's process-group store (broadcast weight sync). `127.0.0.1` for a loopback server; otherwise the local
    address the kernel would send from (a UDP `connect` picks the route and sends nothing), so a trainer on a
    multi-homed node answers on the interface that faces that server."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    if host is None:
        raise ValueError(f"server url {url!r} has no host")
    if is_loopback(url):
        return "127.0.0.1"
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError as e:
        raise ServerError(
            f"cannot find this machine's address on the route to {url} ({e}); set GRPOConfig.vllm_master_address "
            "to the trainer's address as that server sees it"
        ) from e


class ServerError(RuntimeError):
    """A server answered with an error (`status` = HTTP code), or did not answer in time (`status` = None)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerAuthError(ServerError):
    """A server refused the API key (HTTP 401 or 403): it is running, the key is wrong or missing."""


class ServerClient:
    """JSON-over-HTTP client for one server: every route the backends, transports and `RefLogpsClient` call.

    Args:
        url (`str`): base URL, e.g. `"http://127.0.0.1:8000"`.
        api_key (`str`, *optional*): sent as `Authorization: Bearer <key>` on every request.
        timeout (`float`, *optional*, defaults to 120): seconds any single request may take.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0):
        import requests
        from requests.adapters import HTTPAdapter

        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.session = requests.Session()
        self.session.mount("http://", HTTPAdapter(pool_connections=4, pool_maxsize=64))
        self.session.headers["Content-Type"] = "application/json"
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        import requests

        t = self.timeout if timeout is None else timeout
        try:
            r = self.session.request(
                method, self.url + path, data=None if body is None else json.dumps(body), timeout=(min(t, 10.0), t)
            )
        except requests.RequestException as e:
            raise ServerError(f"{method} {self.url}{path} failed: {type(e).__name__}: {e}") from e
        if r.status_code == 401 or (r.status_code == 403 and "--frozen" not in r.text):
            what = "refused the API key" if "Authorization" in self.session.headers else "needs an API key (none sent)"
            raise ServerAuthError(
                f"{method} {self.url}{path} → HTTP {r.status_code}: the server at {self.url} is running but {what}; "
                f"pass the key it was started with (`--api-key`) as GRPOConfig.vllm_api_key: {r.text[:200]}",
                r.status_code,
            )
        if r.status_code >= 400:
            raise ServerError(f"{method} {self.url}{path} → HTTP {r.status_code}: {r.text[:500]}", r.status_code)
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError as e:  # a broken server or proxy: treated like a server that does not answer
            raise ServerError(
                f"{method} {self.url}{path} → HTTP {r.status_code}, body is not JSON ({e}): {r.text[:200]!r}"
            ) from e

    def get(self, path: str, timeout: float | None = None) -> Any:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float | None = None) -> Any:
        return self.request("POST", path, body, timeout=timeout)

    def close(self) -> None:
        self.session.close()
