"""`grpo-async serve`: vLLM's own OpenAI-compatible server plus narrow weight-update endpoints.

Takes every flag `vllm serve` takes (`--model`, `--dtype`, `--max-model-len`, `--tensor-parallel-size`,
`--data-parallel-size`, `--gpu-memory-utilization`, `--api-key`, ...), with three different defaults:
`--host 127.0.0.1` (loopback only unless you say otherwise), `--worker-extension-cls
grpo_async.weight_sync.worker.WeightSyncWorker` and `--logprobs-mode processed_logprobs` (sampler logprobs
of the temperature-scaled, filtered distribution it sampled from).

```
python -m grpo_async.generation.serve --model PATH --port 8000 --api-key SECRET
# prints:  grpo-async serve: ready at http://127.0.0.1:8000
```

Security: the API key guards EVERY route and method (the OpenAI API, `/health`, `/ws/*`, `OPTIONS`), not only
`/v1`, whichever way it is given: `--api-key KEY`, `--api-key-file PATH` (keeps it out of `ps` and shell history) or
the `VLLM_API_KEY` variable (vLLM's own, which vLLM alone applies to `/v1` only). A server refuses to listen on a
non-loopback host without a key. Every request body is capped (`--max-request-mb`, 413 beyond it) and a client gets
`--header-timeout` seconds to send its request headers. vLLM's generic dev routes (`/collective_rpc`, `/pause`,
`/sleep`, ...) are never exposed: `VLLM_SERVER_DEV_MODE` is forced off and those paths answer 404 even if a plugin
registers them. The engine processes exit when the API process dies (even by SIGKILL). Its own routes:

| route | what, where |
|---|---|
| `/ws/info`, `/ws/init_broadcast`, `/ws/close_broadcast`, `/ws/update` | weight updates (`weight_sync/routes.py`) |
| `/ws/logprobs` | reference logprobs, below |
| `/health` | 503 naming a dead engine or a stuck reload session (`add_health_route`) |

Reference logprobs (a frozen server holding the reference weights, `GRPOConfig.ref_server_url`):

`POST /ws/logprobs`, body `{"sequences": [{"prompt_ids": [int], "completion_ids": [int]}], "temperature": float}`,
answers `{"logprobs": [[float, ...], ...]}` (one list per sequence, one value per completion token):

`log_softmax(logits / temperature)` of each completion token given its prefix, from vLLM's prompt logprobs (which
vLLM computes from the raw logits, whatever `--logprobs-mode`): at temperature 1 the target token's logprob is the
answer; at another temperature the route asks for the whole vocabulary's and rescales (`lp_y/T − logsumexp(lp/T)`;
start that server with `--max-logprobs -1`). `--frozen` makes a server refuse every weight update (403), so a
reference server cannot be moved by mistake.

"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import secrets
import sys

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response

from grpo_async.gc_tuning import collector_paused
from grpo_async.generation import vllm_cpu
from grpo_async.generation.server_process import flag_passed
from grpo_async.generation.vllm_cpu import (
    default_cpu_aot_compile,
)
from grpo_async.net import is_loopback_host
from grpo_async.weight_sync.reload_session import RELOAD_IDLE_TIMEOUT_S
from grpo_async.weight_sync.routes import add_frozen_routes, add_weight_routes, json_body

logger = logging.getLogger("grpo_async.serve")

WORKER_EXTENSION = "grpo_async.weight_sync.worker.WeightSyncWorker"

#: vLLM dev-mode routes that must never be reachable through `grpo-async serve`.
BLOCKED_PATHS = (
    "/collective_rpc",
    "/pause",
    "/resume",
    "/is_paused",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/server_info",
    "/init_weight_transfer_engine",
    "/update_weights",
    "/get_world_size",
    "/start_weight_update",
    "/finish_weight_update",
)


#: `--max-request-mb` default: the largest request body any route accepts (413 beyond it)
MAX_REQUEST_MB = 8.0
#: `--header-timeout` default: seconds a client may take to send a request's headers (then the connection is closed)
HEADER_TIMEOUT_S = 20.0


class GuardMiddleware:
    """Pure ASGI middleware: 404 for vLLM's dev routes, 401 for any request without the API key (every path and
    method, `OPTIONS` included), 413 for a body over `max_body_bytes` (read before the app sees it, so no route can
    be fed more)."""

    def __init__(self, app, api_keys: list[str] | None = None, max_body_bytes: int = int(MAX_REQUEST_MB * 2**20)):
        self.app = app
        self.hashes = [hashlib.sha256(k.encode()).digest() for k in (api_keys or []) if k]
        self.max_body_bytes = int(max_body_bytes)

    async def _reply(self, send, status: int, message: str, close: bool = False):
        body = json.dumps({"error": message}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope) -> bool:
        if not self.hashes:
            return True
        value = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        ok = False
        for h in self.hashes:
            ok |= secrets.compare_digest(digest, h)
        return ok

    def _too_large(self, size: int) -> str:
        return (
            f"request body of {size} bytes or more is over this server's limit of {self.max_body_bytes} bytes "
            "(grpo-async serve --max-request-mb)"
        )

    async def _read_body(self, scope, receive, send) -> list[dict] | None:
        """The request's body messages, or None after answering 413 (declared or streamed over the limit)."""
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._reply(send, 413, self._too_large(int(length)), close=True)
            return None
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # the client went away: the app sees the disconnect
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                await self._reply(send, 413, self._too_large(size), close=True)
                return None
            if not message.get("more_body", False):
                return messages

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if any(path == p or path.startswith(p + "/") for p in BLOCKED_PATHS):
            if scope["type"] == "http":
                return await self._reply(send, 404, f"{path} is not exposed by grpo-async serve")
            return None
        if not self._authorized(scope):
            if scope["type"] == "http":
                return await self._reply(send, 401, "missing or wrong API key (Authorization: Bearer <key>)")
            return None
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        messages = await self._read_body(scope, receive, send)
        if messages is None:
            return None

        async def replay():  # the body as read, then the client's later messages (disconnect)
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def header_deadline_protocol(base: type, seconds: float) -> type:
    """A uvicorn HTTP protocol class (`base`: uvicorn's h11 or httptools protocol) that closes a connection whose
    client takes more than `seconds` to send a request's headers: from the connection's start, and from the first
    byte of each later request on a kept-alive connection (uvicorn itself bounds only the idle time between requests).
    """

    class HeaderDeadline(base):
        _header_timer = None

        def _awaiting_headers(self) -> bool:  # no request parsed yet, or the last one answered
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = asyncio.get_running_loop().call_later(seconds, self._header_deadline)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_deadline(self) -> None:
            self._header_timer = None
            if self._awaiting_headers() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._awaiting_headers():
                self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    HeaderDeadline.__name__ = HeaderDeadline.__qualname__ = f"HeaderDeadline{base.__name__}"
    return HeaderDeadline


