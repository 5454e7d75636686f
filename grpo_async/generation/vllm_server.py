"""`VLLMServerBackend(urls)`: `/v1/completions` on `grpo-async serve` servers, least-outstanding routing, failover;
weights by `"broadcast"` (gloo/NCCL), `"shm"` or `"cuda_ipc"` (same machine). A LoRA adapter alone (`load_adapter`)
goes over the same transports to servers started with `--enable-lora`.

Routing over servers: each prompt (with its `n` samples) is one request, sent to the live server with the fewest
outstanding requests. A server that fails to answer (connection error, timeout, 5xx) is taken out of rotation with a
warning and the request is retried on another; only when none is left does `generate` raise. A server out of rotation
is asked `GET /health` again at the next weight push at least `rejoin_interval` seconds after it left (or was last
asked; the probe waits at most `min(timeout, 5)` s); one that answers (restarted on the same URL, say) receives that
push with the others and rejoins the rotation when it has loaded it, so it never serves a round on other weights than
the live servers'.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Literal

import torch

from grpo_async.generation.base import Completion, GenerationAborted, SamplingConfig, check_completions
from grpo_async.generation.vllm_common import (
    CHAT_ROUTE,
    GENERATE_ROUTE,
    Groups,
    check_prompts,
    parse_completions_response,
    parse_generate_response,
    to_chat_body,
    to_completions_body,
    to_generate_body,
    validate_sampling,
)
from grpo_async.generation.vllm_images import check_engine_prompts
from grpo_async.net import ServerAuthError, ServerClient, ServerError, health_problem
from grpo_async.weight_sync.delta import DeltaSync
from grpo_async.weight_sync.lora import adapter_spec, vllm_max_lora_rank
from grpo_async.weight_sync.names import WIRE_TRANSPORTS, WireTransport, check_transport
from grpo_async.weight_sync.server_fanout import ServerFanout
from grpo_async.weight_sync.transports import make_transport

logger = logging.getLogger(__name__)

#: the routes a prompt with images can go to, and the body each takes (`CompletionsRouter(image_route=...)`)
IMAGE_BODIES = {GENERATE_ROUTE: to_generate_body, CHAT_ROUTE: to_chat_body}


class CompletionsRouter:
    """Least-outstanding routing of `/v1/completions` requests over live servers, with failover."""

    def __init__(
        self,
        clients: list[ServerClient],
        model: str | None,
        max_concurrency: int,
        name: str,
        bad_words: list[str] | tuple[str, ...] = (),
        image_route: str = GENERATE_ROUTE,
    ):
        if image_route not in IMAGE_BODIES:
            raise ValueError(f"{name}: image_route must be one of {sorted(IMAGE_BODIES)}, not {image_route!r}")
        self.clients = list(clients)
        self.live = list(clients)
        self.outstanding = {c.url: 0 for c in clients}
        self.served = {c.url: 0 for c in clients}
        self.errors: dict[str, str] = {}  # url -> why it left the rotation
        self.left_at: dict[str, float] = {}  # url -> when it left the rotation, or was last probed (monotonic)
        self.lock = threading.Lock()
        self.name = name
        self.model = model
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=f"{name}-http")
        self.aborted = threading.Event()  # set by the backend's abort(): generate stops waiting for its requests
        #: tokens no request may sample (`SamplingParams.bad_words`): a vision-language model's image placeholders
        self.bad_words: list[str] = list(bad_words)
        #: where a prompt with images goes: vLLM's token-in, token-out route, or the OpenAI chat route
        self.image_route = image_route

    @property
    def live_urls(self) -> list[str]:
        with self.lock:
            return [c.url for c in self.live]

    def pick(self) -> ServerClient:
        """The live server with the fewest outstanding requests (ties: first listed); counts the request."""
        with self.lock:
            if not self.live:
                why = "; ".join(f"{u}: {e}" for u, e in self.errors.items())
                raise RuntimeError(
                    f"{self.name}: no vLLM server left in rotation (all of {[c.url for c in self.clients]} "
                    f"stopped answering or answered garbage){': ' + why if why else ''}"
                )
            client = min(self.live, key=lambda c: self.outstanding[c.url])
            self.outstanding[client.url] += 1
            return client

    def done(self, client: ServerClient) -> None:
        with self.lock:
            self.outstanding[client.url] -= 1
            self.served[client.url] += 1

    def mark_dead(self, client: ServerClient, error: Exception) -> None:
        with self.lock:
            self.errors[client.url] = str(error)
            self.left_at[client.url] = time.monotonic()
            if client in self.live:
                self.live.remove(client)
                logger.warning(
                    "%s: taking %s out of rotation (%s); %d server(s) left",
                    self.name,
                    client.url,
                    error,
                    len(self.live),
                )

    def answering_again(self, interval: float, timeout: float) -> list[ServerClient]:
        """The servers out of rotation, last seen at least `interval` seconds ago, that answer `GET /health` now
        (each probe waits at most `timeout` seconds). They are not put back: `rejoin` does, once they hold the
        current weights."""
        now = time.monotonic()
        with self.lock:
            due = [c for c in self.clients if c not in self.live and now - self.left_at.get(c.url, 0.0) >= interval]
        back = []
        for client in due:
            try:
                client.get("/health", timeout=timeout)
                back.append(client)
            except ServerError as e:
                logger.info("%s: still out of rotation: %s", self.name, health_problem(client.url, e))
            with self.lock:
                self.left_at[client.url] = time.monotonic()
        return back

    def rejoin(self, client: ServerClient) -> None:
        """Put a server that answers again (and holds the current weights) back into the rotation."""
        with self.lock:
            if client not in self.live:
                self.live.append(client)
                self.live.sort(key=self.clients.index)
                self.errors.pop(client.url, None)
                live = len(self.live)
                logger.warning("%s: %s rejoined the rotation; %d server(s) live", self.name, client.url, live)

    def _one(self, prompt: list[int], sampling: SamplingConfig, media=None) -> list[Completion]:
        """One prompt's `n` completions: `/v1/completions` with its token ids, or, for a prompt with images (`media`,
        its `PromptImages`), `image_route` with the images, whose expanded prompt must be the trainer's
        (`check_engine_prompts`)."""
        body = None
        while True:
            client = self.pick()
            try:
                if media is None:
                    body = body or to_completions_body(self.model, prompt, sampling, self.bad_words)
                    resp = client.post("/v1/completions", body)
                    return parse_completions_response(resp, sampling.n, client.url)
                body = body or IMAGE_BODIES[self.image_route](self.model, media, sampling, self.bad_words)
                try:
                    resp = client.post(self.image_route, body)
                except ServerError as e:
                    if e.status in (403, 404) and self.image_route == GENERATE_ROUTE:
                        raise ServerError(  # vLLM < 0.32, or a `vllm serve` without --enable-scale-out
                            f"{client.url} does not take images: its {GENERATE_ROUTE} route answered HTTP {e.status} "
                            f"({e}); `grpo-async serve` enables it, a stock `vllm serve` (>= 0.32) needs "
                            "--enable-scale-out",
                            status=e.status,
                        ) from e
                    raise
                completions, expanded = parse_generate_response(resp, sampling.n, client.url, self.image_route)
                check_engine_prompts([expanded], [prompt], [media])
                return completions
            except ServerError as e:
                if e.status is not None and e.status < 500:
                    raise  # our request is wrong; another server would refuse it too
                self.mark_dead(client, e)
            finally:
                self.done(client)

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, images=None) -> list[Completion]:
        """`images[k]` (`PromptImages` or None): prompt k's images, for a vision-language model."""
        check_prompts(prompt_ids)
        validate_sampling(sampling)
        media = images if images is not None else [None] * len(prompt_ids)
        if len(media) != len(prompt_ids):
            raise ValueError(f"{self.name}: {len(media)} prompts' images for {len(prompt_ids)} prompts")
        # seeded: each request its own seed (`SamplingConfig.for_prompt`); without it, G copies of a prompt (n = 1)
        # would sample the same completion
        futures = [
            self.pool.submit(self._one, p, sampling.for_prompt(i), m)
            for i, (p, m) in enumerate(zip(prompt_ids, media, strict=True))
        ]
        pending = set(futures)
        while pending:  # every request bounded by the client timeout; `abort()` stops the wait within 0.25 s
            if self.aborted.is_set():
                for f in pending:
                    f.cancel()
                raise GenerationAborted(f"{self.name}: generation aborted (shutting down), {len(pending)} requests")
            _, pending = wait(pending, timeout=0.25, return_when=FIRST_EXCEPTION)
            if any(f.done() and not f.cancelled() and f.exception() is not None for f in futures):
                break
        out: list[Completion] = []
        for f in futures:  # each request is bounded by the client timeout (and retried at most once per server)
            out.extend(f.result())
        return check_completions(out, len(prompt_ids), sampling.n, self.name)

    def close(self) -> None:
        """Cancel queued requests and close the clients (idempotent); requests on the wire end by their timeout."""
        self.aborted.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()


