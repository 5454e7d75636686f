"""Every shell command the README (and docs/*.md) shows runs as written on a 2-core CPU machine, or the text says next
to it that it needs GPUs. A command added to them without a test here fails `test_every_readme_command_is_covered`.

Training commands run with `--max_steps 2` (and a temporary `--output_dir`) appended: the same flags, fewer steps.
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import requests
from support.warm_launch import CPU_FLAGS, accelerate_env, run_2cpu, run_script, start_server_command

from grpo_async.generation.server_process import wait_ready
from grpo_async.net import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

#: README command → how it is proven (a test of this file, another test, or why it cannot run here)
COVERED = {
    "make demo": "test_make_demo",
    "make test": "CI: .ci/run runs it on a clean clone; its pytest line: test_make_targets_run_what_the_readme_says",
    "make test-fast": "test_make_targets_run_what_the_readme_says (the pytest line and its marker filter)",
    "make lint": "test_make_targets_run_what_the_readme_says (ruff check + ruff format --check)",
    "make bench": "test_make_targets_run_what_the_readme_says (bench/run_all.py)",
    "accelerate launch --multi_gpu --num_processes 2 recipes/demo.py --output_dir out-ddp": "GPU only ('# 2 GPUs')",
    "accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no "
    "recipes/demo.py --output_dir out-ddp": "test_two_cpu_processes_with_the_in_process_vllm_engine",
    "accelerate launch --config_file recipes/accelerate_configs/deepspeed_zero3.yaml --num_processes 8 "
    "recipes/demo.py": "GPU only (README: '--num_processes = number of GPUs')",
    "accelerate launch --config_file recipes/accelerate_configs/deepspeed_zero3_cpu.yaml recipes/demo.py --backend hf "
    "--max_steps 2": "tests/test_launch_configs.py::test_deepspeed_cpu_config_trains_two_steps[3]",
    "python recipes/demo.py --backend hf --use_peft --lora_r 8 --lora_target_modules q_proj v_proj": (
        "tests/test_model_card.py::test_demo_use_peft_saves_the_adapter_and_its_card (same flags)"
    ),
    "accelerate launch --config_file recipes/accelerate_configs/multi_node.yaml --machine_rank 0 --main_process_ip "
    "10.0.0.1 recipes/gsm8k.py --config recipes/configs/gsm8k.yaml --use_vllm --vllm_mode server --vllm_server_urls "
    "http://10.0.0.3:8000 --vllm_api_key SECRET": (
        "2 GPU machines only ('# needs 2 GPU machines'); the same launch on loopback: tests/test_multinode.py, its "
        "flags parsed by tests/test_launch_configs.py::test_multi_node_launch_flags_parse"
    ),
    "grpo-async serve PATH_OR_HUB_ID --port 8000 --api-key SECRET --dtype float32": "test_serve_commands_as_written",
    "grpo-async serve REF_MODEL --port 8001 --api-key SECRET --max-logprobs -1 --frozen": (
        "test_serve_commands_as_written"
    ),
    # docs/trl-vllm-serve.md
    "pip install grpo_async[cpu]": "not run: installs into the server's Python (from a checkout: make install)",
    "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=4 vllm serve MODEL --host 127.0.0.1 --port 8000 "
    '--weight-transfer-config \'{"backend": "grpo_async"}\' --logprobs-mode processed_logprobs --dtype float32 '
    "--enforce-eager": (
        "tests/test_stock_server.py starts the same server (python -m vllm.entrypoints.openai.api_server, the module "
        "behind `vllm serve`) with these flags and VLLM_SERVER_DEV_MODE=1, plus --max-model-len and --max-num-seqs, "
        "and a 1 GiB KV cache"
    ),
    "pip install grpo_async[gpu]": "GPU only ('### GPU'); not run: installs into the server's Python",
    'VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --port 8000 --weight-transfer-config \'{"backend": "grpo_async"}\' '
    "--logprobs-mode processed_logprobs": "GPU only ('### GPU')",
}


def doc_paths() -> list[str]:
    """README.md, then docs/*.md in name order."""
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md")
    )


def readme_commands() -> list[str]:
    """The commands of the ```bash blocks of README.md and docs/*.md: continuation lines joined, comments dropped."""
    text = ""
    for path in doc_paths():
        with open(path, encoding="utf-8") as f:
            text += f.read() + "\n"
    out = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(" ".join(line.split()))
    return out


def readme_python_block(heading: str) -> str:
    """The first ```python block after the README heading `heading`."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_offline_quick_start_runs_as_written(tmp_path):
    """The README's offline quick start, exactly as written, as a script in a fresh folder (forked from the warm
    interpreter, `warm_launch.run_script`: the code is the subject; `make demo` runs a fresh one)."""
    code = readme_python_block("### Quick start, offline")
    (tmp_path / "quick_start.py").write_text(code)
    proc = run_script(str(tmp_path / "quick_start.py"), [], env=_env(), timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert (tmp_path / "tiny-llama" / "config.json").exists()
    logs = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs if "reward" in r] == [10, 20], proc.stdout[-2000:]  # logging_steps=10


@pytest.mark.slow
def test_train_on_your_own_task_runs_as_written_with_fewer_steps(tmp_path, smollm2_path):
    """The README's "Train on your own task" section, as written but for its sizes (2 steps of 1 prompt x 4,
    16-token completions, 4 held-out problems, 64 training problems): it builds SmolLM2 offline, trains, and both
    greedy-accuracy calls print a number."""
    code = readme_python_block("### Train on your own task")
    reductions = (  # in this order: the held-out set's size=64 first, before the training set's becomes 64
        ("max_steps=20", "max_steps=2"),
        ("size=64,", "size=4,"),
        ("size=1000", "size=64"),
        ("max_completion_length=64", "max_completion_length=16"),
        ("per_device_train_batch_size=16", "per_device_train_batch_size=4"),
    )
    for full, reduced in reductions:
        assert full in code, full
        code = code.replace(full, reduced, 1)
    sizes = re.findall(r'create_dataset\("basic_arithmetic", size=(\d+), seed=(\d)', code)
    assert sizes == [("64", "1"), ("4", "2")], sizes  # 64 training problems, 4 held out (64 cost 27 s a call)
    (tmp_path / "own_task.py").write_text(code)
    proc = run_script(str(tmp_path / "own_task.py"), [], env=_env(), timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-6000:]
    found = re.findall(r"greedy accuracy (before|after): (\d\.\d{3})", proc.stdout)
    assert [w for w, _ in found] == ["before", "after"], proc.stdout[-3000:]
    assert all(0.0 <= float(v) <= 1.0 for _, v in found)
    logs = [json.loads(line) for line in (tmp_path / "own_task" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs if "reward" in r] == [1, 2]


def test_every_readme_command_is_covered():
    commands = readme_commands()
    assert len(commands) >= 5
    missing = [c for c in commands if c not in COVERED]
    assert not missing, f"README commands no test runs (add them to COVERED with a test): {missing}"
    for how in COVERED.values():  # every named test of this file exists
        if how.startswith("test_"):
            assert how.split()[0] in globals(), how


def test_make_targets_run_what_the_readme_says():
    """`make -n` (install left out: `-o install`) prints the commands the README's Development section describes."""
    proc = subprocess.run(
        ["make", "-n", "-o", "install", "--no-print-directory", "test", "test-fast", "lint", "bench"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    test, fast, check, fmt, bench = proc.stdout.strip().splitlines()
    assert "-m pytest" in test and ' tests -m "not gpu" ' in test, test
    fast_marks = '-m "not gpu and not slow and not vllm and not multiprocess and not heavy"'
    assert "-m pytest" in fast and fast_marks in fast and "--dist loadgroup --no-loadscope-reorder" in fast, fast
    assert "--dist loadgroup --no-loadscope-reorder" in test, test  # the units tests/suite_plan.py plans
    assert check.endswith("ruff check .") and fmt.endswith("ruff format --check ."), (check, fmt)
    assert bench.endswith("python bench/run_all.py"), bench
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert '`pytest -m "not gpu and not slow and not vllm and not multiprocess and not heavy"`' in f.read()


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], timeout: int, cwd: str = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return proc


@pytest.mark.slow
def test_make_demo(tmp_path):
    """`make demo`, with the demo's own flags shortened (DEMO_ARGS is the Makefile's hook for that)."""
    out = str(tmp_path / "demo")
    proc = _run(["make", "--no-print-directory", "demo", f"DEMO_ARGS=--max_steps 4 --output_dir {out}"], 600)
    assert "RESULT demo_reward_first10=" in proc.stdout
    assert "final model (special tokens shown):" in proc.stdout
    assert os.path.exists(os.path.join(out, "reward_curve.png"))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.multiprocess
def test_two_cpu_processes_with_the_in_process_vllm_engine(tmp_path):
    """The README's CPU command (the demo's default backend: vLLM in the trainer's process). It used to deadlock:
    vLLM's start-up joined the trainer's process group on rank 0 while rank 1 waited in a gather.

    Its ranks are forks of the warm interpreter (`warm_launch.run_2cpu`) with the environment accelerate's own launch
    code makes of the line's flags (`warm_launch.accelerate_env`), running the line's script with the line's arguments:
    what the ranks do is the subject. The launcher itself starts for real in `test_multinode.py` (reading the shipped
    2-machine config) and `test_clean_exit.py::test_two_processes_agree_on_the_horizon` (its agent)."""
    readme = next(c for c in readme_commands() if "--dynamo_backend no" in c and c.startswith("accelerate launch"))
    argv = shlex.split(readme)
    at = next(i for i, a in enumerate(argv) if a.endswith(".py"))  # accelerate launch FLAGS SCRIPT ARGS
    flags, script, args = argv[2:at], argv[at], argv[at + 1 :]
    # `run_2cpu`'s default launch, what the other 2-process tests run, is the README's
    assert flags == CPU_FLAGS, f"the README's CPU launch flags changed: {flags}; update warm_launch.CPU_FLAGS"
    args[args.index("--output_dir") + 1] = str(tmp_path / "out-ddp")
    nprocs = int(flags[flags.index("--num_processes") + 1])
    proc = run_2cpu(
        os.path.join(ROOT, script),
        [*args, "--max_steps", "2"],
        env=_env(),
        nprocs=nprocs,
        launch_env=accelerate_env(flags),
        cwd=ROOT,
        timeout=420,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "distributed_type=MULTI_CPU" in proc.stdout and "2 process(es)" in proc.stdout, proc.stdout[-2000:]
    assert "backend=vllm" in proc.stdout
    assert os.path.exists(tmp_path / "out-ddp" / "model.safetensors"), proc.stdout[-2000:]


def _serve(readme_line: str, model: str, port: int):
    """The README's `grpo-async serve ...` line with only the model and the port substituted, run as the console script
    runs it (`grpo_async.cli.main` with the line's arguments: `python -m grpo_async.cli serve ...`), its API process
    forked from the warm interpreter (`warm_launch.start_server_command`) with this test's environment. What a fresh
    process adds (the script's start, vLLM's spawned engine) is `test_cli`'s subject: its servers start as real
    processes, and `test_console_script_runs_the_cli` runs the installed script."""
    argv = shlex.split(readme_line)
    assert argv[:2] == ["grpo-async", "serve"], argv
    argv[2] = model
    argv[argv.index("--port") + 1] = str(port)
    args = [sys.executable, "-m", "grpo_async.cli", *argv[1:]]
    return start_server_command(args, _env(), port=port, api_key=argv[argv.index("--api-key") + 1])


def test_console_script_runs_the_cli():
    """The installed `grpo-async` script is `grpo_async.cli:main` (what the README's `grpo-async serve` lines run)."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="grpo-async")
    assert script.value == "grpo_async.cli:main", script
    proc = _run([os.path.join(BIN, "grpo-async"), "--help"], 120)
    assert proc.stdout.startswith("usage: grpo-async ") and "\n    serve " in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.vllm
def test_serve_commands_as_written(tiny_model_path):
    """Both `grpo-async serve` commands of the README, as written (only the model and a free port substituted): the
    policy server answers a completion; the frozen reference server answers logprobs and refuses weight updates."""
    # the distinct ones (docs/trl_compatibility.md repeats the policy server's line as written)
    policy_line, ref_line = dict.fromkeys(c for c in readme_commands() if c.startswith("grpo-async serve"))
    servers = []
    try:
        for line in (policy_line, ref_line):  # one after the other: the second start compiles from the first's cache
            servers.append(wait_ready(_serve(line, tiny_model_path, free_port()), timeout=300))
        urls = [server.url for server in servers]
        auth = {"Authorization": "Bearer SECRET"}
        r = requests.post(
            urls[0] + "/v1/completions",
            json={"model": tiny_model_path, "prompt": [7, 8, 9], "max_tokens": 4},
            headers=auth,
            timeout=60,
        )
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
        assert requests.get(urls[0] + "/health", timeout=5).status_code == 401  # the key is required
        body = {"sequences": [{"prompt_ids": [7, 8, 9], "completion_ids": [10, 11]}]}
        r = requests.post(urls[1] + "/ws/logprobs", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        (logprobs,) = r.json()["logprobs"]  # one per completion token, each a log-probability
        assert len(logprobs) == 2 and all(-100 < lp < 0 for lp in logprobs), logprobs
        r = requests.post(urls[1] + "/ws/update", json={"version": 1}, headers=auth, timeout=30)
        assert r.status_code == 403, r.text  # --frozen
    finally:
        for server in servers:
            server.stop()
    for server in servers:  # vLLM's AOT compile cache does not load on CPU: `grpo-async serve` turns it off there
        with open(server.log_path, errors="replace") as f:
            log = f.read()
        assert "grpo-async serve: VLLM_USE_AOT_COMPILE=0" in log and "due to a load failure" not in log, log[-3000:]
