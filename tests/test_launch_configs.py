"""recipes/accelerate_configs: every config loads and names its launch command; the CPU variants run
`recipes/demo.py` on 2 processes (gloo) for 2 steps: DDP, DeepSpeed ZeRO-2 and ZeRO-3 (ZeRO-3's is the README's
command), their ranks forks of a warm interpreter given the environment accelerate's launch code makes of their config
file (`warm_launch.config_file_env`).

FSDP2 has no CPU variant: accelerate enables FSDP only on accelerator process groups (MULTI_GPU, ...); with
`use_cpu` its state is MULTI_CPU and the FSDP plugin is ignored, so a "CPU FSDP" run would silently be DDP. FSDP2's
weight collection is tested with torch's `fully_shard` directly (tests/test_collect.py)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "recipes", "accelerate_configs")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

GPU_CONFIGS = {
    "single_device": ("NO", 1),
    "multi_gpu": ("MULTI_GPU", 8),
    "deepspeed_zero2": ("DEEPSPEED", 8),
    "deepspeed_zero3": ("DEEPSPEED", 8),
    "fsdp2": ("FSDP", 8),
    "multi_node": ("MULTI_GPU", 16),
}
CPU_CONFIGS = {
    "multi_cpu": "MULTI_GPU",
    "deepspeed_zero2_cpu": "DEEPSPEED",
    "deepspeed_zero3_cpu": "DEEPSPEED",
    "multi_node_cpu": "MULTI_GPU",
}


def _load(name):
    path = os.path.join(CONFIGS, f"{name}.yaml")
    with open(path) as f:
        header = [line for line in f.read().splitlines() if line.startswith("#")]
    return load_config_from_file(path), header


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_load_and_name_their_launch_command(name):
    cfg, header = _load(name)
    distributed_type, processes = GPU_CONFIGS[name]
    assert cfg.distributed_type.value == distributed_type and cfg.num_processes == processes
    assert cfg.mixed_precision == "bf16" and not cfg.use_cpu
    assert any(f"accelerate launch --config_file recipes/accelerate_configs/{name}.yaml" in h for h in header), header
    if name.startswith("deepspeed"):
        assert cfg.deepspeed_config["zero_stage"] == int(name[-1])
    if name == "deepspeed_zero3":
        assert cfg.deepspeed_config["zero3_save_16bit_model"]  # save_model writes whole weights
    if name == "fsdp2":
        assert cfg.fsdp_config["fsdp_version"] == 2 and cfg.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"


@pytest.mark.parametrize("name", sorted(CPU_CONFIGS))
def test_cpu_configs_mirror_their_gpu_config(name):
    cfg, header = _load(name)
    assert cfg.use_cpu and cfg.num_processes == 2 and cfg.mixed_precision == "no"
    assert cfg.distributed_type.value == CPU_CONFIGS[name]
    assert any(f"--config_file recipes/accelerate_configs/{name}.yaml" in h for h in header), header
    gpu_name = {"multi_cpu": "multi_gpu"}.get(name, name.removesuffix("_cpu"))
    gpu, _ = _load(gpu_name)
    assert cfg.distributed_type == gpu.distributed_type
    assert cfg.num_machines == gpu.num_machines
    assert (cfg.deepspeed_config or {}).get("zero_stage") == (gpu.deepspeed_config or {}).get("zero_stage")


DEMO_ARGS = ["--backend", "hf", "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4"]
DEMO_ARGS += ["--max_completion_length", "8"]


STALE_LOCK_S = 600  # the op compiles in ~50-70 s; a lock this old was left by a build that was killed


def clear_stale_build_locks(extensions_dir: str) -> list[str]:
    """Removes the `lock` files of torch extension builds under `extensions_dir` older than `STALE_LOCK_S`: torch's
    `FileBaton` waits forever on a lock whose builder was killed, so a DeepSpeed rank would hang until the test's
    timeout. Returns (and prints) what it removed."""
    import glob
    import time

    removed = []
    for lock in glob.glob(os.path.join(extensions_dir, "**", "lock"), recursive=True):
        if time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
            os.remove(lock)
            removed.append(lock)
            print(f"removed a stale torch extension build lock (its build was killed): {lock}")
    return removed


def test_a_stale_build_lock_is_cleared_and_a_live_one_kept(tmp_path):
    live, stale = tmp_path / "op_a" / "lock", tmp_path / "py311_cpu" / "op_b" / "lock"  # both layouts torch uses
    for lock in (live, stale):
        lock.parent.mkdir(parents=True)
        lock.touch()
    os.utime(stale, (0, 0))
    assert clear_stale_build_locks(str(tmp_path)) == [str(stale)]
    assert live.exists() and not stale.exists()


def run_demo_forked(config: str, out: str) -> str:
    """`accelerate launch --config_file <config> recipes/demo.py` for 2 steps on the HF backend, its 2 ranks forked
    from the warm interpreter (`warm_launch.run_2cpu`), each given the environment `accelerate launch --config_file
    <config>` gives its ranks, computed by accelerate's own code (`warm_launch.config_file_env`): what the config makes
    of a run, without the launcher's start-up; returns the ranks' output. The launcher itself reads a config file in
    `tests/test_multinode.py` (the shipped 2-machine config) and runs its agent in
    `tests/test_clean_exit.py::test_two_processes_agree_on_the_horizon`."""
    from support.warm_launch import config_file_env, run_2cpu

    if config.startswith("deepspeed"):
        clear_stale_build_locks(os.environ["TORCH_EXTENSIONS_DIR"])
    launch_env = config_file_env(os.path.join(CONFIGS, f"{config}.yaml"))
    env = {"TOKENIZERS_PARALLELISM": "false"}
    script = os.path.join(ROOT, "recipes", "demo.py")
    proc = run_2cpu(script, ["--output_dir", out, *DEMO_ARGS], env=env, launch_env=launch_env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def check_run(out: str, stdout: str, distributed_type: str) -> None:
    assert f"2 process(es), distributed_type={distributed_type}" in stdout, stdout[-2000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # round 0 was generated from the initial weights, which the trainer also holds at step 1: the sampler's
    # logprobs equal the trainer's, so the generation engine really received the (possibly sharded) weights whole
    assert steps[0]["sampling/logp_diff/max"] < 1e-3, steps[0]
    # save_model gathered whole weights (ZeRO-3 shards included) and wrote the card
    from safetensors.torch import load_file

    saved = load_file(os.path.join(out, "model.safetensors"))
    initial = load_file(os.path.join(out, "tiny-model", "model.safetensors"))
    assert set(initial) <= set(saved) | {"lm_head.weight"}
    assert all(saved[k].shape == initial[k].shape for k in saved)
    assert any(not saved[k].equal(initial[k]) for k in saved)  # trained
    assert "GRPO" in open(os.path.join(out, "README.md")).read()


def test_config_file_env_is_what_the_launcher_gives_the_ranks():
    """`config_file_env` reads a config as `accelerate launch` does: the CPU DDP config gives the ranks what the
    README's `--multi_gpu ... --mixed_precision no --dynamo_backend no` flags give them; ZeRO-2's and ZeRO-3's,
    DeepSpeed at their stage."""
    from support.warm_launch import CPU_FLAGS, accelerate_env, config_file_env

    assert config_file_env(os.path.join(CONFIGS, "multi_cpu.yaml")) == accelerate_env(CPU_FLAGS)
    for stage in (2, 3):
        env = config_file_env(os.path.join(CONFIGS, f"deepspeed_zero{stage}_cpu.yaml"))
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage), env


@pytest.mark.multiprocess
def test_ddp_cpu_config_trains_two_steps(tmp_path):
    out = str(tmp_path / "out")
    check_run(out, run_demo_forked("multi_cpu", out), "MULTI_CPU")  # MULTI_GPU + use_cpu runs as DDP over gloo


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install deepspeed)")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_cpu_config_trains_two_steps(tmp_path, stage):
    out = str(tmp_path / "out")
    check_run(out, run_demo_forked(f"deepspeed_zero{stage}_cpu", out), "DEEPSPEED")


def _multi_node_flags() -> dict[str, list[str]]:
    """The script flags (after `recipes/gsm8k.py`) of the README's multi-node launch and of the SLURM script's."""
    import re
    import shlex

    from test_readme_commands import readme_commands

    (readme,) = [c for c in readme_commands() if "multi_node.yaml" in c]
    with open(os.path.join(ROOT, "recipes", "slurm", "multi_node.sbatch")) as f:
        sbatch = f.read().replace("\\\n", " ")
    (launch,) = re.findall(r'accelerate launch [^"]*', sbatch)
    values = {"$MODEL": "Qwen/Qwen2.5-1.5B-Instruct", "$GEN_IP": "10.0.0.3", "$PORT": "8000", "$API_KEY": "KEY"}
    for var, value in values.items():
        launch = launch.replace(var, value)
    out = {}
    for name, command in (("readme", readme), ("sbatch", launch)):
        words = shlex.split(command)
        assert "recipes/accelerate_configs/multi_node.yaml" in words and "--machine_rank" in words, command
        out[name] = words[words.index("recipes/gsm8k.py") + 1 :]
    return out


def test_multi_node_launch_flags_parse():
    """The multi-node launches of the README and of recipes/slurm/multi_node.sbatch give gsm8k.py a config that
    generates on the remote server and syncs weights over the broadcast transport."""
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    try:
        from gsm8k import MathArguments
    finally:
        sys.path.remove(os.path.join(ROOT, "recipes"))
    from grpo_async import GRPOConfig
    from grpo_async.model_config import ModelConfig
    from grpo_async.recipe_parser import parse_recipe_args
    from grpo_async.weight_sync.names import server_transport

    for name, argv in _multi_node_flags().items():
        argv = [a.replace("recipes/", os.path.join(ROOT, "recipes") + "/") for a in argv]
        _, args, model_args = parse_recipe_args((MathArguments, GRPOConfig, ModelConfig), argv)
        assert args.generation_backend == "vllm_server", name
        assert args.server_urls == ["http://10.0.0.3:8000"], (name, args.server_urls)
        assert server_transport(args.weight_sync_transport, args.server_urls, cuda=False) == "broadcast", name
        assert args.vllm_master_address is None  # found per server on the trainer (address_seen_by)
        assert model_args.model_name_or_path


def test_sbatch_script_is_valid_bash_and_uses_the_shipped_config():
    path = os.path.join(ROOT, "recipes", "slurm", "multi_node.sbatch")
    subprocess.run(["bash", "-n", path], check=True)
    text = open(path).read()
    assert "#SBATCH --nodes=3" in text and "--machine_rank \\$SLURM_PROCID" in text
    assert "--config_file recipes/accelerate_configs/multi_node.yaml" in text
