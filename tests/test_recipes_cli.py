"""Recipes take every `GRPOConfig`/`ModelConfig` flag and `--config` YAML (TRL's `TrlParser` convention), the demo
included; `grpo-async grpo` trains from the command line as TRL's `trl grpo` does (grpo_async/scripts/grpo.py)."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from grpo_async import GRPOConfig
from grpo_async.model_config import ModelConfig
from grpo_async.plotting import METRICS_FILE, read_metrics
from grpo_async.scripts.grpo import load_named_dataset, resolve_reward_funcs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(ROOT, "recipes")


def _recipe(name):
    """The recipe module `recipes/<name>.py`, imported as a module (its `main(argv)` runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(RECIPES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _steps(output_dir):
    return [r for r in read_metrics(os.path.join(output_dir, METRICS_FILE)) if "reward" in r]


def _cli(*args, cwd=ROOT, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "grpo_async.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def _cli_forked(*args, cwd):
    """`_cli`'s `python -m grpo_async.cli ARGS` in `cwd`, forked from the warm interpreter (`warm_launch.run_script`,
    with `python -m`'s path: the working directory first): the command's work is the subject, not an interpreter's
    start (`tests/test_cli.py` runs the console script fresh)."""
    from support.warm_launch import run_script

    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return run_script("grpo_async.cli", list(args), env=env, timeout=300, cwd=str(cwd), module=True, stderr_apart=True)


# ---- the demo ------------------------------------------------------------------------------------------------------
def test_demo_defaults_are_what_make_demo_trained_with():
    """No flags: the values the demo passed to GRPOConfig by hand before it took every field (hand-copied)."""
    demo = _recipe("demo")
    script, args, model_args = demo.parse_args([])
    assert (args.learning_rate, args.max_steps, args.per_device_train_batch_size, args.num_generations) == (
        5e-4,
        200,
        32,
        8,
    )
    assert (args.max_prompt_length, args.max_completion_length, args.temperature, args.beta) == (32, 16, 1.0, 0.0)
    assert (args.loss_type, args.lr_scheduler_type.value, args.save_strategy.value) == ("dapo", "constant", "no")
    assert (args.seed, args.logging_steps, args.report_to, args.num_batches_ahead) == (0, 1, [], 1)
    assert args.output_dir == "demo_output" and script.dataset_size == 4096 and model_args.model_name_or_path is None
    # the demo's YAML gives the same values (its `backend` key is the demo's other name of generation_backend)
    _, from_yaml, _ = demo.parse_args(["--config", os.path.join(RECIPES, "configs", "demo.yaml"), "--backend", "hf"])
    assert from_yaml.generation_backend == "hf" and from_yaml.learning_rate == 5e-4 and from_yaml.max_steps == 200


def test_demo_takes_any_grpo_config_flag_and_the_seed_reaches_the_trainer(tmp_path):
    demo = _recipe("demo")
    out = str(tmp_path / "demo")
    trainer = demo.main(
        ["--seed", "3", "--max_steps", "2", "--logging_steps", "2", "--backend", "hf", "--output_dir", out,
         "--per_device_train_batch_size", "8", "--num_generations", "4", "--dataset_size", "64",
         "--sampled_completions", "1", "--disable_tqdm", "true"]
    )  # fmt: skip
    assert trainer.args.seed == 3 and trainer.state.global_step == 2
    assert trainer.args.learning_rate == 5e-4 and trainer.args.loss_type == "dapo"  # the demo's defaults still apply
    # the letter task is drawn with the seed: seed 3's prompts, not seed 0's
    from grpo_async.demo_task import make_dataset

    assert trainer.train_dataset["prompt"] == make_dataset(64, seed=3)["prompt"] != make_dataset(64, seed=0)["prompt"]
    assert len(_steps(out)) == 1  # --logging_steps 2 over 2 steps: one logged step (the demo's default logs each)
    assert os.path.exists(os.path.join(out, "model.safetensors"))


def test_unknown_or_shortened_flag_is_an_error_naming_it(capsys):
    demo = _recipe("demo")
    for flag in ("--sed", "--learning_rat"):  # a typo, and a prefix argparse would otherwise take for learning_rate
        with pytest.raises(SystemExit) as e:
            demo.parse_args([flag, "3"])
        assert e.value.code == 2
        assert f"unrecognized arguments: {flag} 3" in capsys.readouterr().err


def test_unknown_yaml_key_is_an_error_naming_it_and_env_sets_variables(tmp_path, monkeypatch):
    demo = _recipe("demo")
    config = tmp_path / "demo.yaml"
    config.write_text("seeed: 3\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"demo.yaml: unknown keys \['seeed'\]"):
        demo.parse_args(["--config", str(config)])
    monkeypatch.delenv("GRPO_ASYNC_TEST_VAR", raising=False)
    config.write_text("seed: 3\nlogging_steps: 5\nbackend: hf\nenv:\n  GRPO_ASYNC_TEST_VAR: from_yaml\n")
    _, args, _ = demo.parse_args(["--config", str(config), "--logging_steps", "7"])
    assert (args.seed, args.logging_steps, args.generation_backend) == (3, 7, "hf")  # the flag overrides the file
    assert os.environ["GRPO_ASYNC_TEST_VAR"] == "from_yaml"
    with pytest.raises(ValueError, match="both --backend and --generation_backend given"):
        demo.parse_args(["--backend", "hf", "--generation_backend", "vllm"])


def test_real_math_takes_grpo_config_flags():
    real = _recipe("real_math")
    script, args, _ = real.parse_args(["--seed", "5", "--beta", "0.04", "--eval_problems", "16"])
    assert (args.seed, args.beta, script.eval_problems) == (5, 0.04, 16)
    assert (args.learning_rate, args.max_steps, args.vllm_max_model_length, args.temperature) == (1e-5, 20, 256, 0.7)


def test_real_math_rewards_pay_the_box_only_with_the_right_sum():
    """`boxed_format`'s 0.2 comes with a right answer only: paid for any one `\\boxed{N}`, it was learned at seed 0
    instead of the sum ("a + b = \\boxed{a}": held-out accuracy 0.164 after 16 steps, 0.547 without it;
    bench/NOTES.md)."""
    real = _recipe("real_math")
    texts = [
        "27 + 82 = \\boxed{109}",
        "\\boxed{110}",
        "\\boxed{}",
        "27 + 82 = 109",
        "\\boxed{109} or \\boxed{109}",
        "",
    ]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    kw = dict(prompts=[None] * len(texts), completions=completions, completion_ids=[[]] * len(texts))
    assert real.sum_reward(answer=["109"] * len(texts), **kw) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert real.boxed_format(answer=["109"] * len(texts), **kw) == [0.2, 0.0, 0.0, 0.0, 0.0, 0.0]


# ---- grpo-async grpo ------------------------------------------------------------------------------------------------
def _cli_in_process(capsys, *args) -> tuple[int, str, str]:
    """`grpo-async ARGS` through `grpo_async.cli.main(argv)` in this process (what `python -m grpo_async.cli` runs,
    without a second interpreter's imports): exit code, stdout, stderr."""
    from grpo_async.cli import main

    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_grpo_help_lists_every_grpo_config_and_model_config_field(capsys):
    code, stdout, stderr = _cli_in_process(capsys, "grpo", "--help")
    assert code == 0, stderr
    assert stdout.startswith("usage: grpo-async grpo ")
    names = [f.name for t in (GRPOConfig, ModelConfig) for f in dataclasses.fields(t) if f.init]
    missing = [n for n in names if f"--{n} " not in stdout and f"--{n}\n" not in stdout]
    assert not missing, missing
    for flag in ("--dataset_name", "--dataset_config", "--dataset_train_split", "--reward_funcs", "--config"):
        assert flag in stdout


def test_top_level_help_lists_grpo():
    proc = _cli("--help", timeout=120)
    assert proc.returncode == 0 and "\n    grpo " in proc.stdout


def test_grpo_trains_two_steps_on_a_local_dataset(tiny_model_path, tmp_path):
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(16)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, completion_ids, **kwargs):\n"
        "    return [1.0 / (1 + len(c)) for c in completion_ids]\n"
    )  # a dotted-path reward found through the working directory, as TRL finds it
    (tmp_path / "run.yaml").write_text(
        "reward_funcs: [math_reward, my_rewards.short]\nlearning_rate: 1.0e-5\nnum_generations: 4\nseed: 3\n"
    )
    out = tmp_path / "out"
    proc = _cli_forked(
        "grpo", "--config", "run.yaml", "--model_name_or_path", tiny_model_path, "--dataset_name", "data.jsonl",
        "--output_dir", str(out), "--generation_backend", "hf", "--use_cpu", "true", "--per_device_train_batch_size",
        "8", "--max_prompt_length", "64", "--max_completion_length", "8", "--max_steps", "2", "--save_strategy",
        "no", "--report_to", "none", "--disable_tqdm", "true", "--logging_steps", "1",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = _steps(out)
    assert len(steps) == 2
    assert "rewards/math_reward/mean" in steps[0] and "rewards/short/mean" in steps[0]
    assert os.path.exists(out / "model.safetensors") and os.path.exists(out / "config.json")
    assert "Model saved to" in proc.stdout


def test_grpo_unknown_flag_exits_2_naming_it(capsys):
    code, _, stderr = _cli_in_process(capsys, "grpo", "--dataset_nme", "x")
    assert code == 2 and "unrecognized arguments: --dataset_nme x" in stderr


# ---- grpo-async grpo's pieces ---------------------------------------------------------------------------------------
def test_reward_names_builtin_dotted_and_unknown():
    from grpo_async.rewards import format_reward, math_reward

    assert resolve_reward_funcs(["math_reward", "format_reward"], "some/reward-model") == [
        "some/reward-model",
        math_reward,
        format_reward,
    ]
    assert resolve_reward_funcs(["grpo_async.rewards.math_reward"]) == [math_reward]
    with pytest.raises(ValueError, match="'accuracy_reward': not a built-in reward"):
        resolve_reward_funcs(["accuracy_reward"])
    with pytest.raises(ValueError, match="'no_such_module.f': cannot import it"):
        resolve_reward_funcs(["no_such_module.f"])


def test_local_datasets_load_by_path(tmp_path):
    from datasets import Dataset, DatasetDict

    rows = {"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}
    Dataset.from_dict(rows).to_parquet(str(tmp_path / "d.parquet"))
    assert load_named_dataset(str(tmp_path / "d.parquet"))["train"]["prompt"] == ["a", "b", "c"]
    Dataset.from_dict(rows).save_to_disk(str(tmp_path / "saved"))  # one Dataset: the train split
    assert load_named_dataset(str(tmp_path / "saved"))["train"]["answer"] == ["1", "2", "3"]
    DatasetDict({"train": Dataset.from_dict(rows), "test": Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dd"))
    assert sorted(load_named_dataset(str(tmp_path / "dd"))) == ["test", "train"]
    with pytest.raises(FileNotFoundError, match="missing.jsonl: no such file"):
        load_named_dataset(str(tmp_path / "missing.jsonl"))
