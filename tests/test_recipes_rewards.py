"""The math (GSM8K-style) and tool recipes and the demo's YAML run end to end, offline, on the tiny model; the
YAML/flag parser they share."""

import json
import os
from dataclasses import dataclass

import pytest
from support.warm_launch import run_script

from grpo_async import GRPOConfig
from grpo_async.model_config import ModelConfig
from grpo_async.plotting import METRICS_FILE, read_metrics
from grpo_async.recipe_parser import parse_recipe_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_RUN = [
    "--dtype", "float32", "--generation_backend", "hf", "--use_cpu", "true", "--bf16", "false",
    "--gradient_checkpointing", "false", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
    "--num_generations", "4", "--max_prompt_length", "200", "--max_steps", "2", "--save_strategy", "no",
    "--disable_tqdm", "true",
]  # fmt: skip


def _run(script, *args, timeout=300):
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # the recipe as `python recipes/<script>` would run it, in a fork of the warm interpreter
    # (`support.warm_launch`)
    proc = run_script(os.path.join(ROOT, "recipes", script), list(args), env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return proc


def _jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _steps(output_dir):
    return [r for r in read_metrics(os.path.join(output_dir, METRICS_FILE)) if "reward" in r]


def test_math_recipe_on_a_local_jsonl(tiny_model_path, tmp_path):
    data = _jsonl(
        tmp_path / "gsm.jsonl",
        [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(16)],
    )
    out = str(tmp_path / "out")
    config = os.path.join(ROOT, "recipes", "configs", "gsm8k.yaml")
    _run("gsm8k.py", "--config", config, "--model_name_or_path", tiny_model_path, "--dataset", data,
         "--output_dir", out, "--max_completion_length", "8", *TINY_RUN)  # fmt: skip
    steps = _steps(out)
    assert len(steps) == 2 and "rewards/math_reward/mean" in steps[0] and "rewards/format_reward/mean" in steps[0]
    assert os.path.exists(os.path.join(out, "model.safetensors"))


def test_tool_recipe_on_a_local_jsonl(tiny_model_path, tmp_path):
    data = _jsonl(tmp_path / "arith.jsonl", [{"question": f"{i} * 3", "answer": str(3 * i)} for i in range(16)])
    out = str(tmp_path / "out")
    config = os.path.join(ROOT, "recipes", "configs", "tool.yaml")
    _run("tool.py", "--config", config, "--model_name_or_path", tiny_model_path, "--dataset", data,
         "--output_dir", out, "--max_tokens_per_turn", "6", "--max_completion_length", "24", *TINY_RUN)  # fmt: skip
    steps = _steps(out)
    assert len(steps) == 2 and "rewards/math_reward/mean" in steps[0] and "rewards/tool_reward/mean" in steps[0]


def test_demo_yaml(tmp_path):
    out = str(tmp_path / "demo")
    config = os.path.join(ROOT, "recipes", "configs", "demo.yaml")
    proc = _run("demo.py", "--config", config, "--backend", "hf", "--max_steps", "2", "--output_dir", out)
    assert "RESULT demo_reward_first10=" in proc.stdout
    assert len(_steps(out)) == 2  # max_steps from the command line overrides the YAML's 200


@dataclass
class Script:
    dataset: str = "default"


def test_yaml_defaults_flags_override_and_unknown_keys_are_named(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("dataset: from_yaml\nlearning_rate: 0.5\nnum_generations: 4\ntrust_remote_code: true\n")
    script, args, model = parse_recipe_args(
        (Script, GRPOConfig, ModelConfig),
        ["--config", str(config), "--learning_rate", "0.25", "--output_dir", str(tmp_path), "--use_cpu", "true",
         "--per_device_train_batch_size", "4"],
    )  # fmt: skip
    assert script.dataset == "from_yaml" and args.learning_rate == 0.25 and args.num_generations == 4
    assert args.trust_remote_code and model.trust_remote_code  # a field of two dataclasses goes to both
    config.write_text("learning_rat: 0.5\n")
    with pytest.raises(ValueError, match=r"c.yaml: unknown keys \['learning_rat'\]"):
        parse_recipe_args((Script, GRPOConfig), ["--config", str(config)])
