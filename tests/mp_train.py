"""Launched by the multi-process tests with 2 processes (gloo on CPU). Writes what each rank trained on.

argv: MODEL OUT_DIR NUM_BATCHES_AHEAD NUM_ITERATIONS [SERVER_URL API_KEY] (with a server: the vllm_server backend).
Environment (resume tests): GRPO_TEST_MAX_STEPS (default 4), GRPO_TEST_SAVE_STEPS (checkpoint every N steps),
GRPO_TEST_STOP_AT (stop after that step), GRPO_TEST_RESUME (checkpoint folder to resume from); GRPO_TEST_TOP_P
(sampling's top_p: the kept sets travel from the main process's round to each rank's slice).
"""

import os
import sys

from support.rank_result import exit_cleanly, write_rank_result
from support.recorders import recorded
from transformers import TrainerCallback

from grpo_async import GRPOConfig
from grpo_async.demo_task import letter_reward, make_dataset


def _rows(micro_batch, state, processing_class):
    """Which rows a micro-batch trained (round, row index) and their prompts."""
    return {
        "round": micro_batch.round_id.tolist(),
        "row": micro_batch.row_index.tolist(),
        "prompt": processing_class.batch_decode(micro_batch.prompt_ids, skip_special_tokens=True),
    }


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def main():
    model_path, out_dir, ahead, mu = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    server = {}
    if len(sys.argv) > 5:
        server = dict(generation_backend="vllm_server", vllm_server_urls=[sys.argv[5]], vllm_api_key=sys.argv[6])
    elif os.environ.get("GRPO_TEST_BACKEND") == "vllm":  # the in-process engine (main process)
        server = dict(generation_backend="vllm", vllm_max_model_length=128)
    if "GRPO_TEST_ASYNC_MODE" in os.environ:  # "stream": tests/test_streaming.py
        server["async_mode"] = os.environ["GRPO_TEST_ASYNC_MODE"]
    if "GRPO_TEST_TOP_P" in os.environ:
        server["top_p"] = float(os.environ["GRPO_TEST_TOP_P"])
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        save_metrics_plot=False,  # the end-of-training plot is not this run's subject (~1.3 CPU-s)
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        num_iterations=mu,
        max_completion_length=6,
        max_steps=int(os.environ.get("GRPO_TEST_MAX_STEPS", 4)),
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="steps" if "GRPO_TEST_SAVE_STEPS" in os.environ else "no",
        save_steps=int(os.environ.get("GRPO_TEST_SAVE_STEPS", 500)),
        disable_tqdm=True,
        num_batches_ahead=ahead,
        beta=0.05,
        seed=0,
        **server,
    )
    callbacks = [StopAt(int(os.environ["GRPO_TEST_STOP_AT"]))] if "GRPO_TEST_STOP_AT" in os.environ else []
    trainer, seen = recorded(
        model=model_path,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=make_dataset(64),
        callbacks=callbacks,
        record=_rows,
    )
    trainer.train(resume_from_checkpoint=os.environ.get("GRPO_TEST_RESUME"))
    trainer.close()
    write_rank_result(
        trainer, out_dir, seen, {"rewards": "reward", "is_ratio_mean": "sampling/importance_sampling_ratio/mean"}
    )


if __name__ == "__main__":
    main()
    exit_cleanly()
