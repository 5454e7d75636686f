"""Train against a stock `vllm serve` (what `trl vllm-serve` starts): generation over its OpenAI API, weights through
vLLM's own RL API and weight-transfer engines.

A stock server must be started with vLLM's RL routes and a weight-transfer engine that can take our weights:

```
VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "grpo_async"}' \
    --logprobs-mode processed_logprobs          # (CPU: also --dtype float32; GPU: see docs/trl-vllm-serve.md)
```

`grpo_async` is the engine `grpo_async.weight_sync.vllm_engine` registers in vLLM (a `vllm.general_plugins` entry
point: installing `grpo_async` next to vLLM is enough). It carries our buckets (`grpo_async.weight_sync.buckets`)
over a gloo broadcast group (any server, local or remote) or shared memory (a server on this machine).

`GRPOConfig(vllm_mode="server", vllm_server_base_url=URL)` (or `vllm_server_urls`) trains against either kind of
server: `_make_vllm_server` asks the first one for `/ws/info`, which only `grpo-async serve` has, and builds
`StockVLLMServerBackend` for a stock one. `StockVLLMServerBackend.check_server` refuses a server it cannot push to at
start, naming what to add (`VLLM_SERVER_DEV_MODE=1`, `--weight-transfer-config`).

One push per server (`StockServerTransport.stream`):

```
POST /pause?mode=wait            requests in flight finish on the old weights ("keep": frozen, for in-flight updates)
POST /start_weight_update        the engine opens a layerwise reload
POST /update_weights             once per bucket {"update_info": {"transport", "buckets": [layout], "segments"}}
  └ meanwhile (broadcast) the trainer broadcasts the bucket's buffers as rank 0
POST /finish_weight_update       {"weight_version": "<version>"}: finalize; `/weight_info` reports the version
POST /reset_prefix_cache         no prompt is served from KV computed with the old weights
POST /resume
```
"""

from __future__ import annotations

import logging
import threading
import weakref
from datetime import timedelta
from typing import Literal

import torch

from grpo_async.generation.vllm_server import VLLMServerBackend
from grpo_async.net import ServerClient, ServerError, address_seen_by, free_port, is_loopback
from grpo_async.weight_sync.buckets import NamedTensors, bucket_layout, pack_bucket
from grpo_async.weight_sync.names import STOCK_TRANSPORTS, StockTransport, check_transport
from grpo_async.weight_sync.transports import pooled_segment, unlink_segments

logger = logging.getLogger("grpo_async.stock_server")

#: the weight-transfer engine name our plugin registers in vLLM
ENGINE = "grpo_async"
ENGINE_FLAG = f'--weight-transfer-config \'{{"backend": "{ENGINE}"}}\''
#: vLLM's RL routes a push needs (they exist only with VLLM_SERVER_DEV_MODE=1)
RL_ROUTES = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/pause",
    "/resume",
    "/weight_info",
    "/reset_prefix_cache",
    "/get_world_size",
)


def detect_server_kind(url: str, api_key: str | None = None, timeout: float = 10.0) -> str | None:
    """`"grpo_async"` for a `grpo-async serve` server, `"stock"` for any other vLLM server (no `/ws/info`), or `None`
    when the server does not answer (the caller reports that its own way)."""
    client = ServerClient(url, api_key=api_key, timeout=timeout)
    try:
        client.get("/ws/info")
        return "grpo_async"
    except ServerError as e:
        if e.status == 404:
            return "stock"
        return "grpo_async" if e.status is not None else None  # 401/403/5xx: it has the route
    finally:
        client.close()


