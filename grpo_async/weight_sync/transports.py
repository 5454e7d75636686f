"""Transports that carry weight buckets from the trainer into vLLM.

- `ColocateTransport`: into a `vllm.LLM` in this process; tensors passed by reference to `collective_rpc`.
- `BroadcastTransport` (`"broadcast"`): into a `grpo-async serve` server, local or remote; one flat uint8 broadcast
  per bucket and dtype over a dedicated process group (gloo on CPU, NCCL on GPU); control by JSON `/ws/update`.
- `ShmTransport` (`"shm"`): server on this machine (CPU); one POSIX shared-memory segment per bucket and dtype.
- `CudaIpcTransport` (`"cuda_ipc"`): server on this machine (GPU); CUDA IPC handles of packed buckets, as JSON.

Every transport takes `bucket_mb`: a size threshold (modules never split, see `buckets.py`). Nothing is ever
pickled: the control messages are JSON layouts, the data are raw bytes. After a sync the server resets its prefix
cache (a repeated prompt would otherwise be served from KV computed with the old weights).

Broadcast timeline (the HTTP call blocks until the worker has received everything, so it runs in a thread):

```
trainer main thread            trainer http thread              server worker
pack b0                        POST /ws/update {layouts}  ───▶  begin reload; post recv b0, b1
broadcast b0 ─────────────────────────────────────────────────▶ recv b0  → load_weights(b0)
pack b1 (while b0 flies)                                        recv b1  → load_weights(b1)
broadcast b1 ─────────────────────────────────────────────────▶ finalize (always), reset prefix cache
join http thread  ◀──────────── {"tensors": n, ...}  ◀──────────
```
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from datetime import timedelta
from typing import ClassVar

import torch

from grpo_async.generation.http_client import ServerClient, ServerError, address_seen_by, free_port
from grpo_async.weight_sync.buckets import BucketPlan, NamedTensors, bucket_layout, iter_buckets, pack_bucket
from grpo_async.weight_sync.names import WireTransport

logger = logging.getLogger("grpo_async.weight_sync")

Groups = Iterable[tuple[str, NamedTensors]]


class _Call(threading.Thread):
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


def _server_said(call: _Call, wait: float = 5.0) -> str:
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


# ---------------------------------------------------------------------------------------------- colocate (in-process)
class ColocateTransport(WeightTransport):
    """Load into a `vllm.LLM` living in this process (engine in-process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`).

    Each bucket is one `load_weights` call inside one layerwise-reload session; tensors are passed by reference.
    """

    name = "colocate"

    def __init__(self, llm, bucket_mb: float = 64.0):
        super().__init__(bucket_mb)
        self.llm = llm

    def push(
        self,
        groups: Groups,
        version: int | None = None,
        *,
        digests: bool = False,
        load: bool = True,
        lora: dict | None = None,
    ) -> dict:
        if not load:
            raise ValueError("ColocateTransport moves no bytes; load=False is meaningless here")
        total = {"tensors": 0, "version": None}
        found: dict[str, str] = {}
        begun = ended = False
        try:
            for bucket in iter_buckets(groups, self.bucket_mb):  # one RPC per bucket, tensors by reference
                out = self._rpc([bucket], None, digests, begin=not begun, end=False, lora=lora)
                begun = True
                total["tensors"] += out["tensors"]
                found.update(out.get("digests", {}))
            out = self._rpc([], version, digests, begin=not begun, end=True, lora=lora)
            ended = True
        finally:
            if begun and not ended:  # never leave the engine's model half-reloaded
                try:
                    self._rpc([], None, False, begin=False, end=True)
                except Exception as e:  # noqa: BLE001 - the original error is more useful
                    logger.warning("could not close the interrupted reload session: %s", e)
        self.llm.reset_prefix_cache()
        total["version"] = out["version"]
        if digests:
            total["digests"] = found
        return total

    def _rpc(self, buckets, version, digests, *, begin: bool, end: bool, lora: dict | None = None) -> dict:
        kwargs = {"buckets": buckets, "version": version, "digests": digests, "begin": begin, "end": end}
        if lora is not None:
            kwargs["lora"] = lora
        return self.llm.collective_rpc("ws_load_tensors", kwargs=kwargs)[0]


# ---------------------------------------------------------------------------------------------- server transports
class _ServerTransport(WeightTransport):
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
        self, version: int | None = None, *, digests: bool = False, load: bool = True, lora: dict | None = None
    ) -> _Stream:
        """Open a push that is fed bucket by bucket: `send(bucket)` each, then `close()` (or `abort()`); with `lora`
        every request carries the adapter spec and the closing one installs the adapter (an abort installs nothing)."""
        self._start_push()
        base = {"digests": digests, "load": load, "pause": self.pause}
        if lora is not None:
            base["lora"] = lora
        return _Stream(self, version, base)

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


class _Stream:
    """One reload session on a server, fed bucket by bucket (see `_ServerTransport.stream`)."""

    def __init__(self, transport: _ServerTransport, version: int | None, base: dict):
        self.transport, self.version, self.base = transport, version, base
        self.begun = self.ended = False
        self.session: str | None = None  # the server's id for this push (answered at begin; sent with the rest)
        self.total = {"tensors": 0, "bytes": 0, "buckets": 0, "digests": {}, "phases": {}}

    def send(self, bucket: NamedTensors) -> None:
        plan = BucketPlan(bucket, bucket_layout(bucket))
        deadline = time.monotonic() + self.transport.timeout  # shared by this request and the abort after it
        try:
            out = self.transport._session([plan], {**self.base, **self._id(), "begin": not self.begun, "end": False})
        except KeyboardInterrupt:
            raise  # never wait for the server when the user interrupts
        except BaseException:
            self.begun = True  # the server may have opened the session: close it
            self.abort(deadline)
            raise
        self.begun = True
        self.session = self.session or out.get("session")
        _ServerTransport._add(self.total, out)

    def _id(self) -> dict:
        return {"session": self.session} if self.session else {}

    def close(self) -> dict:
        extra = {**self.base, **self._id(), "begin": not self.begun, "end": True, "version": self.version}
        out = self.transport._session([], extra)
        self.ended = True
        _ServerTransport._add(self.total, out)
        self.total["version"] = out.get("version")
        if not self.base["digests"]:
            self.total.pop("digests")
        return self.total

    def abort(self, deadline: float | None = None) -> None:
        """Make sure the server finalizes an interrupted session (its model never stays half-reloaded).

        `deadline` (`time.monotonic()` seconds): the deadline of the operation that failed; the closing request gets
        what is left of it, so a server that stopped answering costs `timeout` once, not twice (nothing is sent when
        less than `MIN_ABORT_S` is left: such a server did not answer the request itself, and its session is left to
        the server's own idle deadline). `None`: a fresh `timeout`."""
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


#: an abort is not sent with less than this many seconds left of the failed push's deadline (`_Stream.abort`)
MIN_ABORT_S = 0.5


class BroadcastTransport(_ServerTransport):
    """Broadcast packed buckets over a dedicated process group to every worker of one server.

    Args:
        client (`ServerClient`): the server.
        bucket_mb (`float`, *optional*, defaults to 64): bucket threshold in MiB.
        master_address (`str`, *optional*): address of this (trainer) process that the server's workers can reach;
            the trainer hosts the `TCPStore`. Default: `address_seen_by(client.url)` (`127.0.0.1` for a loopback
            server, else this machine's address on the route to the server).
        backend (`str`, *optional*): `"gloo"` (CPU tensors) or `"nccl"` (CUDA tensors); default by `device`.
        device (`str`, *optional*, defaults to `"cpu"`): where the trainer packs buckets.
        group_timeout (`float`, *optional*, defaults to 60): process-group timeout in seconds (a blocked receive
            stalls the server's engine loop, so keep it short).
    """

    name = "broadcast"

    def __init__(
        self,
        client: ServerClient,
        bucket_mb: float = 64.0,
        *,
        master_address: str | None = None,
        backend: str | None = None,
        device: str | torch.device = "cpu",
        group_timeout: float = 60.0,
        timeout: float | None = None,
    ):
        super().__init__(client, bucket_mb, timeout)
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        self.master_address = master_address or address_seen_by(client.url)
        self.group_timeout = float(group_timeout)
        self.pg = None
        self.store = None
        self._connect()

    def _connect(self) -> None:
        from torch.distributed import PrefixStore, TCPStore

        info = self.client.get("/ws/info", timeout=self.timeout)
        world = 1 + int(info["world_size"])
        port = free_port(self.master_address if self.master_address != "0.0.0.0" else "127.0.0.1")
        timeout = timedelta(seconds=self.group_timeout)
        self.store = TCPStore(
            self.master_address, port, world, is_master=True, wait_for_workers=False, timeout=timeout
        )
        group_name = f"grpo_async_ws_{port}"
        self.group_name = group_name
        body = {
            "host": self.master_address,
            "port": port,
            "world_size": world,
            "group_name": group_name,
            "timeout_s": self.group_timeout,
        }
        call = _Call(
            lambda: self.client.post("/ws/init_broadcast", body, timeout=self.timeout),
            f"ws-init-broadcast {self.client.url}",
        )
        call.start()
        prefixed = PrefixStore(group_name, self.store)
        try:
            if self.backend == "nccl":
                from torch.distributed import ProcessGroupNCCL

                self.pg = ProcessGroupNCCL(prefixed, 0, world, ProcessGroupNCCL.Options())
            else:
                from torch.distributed import ProcessGroupGloo

                self.pg = ProcessGroupGloo(prefixed, 0, world, timeout)
        except Exception as e:  # the server's workers never joined (dead, or stuck) within the group timeout
            self.store = None
            raise ServerError(
                f"weight sync to {self.client.url}: its workers did not join the broadcast group {group_name} "
                f"within group_timeout={self.group_timeout:.0f}s ({type(e).__name__}: {str(e)[:300]})"
                f"{_server_said(call)}"
            ) from e
        call.result(self.timeout)
        self.world_size = world

    def _empty_extra(self) -> dict:
        return {"group": self.group_name}

    def _broadcast(self, bufs: dict[str, torch.Tensor]):
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        return [self.pg.broadcast([b], opts) for b in bufs.values()]

    def _wait(self, work) -> None:
        """Wait for a broadcast in slices, so that Ctrl-C reaches the trainer's main thread (the publish runs there);
        after `group_timeout` the blocking wait raises the group's own error."""
        deadline = time.monotonic() + self.group_timeout
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.005)
        work.wait()

    def _session(self, plans: list[BucketPlan], extra: dict) -> dict:
        body = {"transport": "broadcast", "buckets": [p.layout for p in plans], "group": self.group_name, **extra}
        call = _Call(
            lambda: self.client.post("/ws/update", body, timeout=self.timeout),
            f"ws-update-broadcast {self.client.url}",
        )
        call.start()
        inflight = None
        try:
            for plan in plans:
                _, bufs = pack_bucket(plan.tensors, device=self.device)  # packs while the previous bucket flies
                if inflight is not None:
                    for w in inflight[0]:
                        self._wait(w)
                inflight = (self._broadcast(bufs), bufs)
            if inflight is not None:
                for w in inflight[0]:
                    self._wait(w)
        except KeyboardInterrupt:
            raise  # never wait for the server when the user interrupts
        except Exception as e:  # the peer died or stopped receiving: bounded by the group timeout
            raise ServerError(
                f"weight sync to {self.client.url} failed mid-broadcast (the server died or stopped receiving; "
                f"group_timeout={self.group_timeout:.0f}s): {type(e).__name__}: {str(e)[:300]}{_server_said(call)}"
            ) from e
        return call.result(self.timeout)

    def close(self) -> None:
        self._close(tell_server=True)

    def discard(self) -> None:
        self._close(tell_server=False)

    def _close(self, tell_server: bool) -> None:
        if self.pg is None:
            return
        if tell_server:
            try:
                body = {"group_name": self.group_name}
                self.client.post("/ws/close_broadcast", body, timeout=min(self.timeout, 10.0))
            except Exception as e:  # noqa: BLE001 - server may be gone
                logger.info("close_broadcast on %s: %s", self.client.url, e)
        try:
            if hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:  # noqa: BLE001
            pass
        self.pg = self.store = None


def unlink_segments(pool: dict) -> None:
    """Close and unlink every shared-memory segment of `pool` (`{key: SharedMemory}`), then empty it."""
    for shm in pool.values():
        try:
            shm.close()
            shm.unlink()
        except (FileNotFoundError, BufferError):
            pass
    pool.clear()


def pooled_segment(pool: dict, key, nbytes: int):
    """`pool[key]`, a shared-memory segment of at least `nbytes` bytes: reused while big enough, else replaced."""
    from multiprocessing import shared_memory

    shm = pool.get(key)
    if shm is None or shm.size < nbytes:
        if shm is not None:
            unlink_segments({key: shm})
        shm = shared_memory.SharedMemory(create=True, size=max(int(nbytes), 1))
        pool[key] = shm
    return shm


class ShmTransport(_ServerTransport):
    """Pack each bucket straight into a POSIX shared-memory segment; the server maps it (same machine only).

    Segments are kept and reused by the next sync (bucket `i`, dtype `d` → the same segment while it is big
    enough), which saves the page faults of fresh memory; `close()` unlinks them.
    """

    name = "shm"

    def __init__(self, client: ServerClient, bucket_mb: float = 64.0, timeout: float | None = None):
        import weakref

        super().__init__(client, bucket_mb, timeout)
        self._pool: dict = {}
        self._finalizer = weakref.finalize(self, unlink_segments, self._pool)
        self._counter = 0

    def _empty_extra(self) -> dict:
        return {"segments": []}

    def _segment(self, key, nbytes: int):
        return pooled_segment(self._pool, key, nbytes)

    def _start_push(self) -> None:
        self._counter = 0  # segments are reused push after push, one per bucket and dtype

    def _session(self, plans: list[BucketPlan], extra: dict) -> dict:
        names = []
        for plan in plans:
            seg_names, out = {}, {}
            for dt, nbytes in plan.layout["buffers"].items():
                shm = self._segment((self._counter, dt), nbytes)
                seg_names[dt] = shm.name.lstrip("/")
                if nbytes:
                    out[dt] = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
            self._counter += 1
            pack_bucket(plan.tensors, out=out)
            del out  # no view of the segment may outlive the packing
            names.append(seg_names)
        body = {"transport": "shm", "buckets": [p.layout for p in plans], "segments": names, **extra}
        return self.client.post("/ws/update", body, timeout=self.timeout)

    def close(self) -> None:
        self._finalizer()


def encode_cuda_ipc(buf: torch.Tensor) -> dict:
    """JSON-able CUDA IPC handle of a contiguous uint8 CUDA tensor (no pickle: bytes as base64)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    (_, size, stride, offset, _, dtype, device, handle, size_bytes, offset_bytes, _, ref_h, ref_off, ev_h, ev_sync) = (
        args
    )

    def b64(x):
        return None if x is None else base64.b64encode(x).decode()

    return {
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "device": device,
        "handle": b64(handle),
        "size_bytes": size_bytes,
        "offset_bytes": offset_bytes,
        "ref_handle": b64(ref_h),
        "ref_offset": ref_off,
        "event_handle": b64(ev_h),
        "event_sync": bool(ev_sync),
    }


def decode_cuda_ipc(obj: dict, device: torch.device) -> torch.Tensor:
    """Open a handle made by `encode_cuda_ipc` on `device` (the receiver's GPU)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    def unb64(x):
        return None if x is None else base64.b64decode(x)

    return rebuild_cuda_tensor(
        torch.Tensor,
        tuple(obj["size"]),
        tuple(obj["stride"]),
        int(obj["offset"]),
        torch.storage.UntypedStorage,
        torch.uint8,
        device.index if device.index is not None else int(obj["device"]),
        unb64(obj["handle"]),
        int(obj["size_bytes"]),
        int(obj["offset_bytes"]),
        False,
        unb64(obj["ref_handle"]),
        int(obj["ref_offset"]),
        unb64(obj["event_handle"]),
        bool(obj["event_sync"]),
    )


class CudaIpcTransport(_ServerTransport):
    """Pack buckets on the trainer's GPU and hand the server CUDA IPC handles (same machine, GPU only)."""

    name = "cuda_ipc"

    def __init__(self, client: ServerClient, bucket_mb: float = 64.0, *, device="cuda", timeout=None):
        super().__init__(client, bucket_mb, timeout)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaIpcTransport needs a CUDA device, got {device!r}; use 'shm' on CPU")

    def _empty_extra(self) -> dict:
        return {"handles": []}

    def _session(self, plans: list[BucketPlan], extra: dict) -> dict:
        keep, handles = [], []
        for plan in plans:
            _, bufs = pack_bucket(plan.tensors, device=self.device)
            keep.append(bufs)
            handles.append({dt: encode_cuda_ipc(b) for dt, b in bufs.items()})
        torch.cuda.synchronize(self.device)
        body = {"transport": "cuda_ipc", "buckets": [p.layout for p in plans], "handles": handles, **extra}
        out = self.client.post("/ws/update", body, timeout=self.timeout)
        del keep
        return out


#: wire transport name (`weight_sync.names.WIRE_TRANSPORTS`) → transport class for a server target.
TRANSPORTS: dict[WireTransport, type[_ServerTransport]] = {
    "broadcast": BroadcastTransport,
    "shm": ShmTransport,
    "cuda_ipc": CudaIpcTransport,
}


def make_transport(name: WireTransport, client: ServerClient, bucket_mb: float = 64.0, **kwargs) -> _ServerTransport:
    """Build the server transport registered under `name` (`"broadcast"`, `"shm"`, `"cuda_ipc"`)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {name!r}; choose one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](client, bucket_mb, **kwargs)
