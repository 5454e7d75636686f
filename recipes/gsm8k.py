"""Math reasoning with GRPO: GSM8K-style question/answer data, rewards from `math-verify` and the answer format.

```bash
accelerate launch recipes/gsm8k.py --config recipes/configs/gsm8k.yaml                       # openai/gsm8k
accelerate launch recipes/gsm8k.py --config recipes/configs/gsm8k.yaml --dataset data.jsonl  # local JSONL/parquet
```

Rows need a question column and an answer column (`--question_column`, `--answer_column`); the answer may be a
GSM8K solution ending in `#### <number>`. Each prompt is a system message asking for `<think>…</think>` then
`<answer>…</answer>`, and the question. Rewards: `math_reward` (1 for a mathematically equal answer) and
`format_reward`, weighted by `reward_weights`.

(Named gsm8k.py, not math.py: a script's folder comes first on `sys.path`, and a `math.py` there would shadow the
standard library's `math` module for every import.)
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: no extra process per rank

import torch

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.loading import check_lengths, load_model_config
from grpo_async.logging_utils import use_concise_console
from grpo_async.model_config import ModelConfig, get_peft_config
from grpo_async.recipe_parser import parse_recipe_args
from grpo_async.rewards import format_reward, math_reward

SYSTEM_PROMPT = (
    "Solve the problem. Reason step by step inside <think> </think>, then write only the final answer inside "
    "<answer> </answer>."
)


@dataclass
class MathArguments:
    dataset: str = field(
        default="openai/gsm8k", metadata={"help": "Hub dataset id, or a local .jsonl/.json/.parquet file."}
    )
    dataset_config: str | None = field(default="main", metadata={"help": "Hub dataset configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    question_column: str = field(default="question", metadata={"help": "Column holding the problem."})
    answer_column: str = field(default="answer", metadata={"help": "Column holding the gold answer."})
    system_prompt: str = field(default=SYSTEM_PROMPT, metadata={"help": "System message of every prompt."})
    max_samples: int | None = field(default=None, metadata={"help": "Use only the first N rows."})


def load_rows(path_or_id: str, config: str | None = None, split: str = "train"):
    """A `datasets.Dataset` from a local JSONL/JSON/parquet file or a Hub dataset."""
    from datasets import load_dataset

    local = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    ext = os.path.splitext(path_or_id)[1].lower()
    if os.path.exists(path_or_id):
        if ext not in local:
            raise ValueError(f"--dataset {path_or_id}: a local file must be .jsonl, .json or .parquet")
        return load_dataset(local[ext], data_files=path_or_id, split="train")
    if ext in local:
        raise FileNotFoundError(f"--dataset {path_or_id}: no such file")
    return load_dataset(path_or_id, config, split=split)


def build_dataset(a: MathArguments):
    ds = load_rows(a.dataset, a.dataset_config, a.dataset_split)
    missing = [c for c in (a.question_column, a.answer_column) if c not in ds.column_names]
    if missing:
        raise ValueError(f"dataset {a.dataset} lacks column(s) {missing}; it has {ds.column_names}")
    if a.max_samples is not None:
        ds = ds.select(range(min(a.max_samples, len(ds))))

    def to_prompt(row):
        return {
            "prompt": [
                {"role": "system", "content": a.system_prompt},
                {"role": "user", "content": str(row[a.question_column])},
            ],
            "answer": str(row[a.answer_column]),
        }

    return ds.map(to_prompt, remove_columns=ds.column_names)


def main(argv=None):
    script, args, model_args = parse_recipe_args(
        (MathArguments, GRPOConfig, ModelConfig),
        argv,
        __doc__,
        aliases={"dataset_name": "dataset", "dataset_train_split": "dataset_split"},  # TRL's script names
        prog="recipes/gsm8k.py",
    )
    if model_args.model_name_or_path is None:
        raise ValueError("--model_name_or_path is required (a Hub id or a local folder)")
    args.model_init_kwargs = {**model_args.model_init_kwargs(), **(args.model_init_kwargs or {})}
    # a prompt + completion budget beyond the model's positions: a clear error now, not vLLM's mid-run
    check_lengths(args, load_model_config(model_args.model_name_or_path, trust_remote_code=args.trust_remote_code))
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[math_reward, format_reward],
        args=args,
        train_dataset=build_dataset(script),
        peft_config=get_peft_config(model_args),
    )
    use_concise_console(trainer)
    trainer.train()
    trainer.save_model(args.output_dir)
    trainer.close()


if __name__ == "__main__":
    try:
        main()
    finally:  # free the trainer (its DDP reducer holds the process group) before destroying the group
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
