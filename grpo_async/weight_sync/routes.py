"""The weight-update routes of `grpo-async serve` (`/ws/*`), mounted by `grpo_async.generation.serve`: the
server end of the wire whose trainer end is `grpo_async.weight_sync.transports`; the vLLM workers load what arrives
(`grpo_async.weight_sync.worker`). Every route sits behind the server's API key and body cap.

| route | body (JSON only; pickled or non-JSON bodies get 415) | answer |
|---|---|---|
| `GET /ws/info` | — | `{"world_size", "workers": [{"rank", "device", "version", ...}], "version"}` |
| `POST /ws/init_broadcast` | `{"host", "port", "world_size", "group_name", "timeout_s"}` | `{"ranks": [...]}` |
| `POST /ws/close_broadcast` | `{"group_name"}` (omit: every group) | `{"closed": bool}` |
| `POST /ws/update` | see below | `{"tensors", "bytes", "buckets", "version", "seconds"[, "digests"]}` |

`/ws/update` body:
```
{"transport": "broadcast" | "shm" | "cuda_ipc",
 "buckets":   [layout, ...],        # grpo_async.weight_sync.buckets layouts: {"buffers": {dtype: nbytes},
                                    #   "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}]}
 "segments":  [{dtype: shm_name}],  # shm only, one per bucket
 "handles":   [{dtype: handle}],    # cuda_ipc only (JSON, base64 bytes)
 "group": str,                      # broadcast only: the group_name given to /ws/init_broadcast
 "version": int, "begin": true, "end": true, "load": true, "digests": false,
 "pause": "wait" | "keep",
 "session": str,                    # the id the begin request was answered with (optional, recommended)
 "abort": true,                     # drop the open push: nothing of it is loaded
 "expect": [str, ...],              # with begin (optional): every tensor name the push will send, checked at end
 "lora": {"name": str, "id": int, "config": {...}, "keep": 2},  # optional: the buckets are a LoRA adapter
 "delta": {"mode": "full" | "delta", "id": str, "base": str, "checksum": str}}  # optional: delta sync, see below
```
With `delta` (`GRPOConfig.weight_sync_delta`, `grpo_async.weight_sync.delta`) the workers keep a copy of the weights
the push leaves (id `id`); a `"delta"` push's buckets hold only the changed values against the copy `base`, and is
refused (409, `DeltaRefused`) when the workers hold another copy or none (a restarted server), or when the copy's
checksum after the push is not the closing request's `checksum`: nothing is loaded then.
With `lora` (LoRA adapter-only sync, `GRPOConfig.vllm_lora_sync`; the server must run with `--enable-lora
--max-lora-rank R`, and `--max-cpu-loras 2` for in-flight updates) the buckets hold only the adapter's `lora_A` /
`lora_B` tensors; the base weights never move. The closing request installs the adapter in every worker under `id`
and registers `name` as a served model (`/v1/models` lists it; completions ask for `"model": name`); the policy
adapters beyond the newest `keep` are removed from the workers and the model list. The adapter travels over the same
transport as full weights (shared memory / CUDA IPC on this machine, the broadcast group for a remote server): no
shared folder is needed.

A request with `begin` opens a reload session (a push) and is answered with its `"session"` id; the buckets are
staged in the workers while generation goes on. The request with `end` checks the push is complete (every parameter
of the served model, every shard of a fused q/k/v or gate/up layer, the `expect` names when declared), then pauses
generation, loads it, resets the prefix cache and resumes generation: an incomplete push gets 409 and an aborted or
failed one is dropped, and either way the served weights and version stay as they were. A new `begin` drops an open
push (its sender died or gave up; a later request naming the dropped id gets 409), and so does `--reload-idle-timeout`
seconds (default 60) without a request; `GET /health` answers 503 with `{"error": reason}` for a push idle over half
that, and for a dead engine. `"pause": "wait"` (default): requests in flight finish on the old weights first.
`"keep"` (in-flight updates): they are frozen where they are and continue on the new weights after the update
(their earlier tokens keep the KV computed with the old weights).

`/ws/init_broadcast` first probes the trainer's store from a child process (killed at `timeout_s`, at most 300 s),
so a dead or silent address gets 400 without touching the engine; the workers then join the group on a thread while
the engine keeps generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import socket
import struct
import time

from fastapi import HTTPException, Request

from grpo_async.weight_sync.reload_session import RELOAD_IDLE_TIMEOUT_S, SessionTracker

logger = logging.getLogger("grpo_async.serve")

#: the largest `timeout_s` `/ws/init_broadcast` accepts (the engine waits that long for the trainer's group)
MAX_GROUP_TIMEOUT_S = 300.0


async def json_body(request: Request) -> dict:
    """Parse a `/ws/*` body; refuse anything but a JSON object (pickles in particular)."""
    raw = await request.body()
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if raw[:1] == b"\x80" or ctype in ("application/python-pickle", "application/x-pickle"):
        raise HTTPException(415, "pickled payloads are refused; send the JSON body documented in grpo_async serve")
    if ctype != "application/json":
        raise HTTPException(415, f"Content-Type must be application/json, got {ctype or 'none'!r}")
    try:
        body = json.loads(raw.decode("utf-8")) if raw else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPException(415, f"body is not valid JSON ({e}); pickled or binary payloads are refused") from e
    if not isinstance(body, dict):
        raise HTTPException(400, "body must be a JSON object")
    return body


def add_weight_routes(app, idle_timeout: float = RELOAD_IDLE_TIMEOUT_S) -> None:
    """Register `/ws/*` on a vLLM FastAPI app (engine client read from `app.state.engine_client` per request); the
    reload session's state goes to `app.state.ws_sessions` (read by `/health`). A session with no request for
    `idle_timeout` seconds is dropped."""
    from grpo_async.weight_sync.requests import validate_update_request

    lock = asyncio.Lock()
    sessions = app.state.ws_sessions = SessionTracker(idle_timeout=float(idle_timeout))
    state = {"loras": {}}  # policy adapter name -> id, registered as served models

    def engine(request: Request):
        return request.app.state.engine_client

    async def abort_session(eng, why: str) -> None:
        """Drop the open session in the workers (nothing of it is loaded); call with `lock` held."""
        s = sessions.current
        sessions.close()
        logger.warning("weight reload session %s dropped: %s", s.id, why)
        await eng.collective_rpc("ws_abort")

    def watch(eng, session_id: str) -> None:  # after each request that leaves the session open: one timer at a time
        async def expire():
            async with lock:
                if sessions.expired(session_id):
                    await abort_session(eng, f"no request for {sessions.idle_timeout:g} s (--reload-idle-timeout)")

        loop = asyncio.get_running_loop()
        if state.get("timer") is not None:
            state["timer"].cancel()
        state["timer"] = loop.call_later(sessions.idle_timeout + 0.1, lambda: loop.create_task(expire()))

    @app.get("/ws/info")
    async def ws_info(request: Request):
        workers = await engine(request).collective_rpc("ws_info")
        out = {"world_size": workers[0]["world_size"], "workers": workers, "version": workers[0]["version"]}
        return {**out, "session": sessions.info()}

    @app.post("/ws/init_broadcast")
    async def ws_init_broadcast(request: Request):
        body = await json_body(request)
        await check_init_broadcast(body)
        eng, name = engine(request), body.get("group_name", "grpo_async_ws")
        async with lock:  # the workers join on a thread: the engine keeps generating while the trainer joins
            out = await eng.collective_rpc("ws_init_broadcast", kwargs={**body, "background": True})
            deadline = time.monotonic() + body.get("timeout_s", 60.0) + 10.0
            while True:
                status = await eng.collective_rpc("ws_init_status", kwargs={"group_name": name})
                errors = [o["error"] for o in status if o["error"]]
                if errors:
                    await eng.collective_rpc("ws_close_broadcast", kwargs={"group_name": name})
                    raise HTTPException(500, f"init_broadcast: joining the trainer's group failed: {errors[0]}")
                if all(o["done"] for o in status):
                    break
                if time.monotonic() > deadline:
                    raise HTTPException(504, f"init_broadcast: the process group {name!r} did not form in time")
                await asyncio.sleep(0.05)
        return {"ranks": [o["rank"] for o in out]}

    @app.post("/ws/close_broadcast")
    async def ws_close_broadcast(request: Request):
        body = await json_body(request)
        if set(body) - {"group_name"} or not isinstance(body.get("group_name", ""), str):
            raise HTTPException(400, 'close_broadcast takes {"group_name": str} (omit it to close every group)')
        async with lock:
            out = await engine(request).collective_rpc("ws_close_broadcast", kwargs=body)
        return {"closed": any(o["closed"] for o in out)}

    @app.post("/ws/update")
    async def ws_update(request: Request):
        body = await json_body(request)
        try:
            validate_update_request(body)
        except ValueError as e:
            raise HTTPException(400, f"bad weight-update request: {e}") from e
        eng = engine(request)
        begin, end, load = body.get("begin", True), body.get("end", True), body.get("load", True)
        given = body.pop("session", None)
        async with lock:
            s = sessions.current
            if body.get("abort"):  # the sender gives its push up: drop it (only its own, when it names it)
                if s is None or given not in (None, s.id):
                    return {"aborted": False, "session": None}
                await abort_session(eng, "the sender aborted it")
                return {"aborted": True, "session": None}
            if load and begin:
                if s is not None:  # its sender is gone or gave up: the newest push wins
                    await abort_session(eng, "a new push began")
                s = sessions.open()
            elif load and (s is None or given not in (None, s.id)):
                raise HTTPException(
                    409,
                    f"weight reload session {given or ''} is not open (dropped after --reload-idle-timeout "
                    f"{sessions.idle_timeout:g} s without a request, aborted, or replaced by a newer push's begin); "
                    "start the push again with begin=true",
                )
            paused = False
            if load and end:  # the staged push is loaded by this request: generation waits for it only
                keep = body.get("pause", "wait") == "keep"  # frozen requests keep their KV: no cache clearing
                await pause_for_load(eng, mode="keep" if keep else "wait", clear_cache=not keep)
                paused = True
            sessions.busy_since = time.monotonic()
            try:
                out = await eng.collective_rpc("ws_update", kwargs={"request": body})
                errors = [o for o in out if "error" in o]
                if errors:
                    end = True  # the worker closed the session before answering, loading nothing
                    status = 409 if all(o.get("incomplete") for o in errors) else 500
                    raise HTTPException(status, f"weight update failed in the worker: {errors[0]['error']}")
                if body.get("lora") is not None and end and load:
                    _register_lora(request.app, state["loras"], body["lora"], out[0].get("lora_adapters", []))
            except HTTPException:
                raise
            except Exception as e:
                end = True
                raise HTTPException(500, f"weight update failed in the worker: {type(e).__name__}: {e}") from e
            finally:
                sessions.busy_since = None
                if s is not None:
                    s.last, s.requests = time.monotonic(), s.requests + 1
                    if end:
                        sessions.close()
                    else:
                        watch(eng, s.id)
                if paused:
                    await eng.reset_prefix_cache()
                    if eng.model_config.is_multimodal_model:
                        # the workers cleared their encoder caches (`WeightSyncWorker`); the scheduler would still
                        # count an image seen before the push as encoded ("Encoder cache miss" at its next prompt),
                        # and the processed-input cache holds what the old weights' processor run made
                        await eng.reset_encoder_cache()
                        await eng.reset_mm_cache()
                    await eng.resume_generation()
        return {**out[0], "session": s.id if s is not None and not end else None}


async def pause_for_load(eng, *, mode: str, clear_cache: bool) -> None:
    """`AsyncLLM.pause_generation(mode=..., clear_cache=...)` without the 20 ms sleep it ends with (vLLM 0.32: "not
    required for correctness", there so that the last outputs of the requests it waited for reach their callers before
    it returns; a load reads none of them): the same two engine calls, the processor cache then the scheduler's pause
    (which waits for, or freezes, the requests in flight and clears the caches). Measured on the overlap bench's 3 MB
    model over shared memory, 2 CPU cores: the pause took 22 of a push's ~50 ms, its sleep 20 of them. An engine client
    without those two calls takes the public one."""
    core, renderer = getattr(eng, "engine_core", None), getattr(eng, "renderer", None)
    if not hasattr(core, "pause_scheduler_async") or not hasattr(renderer, "clear_mm_cache_async"):
        await eng.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache:
        await renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


_GROUP_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


async def check_init_broadcast(body: dict) -> None:
    """Refuse (HTTP 400) an `/ws/init_broadcast` body the engine must not act on: wrong keys or types, a port outside
    1..65535, a world size below 2, `timeout_s` not in (0, `MAX_GROUP_TIMEOUT_S`], a host that does not resolve, or
    an address where no `TCPStore` answers within `timeout_s`. The checks run off the event loop and before the
    engine is involved: joining a dead address would otherwise block the engine (and every completion) for the whole
    timeout."""
    spec = {"host": str, "port": int, "world_size": int, "group_name": str, "timeout_s": (int, float)}
    if set(body) - set(spec) or not {"host", "port", "world_size"} <= set(body):
        raise HTTPException(400, f"init_broadcast takes keys {sorted(spec)} (host, port, world_size required)")
    for k, typ in spec.items():
        if k in body and (not isinstance(body[k], typ) or isinstance(body[k], bool)):
            raise HTTPException(400, f"init_broadcast: {k!r} has the wrong type ({type(body[k]).__name__})")
    host, port, timeout = body["host"], body["port"], body.get("timeout_s", 60.0)
    if not 1 <= port <= 65535:
        raise HTTPException(400, f"init_broadcast: 'port' must be in 1..65535, got {port}")
    if body["world_size"] < 2:
        raise HTTPException(400, f"init_broadcast: 'world_size' must be >= 2 got {body['world_size']}")
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_GROUP_TIMEOUT_S):
        raise HTTPException(
            400, f"init_broadcast: 'timeout_s' must be in (0, {MAX_GROUP_TIMEOUT_S:.0f}] seconds, got {timeout!r}"
        )
    if "group_name" in body and not _GROUP_NAME.fullmatch(body["group_name"]):
        raise HTTPException(400, "init_broadcast: 'group_name' must be 1-200 characters of [A-Za-z0-9_.:-]")
    if not host or len(host) > 253:
        raise HTTPException(400, f"init_broadcast: 'host' must be a host name or address, got {host!r}")
    try:
        await asyncio.wait_for(asyncio.to_thread(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        raise HTTPException(400, f"init_broadcast: host {host!r} does not resolve ({type(e).__name__}: {e})") from e
    try:
        await probe_store(host, port, float(timeout))
    except Exception as e:  # noqa: BLE001 - any failure means the engine would hang there
        raise HTTPException(
            400,
            f"init_broadcast: no TCPStore answers at {host}:{port} within timeout_s={timeout:g} "
            f"({type(e).__name__}: {str(e)[:200]}); the trainer hosts it before calling this route",
        ) from e


#: torch's store protocol (c10d's `TCPStore`, torch 2.13), as its client speaks it on connecting: VALIDATE (query 0
#: and the magic number; no answer), PING (query 13 and a nonce the store echoes), then GETNUMKEYS (query 7; an int64
#: answer). `tests/test_weight_sync_routes.py` checks this against a real `TCPStore`.
_STORE_VALIDATE = struct.pack("<BI", 0, 0x3C85F7CE)
_STORE_PING = 13
_STORE_GETNUMKEYS = 7


async def probe_store(host: str, port: int, timeout_s: float) -> None:
    """Connect to the trainer's `TCPStore` as torch's client does (validate, ping) and make one round trip (the number
    of keys); raise if no store answers within `timeout_s`.

    Here, on the event loop, with asyncio's own socket: torch's store client, given a peer that accepts and never
    answers (or resets), keeps waiting and retrying past its timeout, and in the server's own process that held the
    request open while it held a thread; it once ran in a child process for that reason, which cost ~2 s of starting
    Python and torch on every init. A silent peer is refused after `timeout_s`, a closed one at once."""

    async def exchange() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            nonce = os.getpid() & 0xFFFFFFFF
            writer.write(_STORE_VALIDATE + struct.pack("<BI", _STORE_PING, nonce))
            await writer.drain()
            (echoed,) = struct.unpack("<I", await reader.readexactly(4))
            if echoed != nonce:
                raise ConnectionError(f"not a torch TCPStore: it answered the ping with {echoed:#x}, not {nonce:#x}")
            writer.write(bytes([_STORE_GETNUMKEYS]))
            await writer.drain()
            await reader.readexactly(8)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    try:
        await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None
    except asyncio.IncompleteReadError as e:
        raise ConnectionError(f"the peer closed the connection after {len(e.partial)} bytes of an answer") from None


def _register_lora(app, ours: dict, spec: dict, resident: list) -> None:
    """Serve the adapter just installed in the workers as model `spec["name"]` (the OpenAI routes look a LoRA up by
    name), and stop serving our older adapters that the workers no longer hold. The path is a label: the workers
    already hold the adapter, so vLLM never reads it."""
    from vllm.lora.request import LoRARequest

    models = getattr(app.state, "openai_serving_models", None)
    if models is None:
        return
    for name, lora_id in list(ours.items()):
        if lora_id not in resident or name == spec["name"]:
            models.lora_requests.pop(name, None)
            ours.pop(name)
    models.lora_requests[spec["name"]] = LoRARequest(
        lora_name=spec["name"], lora_int_id=spec["id"], lora_path=f"grpo-async://{spec['name']}"
    )
    ours[spec["name"]] = spec["id"]


def add_frozen_routes(app) -> None:
    """A frozen server (`--frozen`, e.g. the reference): the weight-update routes answer 403."""

    async def refuse(request: Request):
        raise HTTPException(403, "this grpo-async serve is --frozen (a reference server): weight updates are refused")

    for path in ("/ws/init_broadcast", "/ws/close_broadcast", "/ws/update"):
        app.post(path)(refuse)