def _rescaled(position: dict, token: int, temperature: float) -> float:
    """log_softmax(z / T)[token] from one position's log_softmax(z) over the whole vocabulary (`{id: Logprob}`)."""
    if temperature == 1.0:
        return position[token].logprob
    scaled = [lp.logprob / temperature for lp in position.values()]
    top = max(scaled)
    return position[token].logprob / temperature - (top + math.log(sum(math.exp(s - top) for s in scaled)))


def add_health_route(app) -> None:
    """Replace vLLM's `/health` (200, or an empty 503 once the engine died) by one that says what is wrong: 503 with
    `{"error": reason}` for a dead engine and for a weight reload session stuck open (`SessionTracker.problem`).

    A dead engine: one of the processes the API process started for it (`app.state.ws_engine_processes`, the
    `multiprocessing` children alive once the engine is up) has exited, or vLLM's engine client reports it dead.
    vLLM marks it dead only after shutting the rest of the engine down, and then stops the server: without the
    process check `/health` said 200 until the API process was gone."""
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/health"]

    @app.get("/health")
    async def health(request: Request):
        client = request.app.state.engine_client
        for proc in getattr(request.app.state, "ws_engine_processes", ()):  # vLLM notices only after its cleanup
            if not proc.is_alive():
                reason = (
                    f"the engine is dead: its process {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}; "
                    "restart this server"
                )
                return JSONResponse({"error": reason}, status_code=503)
        try:
            await client.check_health()
        except Exception as e:  # noqa: BLE001 - EngineDeadError, or the engine client failing to answer
            reason = f"the engine is dead ({type(e).__name__}: {str(e)[:300]}); restart this server"
            return JSONResponse({"error": reason}, status_code=503)
        if getattr(client, "errored", False):
            return JSONResponse({"error": "the engine is dead (errored); restart this server"}, status_code=503)
        sessions = getattr(request.app.state, "ws_sessions", None)
        problem = sessions.problem() if sessions is not None else None
        if problem:
            return JSONResponse({"error": problem}, status_code=503)
        return Response(status_code=200)


