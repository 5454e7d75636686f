"""One vocabulary for weight-sync transports, from the config to the wire.

`GRPOConfig.weight_sync_transport` takes a `SyncSetting`; for a server backend `server_transport` resolves it to the
`WireTransport` its pushes use: the `"transport"` of a `/ws/update` request (`weight_sync/routes.py`), the key of
`transports.TRANSPORTS`, `VLLMServerBackend(transport=...)`. `"none"` is the same word everywhere: the sampler keeps
its initial weights and no transport is built (a backend given `"none"` refuses `load_weights`).

| name | config | what moves the weights | wire |
|---|---|---|---|
| `"auto"` | yes | the best the backend takes (`server_transport` for servers; nothing for `openai`) | resolved |
| `"broadcast"` | yes | a process group (gloo on CPU, NCCL on GPU) the server's workers join | `"broadcast"` |
| `"ipc"` | yes | memory shared with a server on this machine | `"shm"` / `"cuda_ipc"` |
| `"shm"` | no | POSIX shared-memory segments (CPU) | `"shm"` |
| `"cuda_ipc"` | no | CUDA IPC handles (GPU) | `"cuda_ipc"` |
| `"checkpoint_dir"` | yes | safetensors in a folder the engine reloads (`OpenAIRemoteBackend`) | — |
| `"none"` | yes | nothing: the sampler keeps its initial weights | — |
"""

from __future__ import annotations

from typing import Literal, get_args

#: `GRPOConfig.weight_sync_transport`
SyncSetting = Literal["auto", "broadcast", "ipc", "checkpoint_dir", "none"]
SYNC_SETTINGS: tuple[str, ...] = get_args(SyncSetting)
#: how a push reaches a `grpo-async serve` server (`/ws/update`'s `"transport"`)
WireTransport = Literal["broadcast", "shm", "cuda_ipc"]
WIRE_TRANSPORTS: tuple[str, ...] = get_args(WireTransport)
#: the wire transports vLLM's RL API carries into our weight-transfer engine (a stock `vllm serve`)
StockTransport = Literal["broadcast", "shm"]
STOCK_TRANSPORTS: tuple[str, ...] = get_args(StockTransport)


def check_transport(value: object, allowed: tuple[str, ...], who: str) -> None:
    """Raise a `ValueError` naming `who` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{who} must be one of {allowed}, got {value!r}")


def server_transport(setting: str, urls: list[str], cuda: bool) -> WireTransport | Literal["none"]:
    """The wire transport a `grpo-async serve` backend uses for `weight_sync_transport=setting`.

    `"ipc"` is `"cuda_ipc"` on a GPU (`cuda`) and `"shm"` on CPU; `"auto"` is `"ipc"` when every server in `urls` is
    on this machine (a loopback URL), else `"broadcast"`; `"none"` stays `"none"` (nothing is built).

    Example: `server_transport("auto", ["http://10.0.0.3:8000"], cuda=False) == "broadcast"`.
    """
    from grpo_async.net import is_loopback

    check_transport(setting, ("auto", "broadcast", "ipc", "none"), "weight_sync_transport for a server")
    ipc = "cuda_ipc" if cuda else "shm"
    if setting == "auto":
        return ipc if all(is_loopback(u) for u in urls) else "broadcast"
    return ipc if setting == "ipc" else setting
