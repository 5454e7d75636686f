"""What every weight transport is (`WeightTransport`) and what the server ones share (`ServerTransport`: the
`/ws/update` control call in a thread, the stream of one push with its deadline and abort); the transports themselves
are in `transports.py`."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

from grpo_async.net import ServerClient, ServerError
from grpo_async.weight_sync.buckets import BucketPlan, NamedTensors, bucket_layout, iter_buckets

logger = logging.getLogger("grpo_async.weight_sync")

Groups = Iterable[tuple[str, NamedTensors]]


class ControlCall(threading.Thread):
    """Run one blocking HTTP call in a named thread; `result()` re-raises its error."""

    def __init__(self, fn, name: str):
        super().__init__(name=name, daemon=True)
        self.fn, self.value, self.error = fn, None, None

    def run(self):
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in result()
            self.error = e

    def result(self, timeout: float):
        self.join(timeout)
        if self.is_alive():
            raise ServerError(f"{self.name}: no answer within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.value


def server_said(call: ControlCall, wait: float = 5.0) -> str:
    """The server's own answer to the request running in `call`, if it gives one within `wait` seconds."""
    call.join(wait)
    if call.is_alive():
        return f"; the server gave no answer within {wait:.0f}s"
    if call.error is not None:
        return f"; the server said: {call.error}"
    return f"; the server answered {str(call.value)[:200]}"