def add_logprob_route(app) -> None:
    """Register `POST /ws/logprobs` (per-token logprobs of given completions; see the module docstring)."""
    import uuid

    from vllm import SamplingParams

    @app.post("/ws/logprobs")
    async def ws_logprobs(request: Request):
        body = await json_body(request)
        seqs, temperature = body.get("sequences"), body.get("temperature", 1.0)
        if set(body) - {"sequences", "temperature"} or not isinstance(seqs, list):
            raise HTTPException(400, 'logprobs takes {"sequences": [{"prompt_ids", "completion_ids"}], "temperature"}')
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise HTTPException(400, f"logprobs: temperature must be a number > 0, got {temperature!r}")
        for s in seqs:
            ok = isinstance(s, dict) and set(s) == {"prompt_ids", "completion_ids"}
            ok = ok and all(isinstance(s[k], list) and all(type(t) is int for t in s[k]) for k in s)
            if not ok or not s["prompt_ids"]:
                raise HTTPException(400, "logprobs: each sequence is {prompt_ids: [int] (not empty), completion_ids}")
        temperature = float(temperature)
        # the target token's logprob suffices at T = 1; another temperature needs the whole vocabulary's
        params = SamplingParams(max_tokens=1, prompt_logprobs=0 if temperature == 1.0 else -1, detokenize=False)
        eng = request.app.state.engine_client

        async def one(s):
            ids = s["prompt_ids"] + s["completion_ids"]
            if not s["completion_ids"]:
                return []
            final = None
            async for out in eng.generate({"prompt_token_ids": ids}, params, f"ws-logprobs-{uuid.uuid4().hex}"):
                final = out
            lps, P = final.prompt_logprobs, len(s["prompt_ids"])
            return [_rescaled(lps[P + j], tok, temperature) for j, tok in enumerate(s["completion_ids"])]

        try:
            out = await asyncio.gather(*(one(s) for s in seqs))
        except ValueError as e:  # vLLM refuses the request (e.g. --max-logprobs too small, sequence too long)
            raise HTTPException(400, f"logprobs: {e}") from e
        for i, lps in enumerate(out):
            bad = [j for j, lp in enumerate(lps) if not math.isfinite(lp)]
            if bad:  # the request was fine: the weights this server holds give NaN/inf (a server fault)
                raise HTTPException(
                    500,
                    f"logprobs: the served model gives non-finite logprobs (sequence {i}, completion positions "
                    f"{bad[:8]}): its weights hold NaN/inf; reload or push valid weights",
                )
        return {"logprobs": out}