def _model_name(client: ServerClient) -> str:
    resp = client.get("/v1/models")
    data = resp.get("data") if isinstance(resp, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    if not isinstance(first, dict) or not isinstance(first.get("id"), str):
        raise ServerError(f"{client.url}/v1/models lists no model (answer: {str(resp)[:200]!r})")
    return data[0]["id"]


class VLLMServerBackend:
    """Generate on one or more `grpo-async serve` servers; push weights to every live server.

    Args:
        urls (`list[str]`): server base URLs, e.g. `["http://127.0.0.1:8000"]`.
        api_key (`str`, *optional*): the servers' `--api-key`.
        timeout (`float`, *optional*, defaults to 120): seconds any request (generation or weight push) may take.
        transport (`str`, *optional*, defaults to `"broadcast"`): a wire transport (`weight_sync.names`):
            `"broadcast"` (gloo on CPU / NCCL on GPU, works for remote servers), `"shm"` (CPU, same machine),
            `"cuda_ipc"` (GPU, same machine), or `"none"` (generation only: `load_weights` raises).
        bucket_mb (`float`, *optional*, defaults to 64): weight-sync bucket size in MiB.
        model (`str`, *optional*): served model name; asked from `/v1/models` when omitted.
        max_concurrency (`int`, *optional*, defaults to 16): requests in flight over all servers.
        master_address (`str`, *optional*): this process's address as the servers see it (broadcast only: the
            trainer hosts the process group's store). Default: found per server (`address_seen_by`: `127.0.0.1`
            for a loopback server, else this machine's address on the route to it).
        inflight_updates (`bool`, *optional*, defaults to `False`): `update_weights` may run while `generate` is in
            progress; the servers freeze running requests, load, and continue them on the new weights (vLLM pause
            mode "keep"). Off: requests in flight finish on the old weights before the load starts.
        group_timeout (`float`, *optional*, defaults to 60): broadcast only: seconds the process group waits for a
            server's workers (to join, or to receive a bucket) before the push fails and that server leaves rotation.
        rejoin_interval (`float` or `None`, *optional*, defaults to 10): a server out of rotation (or not answering
            at construction) is probed with `GET /health` at the next weight push at least this many seconds after
            it left or was last probed (the probe waits at most `min(timeout, 5)` s); one that answers gets that push
            and rejoins the rotation once it has loaded it. `None`: a server that left never comes back.
        delta (`bool`, *optional*, defaults to `False`): send only the values that changed in the engines' dtype
            since the last push each server acknowledged (`weight_sync.delta`; `GRPOConfig.weight_sync_delta`); the
            statistics of the last push are in `sink.delta.last`.
        delta_full_every (`int`, *optional*, defaults to 50): with `delta`, every this-many-th push is a full one.
        bad_words (`list[str]`, *optional*): tokens no request may sample (vLLM's `bad_words`): a vision-language
            model's image placeholders (`vision_processor.vision_placeholder_ids`).

    A vision-language model's prompts with images (`generate(..., images=)`) go to vLLM's token-in, token-out route
    (`vllm_common.GENERATE_ROUTE`: the rendered prompt's ids and the images as PNG data URLs), which `grpo-async
    serve` enables; the server's processor expands the image placeholders, and the expanded prompt must be the
    trainer's, token for token (`vllm_images.check_engine_prompts`). Prompts without images use `/v1/completions`.
    """

    takes_per_prompt_sampling = True  # `SamplingConfig.per_prompt` honoured
    #: `generate(..., images=)`: prompts with images go to vLLM's token-in, token-out route with their images
    takes_images = True
    takes_delta = True  # `delta=True` (weight_sync.delta) works with its servers

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        timeout: float = 120.0,
        transport: WireTransport | Literal["none"] = "broadcast",
        bucket_mb: float = 64.0,
        model: str | None = None,
        max_concurrency: int = 16,
        master_address: str | None = None,
        inflight_updates: bool = False,
        group_timeout: float = 60.0,
        rejoin_interval: float | None = 10.0,
        delta: bool = False,
        delta_full_every: int = 50,
        bad_words: list[str] | tuple[str, ...] = (),
    ):
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("VLLMServerBackend needs at least one server url")
        check_transport(transport, (*WIRE_TRANSPORTS, "none"), f"{type(self).__name__} transport")
        if delta and not self.takes_delta:
            raise ValueError(
                f"GRPOConfig.weight_sync_delta: {type(self).__name__} ({urls}) cannot take a delta push: stock vLLM "
                "servers load through vLLM's weight-transfer API, which keeps no copy of the weights to apply it to; "
                "serve the model with `grpo-async serve`, or set weight_sync_delta=False"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if rejoin_interval is not None and not rejoin_interval >= 0:
            raise ValueError(f"rejoin_interval must be seconds >= 0 or None (never), got {rejoin_interval!r}")
        clients = [ServerClient(u, api_key=api_key, timeout=timeout) for u in urls]
        live, why, left_out = [], [], {}
        for c in clients:
            probing = True  # GET /health; then /v1/models
            try:
                c.get("/health", timeout=min(timeout, 10.0))
                probing = False
                model = model or _model_name(c)
                live.append(c)
            except ServerAuthError as e:  # running, but the key is wrong: not "not answering"
                logger.warning("VLLMServerBackend: %s left out of rotation: %s", c.url, e)
                why.append(f"{c.url} refused the API key (HTTP {e.status}): {e}")
                left_out[c.url] = e
            except ServerError as e:
                if e.status == 503 and "weight reload session" in str(e):  # a dead trainer's push: ours drops it
                    logger.warning("VLLMServerBackend: %s: %s; the first push replaces that session", c.url, e)
                    model = model or _model_name(c)
                    live.append(c)
                    continue
                # /health: nothing answered, or an error status (not a vLLM server, an engine not healthy)
                problem = health_problem(c.url, e) if probing else f"{c.url}: {e}"
                logger.warning("VLLMServerBackend: %s; left out of rotation", problem)
                why.append(problem)
                left_out[c.url] = e
        if not live:
            reasons = "; ".join(why)
            raise RuntimeError(
                f"VLLMServerBackend: none of the servers {urls} answered /health (200) and /v1/models: {reasons}"
            )
        self.router = CompletionsRouter(clients, model, max_concurrency, "VLLMServerBackend", bad_words)
        for c in clients:
            if c.url in left_out:
                self.router.mark_dead(c, left_out[c.url])
        self.base_model = model  # the router asks for the policy adapter's name instead after load_adapter
        self._lora_checked = False
        self.transport_name = transport
        self.bucket_mb = bucket_mb
        self.master_address = master_address
        self.inflight_updates = inflight_updates
        self.group_timeout = float(group_timeout)
        self.sink = ServerFanout(
            self.router,
            self._new_transport,
            bucket_mb,
            rejoin_interval,
            min(float(timeout), 5.0),
            type(self).__name__,
            delta=DeltaSync(delta_full_every) if delta else None,
        )  # the weights' way to every server (weight_sync/server_fanout.py; delta: weight_sync/delta.py)
        self.version: int | None = None

    @property
    def live_urls(self) -> list[str]:
        return self.router.live_urls

    def start_streaming(self) -> None:
        """Stream mode: nothing to start; `generate` already takes calls from several threads at once (each request
        its own HTTP call, `max_concurrency` at a time)."""

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, images=None) -> list[Completion]:
        """`images[k]` (`PromptImages` or None): prompt k's images, for a vision-language model."""
        return self.router.generate(prompt_ids, sampling, images)

    def _new_transport(self, client: ServerClient, device: torch.device):
        """A server's weight transport (`ServerFanout`'s `make_transport`): the wire transport this backend was built
        with, pausing or keeping requests in flight during a load as `inflight_updates` says."""
        kwargs = {}
        if self.transport_name == "broadcast":
            kwargs = {"master_address": self.master_address, "device": device, "group_timeout": self.group_timeout}
        elif self.transport_name == "cuda_ipc":
            kwargs = {"device": device}
        tr = make_transport(self.transport_name, client, self.bucket_mb, **kwargs)
        tr.pause = "keep" if self.inflight_updates else "wait"
        return tr

    def load_weights(self, groups: Groups, version: int) -> None:
        """Stream the groups to every live server at once, bucket by bucket (the groups are produced once: each
        bucket goes to every server before the next is asked for); a server that fails leaves the rotation."""
        self._push(groups, version)
        self.router.model = self.base_model  # full weights are the whole policy

    def load_adapter(self, groups: Groups, config: dict, version: int) -> None:
        """Send only a LoRA adapter (PEFT-named `lora_A` / `lora_B` tensors and its config) to every live server,
        over the same transport as full weights; each installs it as model `policy-v<version>`, which every later
        completion request asks for. The servers must run with `--enable-lora --max-lora-rank R` (R >= the adapter's
        rank), and with `--max-cpu-loras 2` for in-flight updates (a request frozen mid-update resumes on the adapter
        it started with, which must still be resident)."""
        spec = adapter_spec(version, config)
        if not self._lora_checked:
            self._check_lora(config)
        self._push(groups, version, lora=spec)
        self.router.model = spec["name"]

    def _check_lora(self, config: dict) -> None:
        rank = max([int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())])
        for client in list(self.router.live):
            workers = client.get("/ws/info").get("workers") or [{}]
            lora = workers[0].get("lora") or {}
            problem = None
            if not lora.get("enabled"):
                problem = "was started without LoRA support"
            elif lora["max_lora_rank"] < rank:
                problem = f"serves LoRA ranks up to {lora['max_lora_rank']}, the adapter has rank {rank}"
            elif self.inflight_updates and lora["max_cpu_loras"] < 2:
                problem = "keeps one adapter (--max-cpu-loras 1); in-flight updates need the previous one resident"
            if problem:
                flags = f"--enable-lora --max-lora-rank {vllm_max_lora_rank(rank)} --max-cpu-loras 2"
                raise RuntimeError(
                    f"VLLMServerBackend: LoRA adapter sync to {client.url}: the server {problem}. Start it with "
                    f"`grpo-async serve ... {flags}`, or sync merged weights (GRPOConfig.vllm_lora_sync='merged')"
                )
        self._lora_checked = True

    def _push(self, groups: Groups, version: int, lora: dict | None = None) -> None:
        if self.transport_name == "none":
            raise RuntimeError(
                f"{type(self).__name__}(transport='none') generates only (GRPOConfig.weight_sync_transport='none'): "
                "it takes no weights; build it with a wire transport ('broadcast', 'shm', 'cuda_ipc') to push them"
            )
        self.sink.push(groups, version, lora)
        self.version = version

    def abort(self) -> None:
        """Stop waiting for the `generate` call in progress (any thread may call it): it raises `GenerationAborted`
        within 0.25 s, until `resume()`; requests already on the wire end on the server."""
        self.router.aborted.set()

    def resume(self) -> None:
        self.router.aborted.clear()

    def close(self) -> None:
        """Close the weight transports and the router (idempotent)."""
        self.sink.close()
        self.router.close()
