"""`BucketReceiver`: how `WeightSyncWorker` (the vLLM worker extension, `worker.py`) receives a push's buckets, one
transport each, yielding one bucket at a time as `[(name, tensor), ...]`: NCCL / gloo broadcast (the receive of the
next bucket posted before the current one is loaded), shared-memory segments (attached, kept open until the session
ends), CUDA IPC handles. A mixin: it reads the worker's session state (`_ws_state()`: the process groups, the segments
kept open) and device (`_ws_device()`)."""

from __future__ import annotations

import torch

from grpo_async.weight_sync.buckets import unpack_bucket
from grpo_async.weight_sync.requests import AttachedSegment


class BucketReceiver:
    """The receivers of `WeightSyncWorker` (see the module)."""

    def _ws_receive(self, req: dict):
        kind = req["transport"]
        if kind == "broadcast":
            yield from self._ws_recv_broadcast(req["buckets"], req.get("group"))
        elif kind == "shm":
            yield from self._ws_recv_shm(req["buckets"], req["segments"])
        else:
            yield from self._ws_recv_cuda_ipc(req["buckets"], req["handles"])

    def _ws_recv_broadcast(self, layouts: list[dict], group: str | None):
        from torch.distributed import BroadcastOptions

        st = self._ws_state()
        group = group or st["last_group"]
        if group not in st["pgs"]:
            raise RuntimeError(f"broadcast update for process group {group!r}, which /ws/init_broadcast never set up")
        pg, device = st["pgs"][group][0], self._ws_device()
        opts = BroadcastOptions()
        opts.rootRank = 0

        def post(layout):
            bufs = {dt: torch.empty(n, dtype=torch.uint8, device=device) for dt, n in layout["buffers"].items()}
            works = [pg.broadcast([bufs[dt]], opts) for dt in layout["buffers"]]  # same dtype order as the sender
            return bufs, works

        # Pipeline: the receive of bucket i+1 is posted before bucket i is loaded.
        nxt = post(layouts[0]) if layouts else None
        for i, layout in enumerate(layouts):
            bufs, works = nxt
            nxt = post(layouts[i + 1]) if i + 1 < len(layouts) else None
            for w in works:
                w.wait()
            yield unpack_bucket(layout, bufs)

    def _ws_recv_shm(self, layouts: list[dict], segments: list[dict]):
        st = self._ws_state()
        for layout, seg in zip(layouts, segments):
            bufs = {}
            for dt, name in seg.items():
                shm = AttachedSegment(name)
                st["keep"].append(shm)
                if shm.size < layout["buffers"][dt]:
                    raise ValueError(f"shared-memory segment {name!r} holds {shm.size} bytes, layout needs more")
                bufs[dt] = (
                    torch.frombuffer(shm.buf, dtype=torch.uint8, count=layout["buffers"][dt])
                    if layout["buffers"][dt]
                    else torch.empty(0, dtype=torch.uint8)
                )
            yield unpack_bucket(layout, bufs)
            del bufs

    def _ws_recv_cuda_ipc(self, layouts: list[dict], handles: list[dict]):
        from grpo_async.weight_sync.transports import decode_cuda_ipc

        device = self._ws_device()
        for layout, handle in zip(layouts, handles):
            bufs = {dt: decode_cuda_ipc(handle[dt], device) for dt in layout["buffers"]}
            yield unpack_bucket(layout, bufs)