#: what `grpo-async serve --help` prints first: our flags and defaults, then vLLM's engine options
OUR_HELP = """usage: grpo-async serve MODEL [--port 8000] [--api-key KEY] [--frozen] [vLLM engine options]

vLLM's OpenAI-compatible server plus the weight-sync routes a grpo_async trainer uses
(GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url=..., vllm_api_key=...)).

grpo-async options and defaults (they differ from `vllm serve`):
  MODEL                 a local model folder or a Hugging Face Hub id (same as --model)
  --host HOST           default 127.0.0.1: loopback only; pass --host 0.0.0.0 to listen on every interface
  --api-key KEY         required on EVERY route and method (OpenAI API, /health, /ws/*, docs, OPTIONS), not only
                        /v1; clients send `Authorization: Bearer KEY`. A request without it, or with another key, gets
                        HTTP 401. Also read from --api-key-file PATH (first line) or the VLLM_API_KEY variable (in
                        that order of precedence). Required when --host is not a loopback address.
  --api-key-file PATH   the API key, from a file (not visible in `ps` or shell history)
  --max-request-mb MB   default 8: the largest request body any route accepts (HTTP 413 beyond it)
  --header-timeout S    default 20: seconds a client may take to send a request's headers before it is cut off
  --reload-idle-timeout S
                        default 60: a weight push (reload session) with no request for S seconds is dropped (its
                        trainer died mid-push); /health answers 503 naming it from S/2 on. A new push's begin drops
                        an open one at once. Nothing of a dropped, aborted or incomplete push is loaded.
  --frozen              refuse weight updates (HTTP 403): for a reference-model server (GRPOConfig.ref_server_url)
  --gpu-memory-utilization F
                        on a GPU: vLLM's default (0.92 of the GPU). On CPU (where it is the share of the machine's
                        RAM vLLM reserves) it is not used by default: the KV cache is sized instead (next option).
  --kv-cache-memory-bytes N
                        on CPU, default: what --max-model-len x --max-num-seqs tokens of this model need (K and V of
                        every layer, +10%), at least one full-length request and 64 MiB, at most 4 GiB or a quarter of
                        the RAM (cpu_kv_cache_bytes); printed at start. VLLM_CPU_KVCACHE_SPACE (GiB), this flag or
                        --gpu-memory-utilization, when given, win. (vLLM's own CPU default reserves half the free RAM:
                        9 GB for a 2-layer model, and two servers started together raced for it.)
  --worker-extension-cls
                        default grpo_async.weight_sync.worker.WeightSyncWorker (needed by the /ws/* routes)
  --logprobs-mode       default processed_logprobs: the sampler's logprobs of the distribution it sampled from
  --[no-]enable-chunked-prefill
                        on CPU, default off (unless --max-num-batched-tokens is given): a seeded request
                        (GRPOConfig.seeded_generation) whose prompt vLLM CPU prefills in chunks fails ("CPU Generator
                        does not use offset"); on a GPU, vLLM's default
  --[no-]enable-scale-out
                        default on: vLLM's token-in, token-out route (/inference/v1/generate), by which a trainer sends
                        a vision-language model's prompts with their images (token ids, images as data URLs)
  --enable-lora --max-lora-rank R [--max-cpu-loras 2]
                        vLLM's own flags; needed for LoRA adapter-only sync (GRPOConfig.vllm_lora_sync='adapter'):
                        the trainer then sends only the adapter, served as model `policy-v<version>`

Routes added to vLLM's: GET /ws/info, POST /ws/init_broadcast, /ws/close_broadcast, /ws/update (weight sync from
the trainer: shared memory or CUDA IPC on this machine, else a gloo/NCCL broadcast), POST /ws/logprobs (reference
logprobs). vLLM's dev routes (/collective_rpc, /sleep, ...) are never exposed. Prints
`grpo-async serve: ready at http://HOST:PORT` once it answers.
"""


