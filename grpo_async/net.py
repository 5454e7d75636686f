"""The one HTTP client for every call to a server: generation (`/v1/completions`, `/v1/models`, `/health`), weight
sync (`/ws/*` on `grpo-async serve`, vLLM's RL routes on a stock server) and reference logprobs (`/ws/logprobs`).

JSON bodies only (nothing is pickled); an error answer becomes `ServerError` (`status` = the HTTP code, None when the
server did not answer in time), a refused API key `ServerAuthError`; `probe_health` / `health_problem` say what a
failed `GET /health` means: nothing answered (no server there) or something answered with an error status (not a
vLLM server, or one whose engine is not healthy). Also the address helpers the callers share: `free_port`,
`is_loopback`, `address_seen_by`.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on `host` (an IPv4 or IPv6 address)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback_host(host: str | None) -> bool:
    """Whether listening on `host` is reachable from this machine only (`None`/"" mean every interface: no)."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def is_loopback(url: str) -> bool:
    """Whether the server at `url` is on this machine, reached over loopback (`is_loopback_host` of its host)."""
    from urllib.parse import urlparse

    return is_loopback_host(urlparse(url).hostname)


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
    """A server answered with an error (`status` = HTTP code), or did not answer in time (`status` = None).

    `http_status`: the status the server answered with, also for an answer whose body is not JSON (`status` None
    there: treated like no answer); None when nothing answered. `detail`: why nothing answered (connection refused,
    timed out, ...), or the start of the answer's body."""

    def __init__(self, message: str, status: int | None = None, *, http_status: int | None = None, detail: str = ""):
        super().__init__(message)
        self.status = status
        self.http_status = status if http_status is None else http_status
        self.detail = detail

    @property
    def answered(self) -> bool:
        """Whether the server sent an HTTP answer (an error status, or a body that is not JSON)."""
        return self.http_status is not None


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
            why = no_answer_reason(e, self.url, t)
            raise ServerError(
                f"{method} {self.url}{path} failed, no answer: {type(e).__name__}: {why}", detail=why
            ) from e
        if r.status_code == 401 or (r.status_code == 403 and "--frozen" not in r.text):
            what = "refused the API key" if "Authorization" in self.session.headers else "needs an API key (none sent)"
            raise ServerAuthError(
                f"{method} {self.url}{path} → HTTP {r.status_code}: the server at {self.url} is running but {what}; "
                f"pass the key it was started with (`--api-key`) as GRPOConfig.vllm_api_key: {r.text[:200]}",
                r.status_code,
                detail=r.text[:200],
            )
        if r.status_code >= 400:
            message = f"{method} {self.url}{path} → HTTP {r.status_code}: {r.text[:500]}"
            raise ServerError(message, r.status_code, detail=r.text[:200])
        if not r.content:
            return None
        try:
            return r.json()
        except ValueError as e:  # a broken server or proxy: treated like a server that does not answer
            raise ServerError(
                f"{method} {self.url}{path} → HTTP {r.status_code}, body is not JSON ({e}): {r.text[:200]!r}",
                http_status=r.status_code,
                detail=f"a body that is not JSON: {r.text[:200]!r}",
            ) from e

    def get(self, path: str, timeout: float | None = None) -> Any:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float | None = None) -> Any:
        return self.request("POST", path, body, timeout=timeout)

    def close(self) -> None:
        self.session.close()


def no_answer_reason(error: Exception, url: str, timeout: float | None = None) -> str:
    """Why a request to the server at `url` got no HTTP answer, in words: connection refused (nothing listening
    there), timed out (connecting, or waiting for the answer), the host unknown, or the connection closed; else the
    exception's text as `requests` words it."""
    from urllib.parse import urlparse

    import requests

    where = urlparse(url).netloc or url
    text = str(error)
    if isinstance(error, requests.ConnectTimeout):
        return f"no connection to {where} within {min(timeout, 10.0):g} s" if timeout else f"no connection to {where}"
    if isinstance(error, requests.Timeout):
        return f"connected to {where}, but no answer within {timeout:g} s" if timeout else f"no answer from {where}"
    if isinstance(error, requests.ConnectionError):
        if "Connection refused" in text:
            return f"connection refused: nothing is listening on {where}"
        if "NameResolutionError" in text or "Name or service not known" in text or "getaddrinfo" in text:
            return f"cannot resolve the host of {url}"
        if "RemoteDisconnected" in text or "Connection reset" in text or "Connection aborted" in text:
            return f"{where} closed the connection without an answer"
    return text


def health_problem(url: str, error: ServerError) -> str:
    """What a failed `GET /health` (`error`) says about the server at `url`, told apart: nothing answered (no server
    there, or one too busy to answer), the API key refused, 503 (a vLLM / grpo-async server whose engine is not
    healthy or still starting), or any other answer (not a vLLM / grpo-async server: theirs answer 200).

    >>> health_problem("http://h:1", ServerError("...", detail="connection refused: nothing is listening on h:1"))
    'http://h:1 is not answering GET /health: connection refused: nothing is listening on h:1'
    >>> health_problem("http://h:1", ServerError("...", 404, detail="Not Found"))[:82]
    'http://h:1 answered GET /health with HTTP 404: is this a vLLM / grpo-async server?'
    """
    if not error.answered:
        return f"{url} is not answering GET /health: {error.detail or error}"
    if isinstance(error, ServerAuthError):
        return f"{url} refused the API key (HTTP {error.status}): {error}"
    if error.http_status == 503:
        return f"{url} answered GET /health with HTTP 503: the server is up but not healthy: {error.detail!r}"
    answer = f"HTTP {error.http_status}" + (" and a body that is not JSON" if error.status is None else "")
    return (
        f"{url} answered GET /health with {answer}: is this a vLLM / grpo-async server? Theirs answer 200 there; "
        f"check the URL and port (its answer: {error.detail[:200]!r})"
    )


def probe_health(url: str, api_key: str | None = None, timeout: float = 5.0) -> ServerError | None:
    """`GET url/health` once: None when the server answers 200 (healthy; whatever the body), else the `ServerError`
    (see `health_problem` to word it)."""
    client = ServerClient(url, api_key=api_key, timeout=timeout)
    try:
        client.get("/health")
        return None
    except ServerError as e:
        return None if e.http_status == 200 else e
    finally:
        client.close()
