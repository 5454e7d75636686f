"""Our weight transports as a vLLM weight-transfer engine, for stock `vllm serve` servers (vLLM's RL API).

vLLM 0.32 lets a trainer push weights into a plain `vllm serve` through its RL routes (`VLLM_SERVER_DEV_MODE=1`):
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`. The bytes travel
through a *weight-transfer engine* chosen with `--weight-transfer-config '{"backend": NAME}'`; vLLM's built-in ones
(NCCL, CUDA IPC) need a GPU. This module registers ours under the name `"grpo_async"` (installing `grpo_async` is
enough: `setup.py` declares `register` as a `vllm.general_plugins` entry point, which vLLM calls in every process).

It receives exactly what `grpo-async serve` receives (`grpo_async.weight_sync.buckets`: one flat uint8 buffer per
bucket and dtype, described by a JSON layout), over one of two transports:

- `"broadcast"`: a dedicated gloo process group (NCCL on GPU) whose store the trainer hosts: works across machines.
- `"shm"`: POSIX shared-memory segments the trainer packed (same machine).

The trainer side is `grpo_async.generation.stock_server`. One push, as vLLM's routes see it:

```
trainer                                                 vLLM worker (this engine)
POST /init_weight_transfer_engine {transport, host..}  init_transfer_engine: join the group (broadcast)   [once]
POST /pause?mode=wait                                   (vLLM: requests in flight finish, caches cleared)
POST /start_weight_update                               start_weight_update: initialize_layerwise_reload
POST /update_weights {transport, buckets, segments}     receive_weights: recv (or map) each bucket, load_weights
   └ concurrently: broadcast bucket(s) as rank 0        (a failure finalizes the reload before it propagates)
POST /finish_weight_update {weight_version: "3"}        finish_weight_update: finalize_layerwise_reload (always)
POST /resume
```
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_async.weight_sync.buckets import unpack_bucket, validate_layout
from grpo_async.weight_sync.moe_reload import detach_cpu_moe_kernels, restore_cpu_moe_kernels
from grpo_async.weight_sync.names import STOCK_TRANSPORTS
from grpo_async.weight_sync.requests import AttachedSegment, close_segments, tied_lm_head

logger = logging.getLogger("grpo_async.vllm_engine")

#: the name this engine is registered under: `--weight-transfer-config '{"backend": "grpo_async"}'`
BACKEND_NAME = "grpo_async"
ENGINE_TRANSPORTS = STOCK_TRANSPORTS  # what vLLM's RL API carries (weight_sync.names)


@dataclass
class GrpoAsyncInitInfo(WeightTransferInitInfo):
    """`/init_weight_transfer_engine` body (`init_info`) for the `grpo_async` engine.

    Args:
        transport (`str`): `"broadcast"` (process group; host/port/world_size/group_name needed) or `"shm"`.
        host (`str`, *optional*): the trainer's `TCPStore` address as the server's workers reach it.
        port (`int`, *optional*): its port.
        world_size (`int`, *optional*): 1 (the trainer) + the server's workers.
        group_name (`str`, *optional*): the store prefix of the group (one per trainer connection).
        rank_offset (`int`, *optional*, defaults to 1): worker `r` joins as rank `rank_offset + r`.
        timeout_s (`float`, *optional*, defaults to 60): group timeout: a receive that waits longer fails (and the
            reload is finalized) instead of stalling the engine loop.
    """

    transport: str = "broadcast"
    host: str | None = None
    port: int | None = None
    world_size: int | None = None
    group_name: str = "grpo_async_vllm"
    rank_offset: int = 1
    timeout_s: float = 60.0

    def __post_init__(self):
        if self.transport not in ENGINE_TRANSPORTS:
            raise ValueError(f"init_info.transport must be one of {ENGINE_TRANSPORTS}, got {self.transport!r}")
        if self.transport == "broadcast":
            missing = [k for k in ("host", "port", "world_size") if getattr(self, k) is None]
            if missing:
                raise ValueError(f"init_info for transport 'broadcast' needs {missing}")
            if not (isinstance(self.world_size, int) and self.world_size >= 2):
                raise ValueError(f"init_info.world_size must be an integer >= 2, got {self.world_size!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"init_info.timeout_s must be positive seconds, got {self.timeout_s!r}")


@dataclass
class GrpoAsyncUpdateInfo(WeightTransferUpdateInfo):
    """`/update_weights` body (`update_info`): the layouts of the buckets that follow.

    Args:
        transport (`str`): `"broadcast"` or `"shm"`, as given at init.
        buckets (`list[dict]`): bucket layouts (`grpo_async.weight_sync.buckets.bucket_layout`), in sending order.
        segments (`list[dict]`, *optional*): shm only: `{dtype: shared-memory name}` per bucket.
    """

    transport: str
    buckets: list[dict]
    segments: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if self.transport not in ENGINE_TRANSPORTS:
            raise ValueError(f"update_info.transport must be one of {ENGINE_TRANSPORTS}, got {self.transport!r}")
        if not isinstance(self.buckets, list):
            raise ValueError("update_info.buckets must be a list of bucket layouts")
        for layout in self.buckets:
            validate_layout(layout)
        if self.transport == "shm":
            if not isinstance(self.segments, list) or len(self.segments) != len(self.buckets):
                raise ValueError("update_info.segments must list one {dtype: shared-memory name} object per bucket")
            for seg, layout in zip(self.segments, self.buckets):
                if not isinstance(seg, dict) or set(seg) != set(layout["buffers"]):
                    raise ValueError("each update_info.segments entry must name one segment per dtype buffer")
                if not all(isinstance(v, str) and v and "/" not in v for v in seg.values()):
                    raise ValueError("shared-memory segment names must be non-empty strings without '/'")


class GrpoAsyncWeightTransferEngine(WeightTransferEngine[GrpoAsyncInitInfo, GrpoAsyncUpdateInfo]):
    """vLLM worker side: receives our buckets (gloo/NCCL broadcast or shared memory) and loads them with vLLM's
    layerwise reload (the only load that works after vLLM repacked the weights for its CPU kernels)."""

    init_info_cls = GrpoAsyncInitInfo
    update_info_cls = GrpoAsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.transport: str | None = None
        self.pg = None
        self.store = None
        self.reload_open = False
        self.segments: list[AttachedSegment] = []  # mapped until the reload is finalized (it keeps views)
        self.received = 0  # buckets received since start, over any transport
        self.tied = None  # (LM head, embedding name) of a tied-embedding model during a reload (see tied_lm_head)
        self.moe_kernels: dict | None = None  # CPU MoE kernels detached for the open reload (moe_reload)

    @property
    def rank(self) -> int:
        return int(self.parallel_config.rank) if hasattr(self.parallel_config, "rank") else 0

    def init_transfer_engine(self, init_info: GrpoAsyncInitInfo) -> None:
        """Join the trainer's process group (broadcast), or just note the transport (shm)."""
        self.shutdown()
        self.transport = init_info.transport
        if init_info.transport != "broadcast":
            return
        from torch.distributed import PrefixStore, TCPStore

        timeout = timedelta(seconds=float(init_info.timeout_s))
        rank = int(init_info.rank_offset) + self.rank
        self.store = TCPStore(init_info.host, int(init_info.port), int(init_info.world_size), False, timeout=timeout)
        prefixed = PrefixStore(init_info.group_name, self.store)
        if self.device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            self.pg = ProcessGroupNCCL(prefixed, rank, int(init_info.world_size), ProcessGroupNCCL.Options())
        else:
            from torch.distributed import ProcessGroupGloo

            self.pg = ProcessGroupGloo(prefixed, rank, int(init_info.world_size), timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.reload_open:  # a previous session was never finished (the trainer died): close it first
            self.finish_weight_update()
        self.tied = tied_lm_head(self.model)  # before the reload puts each layer's weights on meta
        initialize_layerwise_reload(self.model)
        self.moe_kernels = detach_cpu_moe_kernels(self.model)  # CPU MoE experts prepacked again (moe_reload)
        self.reload_open = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """As vLLM's, without its `torch.accelerator.synchronize()` where there is no accelerator (CPU)."""
        typed = self.parse_update_info(update_info)
        self.receive_weights(typed)
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GrpoAsyncUpdateInfo) -> None:
        if not self.reload_open:
            raise RuntimeError("update_weights without start_weight_update (no open reload session)")
        if update_info.transport != self.transport:
            raise RuntimeError(
                f"update_weights over {update_info.transport!r}, but the engine was initialized for "
                f"{self.transport!r} (call /init_weight_transfer_engine again)"
            )
        try:
            if update_info.transport == "broadcast":
                buckets = self._recv_broadcast(update_info.buckets)
            else:
                buckets = self._recv_shm(update_info.buckets, update_info.segments)
            for named in buckets:
                self.received += 1
                self.model.load_weights(named)
                if self.tied is not None:  # vLLM drops `lm_head.*` of a tied model: load it from the embedding
                    head, embed_name = self.tied
                    for name, tensor in named:
                        if name == embed_name:
                            head.weight.weight_loader(head.weight, tensor)
        except BaseException:
            self.finish_weight_update()  # never leave the model on the meta device
            raise

    def finish_weight_update(self) -> None:
        """Finalize the reload (idempotent), unmap the shared memory."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self.reload_open:
            return
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            restore_cpu_moe_kernels(self.moe_kernels)
            self.moe_kernels = None
            self.reload_open = False
            self.tied = None
            self._release_segments()

    def shutdown(self) -> None:
        self.finish_weight_update()
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass

    # ------------------------------------------------------------------ receivers (one bucket at a time)
    def _recv_broadcast(self, layouts: list[dict]):
        from torch.distributed import BroadcastOptions

        if self.pg is None:
            raise RuntimeError("broadcast update before /init_weight_transfer_engine joined a process group")
        opts = BroadcastOptions()
        opts.rootRank = 0

        def post(layout):
            bufs = {dt: torch.empty(n, dtype=torch.uint8, device=self.device) for dt, n in layout["buffers"].items()}
            return bufs, [self.pg.broadcast([bufs[dt]], opts) for dt in layout["buffers"]]  # the sender's order

        nxt = post(layouts[0]) if layouts else None
        for i, layout in enumerate(layouts):  # the receive of bucket i+1 is posted before bucket i is loaded
            bufs, works = nxt
            nxt = post(layouts[i + 1]) if i + 1 < len(layouts) else None
            for w in works:
                w.wait()
            yield unpack_bucket(layout, bufs)

    def _recv_shm(self, layouts: list[dict], segments: list[dict]):
        for layout, seg in zip(layouts, segments):
            bufs = {}
            for dt, name in seg.items():
                shm = AttachedSegment(name)
                self.segments.append(shm)
                nbytes = layout["buffers"][dt]
                if shm.size < nbytes:
                    raise ValueError(
                        f"shared-memory segment {name!r} holds {shm.size} bytes, the layout needs {nbytes}"
                    )
                bufs[dt] = (
                    torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
                    if nbytes
                    else torch.empty(0, dtype=torch.uint8)
                )
            yield unpack_bucket(layout, bufs)
            del bufs

    def _release_segments(self) -> None:
        segments, self.segments = self.segments, []
        close_segments(segments)


def register() -> None:
    """vLLM plugin (`vllm.general_plugins` entry point `grpo_async`): make `{"backend": "grpo_async"}` a
    weight-transfer engine. vLLM calls it in every process, possibly more than once: registering twice is skipped."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, __name__, GrpoAsyncWeightTransferEngine.__name__)
    except ValueError:  # already registered in this process
        pass