def make_parser():
    """vLLM's `serve` argument parser with grpo-async defaults (host, worker extension, logprobs mode)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(
        FlexibleArgumentParser(prog="grpo-async serve", description="vLLM OpenAI server + grpo-async weight sync")
    )
    parser.set_defaults(host="127.0.0.1", worker_extension_cls=WORKER_EXTENSION, logprobs_mode="processed_logprobs")
    parser.add_argument(
        "--frozen", action="store_true", help="grpo-async: refuse weight updates (403), e.g. for a reference server"
    )
    parser.add_argument("--api-key-file", default=None, help="grpo-async: read the API key from this file")
    parser.add_argument(
        "--max-request-mb", type=float, default=MAX_REQUEST_MB, help="grpo-async: request body cap (413 beyond it)"
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        help="grpo-async: seconds a client may take to send its request headers",
    )
    parser.add_argument(
        "--reload-idle-timeout",
        type=float,
        default=RELOAD_IDLE_TIMEOUT_S,
        help="grpo-async: seconds a weight push may go without a request before the server drops it",
    )
    return parser


def resolve_api_key(args, environ: dict) -> str | None:
    """The server's API key: `--api-key`, else the first line of `--api-key-file`, else `VLLM_API_KEY`; None when
    none is given. Raises `SystemExit` naming the file when it cannot be read or is empty."""
    given = [k for k in (args.api_key or []) if k]
    if given:
        if len(set(given)) > 1:
            raise SystemExit("grpo-async serve: give one --api-key (several keys are not supported)")
        return given[0]
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                key = f.readline().strip()
        except OSError as e:
            raise SystemExit(f"grpo-async serve: cannot read --api-key-file {args.api_key_file}: {e}") from e
        if not key:
            raise SystemExit(f"grpo-async serve: --api-key-file {args.api_key_file} is empty")
        return key
    return environ.get("VLLM_API_KEY") or None


def _check_limits(args) -> None:
    if not (math.isfinite(args.max_request_mb) and args.max_request_mb > 0):
        raise SystemExit(f"grpo-async serve: --max-request-mb must be a number > 0, got {args.max_request_mb}")
    if not (math.isfinite(args.header_timeout) and args.header_timeout > 0):
        raise SystemExit(f"grpo-async serve: --header-timeout must be seconds > 0, got {args.header_timeout}")
    if not (math.isfinite(args.reload_idle_timeout) and args.reload_idle_timeout > 0):
        raise SystemExit(
            f"grpo-async serve: --reload-idle-timeout must be seconds > 0, got {args.reload_idle_timeout}"
        )


def print_help(file=None) -> None:
    """Our flags, described, then "vLLM engine options:" and vLLM's own help."""
    file = file or sys.stdout
    print(OUR_HELP, file=file)
    print("vLLM engine options:\n", file=file)
    print(make_parser().format_help(), file=file)