class WeightTransport(ABC):
    """Carries buckets to one target. `push` is called by the generator thread between rounds.

    Args:
        bucket_mb (`float`, *optional*, defaults to 64): bucket threshold in MiB.
    """

    name: ClassVar[str]

    def __init__(self, bucket_mb: float = 64.0):
        if not (isinstance(bucket_mb, (int, float)) and not isinstance(bucket_mb, bool) and bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a positive number of MiB, got {bucket_mb!r}")
        self.bucket_mb = bucket_mb

    @abstractmethod
    def push(
        self,
        groups: Groups,
        version: int | None = None,
        *,
        digests: bool = False,
        load: bool = True,
        lora: dict | None = None,
    ) -> dict:
        """Stream `(module, [(hf_name, tensor), ...])` groups to the receiver, bucket by bucket, as they are produced
        (the groups may be views of live, gathered or merged parameters: each bucket is sent before the next group
        is asked for, so the sender holds about one bucket beyond the model); return the receiver's summary.

        `digests=True` asks the receiver for sha256 of every tensor as received; `load=False` moves the bytes without
        loading them (benchmark of the transport alone). `lora` (`grpo_async.weight_sync.lora.adapter_spec`): the
        groups are a LoRA adapter's tensors, installed by the receiver as that adapter (the base weights stay).
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the transport's resources (process group, shared memory); idempotent."""

    def discard(self) -> None:
        """Release the transport's resources without asking anything of the receiver (it stopped answering, or
        answered garbage, and leaves the rotation: a goodbye request would only wait another timeout)."""
        self.close()


# ---------------------------------------------------------------------------------------------- server transports
class ServerTransport(WeightTransport):
    """Common driver: a push is one reload session on the server, one `/ws/update` request per bucket."""

    def __init__(self, client: ServerClient, bucket_mb: float = 64.0, timeout: float | None = None):
        super().__init__(bucket_mb)
        self.client = client
        self.timeout = client.timeout if timeout is None else float(timeout)
        #: "wait": requests in flight finish on the old weights first; "keep": in-flight updates (see routes.py)
        self.pause = "wait"

    def push(
        self,
        groups: Groups,
        version: int | None = None,
        *,
        digests: bool = False,
        load: bool = True,
        lora: dict | None = None,
    ) -> dict:
        """One reload session on the server: a request per bucket (packed and sent while the trainer has produced
        only that bucket), then a closing request that finalizes the load and sets `version`."""
        stream = self.stream(version, digests=digests, load=load, lora=lora)
        try:
            for bucket in iter_buckets(groups, self.bucket_mb):
                stream.send(bucket)
        except KeyboardInterrupt:
            raise  # never wait for the server when the user interrupts
        except BaseException:
            stream.abort()
            raise
        return stream.close()

    def stream(
        self,
        version: int | None = None,
        *,
        digests: bool = False,
        load: bool = True,
        lora: dict | None = None,
        delta: dict | None = None,
    ) -> PushStream:
        """Open a push that is fed bucket by bucket: `send(bucket)` each, then `close()` (or `abort()`); with `lora`
        every request carries the adapter spec and the closing one installs the adapter (an abort installs nothing).
        `delta`: the push's `delta` spec (`weight_sync.delta.DeltaPush.spec`), carried by every request."""
        self._start_push()
        base = {"digests": digests, "load": load, "pause": self.pause}
        if lora is not None:
            base["lora"] = lora
        if delta is not None:
            base["delta"] = delta
        return PushStream(self, version, base)

    @staticmethod
    def _add(total: dict, out: dict) -> None:
        for k in ("tensors", "bytes", "buckets"):
            total[k] += out.get(k, 0)
        total["digests"].update(out.get("digests", {}))
        for k, v in (out.get("phases") or {}).items():
            total["phases"][k] = total["phases"].get(k, 0.0) + v

    def _start_push(self) -> None:  # noqa: B027 - optional hook
        """Called once before each push's first bucket."""

    @abstractmethod
    def _empty_extra(self) -> dict:
        """The transport's own fields of a `/ws/update` request that carries no bucket (an abort)."""

    @abstractmethod
    def _session(self, plans: list[BucketPlan], extra: dict) -> dict:
        """Send `plans` (packed here) in one `/ws/update` request carrying `extra`; return the server's answer."""

    def _pack(self, plans: list[BucketPlan]) -> dict | None:
        """Pack `plans` where they can wait for a later request (`_post`): the fields naming them; None (the
        default): this transport sends each bucket as it is packed (`_session`)."""
        return None

    def _post(self, packed: dict, extra: dict) -> dict:
        """The `/ws/update` request carrying buckets `_pack`ed before, and `extra`; the server's answer."""
        raise NotImplementedError(f"{type(self).__name__} packs no bucket ahead of its request")


class PushStream:
    """One reload session on a server, fed bucket by bucket (see `ServerTransport.stream`).

    A transport that packs a bucket where it can wait (`ServerTransport._pack`: shared memory) sends each bucket's
    request when the next bucket is packed, and the last bucket with the closing request: a push of `n` buckets is `n`
    requests, not `n + 1` (the closing one loads the push while generation waits: one request less there)."""

    def __init__(self, transport: ServerTransport, version: int | None, base: dict):
        self.transport, self.version, self.base = transport, version, base
        self.begun = self.ended = False
        self.session: str | None = None  # the server's id for this push (answered at begin; sent with the rest)
        self.total = {"tensors": 0, "bytes": 0, "buckets": 0, "digests": {}, "phases": {}}
        self.held: dict | None = None  # the packed bucket whose request goes out with the next one

    def send(self, bucket: NamedTensors) -> None:
        plan = BucketPlan(bucket, bucket_layout(bucket))
        deadline = time.monotonic() + self.transport.timeout  # shared by this request and the abort after it
        try:
            body = {**self.base, **self._id(), "begin": not self.begun, "end": False}
            packed = self.transport._pack([plan])
            if packed is None:
                out = self.transport._session([plan], body)
            else:
                held, self.held = self.held, packed
                if held is None:  # the first bucket: it goes out with the next request
                    return
                out = self.transport._post(held, body)
        except KeyboardInterrupt:
            raise  # never wait for the server when the user interrupts
        except BaseException:
            self.begun = True  # the server may have opened the session: close it
            self.abort(deadline)
            raise
        self.begun = True
        self.session = self.session or out.get("session")
        ServerTransport._add(self.total, out)

    def _id(self) -> dict:
        return {"session": self.session} if self.session else {}

    def close(self, extra: dict | None = None) -> dict:
        """The closing request (`extra`: fields it alone carries, e.g. the delta's checksum); the push's summary."""
        body = {**self.base, **self._id(), "begin": not self.begun, "end": True, "version": self.version}
        held, self.held = self.held, None
        if held is None:
            out = self.transport._session([], {**body, **(extra or {})})
        else:  # the last bucket, and the end of the push
            out = self.transport._post(held, {**body, **(extra or {})})
        self.ended = True
        ServerTransport._add(self.total, out)
        self.total["version"] = out.get("version")
        if "delta" in out:
            self.total["delta"] = out["delta"]
        if not self.base["digests"]:
            self.total.pop("digests")
        return self.total

    def abort(self, deadline: float | None = None) -> None:
        """Make sure the server finalizes an interrupted session (its model never stays half-reloaded).

        `deadline` (`time.monotonic()` seconds): the deadline of the operation that failed; the closing request gets
        what is left of it, so a server that stopped answering costs `timeout` once, not twice (nothing is sent when
        less than `MIN_ABORT_S` is left: such a server did not answer the request itself, and its session is left to
        the server's own idle deadline). `None`: a fresh `timeout`."""
        self.held = None  # a bucket packed but never sent stays unsent
        if not self.begun or self.ended:
            return
        self.ended = True
        tr = self.transport
        left = tr.timeout if deadline is None else deadline - time.monotonic()
        if left < MIN_ABORT_S:
            logger.warning(
                "not closing the interrupted reload session on %s: it did not answer within the push's deadline "
                "(timeout=%.0f s)",
                tr.client.url,
                tr.timeout,
            )
            return
        try:
            tr.client.post(
                "/ws/update",
                {"transport": tr.name, "buckets": [], "begin": False, "abort": True, **self._id()} | tr._empty_extra(),
                timeout=left,
            )
        except Exception as e:  # noqa: BLE001
            logger.warning("could not close the interrupted reload session on %s: %s", tr.client.url, e)


#: an abort is not sent with less than this many seconds left of the failed push's deadline (`PushStream.abort`)
MIN_ABORT_S = 0.5
