"""Start and stop `grpo-async serve` processes (tests, benchmark, recipes that launch their own servers).

Each server runs in its own session (process group), so `stop()` / `kill()` take down the API process together with
vLLM's engine-core and worker children: no orphans. When only the API process dies (out of memory, `kill -9` of its
pid), its engine and worker processes notice within about a second and exit (`parent_watch.exit_with_parent`,
started in every process vLLM starts with the worker extension loaded).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from grpo_async.net import free_port, health_problem, probe_health

logger = logging.getLogger(__name__)

#: environment every CPU server gets unless the caller overrides it.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
#: forced for servers (unless `env` says otherwise): vLLM's multiprocess executor, the worker in a process of its own
#: (the API server's engine core runs in a process of its own either way: vLLM's `AsyncLLM` always starts one).
SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
#: a launch option for short-lived servers (tests), not the default: the worker runs inside the engine-core process
#: (vLLM's one-process executor), so a start pays two imports of vLLM instead of three: the tiny model's server is
#: healthy after ~17 s instead of ~23 s on 2 quiet cores (~21 CPU-s instead of ~31). API process, engine core, weight
#: routes and worker extension are the same code; `launch_server(..., env=TWO_PROCESS_ENV)`.
TWO_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass
class ServerProcess:
    """A running `grpo-async serve`: `url`, `api_key`, the `Popen` and its log file."""

    url: str
    proc: subprocess.Popen
    log_path: str
    api_key: str | None = None
    args: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    shm_before: frozenset[str] = frozenset()

    def kill(self) -> None:
        """SIGKILL the whole process group at once (simulates a crash); vLLM's leaked shared memory is removed."""
        owned = group_shm(self.proc.pid)
        self._signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        remove_orphan_shm(self.shm_before, owned)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after `timeout` seconds."""
        owned = group_shm(self.proc.pid)
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # children (engine core, worker) may outlive the API process
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        remove_orphan_shm(self.shm_before, owned)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the server's own session: pgid == its pid
        except ProcessLookupError:
            pass


def _shm_names() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}
    except OSError:
        return set()


def _mapped_shm(pid: str) -> set[str]:
    """The `/dev/shm` names process `pid` maps."""
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    names.add(fields[5].strip().removesuffix(" (deleted)")[len("/dev/shm/") :])
    except OSError:
        pass
    return names


def group_shm(pgid: int) -> set[str]:
    """The `/dev/shm` names mapped by the live processes of process group `pgid` (a server and its engine)."""
    names: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:  # fields after the name: state, ppid, pgrp
            names |= _mapped_shm(entry)
    return names


def remove_orphan_shm(before: frozenset[str] | set[str], owned: set[str] | None = None) -> list[str]:
    """Unlink `/dev/shm/psm_*` and `sem.mp-*` that appeared after `before`, that the stopped server's processes
    mapped (`owned`, read while they were alive; `None`: any) and that no live process maps any more.

    vLLM's engine keeps its message queues (and multiprocessing its semaphores) in shared memory; a SIGKILLed server
    cannot unlink them. Only the server's own segments are candidates: another program on the machine may have
    created a semaphore its child has not opened yet (unmapped for that moment), and unlinking it would kill that
    child's start (`SemLock._rebuild: FileNotFoundError`, seen when two runs shared the machine).
    """
    import glob

    new = _shm_names() - set(before)
    if owned is not None:
        new &= owned
    if not new:
        return []
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                        mapped.add(fields[5].strip().removesuffix(" (deleted)")[len("/dev/shm/") :])
        except OSError:
            continue
    removed = []
    for name in sorted(new - mapped):
        try:
            os.unlink(os.path.join("/dev/shm", name))
            removed.append(name)
        except OSError:
            pass
    return removed


def launch_server(
    model: str,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    log_path: str | None = None,
    wait: bool = True,
    ready_timeout: float = 240.0,
) -> ServerProcess:
    """Start `python -m grpo_async.generation.serve --model MODEL ...` and (by default) wait for its ready line.

    Args:
        model (`str`): model folder.
        port (`int`, *optional*): defaults to a free port.
        api_key (`str`, *optional*): the server's key, passed in its `VLLM_API_KEY` variable (not on the command
            line, which `ps` shows to every user); without it the server has no key (the caller's `VLLM_API_KEY`
            is not passed on).
        extra_args (`list[str]`, *optional*): more `vllm serve` flags, e.g. `["--dtype", "float32"]`. With
            `--kv-cache-memory-bytes` among them, the flag sizes the KV cache: the `VLLM_CPU_KVCACHE_SPACE` of
            `CPU_ENV` and of `os.environ` is not passed on (vLLM would take it over the flag; one in `env` is, and
            the server then refuses to start, naming both).
        env (`dict`, *optional*): extra environment (on top of `os.environ` and `CPU_ENV`).
        log_path (`str`, *optional*): where stdout+stderr go; defaults to a temp file.
        wait (`bool`, *optional*, defaults to `True`): block until ready (call `wait_ready` yourself otherwise).
        ready_timeout (`float`, *optional*, defaults to 240): seconds to wait; the process is killed on timeout.
    """
    port = port or free_port(host)
    args, full_env = server_command(model, port=port, host=host, api_key=api_key, extra_args=extra_args, env=env)
    log_path = log_path or server_log_path(port)
    shm_before = frozenset(_shm_names())
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = ServerProcess(url=f"http://{host}:{port}", proc=proc, log_path=log_path, api_key=api_key, args=args)
    server.shm_before = shm_before
    if wait:
        wait_ready(server, ready_timeout)
    return server


def server_command(
    model: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and the environment `launch_server` starts a server with (arguments as there)."""
    args = [sys.executable, "-m", "grpo_async.generation.serve", "--model", model, "--host", host, "--port", str(port)]
    args += list(extra_args)
    full_env = {**CPU_ENV, **os.environ, **SERVER_ENV, **(env or {})}
    if flag_passed(args, "--kv-cache-memory-bytes") and "VLLM_CPU_KVCACHE_SPACE" not in (env or {}):
        # the flag sizes the KV cache; vLLM would let the variable (CPU_ENV's default or this process's) override it
        full_env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    full_env.pop("VLLM_SERVER_DEV_MODE", None)
    full_env.pop("VLLM_API_KEY", None)
    if api_key:  # through the environment: not in the command line, which `ps` shows to every user
        full_env["VLLM_API_KEY"] = api_key
    return args, full_env


