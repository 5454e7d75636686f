"""`EngineLoop`: one thread that owns an in-process vLLM engine in stream mode.

Any thread submits requests (`submit`) and waits for them (`wait`); the loop thread adds them to the engine and
steps it, so each request finishes on its own: a prompt group is done when its G requests are, whatever else the
engine still runs. Weights are loaded between two engine steps (`between_steps`), with requests still running (their
KV cache kept); every token records the policy version of the weights that sampled it:

```txt
loop thread  add r0, r1 ─ step ─ step ─ [load v1] ─ step ─ step (r0 done) ─ add r2 ─ step ...
r1 tokens      v0     v0    │    v1     v1   ...                 r1.versions = [0, 0, 1, 1, ...]
trainer thread              between_steps(load, 1): waits for the step in progress, loads, returns
```

Outputs come back per step (`RequestOutputKind.DELTA`): the new tokens of each request with their logprobs. Every
wait is bounded by the caller (`wait(..., timeout)`); a loop that dies fails every request it held with its error.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .base import GenerationAborted

logger = logging.getLogger(__name__)


@dataclass
class LoopRequest:
    """One request (n = 1) of the loop: its tokens, their logprobs and policy versions, filled as the engine steps."""

    request_id: str
    prompt_ids: list[int]
    params: object  # vllm.SamplingParams, n = 1, output_kind DELTA
    lora_request: object | None = None
    #: what the engine takes instead of `prompt_ids` (a vision-language model's prompt with images: its rendered
    #: text and `multi_modal_data`, `vllm_images.engine_prompts`), and the prompt ids the engine made of it
    engine_prompt: dict | None = None
    engine_prompt_ids: list[int] | None = None
    version: int | None = None  # the version the next token is sampled with (set when added, moved by a load)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # [T] version of each token
    finish_reason: str | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def adopt_torch_threads() -> None:
    """Give the calling thread the process's torch thread count (`torch.set_num_threads`) before it steps an
    in-process vLLM engine.

    OpenMP keeps the thread count per thread; torch applies its own setting to a thread lazily, at the thread's first
    torch call. vLLM's CPU attention sizes its scheduling metadata with the calling thread's OpenMP count before any
    torch call of a fresh thread, then runs with torch's: a process that set `torch.set_num_threads(k)` (k ≠ OpenMP's
    default, e.g. `OMP_NUM_THREADS` unset and 1 thread asked for) failed its first generation on a new thread with
    `Check failed: input->metadata->thread_num == thread_num (2 vs. 1)`. Asking torch for the count applies it here.
    """
    import torch

    torch.get_num_threads()


class EngineLoop:
    """Owns the stepping of `engine` (a `vllm` V1 `LLMEngine`) on its thread.

    Args:
        engine: `LLM.llm_engine`.
        version (`Callable[[], int | None]`): the policy version the engine holds now (read when a request is added).
        name (`str`, *optional*): thread name and log prefix.
    """

    def __init__(self, engine, version: Callable[[], int | None], name: str = "grpo-async-engine-loop"):
        self.engine = engine
        self.version = version
        self.name = name
        self._incoming: queue.SimpleQueue[LoopRequest] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._running: dict[str, LoopRequest] = {}  # loop thread only
        self._step_lock = threading.Lock()  # held by the loop around each engine call; by a load between steps
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._fatal: BaseException | None = None
        self._busy = 0.0  # seconds the engine had unfinished requests
        self._busy_since: float | None = None
        self._loaded: int | None = None  # the version a load between steps installed (None: ask `version()`)
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def stop(self, timeout: float = 10.0) -> bool:
        """Abort every request (their waiters get `GenerationAborted`) and join the thread within `timeout`."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def check_health(self) -> None:
        if self._fatal is not None:
            raise RuntimeError(f"{self.name} died: {self._fatal!r}") from self._fatal

    def busy_seconds(self) -> float:
        """Seconds the engine had unfinished requests (the request running now counted up to now)."""
        since = self._busy_since
        return self._busy + (time.perf_counter() - since if since is not None else 0.0)

    # -- any thread ------------------------------------------------------------------------------------------
    def submit(
        self, prompt_ids: list[list[int]], params: list, lora_request=None, engine_prompts: list[dict] | None = None
    ) -> list[LoopRequest]:
        """Queue one request per prompt (`params[i]` with n = 1); the loop adds them before its next step.
        `engine_prompts[i]`: what the engine takes for prompt i instead of its token ids (`LoopRequest.engine_prompt`;
        a dict holding `prompt_token_ids` is the same as none)."""
        self.check_health()
        if not self.is_running():
            raise GenerationAborted(f"{self.name}: the engine loop is stopped")
        from vllm.sampling_params import RequestOutputKind

        requests = []
        given = engine_prompts if engine_prompts is not None else [None] * len(prompt_ids)
        for p, sp, e in zip(prompt_ids, params, given, strict=True):
            if sp.n != 1:
                raise ValueError(f"{self.name}: one completion per request (n=1), got n={sp.n}")
            sp.output_kind = RequestOutputKind.DELTA  # each step's new tokens
            e = None if e is None or "prompt_token_ids" in e else e
            requests.append(LoopRequest(f"stream-{next(self._ids)}", list(p), sp, lora_request, engine_prompt=e))
        for r in requests:
            self._incoming.put(r)
        self._wake.set()
        return requests

    def wait(self, requests: list[LoopRequest], aborted: threading.Event, timeout: float | None = None) -> None:
        """Wait until every request is done; `aborted` set (shutdown) aborts them in the engine and raises
        `GenerationAborted`; an error of the loop or a request is raised; `TimeoutError` after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in requests:
            while not r.done.wait(0.05):
                if aborted.is_set() or self._stop.is_set():
                    self.abort(requests)
                    raise GenerationAborted(f"{self.name}: {len(requests)} requests aborted (shutting down)")
                self.check_health()
                if deadline is not None and time.monotonic() > deadline:
                    self.abort(requests)
                    raise TimeoutError(f"{self.name}: requests not done after {timeout:.1f}s")
            if r.error is not None:
                raise r.error

    def abort(self, requests: list[LoopRequest]) -> None:
        """Abort `requests` in the engine (applied by the loop before its next step)."""
        for r in requests:
            if not r.done.is_set():
                self._aborts.put(r.request_id)
        self._wake.set()

    def between_steps(self, fn: Callable[[], None], version: int) -> None:
        """Run `fn` (a weight load) while the engine does not step; the tokens sampled after it are `version`'s,
        those of the requests running now included."""
        with self._step_lock:
            fn()
            self._loaded = version
            for r in list(self._running.values()):
                r.version = version

    # -- the thread ------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        while True:
            try:
                r = self._incoming.get_nowait()
            except queue.Empty:
                return
            r.version = self.version() if self._loaded is None else self._loaded
            prompt = r.engine_prompt if r.engine_prompt is not None else {"prompt_token_ids": r.prompt_ids}
            self.engine.add_request(r.request_id, prompt, r.params, lora_request=r.lora_request)
            self._running[r.request_id] = r

    def _apply_aborts(self) -> None:
        ids = []
        while True:
            try:
                ids.append(self._aborts.get_nowait())
            except queue.Empty:
                break
        ids = [i for i in ids if i in self._running]
        if ids:
            self.engine.abort_request(ids)
            for i in ids:
                self._finish(self._running.pop(i), error=GenerationAborted(f"{self.name}: request {i} aborted"))

    @staticmethod
    def _finish(r: LoopRequest, reason: str | None = None, error: BaseException | None = None) -> None:
        r.finish_reason, r.error = reason, error
        r.done.set()

    def _run(self) -> None:
        adopt_torch_threads()
        try:
            while not self._stop.is_set():
                with self._step_lock:
                    self._admit()
                    self._apply_aborts()
                    busy = self.engine.has_unfinished_requests()
                    now = time.perf_counter()
                    if busy and self._busy_since is None:
                        self._busy_since = now
                    elif not busy and self._busy_since is not None:
                        self._busy += now - self._busy_since
                        self._busy_since = None
                    outputs = self.engine.step() if busy else []
                    for o in outputs:
                        r = self._running.get(o.request_id)
                        if r is None:  # aborted meanwhile
                            continue
                        if r.engine_prompt is not None and r.engine_prompt_ids is None:
                            r.engine_prompt_ids = list(o.prompt_token_ids or [])
                        out = o.outputs[0]
                        new = list(out.token_ids)
                        r.token_ids += new
                        if out.logprobs is not None:
                            r.logprobs += [out.logprobs[i][t].logprob for i, t in enumerate(new)]
                        r.versions += [r.version] * len(new)
                        if o.finished:
                            del self._running[o.request_id]
                            self._finish(r, "length" if out.finish_reason == "length" else "stop")
                if not busy:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - every waiter gets the error
            self._fatal = e
            logger.error("[%s] engine loop died: %r", self.name, e)
        finally:
            if self._busy_since is not None:
                self._busy += time.perf_counter() - self._busy_since
                self._busy_since = None
            stopped = self._fatal or GenerationAborted(f"{self.name}: the engine loop stopped")
            with self._step_lock:
                if self._running and self._fatal is None:
                    try:
                        self.engine.abort_request(list(self._running))
                    except Exception as e:  # noqa: BLE001 - the engine may be gone
                        logger.warning("[%s] aborting the requests at stop failed: %r", self.name, e)
                for r in self._running.values():
                    self._finish(r, error=stopped)
                self._running.clear()
                while True:
                    try:
                        self._finish(self._incoming.get_nowait(), error=stopped)
                    except queue.Empty:
                        break
