"""The weight sink of the server backends: one push streamed to every live server at once, bucket by bucket.

```txt
publisher ──groups──▶ ServerFanout.push ──bucket b0──▶ transport(server 1) ─▶ server 1
                        (buckets made once)  └───────▶ transport(server 2) ─▶ server 2
```
The servers and which of them serve are the backend's rotation (`generation.vllm_server.CompletionsRouter`); the
fan-out only reads it and reports to it: a server whose push fails leaves the rotation (`mark_dead`), one out of
rotation that answers `GET /health` again (probed at a push at least `rejoin_interval` seconds after it left) gets
this push on a fresh transport and rejoins once it has loaded it (`rejoin`), so it never serves a round on other
weights than the live servers'. A new wire transport is a `make_transport` of the backend; nothing here changes.

With `delta` (`weight_sync.delta.DeltaSync`, `GRPOConfig.weight_sync_delta`) each bucket is coded once against the
trainer's copy and each server gets its delta or the full bucket in the engine's dtype; a server that refuses the
delta (restarted, or its copy disagrees) gets a full push of the trainer's copy right after the others closed theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from grpo_async.net import ServerClient, ServerError
from grpo_async.weight_sync.buckets import NamedTensors, iter_buckets
from grpo_async.weight_sync.delta import DeltaSync, is_refusal

logger = logging.getLogger(__name__)

Groups = Iterable[tuple[str, NamedTensors]]


class Rotation(Protocol):
    """What the fan-out needs of the servers' rotation (`CompletionsRouter` is one)."""

    clients: list[ServerClient]
    live: list[ServerClient]

    def mark_dead(self, client: ServerClient, error: BaseException) -> None: ...

    def answering_again(self, interval: float, timeout: float) -> list[ServerClient]: ...

    def rejoin(self, client: ServerClient) -> None: ...


def discard(transport) -> None:
    """Release a server transport without a goodbye request when it has `discard` (`WeightTransport`), else `close`."""
    (getattr(transport, "discard", None) or transport.close)()


class ServerFanout:
    """Push module-grouped weights to every live server of `rotation`.

    Args:
        rotation (`Rotation`): the servers and which are live.
        make_transport (`Callable[[ServerClient, torch.device], transport]`): a server's transport (one per server,
            kept across pushes; its `stream(version, lora=...)` sends one push).
        bucket_mb (`float`): bucket size in MiB (`buckets.iter_buckets`).
        rejoin_interval (`float` or `None`): seconds before a server out of rotation is probed again; None: never.
        probe_timeout (`float`): seconds a `GET /health` probe waits.
        name (`str`): who pushes, for the error when no server is left.
        delta (`DeltaSync`, *optional*): send full-weight pushes as deltas (`weight_sync.delta`); adapter pushes
            (`lora`) are always whole.
    """

    def __init__(
        self,
        rotation: Rotation,
        make_transport: Callable[[ServerClient, torch.device], object],
        bucket_mb: float,
        rejoin_interval: float | None,
        probe_timeout: float,
        name: str,
        delta: DeltaSync | None = None,
    ):
        self.rotation = rotation
        self.make_transport = make_transport
        self.bucket_mb = bucket_mb
        self.rejoin_interval = rejoin_interval
        self.probe_timeout = probe_timeout
        self.name = name
        self.transports: dict[str, object] = {}  # server url -> its transport
        self.delta = delta

    def _transport(self, client: ServerClient, device: torch.device):
        tr = self.transports.get(client.url)
        if tr is None:
            tr = self.transports[client.url] = self.make_transport(client, device)
        return tr

    def push(self, groups: Groups, version: int, lora: dict | None = None) -> None:
        """Stream `groups` to every live server (and to those answering again), bucket by bucket: each bucket goes
        to every server before the next is made. Raises when no server is left in rotation."""
        errors: list[str] = []
        sessions = {client.url: (client, None) for client in list(self.rotation.live)}
        returning = []
        if self.rejoin_interval is not None:  # servers that answer again get this push, then rejoin the rotation
            returning = self.rotation.answering_again(self.rejoin_interval, self.probe_timeout)
            for client in returning:
                stale = self.transports.pop(client.url, None)  # a restarted server knows nothing of the old one
                if stale is not None:
                    discard(stale)
                sessions[client.url] = (client, None)
                if self.delta is not None:
                    self.delta.forget(client.url)
        refused: list[ServerClient] = []  # servers that refused the delta: a full push of the trainer's copy next

        def drop(url: str, e: BaseException) -> None:
            client, _ = sessions.pop(url)
            errors.append(f"{url}: {e}")
            self.rotation.mark_dead(client, e)
            tr = self.transports.pop(url, None)
            if tr is not None:
                discard(tr)  # it stopped answering: no goodbye request (another timeout)
            if self.delta is not None:
                self.delta.forget(url)

        def each(fn, retry: bool = True) -> None:
            for url, (client, _) in list(sessions.items()):
                try:
                    fn(url, client)
                except (ServerError, RuntimeError, OSError) as e:
                    if retry and plan is not None and is_refusal(e):  # nothing loaded: a full push next
                        sessions.pop(url)
                        plan.refused(url)
                        refused.append(client)
                    else:
                        drop(url, e)

        plan = None
        if self.delta is not None and lora is None:
            each(lambda url, client: self.delta.engine_dtype(client))
            plan = self.delta.plan(list(sessions))

        def open_stream(url, client):
            delta = {} if plan is None else {"delta": plan.spec(url)}
            sessions[url] = (client, self._transport(client, device).stream(version, lora=lora, **delta))

        def send(url: str, coded) -> None:
            bucket = coded if plan is None else plan.payload(url, coded)
            if bucket is not None:  # a delta push sends nothing of an unchanged bucket
                sessions[url][1].send(bucket)

        def close(url: str) -> None:
            stream = sessions[url][1]
            if plan is None:  # a stream of any transport (a stock server's too): its plain close
                stream.close()
            else:
                plan.acknowledged(url, stream.close(plan.close_extra(url)))

        device = None
        for bucket in iter_buckets(groups, self.bucket_mb):
            if device is None:
                device = bucket[0][1].device
                each(open_stream)
            coded = bucket if plan is None else plan.encode(bucket)
            each(lambda url, client, c=coded: send(url, c))
        if device is None:  # a model without parameters: nothing to send, still close the session
            device = torch.device("cpu")
            each(open_stream)
        each(lambda url, client: close(url))
        loaded = set(sessions)
        if refused:  # a full push of the trainer's copy, which holds this push's weights in the engine's dtype
            sessions = {c.url: (c, None) for c in refused}
            each(open_stream, retry=False)
            for bucket in iter_buckets(plan.baseline_groups(), self.bucket_mb):
                each(lambda url, client, b=bucket: send(url, {"full": b}), retry=False)
            each(lambda url, client: close(url), retry=False)
            loaded |= set(sessions)
        if plan is not None:
            plan.finish()
        for client in returning:
            if client.url in loaded:  # loaded this push: serves the next rounds
                self.rotation.rejoin(client)
        if not self.rotation.live:
            raise RuntimeError(
                f"{self.name}: no vLLM server left in rotation while pushing weights version {version} "
                f"(all of {[c.url for c in self.rotation.clients]} stopped answering); last errors: {errors}"
            )

    def close(self) -> None:
        """Close every server's transport (idempotent)."""
        for tr in self.transports.values():
            tr.close()
        self.transports.clear()