def flag_passed(argv: list[str] | tuple[str, ...], flag: str) -> bool:
    """Whether the command line `argv` passes `flag` (`--a-b` or `--a_b`, the value apart or after `=`).

    >>> flag_passed(["--model", "m", "--kv_cache_memory_bytes=1024"], "--kv-cache-memory-bytes")
    True
    >>> flag_passed(["--max-model-len", "256"], "--max-model")
    False
    """
    names = (flag, flag.replace("-", "_").replace("__", "--", 1))
    return any(a in names or a.startswith(tuple(n + "=" for n in names)) for a in argv)


def server_log_path(port: int) -> str:
    """A fresh temporary file for the log of the server on `port`."""
    import tempfile

    fd, log_path = tempfile.mkstemp(prefix=f"grpo_serve_{port}_", suffix=".log")
    os.close(fd)
    return log_path


def wait_ready(server: ServerProcess, timeout: float = 240.0) -> ServerProcess:
    """Block until the server answers `/health` with 200; kill it and raise otherwise, saying what the last probe
    got: no answer (still loading, or not listening) or an error status (another program on that port, or an engine
    that is not healthy)."""
    deadline = time.monotonic() + timeout
    problem = None
    while time.monotonic() < deadline:
        if not server.alive:
            raise RuntimeError(f"grpo-async serve exited with {server.proc.returncode}:\n{server.log_tail()}")
        problem = probe_health(server.url, server.api_key, timeout=2.0)
        if problem is None:
            return server
        time.sleep(0.5)
    server.stop()
    last = health_problem(server.url, problem) if problem is not None else "never probed"
    log = server.log_tail()
    raise TimeoutError(
        f"grpo-async serve at {server.url} not healthy after {timeout:.0f} s (last probe: {last}):\n{log}"
    )