def check_stock_server(client: ServerClient) -> dict:
    """Refuse a stock server that cannot take weights, naming the env var or flag to add; return its `/server_info`
    (`{}` when the server hides it). Checks, in order: the RL routes (`VLLM_SERVER_DEV_MODE=1`), the weight-transfer
    engine (`--weight-transfer-config '{"backend": "grpo_async"}'`)."""
    api = client.get("/openapi.json")
    paths = set((api or {}).get("paths", {})) if isinstance(api, dict) else set()
    missing = [r for r in RL_ROUTES if r not in paths]
    if missing:
        raise RuntimeError(
            f"the vLLM server at {client.url} has no RL weight-update API (missing routes {missing}): it cannot take "
            f"the trainer's weights. Start it with VLLM_SERVER_DEV_MODE=1 in its environment and {ENGINE_FLAG}, e.g. "
            f"`VLLM_SERVER_DEV_MODE=1 vllm serve MODEL {ENGINE_FLAG}` (docs/trl-vllm-serve.md), or use "
            "`grpo-async serve`"
        )
    try:
        info = client.get("/server_info?config_format=json")
    except ServerError as e:
        logger.warning(
            "%s/server_info: %s; the weight-transfer config is checked at the first handshake", client.url, e
        )
        return {}
    config = (info or {}).get("vllm_config") or {}
    transfer = config.get("weight_transfer_config") if isinstance(config, dict) else None
    backend = transfer.get("backend") if isinstance(transfer, dict) else None
    if backend != ENGINE:
        what = "was started without a weight-transfer engine" if backend is None else f"uses the {backend!r} engine"
        raise RuntimeError(
            f"the vLLM server at {client.url} {what}; the trainer pushes weights through the {ENGINE!r} engine. "
            f"Restart it with {ENGINE_FLAG} (grpo_async must be installed in the server's Python; it registers the "
            "engine as a vLLM plugin)"
        )
    mode = (config.get("model_config") or {}).get("logprobs_mode")
    if mode not in (None, "processed_logprobs"):
        logger.warning(
            "the vLLM server at %s returns %s: at a temperature other than 1 (or with top_k/top_p/min_p) its sampler "
            "logprobs are not those of the distribution it sampled from; start it with --logprobs-mode "
            "processed_logprobs",
            client.url,
            mode,
        )
    return info