async def _serve(args, api_key: str | None) -> None:
    import vllm.envs as envs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.launcher import serve_http, setup_server
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config

    listen_address, sock = setup_server(args, reuse_port=False)
    async with build_async_engine_client(args) as engine_client:
        import multiprocessing

        supported_tasks = await engine_client.get_supported_tasks()
        app = build_app(args, supported_tasks, engine_client.model_config)
        app.state.ws_engine_processes = multiprocessing.active_children()  # the engine core (none when in-process)
        if args.frozen:
            add_frozen_routes(app)
        else:
            add_weight_routes(app, idle_timeout=args.reload_idle_timeout)
        add_logprob_route(app)
        add_health_route(app)
        app.middleware_stack = None  # vLLM's bootstrap may have built it; ours must wrap everything
        app.add_middleware(  # outermost
            GuardMiddleware, api_keys=[api_key] if api_key else [], max_body_bytes=int(args.max_request_mb * 2**20)
        )
        await init_app_state(engine_client, app.state, args, supported_tasks)
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        kwargs = {"http": header_deadline_protocol(AutoHTTPProtocol, args.header_timeout)}
        log_config = get_uvicorn_log_config(args)
        if log_config is not None:
            kwargs["log_config"] = log_config

        async def announce():  # serve_http blocks until shutdown: print from a side task once uvicorn is up
            while not getattr(getattr(app.state, "server", None), "started", False):
                await asyncio.sleep(0.05)
            print(f"grpo-async serve: ready at {listen_address}", flush=True)

        announcer = asyncio.get_running_loop().create_task(announce())
        shutdown_task = await serve_http(
            app,
            sock=sock,
            enable_ssl_refresh=args.enable_ssl_refresh,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
            ssl_ciphers=args.ssl_ciphers,
            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
            h11_max_header_count=args.h11_max_header_count,
            **kwargs,
        )
        announcer.cancel()
    try:
        await shutdown_task
    finally:
        sock.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point of `grpo-async serve`; `argv` excludes the program name (defaults to `sys.argv[1:]`)."""
    os.environ["VLLM_SERVER_DEV_MODE"] = "0"  # never expose vLLM's generic dev routes
    with collector_paused():  # torch and vLLM (~10 CPU-s): see `grpo_async.gc_tuning`
        import uvloop
        from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
        from vllm.logger import configure_logging_from_args

    cli_env_setup()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return
    args = make_parser().parse_args(argv)
    if getattr(args, "model_tag", None):  # `grpo-async serve MODEL ...` like `vllm serve MODEL`
        args.model = args.model_tag
    if not vllm_cpu.default_cpu_kv_cache(args, argv, os.environ):
        vllm_cpu.default_cpu_memory(args, argv)
    vllm_cpu.default_cpu_chunked_prefill(args, argv)
    vllm_cpu.inspect_models_in_process()
    _default_shutdown_timeout(args, argv)
    if not flag_passed(argv, "--enable-scale-out") and not flag_passed(argv, "--no-enable-scale-out"):
        args.enable_scale_out = True  # vLLM's token-in, token-out route: a vision-language model's prompts with images
    if not args.enforce_eager:
        if default_cpu_aot_compile(os.environ):
            print(
                "grpo-async serve: VLLM_USE_AOT_COMPILE=0 (vLLM's AOT compile cache does not load on CPU; "
                "torch inductor's cache serves a restart); set the variable to choose",
                flush=True,
            )
    if args.worker_extension_cls != WORKER_EXTENSION and not _is_subclass_path(args.worker_extension_cls):
        raise SystemExit(
            f"grpo-async serve needs --worker-extension-cls {WORKER_EXTENSION} or a subclass of it "
            f"(got {args.worker_extension_cls!r})"
        )
    _check_limits(args)
    # our guard applies the key to every route; vLLM (which would read either and guard /v1 only) gets neither, so
    # it neither logs the key with the other arguments nor passes the variable on to the engine processes
    api_key = resolve_api_key(args, os.environ)
    args.api_key = None
    os.environ.pop("VLLM_API_KEY", None)
    if api_key is None and not getattr(args, "uds", None) and not is_loopback_host(args.host):
        raise SystemExit(
            f"grpo-async serve: refusing to listen on {args.host or 'every interface'} without an API key: anyone "
            "who reaches the port could replace the weights. Give one with --api-key-file PATH, --api-key KEY or "
            "the VLLM_API_KEY variable, or listen on 127.0.0.1."
        )
    configure_logging_from_args(args)
    validate_parsed_serve_args(args)
    uvloop.run(_serve(args, api_key))
    exit_after_clean_shutdown()


#: seconds a SIGTERM/SIGINT lets the engine drain and exit by itself (vLLM's default, 0, SIGKILLs it at once: its
#: shared memory and semaphores are then left to the resource tracker, which warns about each)
SHUTDOWN_TIMEOUT_S = 10


def _default_shutdown_timeout(args, argv: list[str]) -> None:
    if not flag_passed(argv, "--shutdown-timeout"):
        args.shutdown_timeout = SHUTDOWN_TIMEOUT_S


def exit_after_clean_shutdown(code: int = 0) -> None:
    """Leave after the server shut down cleanly: the exit handlers run (logging flushed; multiprocessing unlinks this
    process's semaphores and shared memory), then the process exits without the interpreter's module teardown, where
    triton's nanobind bindings list every object still alive as "leaked" (harmless at exit, alarming in a log)."""
    import atexit

    atexit._run_exitfuncs()  # what interpreter exit runs first; then it would tear the modules down
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _is_subclass_path(qualname: str) -> bool:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from grpo_async.weight_sync.worker import WeightSyncWorker

    try:
        cls = resolve_obj_by_qualname(qualname)
    except Exception:  # noqa: BLE001
        return False
    return isinstance(cls, type) and issubclass(cls, WeightSyncWorker)


if __name__ == "__main__":
    main()
