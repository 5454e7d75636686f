"""2 training processes forked from a warm interpreter: `accelerate launch --multi_gpu` without its start-up cost, for
the tests whose subject is what the ranks train, not the launcher (and the runs of the benches' `--smoke` modes:
`bench/_runs.run_python`). Test infrastructure; `tests/test_warm_launch.py` checks it.

`accelerate launch` on 2 CPU processes costs ~13 CPU-seconds before a rank runs a line of its script (the launcher
imports accelerate and torch, then each rank imports torch, transformers and the trainer: ~9 s on 2 quiet cores). The
suite launched ~20 such runs. Here one `multiprocessing` fork server imports that stack once (`PRELOAD`): under
pytest-xdist the controller starts it before the workers and every worker asks it (`start_shared_fork_server`); a run
without workers starts its own on first use. Every rank is a fresh `fork()` of it — its own process, its own address
space, gloo between them as under `accelerate launch` — that gets the environment `accelerate launch` would give it
(the `ACCELERATE_*` variables from accelerate's own `prepare_multi_gpu_env`, torchelastic's `RANK` / `WORLD_SIZE` /
`MASTER_*`) and runs the script as `__main__` with `sys.argv` set.

The test servers of `vllm_utils.running_servers` start the same way (`start_server`): `grpo-async serve`'s API process
is a fork of the same warm interpreter, in a session of its own as `launch_server` makes it; ~7 of the ~17 s a server
takes to be ready on 2 quiet cores are that process's imports. Its engine-core process is a `fork()` of that API
process instead of vLLM's `spawn` (which vLLM's CPU platform forces: a fresh interpreter importing torch and vLLM
again, ~5.5 of the ~9.5 s a forked API process then still needed to be ready; 4 s with the fork). Safe there: the API
process has run no OpenMP region and no `torch.distributed` group (vLLM forks its engine core by default elsewhere).
The ranks of `run_2cpu` fork theirs too where a rank starts one (a colocated engine runs inside its rank, but with
`separate_process`, the main process generating alone, it is an engine core plus a worker process it starts: vLLM's CPU
platform requires the multiprocess executor then); forked, the engine core runs the scheduler only, and a rank runs one
OpenMP thread. The worker, which holds the model and joins vLLM's own process group, hung when forked from the engine
core; it is a fork of the fork server instead (`_WorkerContext`: no thread, no OpenMP region run there), with the
environment and output a spawned one would inherit (~12 CPU-s less per worker: `bench/lora_sync.py --smoke` 47 → 26
CPU-s). A forked script that forks in turn (a bench's `--smoke` run under `tests/test_benches.py` starts its runs and
servers here too) asks the same fork server, not a second one of its own: one preload per pytest run, not one per
bench (`_use_the_parent_fork_server`). `run_script`'s scripts keep `spawn`: they may have run OpenMP regions on several
threads first, after which a forked child's OpenMP can hang (unless the caller knows they run one thread:
`fork_engine`, as the bench smokes do). `start_server_command` forks a server from a test's own command line and
environment (`test_security`: no `--host`, the key in `VLLM_API_KEY`; `test_stock_server`: vLLM's own
`vllm.entrypoints.openai.api_server`, whose routes and refusals are the subject). The servers that start as real
commands (`test_cli`, `test_hardening`, ...: how the process starts, stops or dies is their subject) keep vLLM's
`spawn`: tried with `test_hardening`'s server, the engine core of a forked server outlived its
SIGKILLed API process by more than 60 s, where a real one exits within seconds.

Every forked process takes its command line as its title (`setproctitle`, as vLLM names its own processes): `ps`
shows what each fork runs, and vLLM's `VLLM::EngineCore` title works in the forks (setproctitle needs the process's
original environment layout, so it runs before the environment is replaced).

How a fork ends: a rank of `run_2cpu` ends with `os._exit` after its non-daemon threads and `atexit` handlers, so an
abort later in the interpreter's shutdown would not show. The tests whose subject is how a process ends or dies
(`tests/test_clean_exit.py`'s runs, `tests/test_faults.py`, `tests/test_faults_mp.py`, the chaos test's trainers) fork
with `real_exit` (`run_script`, `start_script`): the fork ends through `Py_Exit`, the interpreter's whole
finalization and the C library's `exit`, as a fresh `python script` does, so a thread left in torch ops at exit aborts
it (`terminate called without an active exception`) as it aborts a fresh interpreter
(`tests/test_warm_launch.py` runs both); they save the ~8 CPU-s of imports each such process paid.

What stays on the real launcher: `make demo`, multi-node (`tests/test_multinode.py`: the launcher reads the shipped
2-machine config), `accelerate launch`'s own agent
(`tests/test_clean_exit.py::test_two_processes_agree_on_the_horizon`), and the servers whose start or stop is the
subject (above). The other commands the documents show run here with what the line says: the README's 2-process CPU
command on ranks given the environment of its flags (`accelerate_env`; `tests/test_readme_commands.py`), its ZeRO-3
command (and the DDP and ZeRO-2 configs) on ranks given the environment accelerate makes of the config file
(`config_file_env`; `tests/test_launch_configs.py`), its two `grpo-async serve` lines as `python -m grpo_async.cli
serve ...` with the line's arguments.
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing import popen_forkserver

from grpo_async.net import free_port

#: imported once by the fork server, before any rank forks: the stack every training script imports
PRELOAD = [
    "support.collector_off",  # the imports below without the garbage collector's walks (see the module)
    "torch",
    "transformers",
    "accelerate",
    "grpo_async.trainer",
    "vllm",
    # what `grpo-async serve` imports before it starts its engine
    "uvloop",
    "grpo_async.generation.serve",
    "vllm.entrypoints.launchers.cli_args",
    "vllm.entrypoints.launchers.api_server.entry",
    "vllm.entrypoints.launchers.app",
    "vllm.entrypoints.launchers.launcher",
    # what a vLLM engine imports as it starts (its worker, model runner, sampler): ~1 CPU-s per engine otherwise
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.sample.rejection_sampler",
    # TRL's trainer (~3.4 CPU-s after the above), which the TRL runs of `bench/vs_trl.py`'s smoke import in each rank
    "trl.trainer.grpo_trainer",
    # what a Trainer's construction imports (accelerate asks for DeepSpeed: ~440 modules), the quantization layers an
    # engine imports as it loads a model, and matplotlib for a run's end-of-training plot
    "deepspeed",
    "vllm.model_executor.layers.quantization.online.base",
    "matplotlib.pyplot",
    # what forks imported each on their own (py-spy over a suite run, 2026-11-30): the tiny test model's
    # architecture, the weight-transfer plugin every engine loads, the backends, the demo task, and pytest (the test
    # files that run as scripts: `test_clean_exit.py train ...`)
    "transformers.models.llama.modeling_llama",
    "grpo_async.weight_sync.vllm_engine",
    "grpo_async.generation.vllm_colocate",
    "grpo_async.generation.stock_server",
    "grpo_async.demo_task",
    "pytest",
    # forks count the sampler's token ranks with the eager original of vLLM's compiled helper (see the module)
    "support.eager_compile",
    # last: the preloaded heap into the collector's permanent generation (see the module)
    "support.frozen_heap",
]

_CTX = None
_IN_WARM_FORK = False  # set in a process this module forked (`_rank_main`)


class _ThreadSafePopen(popen_forkserver.Popen):
    """The fork server's child handle, safe to poll from several threads at once. The stock one is not: its exit
    status arrives as 8 bytes on a pipe that the fork server then closes, and two threads that both see the pipe
    readable both read it; the one that comes second meets end-of-file and records exit status 255 ("perhaps the
    forkserver process itself got killed"), over the real one. `test_faults.Proc` polls from its log reader while
    the test waits for the exit (a CI run recorded 255 for a worker that had exited 130). Here one thread reads the
    status and every other one gets what it recorded; a blocking wait waits for the pipe outside the lock."""

    def __init__(self, process_obj):
        self._poll_lock = threading.Lock()
        super().__init__(process_obj)

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None and flag != os.WNOHANG:
            multiprocessing.connection.wait([self.sentinel])
        with self._poll_lock:
            return super().poll(os.WNOHANG)


class _ForkServerProcess(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _ThreadSafePopen(process_obj)


class _ForkServerContext(multiprocessing.context.ForkServerContext):
    """The `forkserver` start method, its processes' handles thread-safe (`_ThreadSafePopen`)."""

    Process = _ForkServerProcess


#: set by `start_shared_fork_server` (pytest-xdist's controller) to its fork server's address, for the workers
SHARED_FORK_SERVER = "GRPO_TEST_FORK_SERVER"


def _context():
    global _CTX
    if _CTX is None:
        _CTX = _ForkServerContext()
        _CTX.set_forkserver_preload(PRELOAD)
        if _IN_WARM_FORK:
            _use_the_parent_fork_server()
        elif os.environ.get(SHARED_FORK_SERVER):
            _use_the_shared_fork_server(os.environ[SHARED_FORK_SERVER])
        else:
            _start_fork_server()
    return _CTX


def start_shared_fork_server(worker_env: dict[str, str]) -> None:
    """In pytest-xdist's controller (`tests/conftest.py`), before it starts the workers: start the fork server all of
    them use (`SHARED_FORK_SERVER` in their environment), one preload (~20 CPU-s on 2 slow cores) instead of one per
    worker. It starts in the background: a worker's first fork waits for the preload to end. It starts with
    `worker_env`, what `tests/conftest.py` gives a worker (OpenMP reads `OMP_NUM_THREADS` as torch loads it: 1), where
    not already set; every fork then takes its caller's whole environment (`_rank_main`). It ends with the controller
    (the server exits when its "alive" pipe, which only the controller holds, closes)."""
    from multiprocessing import forkserver

    added = [k for k in worker_env if k not in os.environ]
    os.environ.update({k: worker_env[k] for k in added})
    try:
        _context()
    finally:
        for k in added:
            del os.environ[k]
    os.environ[SHARED_FORK_SERVER] = forkserver._forkserver._forkserver_address


def _use_the_shared_fork_server(address: str) -> None:
    """In a pytest-xdist worker: ask the controller's fork server (`start_shared_fork_server`) at `address`. A client
    hands the server an "alive" file descriptor with each request, which the fork keeps as its own for forks of its
    own (`_use_the_parent_fork_server`); the worker holds no end of the server's pipe, so it hands `/dev/null`: the
    server's life is the controller's."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    server._forkserver_address = address
    server._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)
    server.ensure_running = resource_tracker.ensure_running


def _start_fork_server() -> None:
    """Start this process's fork server with `tests/` on its `PYTHONPATH`. Python 3.11's fork server imports its
    preload with the path of a fresh `python -c` (the working directory and `PYTHONPATH`; the `sys_path` it is handed
    is ignored there, `multiprocessing.forkserver.main`), and drops every `ImportError` silently: started from the
    repository's root, `support.*` (the heap freeze, the CPU-ISA check) were never imported. Set only while the
    server starts: the other processes the tests start see the environment they were given."""
    from multiprocessing import forkserver

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests, before) if p)
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _use_the_parent_fork_server() -> None:
    """In a process the fork server forked (a bench's `--smoke` run under `tests/test_benches.py`, which forks its own
    runs and servers): ask that same fork server for those forks instead of starting a second one that imports the
    whole stack again (~10 CPU-seconds each). The process already holds the server's address and its "alive" pipe
    (`multiprocessing.forkserver` hands them to every child); only the check that the server is this process's own
    child has to go (it is the parent's: `waitpid` cannot see it, and the check would start a new server)."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    if server._forkserver_address is None or server._forkserver_alive_fd is None:
        return  # not a fork server's child after all: start one as usual
    server.ensure_running = resource_tracker.ensure_running


#: the flags of the README's 2-process CPU command: `accelerate launch CPU_FLAGS script.py`
CPU_FLAGS = [
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]


def accelerate_env(flags: list[str]) -> dict[str, str]:
    """The variables `accelerate launch FLAGS script.py` adds for its ranks, from accelerate's own code: the flags (a
    `--config_file` read as `launch_command` reads it) into the launcher's arguments, then the environment of the
    launcher that `launch_command` picks for them (`prepare_deepspeed_cmd_env` for DeepSpeed, `prepare_multi_gpu_env`
    for a multi-process run); for `run_2cpu(..., launch_env=...)`. `OMP_NUM_THREADS` is the caller's (`run_2cpu`: 1 per
    rank unless its `env` says otherwise, as the tests' launches always set it; without `--num_cpu_threads_per_process`
    accelerate would write "None")."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args([*flags, "--main_process_port", "0", "script.py"])
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    before = dict(os.environ)
    if args.use_deepspeed:  # as `launch_command` prepares a DeepSpeed launch
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config_flag else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        assert args.multi_gpu, f"accelerate launch {' '.join(flags)}: not a multi-process launch"
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if before.get(k) != v and k != "OMP_NUM_THREADS"}


def config_file_env(config_file: str) -> dict[str, str]:
    """The variables `accelerate launch --config_file CONFIG_FILE script.py` adds for its ranks (`accelerate_env`)."""
    return accelerate_env(["--config_file", config_file])


def _rank_main(
    script: str,
    argv: list[str],
    env: dict[str, str],
    log_path: str,
    *,
    module: bool = False,
    cwd: str | None = None,
    fork_engine: bool = False,
    real_exit: bool = False,
    err_path: str | None = None,
    new_session: bool = False,
    sigint_default: bool = False,
) -> None:
    """In the forked process: output to `log_path` (standard error to `err_path` if given), the given environment,
    then `script` (a module with `module`) as `__main__`; ends with the script's exit status like an interpreter would
    (non-daemon threads joined, `atexit` handlers run), then `os._exit`; with `real_exit`, by the interpreter's own
    `Py_Exit` instead: the whole finalization a fresh `python script` goes through at exit, C++ static destructors
    included, so an abort there shows (`terminate called without an active exception`, exit -6) as it would in a
    fresh interpreter. A module runs in a session of its own (`start_new_session`, as `launch_server` starts
    servers), so does a script with `new_session`. `sigint_default`: SIGINT raises `KeyboardInterrupt`, as in a fresh
    interpreter started with SIGINT at its default (the fork server ignores it, and a suite started in the background
    of a non-interactive shell has it ignored too)."""
    global _IN_WARM_FORK
    import setproctitle  # before the environment changes below: it needs the process's original argv/environ layout

    _IN_WARM_FORK = True

    setproctitle.setproctitle(" ".join([sys.executable, *(["-m", script] if module else [script]), *argv]))
    if module or new_session:
        os.setsid()
    if sigint_default:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if fork_engine:
        _fork_engine_core()
    for targets, path in [((1, 2), log_path)] if err_path is None else [((1,), log_path), ((2,), err_path)]:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # one open file: one offset for both
        for target in targets:
            os.dup2(fd, target)
        os.close(fd)
    # `SIGUSR1` writes every thread's Python stack to standard error (its log): `_run_forked` sends it to a process
    # that ran past its timeout before killing it, so the report shows where it was stuck
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # as in a fresh interpreter: the first temporary file reads TMPDIR of this environment
    if cwd:  # the caller's, as `subprocess` would give it (the fork server's is wherever the first caller was)
        os.chdir(cwd)
    if env.get("OMP_NUM_THREADS"):  # the fork server's OpenMP read its own environment at start
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *argv]
    # what `python script` / `python -m module` put first on the path: the script's folder / the working directory
    sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(script)))
    code = 0
    interrupted = False
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        code = 1
        interrupted = isinstance(e, KeyboardInterrupt)
        if interrupted:  # as the interpreter: its hook (the trainer's ends the process itself: grpo_async.interrupt)
            sys.excepthook(type(e), e, e.__traceback__)
        else:
            traceback.print_exc()
    if real_exit and not interrupted:
        import ctypes

        ctypes.pythonapi.Py_Exit.argtypes = [ctypes.c_int]
        ctypes.pythonapi.Py_Exit(code)  # does not return
    threading._shutdown()  # what the interpreter does at exit, in this order
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if real_exit and interrupted:  # an uncaught KeyboardInterrupt: the interpreter ends by SIGINT (exit -2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


#: the signal on which a fork writes its threads' Python stacks to its log (`faulthandler.register` in `_rank_main`)
STACK_DUMP_SIGNAL = signal.SIGUSR1


def dump_stacks(pids: list[int], wait: float = 2.0) -> None:
    """Ask each fork of `pids` (still running) to write every thread's Python stack to its log (`STACK_DUMP_SIGNAL`),
    and give them `wait` seconds to: what a process stuck past its timeout was doing, in the output its caller
    reports (a stuck bench smoke once left nothing but the worker's own stack to read)."""
    for pid in pids:
        try:
            os.kill(pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    if pids:
        time.sleep(wait)


def _fork_engine_core() -> None:
    """In a forked server's API process or a `run_2cpu` rank: vLLM starts its engine core with `fork`, and the worker
    processes of its multiprocess executor as forks of the fork server (`_WorkerContext`; see the module docstring)."""
    import vllm.v1.engine.utils as engine_utils
    import vllm.v1.executor.multiproc_executor as multiproc_executor

    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
    multiproc_executor.get_mp_context = lambda: _WorkerContext(_context())


class _WorkerContext:
    """The `multiprocessing` context vLLM's multiprocess executor starts its workers with, in a warm fork: each worker
    is a fork of the fork server (torch and vLLM imported, no OpenMP region run, no thread) instead of a spawned
    interpreter importing them again (~12 CPU-s), and gets what a spawned one would inherit from the process starting
    it: its environment at that moment (the OpenMP variables vLLM sets for each worker included) and its standard
    output and error. Pipes, locks and the start method's other parts are the fork server context's own."""

    def __init__(self, ctx):
        self._ctx = ctx

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def Process(self, *, target, args=(), kwargs=None, **options):  # noqa: N802 - multiprocessing's name
        inherited = (dict(os.environ), _StdStreams(), target, tuple(args), dict(kwargs or {}))
        return self._ctx.Process(target=_run_inherited, args=inherited, **options)


class _StdStreams:
    """This process's standard output and error, handed to a child of the fork server as it starts."""

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return _StdStreamsInChild, (DupFd(1), DupFd(2))


class _StdStreamsInChild:
    def __init__(self, out, err):
        self.fds = (out.detach(), err.detach())


def _run_inherited(env: dict, streams: _StdStreamsInChild, target, args: tuple, kwargs: dict):
    """In a fork server's child: take the starting process's environment and output (`_WorkerContext`), then run."""
    for target_fd, fd in zip((1, 2), streams.fds):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None
    if env.get("OMP_NUM_THREADS"):  # the fork server's OpenMP read its own environment at start
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    return target(*args, **kwargs)


def run_script(
    script: str,
    args: list,
    *,
    env: dict | None = None,
    timeout: float = 600.0,
    cwd: str | None = None,
    fork_engine: bool = False,
    real_exit: bool = False,
    stderr_apart: bool = False,
    module: bool = False,
):
    """`python script args` (`python -m script args` with `module`) in one process forked from the warm interpreter
    (its environment: this process's updated with `env`; in `cwd`, default this process's); a
    `subprocess.CompletedProcess` with the script's exit status and its output in `stdout` (its standard error in
    `stderr` with `stderr_apart`, else in `stdout` too). `fork_engine`:
    the vLLM engine cores the script starts (`separate_process`) are forks of it, as a `run_2cpu` rank's are, instead
    of fresh interpreters; only for a script that runs one OpenMP thread (the environment's `OMP_NUM_THREADS=1`),
    after which a fork is safe. `real_exit`: the process ends through the interpreter's whole finalization, as a fresh
    `python script` does (`_rank_main`), for the tests whose subject is how a process exits."""
    envs = [{**os.environ, **(env or {})}]
    options = dict(fork_engine=fork_engine, real_exit=real_exit, stderr_apart=stderr_apart, module=module)
    return _run_forked(script, args, envs, timeout, cwd, **options)


def run_2cpu(
    script: str,
    args: list[str],
    *,
    env: dict | None = None,
    timeout: float = 420.0,
    nprocs: int = 2,
    launch_env: dict[str, str] | None = None,
    cwd: str | None = None,
):
    """Run `script args` on `nprocs` ranks (gloo on CPU) as `accelerate launch --multi_gpu ... --num_processes 2`
    would (as `accelerate launch --config_file ...` would with `launch_env=config_file_env(...)`); a
    `subprocess.CompletedProcess` whose `stdout` holds every rank's output (rank 0 first) and whose `returncode` is the
    first non-zero rank status (0 when all ended well). A rank that fails ends the others (as torchelastic's agent
    does); past `timeout` seconds every rank writes its threads' stacks to its output (`dump_stacks`), is killed, and
    `subprocess.TimeoutExpired` is raised with that output."""
    base = {**os.environ, **(env or {}), "OMP_NUM_THREADS": (env or {}).get("OMP_NUM_THREADS", "1")}
    if launch_env is None:
        base.setdefault("ACCELERATE_USE_CPU", "true")
        launch_env = accelerate_env(CPU_FLAGS)
    base.update(launch_env)
    port = str(free_port("127.0.0.1"))
    envs = []
    for rank in range(nprocs):
        rank_env = {
            **base,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "ROLE_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "TORCHELASTIC_RUN_ID": "none",
        }
        envs.append(rank_env)
    return _run_forked(script, args, envs, timeout, cwd, fork_engine=True)


def _run_forked(
    script: str,
    args: list,
    envs: list[dict[str, str]],
    timeout: float,
    cwd: str | None = None,
    fork_engine: bool = False,
    real_exit: bool = False,
    stderr_apart: bool = False,
    module: bool = False,
):
    """One forked process per environment of `envs`, each running `script args` in `cwd`; see `run_2cpu` and
    `run_script`."""
    assert not stderr_apart or len(envs) == 1, "stderr_apart: one process"
    ctx = _context()
    cwd = cwd or os.getcwd()
    logs, procs = [], []
    err_log = None
    if stderr_apart:
        fd, err_log = tempfile.mkstemp(prefix="warm_stderr_", suffix=".log")
        os.close(fd)
    for rank, env in enumerate(envs):
        fd, log = tempfile.mkstemp(prefix=f"warm_rank{rank}_", suffix=".log")
        os.close(fd)
        argv = [str(a) for a in args]
        options = dict(cwd=cwd, fork_engine=fork_engine, real_exit=real_exit, err_path=err_log, module=module)
        p = ctx.Process(target=_rank_main, args=(script, argv, env, log), kwargs=options, daemon=False)
        p.start()
        logs.append(log)
        procs.append(p)
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # one rank failed: the others would wait on it
            if time.monotonic() > deadline:
                timed_out = True
                break
            multiprocessing.connection.wait([p.sentinel for p in procs if p.is_alive()], timeout=0.5)
    finally:
        killed = [p.is_alive() for p in procs]
        if timed_out:
            dump_stacks([p.pid for p, alive in zip(procs, killed) if alive])
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)
    codes = [p.exitcode for p in procs]
    # the processes that failed by themselves (not killed here because another one did), by rank
    failed = [rank for rank, code in enumerate(codes) if code not in (0, None) and not killed[rank]]
    parts = []
    for rank, log in enumerate(logs):
        with open(log, errors="replace") as f:
            text = f.read()
        os.unlink(log)
        ended = f"exit {codes[rank]}" + (", killed: another process failed" if killed[rank] and failed else "")
        header = f"==== process {rank} of {len(procs)} ({ended}) ====\n" if len(procs) > 1 else ""
        parts.append((rank in failed, header + text))
    # a failed process's output last, where a caller's `stdout[-N:]` looks
    output = "".join(text for _, text in sorted(parts, key=lambda p: p[0]))
    errors = ""
    if err_log:
        with open(err_log, errors="replace") as f:
            errors = f.read()
        os.unlink(err_log)
    cmd = ["warm_launch", script, *map(str, args)]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=output, stderr=errors)
    failed = codes[failed[0]] if failed else next((c for c in codes if c not in (0, None)), 0)
    return subprocess.CompletedProcess(cmd, failed, stdout=output, stderr=errors)


class ForkedProcess:
    """A forked `multiprocessing` process seen through the part of `subprocess.Popen` that `ServerProcess` uses."""

    def __init__(self, process, args: list[str]):
        self._process = process
        self.pid = process.pid
        self.args = args

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        """As `Popen.send_signal`: nothing once the process has ended (also if it ends just before the signal)."""
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_script(
    script: str,
    args: list,
    *,
    log_path: str,
    env: dict | None = None,
    cwd: str | None = None,
    new_session: bool = False,
    sigint_default: bool = False,
) -> ForkedProcess:
    """`subprocess.Popen([sys.executable, script, *args], stdout=log, stderr=STDOUT, ...)` for the tests that signal or
    kill a running script: one process forked from the warm interpreter, its output (standard error too) written to
    `log_path`, its environment this process's updated with `env`, ending through the interpreter's whole
    finalization (`real_exit`); `new_session` as `start_new_session`, `sigint_default` as a child started with SIGINT
    at its default (see `_rank_main`)."""
    argv = [str(a) for a in args]
    options = dict(cwd=cwd or os.getcwd(), real_exit=True, new_session=new_session, sigint_default=sigint_default)
    env = {**os.environ, **(env or {})}
    p = _context().Process(target=_rank_main, args=(script, argv, env, log_path), kwargs=options, daemon=False)
    p.start()
    return ForkedProcess(p, [sys.executable, script, *argv])


def start_server(model: str, *, api_key: str | None, extra_args=(), env: dict | None = None, port: int | None = None):
    """`launch_server(model, api_key=..., extra_args=..., env=..., wait=False)`, its API process forked from the warm
    interpreter: the same command line (run as `python -m grpo_async.generation.serve`), environment, session and
    log; a `ServerProcess` (call `wait_ready`)."""
    from grpo_async.generation.server_process import server_command

    port = port or free_port("127.0.0.1")
    args, full_env = server_command(model, port=port, api_key=api_key, extra_args=extra_args, env=env)
    return start_server_command(args, full_env, port=port, api_key=api_key)


def start_server_command(args: list[str], env: dict[str, str], *, port: int, api_key: str | None):
    """`python -m MODULE ...` (`args`: `grpo-async serve` as `server_command` makes it or one of a test's own, the
    console script's `python -m grpo_async.cli serve ...`, or a stock `python -m vllm.entrypoints.openai.api_server
    ...`) with exactly the environment `env`, its API process forked from the warm interpreter; a `ServerProcess`
    (call `wait_ready`)."""
    from grpo_async.generation.server_process import ServerProcess, _shm_names, server_log_path

    modules = ("grpo_async.generation.serve", "grpo_async.cli", "vllm.entrypoints.openai.api_server")
    assert args[1] == "-m" and args[2] in modules and (args[2] != "grpo_async.cli" or args[3] == "serve"), args
    log_path = server_log_path(port)
    shm_before = frozenset(_shm_names())
    options = dict(module=True, cwd=os.getcwd(), fork_engine=True)
    p = _context().Process(target=_rank_main, args=(args[2], args[3:], env, log_path), kwargs=options, daemon=False)
    p.start()
    server = ServerProcess(
        url=f"http://127.0.0.1:{port}", proc=ForkedProcess(p, args), log_path=log_path, api_key=api_key, args=args
    )
    server.shm_before = shm_before
    return server


if __name__ == "__main__":  # `python -m support.warm_launch SCRIPT ARGS...`: try it by hand
    ap = argparse.ArgumentParser()
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    proc = run_2cpu(a.script, a.args)
    print(proc.stdout)
    sys.exit(proc.returncode)
