"""Launched by `tests/test_vlm.py` on 2 processes (gloo on CPU): the tiny Qwen2-VL on the colour task, hf backend (an
engine on every rank, rounds joined), one round ahead. Writes what each rank trained: each row's round, row index and
image checksum, and the sampler-vs-trainer log-prob gap of every round.

argv: MODEL OUT_DIR
"""

import sys

from support.rank_result import exit_cleanly, write_rank_result
from support.recorders import recorded

from grpo_async import GRPOConfig
from grpo_async.testing.vlm import colour_dataset, colour_letter_reward


def _rows(micro_batch, state, processing_class):
    """Which rows a micro-batch trained, with a checksum of each row's own pixels."""
    pixels = micro_batch.vision.stacks["pixel_values"]  # [B, N, D]
    return {
        "round": micro_batch.round_id.tolist(),
        "row": micro_batch.row_index.tolist(),
        "pixels": pixels.double().flatten(1).sum(1).tolist(),
    }


def main():
    model_path, out_dir = sys.argv[1], sys.argv[2]
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        save_metrics_plot=False,  # the end-of-training plot is not this run's subject (~1.3 CPU-s)
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=6,
        max_steps=3,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        num_batches_ahead=1,
        beta=0.05,
        seed=0,
    )
    trainer, seen = recorded(
        model=model_path,
        reward_funcs=colour_letter_reward,
        args=args,
        train_dataset=colour_dataset(64),
        record=_rows,
    )
    trainer.train()
    trainer.close()
    write_rank_result(trainer, out_dir, seen, {"logp_diff_max": "sampling/logp_diff/max"})


if __name__ == "__main__":
    main()
    exit_cleanly()
