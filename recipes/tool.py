"""Multi-turn tool use with GRPO: the model may call a calculator before answering generated arithmetic problems.

```bash
accelerate launch recipes/tool.py --config recipes/configs/tool.yaml
accelerate launch recipes/tool.py --config recipes/configs/tool.yaml --dataset problems.jsonl  # question/answer rows
```

Each rollout alternates assistant turns and tool results (`grpo_async.envs.ToolEnv`): the assistant writes
`<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>`, the environment answers with a
`tool` message, until a turn without a tool call or `max_turns`. Tool-result tokens are in the sequence but not
trained on (`mask_env_responses`). Rewards: `math_reward` on the final answer, and `tool_reward` (a call that ran
without an error).
"""

from __future__ import annotations

import gc
import os
import random
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: no extra process per rank

import torch

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.envs import ToolEnv, calculator
from grpo_async.loading import check_lengths, load_model_config
from grpo_async.logging_utils import use_concise_console
from grpo_async.model_config import ModelConfig, get_peft_config
from grpo_async.recipe_parser import parse_recipe_args
from grpo_async.rewards import math_reward


@dataclass
class ToolArguments:
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Local .jsonl/.json/.parquet or Hub dataset with question/answer columns. Default: generated."
        },
    )
    num_problems: int = field(default=2000, metadata={"help": "Generated problems (when --dataset is not given)."})
    max_operand: int = field(default=999, metadata={"help": "Largest operand of a generated problem."})
    max_turns: int = field(default=4, metadata={"help": "Most assistant turns of a rollout (tool calls + 1)."})
    max_tokens_per_turn: int | None = field(default=None, metadata={"help": "Most tokens of one assistant turn."})
    tool_timeout: float = field(default=5.0, metadata={"help": "Seconds a tool call may run."})
    question_column: str = field(default="question", metadata={"help": "Column holding the problem."})
    answer_column: str = field(default="answer", metadata={"help": "Column holding the gold answer."})


def make_problems(n: int, max_operand: int, seed: int) -> list[dict]:
    """`a op b op c` problems with their exact answers (integers; divisions are exact)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = (rng.randint(2, max_operand) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        expression = f"{a} {op1} {b} {op2} {c}"
        rows.append({"question": f"What is {expression}?", "answer": calculator(expression)})
    return rows


def tool_reward(prompts, completions, completion_ids, env_state, **kwargs) -> list[float]:
    """0.2 when the rollout called a tool and every call got a result back (not an error), else 0. `env_state` is
    each rollout's final `ToolEnv` state, which the trainer passes to reward functions of multi-turn runs."""
    return [0.2 if s["tool_calls"] and not s["tool_errors"] else 0.0 for s in env_state]


def build_dataset(a: ToolArguments, env: ToolEnv, seed: int):
    from datasets import Dataset

    if a.dataset is None:
        ds = Dataset.from_list(make_problems(a.num_problems, a.max_operand, seed))
        question, answer = "question", "answer"
    else:
        from gsm8k import load_rows  # the math recipe's loader (this folder is on sys.path)

        ds, question, answer = load_rows(a.dataset), a.question_column, a.answer_column
    system = env.system_prompt() + "\nGive the final answer inside <answer> </answer>."

    def to_prompt(row):
        return {
            "prompt": [{"role": "system", "content": system}, {"role": "user", "content": str(row[question])}],
            "answer": str(row[answer]),
        }

    return ds.map(to_prompt, remove_columns=ds.column_names)


def main(argv=None):
    script, args, model_args = parse_recipe_args(
        (ToolArguments, GRPOConfig, ModelConfig),
        argv,
        __doc__,
        aliases={"dataset_name": "dataset"},  # TRL's script names
        prog="recipes/tool.py",
    )
    if model_args.model_name_or_path is None:
        raise ValueError("--model_name_or_path is required (a Hub id or a local folder)")
    args.model_init_kwargs = {**model_args.model_init_kwargs(), **(args.model_init_kwargs or {})}
    # a prompt + completion budget beyond the model's positions: a clear error now, not vLLM's mid-run
    check_lengths(args, load_model_config(model_args.model_name_or_path, trust_remote_code=args.trust_remote_code))
    env = ToolEnv(
        [calculator],
        max_turns=script.max_turns,
        tool_timeout=script.tool_timeout,
        max_tokens_per_turn=script.max_tokens_per_turn,
    )
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[math_reward, tool_reward],
        args=args,
        train_dataset=build_dataset(script, env, args.seed),
        peft_config=get_peft_config(model_args),
        environment=env,
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
