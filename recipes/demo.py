"""`make demo`: train a tiny model from scratch with async GRPO on the bundled letter task (2 CPU cores, minutes).

Shows a progress bar and one line per step (reward, KL, mean length, seconds per step, staleness), then a few
completions of the final model (greedy and sampled), where it wrote the metrics (JSONL) and the reward-curve PNG,
and ends with `RESULT demo_reward_first10=<a> demo_reward_last10=<b>`. The trained model (or LoRA adapter with
`--use_peft`) and its model card (README.md) are saved to `--output_dir`.

Every `GRPOConfig` and `ModelConfig` field is a flag (`--seed 3`, `--logging_steps 5`, `--beta 0.04`, ...), as in
TRL's scripts; `--config recipes/configs/demo.yaml` sets defaults for any of them, and flags override the file. The
demo's own defaults (`demo_defaults()`: learning rate 5e-4, 200 steps, ...) replace the dataclasses' where they differ.
`--backend` is another name of `--generation_backend` (vllm when vLLM is installed, else hf; env `DEMO_BACKEND`).

Launch on several processes with one of the accelerate configs, e.g.
`accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/demo.py --backend hf`.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the in-process engine starts in seconds
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
from accelerate import PartialState

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.demo_task import LETTERS, letter_reward, make_dataset, make_ends_cleanly_for
from grpo_async.loading import load_tokenizer
from grpo_async.logging_utils import use_concise_console
from grpo_async.model_config import ModelConfig, get_peft_config
from grpo_async.plotting import METRICS_FILE, copy_or_plot, read_metrics
from grpo_async.recipe_parser import parse_recipe_args
from grpo_async.testing import TinyModelSpec, build_tiny_model

DATASET_NAME = "letter task (grpo_async.demo_task)"


def _default_backend() -> str:
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def _until_eos(ids: list[int], eos: int) -> list[int]:
    """The generated ids up to and including the first EOS (what follows is `generate`'s batch padding)."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def show_final_completions(trainer, tokenizer, max_new_tokens: int, sampled: int = 2) -> None:
    """Print what the FINAL model answers to each prompt: greedy, and `sampled` samples at temperature 1, with the
    special tokens left visible (a clean answer is letters, then one `<|end|>`). Every process must call it: under
    ZeRO-3 a forward pass gathers the partitioned weights from all of them (`synced_gpus`); the main process prints."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    main = trainer.accelerator.is_main_process
    if main:
        print("final model (special tokens shown):")
    torch.manual_seed(0)
    with torch.no_grad():
        for c in LETTERS:
            chat = [{"role": "user", "content": f"Say {c}"}]
            ids = tokenizer.apply_chat_template(
                chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
            ids = {k: v.to(model.device) for k, v in ids.items() if k in ("input_ids", "attention_mask")}
            n = ids["input_ids"].shape[1]
            kw = dict(
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                synced_gpus=is_deepspeed_zero3_enabled(),
            )
            greedy = model.generate(**ids, do_sample=False, **kw)[0, n:]
            samples = model.generate(**ids, do_sample=True, temperature=1.0, num_return_sequences=sampled, **kw)[:, n:]
            texts = [tokenizer.decode(_until_eos(t.tolist(), tokenizer.eos_token_id)) for t in [greedy, *samples]]
            if main:
                print(f"  Say {c}: greedy {texts[0]!r}  sampled " + "  ".join(repr(t) for t in texts[1:]))


@dataclass
class DemoArguments:
    """The demo's own arguments (every `GRPOConfig` and `ModelConfig` field is a flag too)."""

    dataset_size: int = field(default=4096, metadata={"help": "Prompts of the letter task (seeded by --seed)."})
    sampled_completions: int = field(
        default=2, metadata={"help": "Sampled completions of the final model shown per prompt (besides greedy)."}
    )


def demo_defaults() -> dict:
    """The demo's defaults for `GRPOConfig` fields (`--config` YAML and flags override them): what `make demo`
    trains with."""
    return dict(
        output_dir="demo_output",
        max_steps=200,
        generation_backend=os.environ.get("DEMO_BACKEND", _default_backend()),
        num_batches_ahead=1,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        per_device_train_batch_size=32,
        gradient_accumulation_steps=1,
        num_generations=8,
        max_prompt_length=32,
        max_completion_length=16,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=not torch.cuda.is_available(),
    )


def parse_args(
    argv: list[str] | None = None, is_main_process: bool = True
) -> tuple[DemoArguments, GRPOConfig, ModelConfig]:
    """The demo's arguments from `demo_defaults()`, `--config <yaml>` and the flags in `argv` (without the program
    name; defaults to `sys.argv[1:]`). `--backend` is another name of `--generation_backend`; the progress bar is
    off on processes other than the main one."""
    return parse_recipe_args(
        (DemoArguments, GRPOConfig, ModelConfig),
        argv,
        __doc__,
        defaults={**demo_defaults(), "disable_tqdm": not is_main_process},
        aliases={"backend": "generation_backend"},
        prog="recipes/demo.py",
    )


def main(argv: list[str] | None = None) -> GRPOTrainer:
    """Train, save, show the final model's completions; returns the (closed) trainer. `argv` as for `parse_args`."""
    # cpu=True on a machine without CUDA: gloo process group, so that main_process_first really waits
    state = PartialState(cpu=not torch.cuda.is_available())
    script, args, model_args = parse_args(argv, state.is_main_process)
    if model_args.model_name_or_path is not None:
        model_dir = model_args.model_name_or_path
        args.model_init_kwargs = {**model_args.model_init_kwargs(), **(args.model_init_kwargs or {})}
    else:
        with state.main_process_first():  # one process writes the model folder, the others wait
            model_dir = build_tiny_model(
                os.path.join(args.output_dir, "tiny-model"),
                TinyModelSpec(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4),
            )
    metrics = os.path.join(args.output_dir, METRICS_FILE)
    if os.path.exists(metrics) and state.is_main_process:
        os.remove(metrics)
    tokenizer = load_tokenizer(model_dir)
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=[letter_reward, make_ends_cleanly_for(tokenizer)],
        args=args,
        train_dataset=make_dataset(script.dataset_size, seed=args.seed),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    use_concise_console(trainer)
    start = time.time()
    trainer.train()
    trainer.close()
    trainer.save_model()  # every process: sharded (FSDP, ZeRO-3) weights are gathered
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=DATASET_NAME)  # writes the model card, then uploads
    else:
        trainer.create_model_card(dataset_name=DATASET_NAME)
    seconds = time.time() - start
    # every process (ZeRO-3 gathers weights)
    show_final_completions(trainer, tokenizer, args.max_completion_length, script.sampled_completions)
    if not trainer.accelerator.is_main_process:
        return trainer
    rewards = [r["reward"] for r in read_metrics(metrics) if "reward" in r]
    png = os.path.join(args.output_dir, "reward_curve.png")
    png = copy_or_plot(metrics, png, title="grpo_async demo: letter task")
    first, last = sum(rewards[:10]) / len(rewards[:10]), sum(rewards[-10:]) / len(rewards[-10:])
    acc = trainer.accelerator
    print(
        f"trained {len(rewards)} steps in {seconds:.0f}s on backend={args.generation_backend}, "
        f"{acc.num_processes} process(es), distributed_type={acc.distributed_type.value}"
    )
    print(f"metrics: {os.path.abspath(metrics)}")
    print(f"plot:    {os.path.abspath(png)}")
    print(f"RESULT demo_reward_first10={first:.4f} demo_reward_last10={last:.4f}")
    return trainer


if __name__ == "__main__":
    try:
        main()
    finally:
        # free the trainer (its DDP reducer holds the process group) before destroying the group: a reducer collected
        # afterwards can hang in gloo's teardown
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
