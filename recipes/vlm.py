"""A vision-language model learns a task from its images on 2 CPU cores: "What colour is the square?"

A tiny Qwen2-VL (random weights, real Qwen2-VL image processor; `grpo_async.testing.vlm`) is trained from scratch with
async GRPO on generated 40×40 images of a coloured square on grey (`colour_dataset`). Every prompt has the same text;
only the image tells the colour. The reward is the share of the completion's characters that are the colour's
initial (`r`, `g`, `b`, `y`): a model that ignores the image scores at most 1/4 on average, one that reads it up to 1.

Shows one line per step, then the final model's greedy answers on held-out images of each colour, where it wrote the
metrics (JSONL) and the reward-curve PNG, and ends with
`RESULT vlm_reward_first10=<a> vlm_reward_last10=<b> vlm_greedy_accuracy=<c>` (the share of held-out images whose
greedy answer starts with the right initial).

Every `GRPOConfig` and `ModelConfig` field is a flag (`--max_steps 50`, `--learning_rate 1e-3`, ...); `--family`
picks the tiny model (`qwen2_vl`, `qwen2_5_vl`, `gemma3`, `idefics3`; `idefics3` also runs on `--backend vllm`).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.generation.base import SamplingConfig
from grpo_async.logging_utils import use_concise_console
from grpo_async.model_config import ModelConfig
from grpo_async.pipeline.vision_prompts import tokenize_with_images
from grpo_async.plotting import METRICS_FILE, copy_or_plot, read_metrics
from grpo_async.recipe_parser import parse_recipe_args
from grpo_async.testing.vlm import (
    COLOURS,
    TinyVLMSpec,
    build_tiny_vlm,
    colour_dataset,
    colour_letter_reward,
    square_image,
)

QUESTION = [{"role": "user", "content": "What colour is the square?"}]


@dataclass
class VLMArguments:
    """The recipe's own arguments (every `GRPOConfig` and `ModelConfig` field is a flag too)."""

    family: str = field(
        default="qwen2_vl", metadata={"help": "Tiny VLM family: qwen2_vl, qwen2_5_vl, gemma3, idefics3."}
    )
    dataset_size: int = field(default=4096, metadata={"help": "Images of the colour task (seeded by --seed)."})
    eval_images: int = field(default=8, metadata={"help": "Held-out images per colour for the final greedy check."})


def vlm_defaults() -> dict:
    """The recipe's defaults for `GRPOConfig` fields (`--config` YAML and flags override them)."""
    return dict(
        output_dir="vlm_output",
        max_steps=150,
        generation_backend="hf",
        num_batches_ahead=1,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        per_device_train_batch_size=32,
        gradient_accumulation_steps=1,
        num_generations=8,
        max_completion_length=6,
        temperature=1.0,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
    )


def parse_args(argv: list[str] | None = None) -> tuple[VLMArguments, GRPOConfig, ModelConfig]:
    """The recipe's arguments from `vlm_defaults()`, `--config <yaml>` and the flags in `argv` (without the program
    name; defaults to `sys.argv[1:]`); `--backend` is another name of `--generation_backend`."""
    return parse_recipe_args(
        (VLMArguments, GRPOConfig, ModelConfig),
        argv,
        __doc__,
        defaults=vlm_defaults(),
        aliases={"backend": "generation_backend"},
        prog="recipes/vlm.py",
    )


def greedy_answers(trainer, per_colour: int, seed: int = 10_000) -> dict[str, list[str]]:
    """The sampler's greedy answers (with the trained weights) on `per_colour` held-out images of each colour."""
    trainer.sync_weights()
    processor, backend = trainer.processing_class, trainer.backend
    out = {}
    for name in COLOURS:
        texts = []
        for i in range(per_colour):
            ids, media = tokenize_with_images(processor, QUESTION, [square_image(name, seed=seed + i)])
            (completion,) = backend.generate([ids], SamplingConfig(max_tokens=6, temperature=0.0), images=[media])
            texts.append(processor.tokenizer.decode(completion.completion_ids, skip_special_tokens=True))
        out[name] = texts
    return out


def main(argv: list[str] | None = None) -> GRPOTrainer:
    """Train on the colour task, show the final greedy answers, plot; returns the (closed) trainer."""
    script, args, _ = parse_args(argv)
    model_dir = build_tiny_vlm(os.path.join(args.output_dir, "tiny-vlm"), TinyVLMSpec(family=script.family))
    metrics = os.path.join(args.output_dir, METRICS_FILE)
    if os.path.exists(metrics):
        os.remove(metrics)
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=colour_letter_reward,
        args=args,
        train_dataset=colour_dataset(script.dataset_size, seed=args.seed),
    )
    use_concise_console(trainer)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    answers = greedy_answers(trainer, script.eval_images)
    trainer.close()
    hits = sum(t[:1] == name[0] for name, texts in answers.items() for t in texts)
    accuracy = hits / sum(len(t) for t in answers.values())
    print("final model, greedy answers on held-out images:")
    for name, texts in answers.items():
        print(f"  {name:>6}: " + "  ".join(repr(t) for t in texts[:4]))
    rewards = [r["reward"] for r in read_metrics(metrics) if "reward" in r]
    png = copy_or_plot(metrics, os.path.join(args.output_dir, "reward_curve.png"), title="VLM: colour of the square")
    first, last = sum(rewards[:10]) / len(rewards[:10]), sum(rewards[-10:]) / len(rewards[-10:])
    print(f"trained {len(rewards)} steps in {seconds:.0f}s on backend={args.generation_backend} ({script.family})")
    print(f"metrics: {os.path.abspath(metrics)}")
    print(f"plot:    {os.path.abspath(png)}")
    print(f"RESULT vlm_reward_first10={first:.4f} vlm_reward_last10={last:.4f} vlm_greedy_accuracy={accuracy:.4f}")
    return trainer


if __name__ == "__main__":
    try:
        main()
    finally:
        gc.collect()
