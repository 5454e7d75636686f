"""`grpo-async grpo`: TRL's `trl grpo` (`trl/scripts/grpo.py`) on this trainer.

```bash
grpo-async grpo --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/DeepMath-103K \\
    --reward_funcs math_reward format_reward --output_dir outputs/grpo --learning_rate 1e-6
grpo-async grpo --config my_run.yaml --max_steps 10       # YAML keys: any flag below; flags override the file
accelerate launch -m grpo_async.cli grpo --config my_run.yaml   # several processes
```

Every `GRPOConfig` and `ModelConfig` field is a flag, plus the script's (`GRPOScriptArguments`, TRL's names):
`--dataset_name` (a Hub dataset, or a local folder / `.json` / `.jsonl` / `.parquet` / `.csv` file, or a folder
written by `Dataset.save_to_disk`), `--dataset_config`, `--dataset_train_split`, `--dataset_test_split` (used when
`--eval_strategy` is not `no`), `--dataset_streaming`, `--reward_model_name_or_path` and `--reward_funcs`: names of the
built-in rewards (`math_reward`, `format_reward`) or dotted import paths (`my_lib.rewards.custom_reward`, resolved
with the working directory on `sys.path`; TRL's own are `trl.rewards.accuracy_reward` and so on). Rows need a
`prompt` column (text or chat messages) plus the columns the rewards read (`math_reward`: `answer`).

What TRL's script has and this one lacks: `--datasets` mixtures (`DatasetMixtureConfig`) and quantized loading
(`--load_in_4bit`/`--load_in_8bit`); both are unknown flags here.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field

from ..config import GRPOConfig
from ..model_config import ModelConfig
from ..recipe_parser import parse_recipe_args

PROG = "grpo-async grpo"


@dataclass
class GRPOScriptArguments:
    """The script's own arguments: TRL's `ScriptArguments` plus `GRPOScriptArguments`' reward fields."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset name, or a local dataset: a folder of data files, a .json/.jsonl/.parquet/.csv file, "
            "or a folder written by Dataset.save_to_disk."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset configuration name (`name` of datasets.load_dataset)."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    dataset_test_split: str = field(
        default="test", metadata={"help": "Dataset split to evaluate on (when --eval_strategy is not 'no')."}
    )
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset (Hub datasets)."})
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A sequence-classification reward model: Hub id or local folder (scored as in TRL)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: built-in names (math_reward, format_reward) or dotted import paths "
            "(e.g. my_lib.rewards.custom_reward, trl.rewards.accuracy_reward)."
        },
    )


def builtin_rewards() -> dict:
    """The reward functions `--reward_funcs` accepts by name."""
    from ..rewards import format_reward, math_reward

    return {"math_reward": math_reward, "format_reward": format_reward}


def resolve_reward_funcs(names: list[str] | None, reward_model: str | None = None) -> list:
    """`--reward_model_name_or_path` (kept as a name: the trainer loads it) then each of `--reward_funcs`: a built-in
    name or a dotted import path `module.attribute` (the working directory is on `sys.path`, as in TRL).

    Raises:
        `ValueError`: a name that is neither, or a dotted path whose module or attribute cannot be imported.
    """
    registry = builtin_rewards()
    funcs = [reward_model] if reward_model else []
    for name in names or []:
        if name in registry:
            funcs.append(registry[name])
            continue
        if "." not in name:
            raise ValueError(
                f"--reward_funcs {name!r}: not a built-in reward {sorted(registry)} and not a dotted import path "
                "(module.function); TRL's rewards are e.g. trl.rewards.accuracy_reward"
            )
        module_path, attr = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            func = getattr(importlib.import_module(module_path), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--reward_funcs {name!r}: cannot import it ({type(e).__name__}: {e})") from e
        if not callable(func):
            raise ValueError(f"--reward_funcs {name!r}: {type(func).__name__} is not callable")
        funcs.append(func)
    return funcs


#: file extension -> the `datasets` builder that reads it
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_named_dataset(name: str, config: str | None = None, streaming: bool = False):
    """`datasets.load_dataset(name, name=config, streaming=streaming)` as TRL's script calls it, plus local data:
    a folder written by `save_to_disk` (`load_from_disk`; a single `Dataset` becomes the `train` split), a data file
    (by extension: its rows are the `train` split) or a folder of data files. Returns a `DatasetDict`-like mapping.

    Raises:
        `FileNotFoundError`: a name that looks like a local file (has a data file extension) but does not exist.
    """
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    ext = os.path.splitext(name)[1].lower()
    if os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json")):
        ds = load_from_disk(name)
        return DatasetDict({"train": ds}) if isinstance(ds, Dataset) else ds
    if os.path.isfile(name) and ext in DATA_FILE_BUILDERS:
        return load_dataset(DATA_FILE_BUILDERS[ext], data_files=name, streaming=streaming)
    if ext in DATA_FILE_BUILDERS and not os.path.exists(name):
        raise FileNotFoundError(f"--dataset_name {name}: no such file")
    return load_dataset(name, name=config, streaming=streaming)


def _split(dataset, split: str, flag: str, name: str):
    if split not in dataset:
        raise ValueError(f"{flag} {split!r}: dataset {name} has no such split; it has {sorted(dataset)}")
    return dataset[split]


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (without the program name), train, save to `--output_dir`; returns the exit status 0.

    Raises:
        `ValueError`: no `--dataset_name`, no reward, a missing split or an unknown reward name (named).
    """
    from ..model_config import get_peft_config
    from ..trainer import GRPOTrainer

    script, args, model_args = parse_recipe_args(
        (GRPOScriptArguments, GRPOConfig, ModelConfig), argv, __doc__, prog=PROG
    )
    if model_args.model_name_or_path is None:
        raise ValueError("--model_name_or_path is required (a Hub id or a local folder)")
    if script.dataset_name is None:
        raise ValueError(
            "--dataset_name is required (a Hub dataset or a local folder/file); --datasets is not supported"
        )
    reward_funcs = resolve_reward_funcs(script.reward_funcs, script.reward_model_name_or_path)
    args.model_init_kwargs = {**model_args.model_init_kwargs(), **(args.model_init_kwargs or {})}
    dataset = load_named_dataset(script.dataset_name, script.dataset_config, script.dataset_streaming)
    train = _split(dataset, script.dataset_train_split, "--dataset_train_split", script.dataset_name)
    test_split = script.dataset_test_split
    evaluate = args.eval_strategy != "no"
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs or None,
        args=args,
        train_dataset=train,
        eval_dataset=(_split(dataset, test_split, "--dataset_test_split", script.dataset_name) if evaluate else None),
        peft_config=get_peft_config(model_args),
    )
    try:
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        trainer.accelerator.print("Training completed.")
        trainer.save_model(args.output_dir)
        trainer.accelerator.print(f"Model saved to {args.output_dir}.")
        if args.push_to_hub:
            trainer.push_to_hub(dataset_name=script.dataset_name)
            trainer.accelerator.print(f"Model pushed to the Hub: https://huggingface.co/{trainer.hub_model_id}.")
    finally:
        trainer.end()  # the pipeline and engine, then the trackers and the process group (as TRL's script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
