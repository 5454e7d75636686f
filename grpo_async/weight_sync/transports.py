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
import time
from datetime import timedelta

import torch

from grpo_async.net import ServerClient, ServerError, address_seen_by, free_port
from grpo_async.weight_sync.buckets import BucketPlan, iter_buckets, pack_bucket
from grpo_async.weight_sync.names import WireTransport
from grpo_async.weight_sync.transport_base import (
    ControlCall,
    Groups,
    ServerTransport,
    WeightTransport,
    server_said,
)

logger = logging.getLogger("grpo_async.weight_sync")


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


class BroadcastTransport(ServerTransport):
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
        call = ControlCall(
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
                f"{server_said(call)}"
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
        call = ControlCall(
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
                f"group_timeout={self.group_timeout:.0f}s): {type(e).__name__}: {str(e)[:300]}{server_said(call)}"
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


class ShmTransport(ServerTransport):
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

    def _pack(self, plans: list[BucketPlan]) -> dict:
        """Pack `plans` into their segments (each bucket of a push its own, so a packed bucket waits there for its
        request: `PushStream` sends it with the next one, the last with the closing one)."""
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
        return {"buckets": [p.layout for p in plans], "segments": names}

    def _post(self, packed: dict, extra: dict) -> dict:
        return self.client.post("/ws/update", {"transport": "shm", **packed, **extra}, timeout=self.timeout)

    def _session(self, plans: list[BucketPlan], extra: dict) -> dict:
        return self._post(self._pack(plans), extra)

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


class CudaIpcTransport(ServerTransport):
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
TRANSPORTS: dict[WireTransport, type[ServerTransport]] = {
    "broadcast": BroadcastTransport,
    "shm": ShmTransport,
    "cuda_ipc": CudaIpcTransport,
}


def make_transport(name: WireTransport, client: ServerClient, bucket_mb: float = 64.0, **kwargs) -> ServerTransport:
    """Build the server transport registered under `name` (`"broadcast"`, `"shm"`, `"cuda_ipc"`)."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {name!r}; choose one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](client, bucket_mb, **kwargs)