class _Post(threading.Thread):
    """One blocking HTTP call in a named thread (the server answers once the broadcast it waits for is over)."""

    def __init__(self, client: ServerClient, path: str, body: dict, timeout: float):
        super().__init__(name=f"stock-vllm {client.url}{path}", daemon=True)
        self.client, self.path, self.body, self.timeout = client, path, body, timeout
        self.error: BaseException | None = None

    def run(self):
        try:
            self.client.post(self.path, self.body, timeout=self.timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self.error = e

    def result(self) -> None:
        self.join(self.timeout + 5)
        if self.is_alive():
            raise ServerError(f"{self.name}: no answer within {self.timeout:.0f} s")
        if self.error is not None:
            raise self.error


class StockServerTransport:
    """Pushes weight buckets into one stock vLLM server through its RL API and our `grpo_async` engine.

    Args:
        client (`ServerClient`): the server.
        transport (`str`, *optional*, defaults to `"broadcast"`): `"broadcast"` (gloo group, any server) or `"shm"`
            (shared memory, a server on this machine).
        master_address (`str`, *optional*): broadcast: this process's address as the server's workers see it
            (default `address_seen_by(client.url)`).
        group_timeout (`float`, *optional*, defaults to 60): broadcast: seconds a join or a bucket may wait.
        timeout (`float`, *optional*): seconds per HTTP call; defaults to the client's.
    """

    def __init__(
        self,
        client: ServerClient,
        transport: StockTransport = "broadcast",
        *,
        master_address: str | None = None,
        group_timeout: float = 60.0,
        timeout: float | None = None,
    ):
        check_transport(transport, STOCK_TRANSPORTS, "a stock vLLM server's transport")
        if transport == "shm" and not is_loopback(client.url):
            raise ValueError(f"transport 'shm' needs a server on this machine; {client.url} is not a loopback URL")
        self.client, self.name = client, transport
        self.timeout = client.timeout if timeout is None else float(timeout)
        self.group_timeout = float(group_timeout)
        self.pause = "wait"  # or "keep": in-flight updates
        self.pg = self.store = None
        self._pool: dict = {}  # shm: (bucket index, dtype) -> segment, reused push after push
        self._finalizer = weakref.finalize(self, unlink_segments, self._pool)
        if transport == "broadcast":
            self._join(master_address or address_seen_by(client.url))
        else:
            self.client.post("/init_weight_transfer_engine", {"init_info": {"transport": "shm"}}, self.timeout)

    def _join(self, host: str) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        workers = int(self.client.get("/get_world_size", timeout=self.timeout)["world_size"])
        world = 1 + workers
        port = free_port(host if host != "0.0.0.0" else "127.0.0.1")
        timeout = timedelta(seconds=self.group_timeout)
        self.store = TCPStore(host, port, world, is_master=True, wait_for_workers=False, timeout=timeout)
        group = f"grpo_async_vllm_{port}"
        init = {"transport": "broadcast", "host": host, "port": port, "world_size": world, "group_name": group}
        call = _Post(self.client, "/init_weight_transfer_engine", {"init_info": {**init, "timeout_s": 60.0}}, 60)
        call.start()
        try:
            self.pg = ProcessGroupGloo(PrefixStore(group, self.store), 0, world, timeout)
        except Exception as e:  # the workers never joined: the server's own answer says why
            call.join(5)
            said = f"; the server said: {call.error}" if call.error else ""
            raise ServerError(
                f"weight sync to {self.client.url}: its workers did not join the broadcast group {group} within "
                f"{self.group_timeout:.0f}s ({type(e).__name__}: {str(e)[:300]}){said}"
            ) from e
        call.result()

    def stream(self, version: int | None, *, lora: dict | None = None) -> _StockStream:
        """Open one push (pause, start): feed it with `send(bucket)`, end it with `close()` (or `abort()`)."""
        if lora is not None:
            raise RuntimeError(
                f"{self.client.url} is a stock vLLM server: it takes merged weights only; set "
                "GRPOConfig.vllm_lora_sync='merged' (or serve with `grpo-async serve --enable-lora`)"
            )
        return _StockStream(self, version)

    def send_bucket(self, index: int, bucket: NamedTensors) -> int:
        """Move one bucket into the open session; return its bytes."""
        layout = bucket_layout(bucket)
        if self.name == "shm":
            names, out = {}, {}
            for dt, nbytes in layout["buffers"].items():
                shm = self._segment((index, dt), nbytes)
                names[dt] = shm.name.lstrip("/")
                if nbytes:
                    out[dt] = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
            pack_bucket(bucket, out=out)
            del out  # no view of the segment may outlive the packing
            info = {"transport": "shm", "buckets": [layout], "segments": [names]}
            self.client.post("/update_weights", {"update_info": info}, self.timeout)
        else:
            from torch.distributed import BroadcastOptions

            if self.pg is None:
                raise ServerError(f"weight sync to {self.client.url}: the broadcast group is closed")
            info = {"transport": "broadcast", "buckets": [layout]}
            call = _Post(self.client, "/update_weights", {"update_info": info}, self.timeout)
            call.start()
            _, bufs = pack_bucket(bucket, device="cpu")
            opts = BroadcastOptions()
            opts.rootRank = 0
            try:
                for work in [self.pg.broadcast([b], opts) for b in bufs.values()]:
                    work.wait()
            except Exception as e:  # the server died or stopped receiving: bounded by the group timeout
                call.join(5)
                said = f"; the server said: {call.error}" if call.error else ""
                raise ServerError(
                    f"weight sync to {self.client.url} failed mid-broadcast: {type(e).__name__}: {str(e)[:300]}{said}"
                ) from e
            call.result()
        return sum(layout["buffers"].values())

    def _segment(self, key, nbytes: int):
        return pooled_segment(self._pool, key, nbytes)

    def close(self) -> None:
        """Leave the server's weight-transfer engine and release the group / shared memory (idempotent)."""
        if self.pg is not None or self._pool:
            try:
                self.client.post("/shutdown_weight_transfer_engine", {}, timeout=min(self.timeout, 10.0))
            except Exception as e:  # noqa: BLE001 - the server may be gone
                logger.info("shutdown_weight_transfer_engine on %s: %s", self.client.url, e)
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001
                pass
        self._finalizer()


class _StockStream:
    """One weight update on one stock server (see `StockServerTransport.stream`)."""

    def __init__(self, transport: StockServerTransport, version: int | None):
        self.tr, self.version = transport, version
        self.total = {"tensors": 0, "bytes": 0, "buckets": 0}
        self.ended = False
        c, t = transport.client, transport.timeout
        c.post(f"/pause?mode={transport.pause}", {}, t)
        try:
            c.post("/start_weight_update", {}, t)
        except BaseException:
            self._resume()
            raise

    def send(self, bucket: NamedTensors) -> None:
        try:
            self.total["bytes"] += self.tr.send_bucket(self.total["buckets"], bucket)
        except KeyboardInterrupt:
            raise
        except BaseException:
            self.abort()
            raise
        self.total["buckets"] += 1
        self.total["tensors"] += len(bucket)

    def close(self, extra: dict | None = None) -> dict:
        """End the push (`extra`: what a delta push's closing request carries; stock servers take no delta, so
        `ServerFanout` never passes one here: kept for a caller that treats every stream alike)."""
        if extra:
            raise ValueError(f"a stock vLLM server takes no delta push (closing fields {sorted(extra)})")
        c, t = self.tr.client, self.tr.timeout
        body = {} if self.version is None else {"weight_version": str(self.version)}
        try:
            c.post("/finish_weight_update", body, t)
            self.ended = True
            c.post("/reset_prefix_cache", {}, t)  # "keep" pauses leave the prefix cache as it was
        finally:
            self._resume()
        self.total["version"] = self.version
        return self.total

    def abort(self) -> None:
        """Finalize the server's reload (its model never stays half-loaded) and resume generation."""
        if self.ended:
            return
        self.ended = True
        try:
            self.tr.client.post("/finish_weight_update", {}, timeout=self.tr.timeout)
        except Exception as e:  # noqa: BLE001 - a receive error already finalized it on the server
            logger.info("finish_weight_update after a failed push to %s: %s", self.tr.client.url, e)
        self._resume()

    def _resume(self) -> None:
        try:
            self.tr.client.post("/resume", {}, timeout=self.tr.timeout)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not resume generation on %s: %s", self.tr.client.url, e)


class StockVLLMServerBackend(VLLMServerBackend):
    """Generate on stock `vllm serve` servers (OpenAI API, least-outstanding routing and failover as
    `VLLMServerBackend`); push weights through vLLM's RL API into our `grpo_async` weight-transfer engine. Every push
    is whole: `delta=True` (`GRPOConfig.weight_sync_delta`) is refused.

    Args:
        urls (`list[str]`): server base URLs.
        transport (`str`, *optional*, defaults to `"broadcast"`): `"broadcast"`, `"shm"` (servers on this machine)
            or `"none"` (generation only: `load_weights` raises).
        **kwargs: as `VLLMServerBackend` (`api_key`, `timeout`, `bucket_mb`, `model`, `max_concurrency`,
            `master_address`, `inflight_updates`, `group_timeout`).

    Raises:
        `RuntimeError`: at construction, when a server lacks the RL routes (`VLLM_SERVER_DEV_MODE=1`) or the
            `grpo_async` weight-transfer engine (`--weight-transfer-config '{"backend": "grpo_async"}'`).
    """

    takes_delta = False  # vLLM's weight-transfer API keeps no copy a delta could apply to

    def __init__(self, urls: list[str], *, transport: StockTransport | Literal["none"] = "broadcast", **kwargs):
        check_transport(transport, (*STOCK_TRANSPORTS, "none"), "a stock vLLM server's transport")
        super().__init__(urls, transport=transport, **kwargs)
        self.server_info = {}  # generation only ('none') needs no weight-transfer engine
        if transport != "none":
            self.server_info = {c.url: check_stock_server(c) for c in self.router.live}

    def _new_transport(self, client: ServerClient, device: torch.device):
        """A stock server's weight transport (vLLM's RL API into our weight-transfer engine), for the fan-out."""
        tr = StockServerTransport(
            client, self.transport_name, master_address=self.master_address, group_timeout=self.group_timeout
        )
        tr.pause = "keep" if self.inflight_updates else "wait"
        return tr

    def weight_version(self, url: str) -> str:
        """The version a server reports (`GET /weight_info`): `str(version)` of the last push, `"default"` before."""
        client = next(c for c in self.router.clients if c.url == url)
        return client.get("/weight_info")["weight_version"]

    def load_adapter(self, groups, config: dict, version: int) -> None:
        raise RuntimeError(
            "stock vLLM servers take merged weights only: set GRPOConfig.vllm_lora_sync='merged' (or serve with "
            "`grpo-async serve --enable-lora`)"
        )
