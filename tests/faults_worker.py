"""A training process that the `test_faults*` tests interrupt, kill or starve. Prints marker lines they wait for.

argv: MODE MODEL OUT_DIR [SERVER_URL]
- `sigint`: trains (HF backend, or the vllm_server backend with a broadcast weight sync when SERVER_URL is given)
  until the test sends SIGINT; prints `GENERATING` when a round starts generating, and on KeyboardInterrupt
  `INTERRUPTED threads=[...]` (the threads still alive) before exiting with 130.
- `checkpoint`: saves every step; the save of step 2 blocks half-way (model written, RNG state not yet) after
  printing `SAVING 2`, for the test to SIGKILL. `resume`: resumes with `resume_from_checkpoint=True`, prints
  `RESUMED FROM <path>` and `DONE <global_step>`.
- `rank_dies` / `rank_hangs`: one of 2 processes (env RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, gloo, no launcher
  agent that would kill the survivor; ddp_timeout=15); at its 3rd micro-step rank 1 calls `os._exit(3)` / sleeps
  forever; rank 0 must fail with a clear error (at once / within ddp_timeout).
"""

import os
import sys
import threading
import time

from grpo_async import GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.testing import tiny_config


class Observed(GRPOTrainer):
    """Adds marker lines and the injected faults; nothing of the pipeline is replaced."""

    mode = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        generate = self.producer.generate  # the round producer's generate step, observed (not replaced)

        def observed(*a, **k):
            print("GENERATING", flush=True)
            return generate(*a, **k)

        self.producer.generate = observed

    def _save_rng_state(self, output_dir):
        if self.mode == "checkpoint" and self.state.global_step == 2:
            print("SAVING 2", flush=True)
            time.sleep(3600)  # killed here, half-way through the checkpoint
        return super()._save_rng_state(output_dir)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.mode in ("rank_dies", "rank_hangs") and self.accelerator.process_index == 1 and self._step == 2:
            print("RANK 1 DIES" if self.mode == "rank_dies" else "RANK 1 HANGS", flush=True)
            if self.mode == "rank_dies":
                os._exit(3)
            time.sleep(3600)  # stalled (deadlock, stuck I/O): alive, its sockets open, never joins a collective
        return super().training_step(model, inputs, num_items_in_batch)


def main():
    mode, model, out = sys.argv[1], sys.argv[2], sys.argv[3]
    server = sys.argv[4] if len(sys.argv) > 4 else None
    kw = dict(output_dir=out, per_device_train_batch_size=4, max_steps=4)
    if mode == "sigint":
        kw.update(max_steps=1000, max_completion_length=64)
        if server:
            kw.update(generation_backend="vllm_server", vllm_server_urls=[server], weight_sync_transport="broadcast")
    elif mode in ("checkpoint", "resume"):
        kw.update(save_strategy="steps", save_steps=1, save_total_limit=1)
    elif mode in ("rank_dies", "rank_hangs"):
        kw.update(ddp_timeout=15, max_steps=20)
    args = tiny_config(**kw)
    trainer = Observed(model=model, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(256))
    trainer.mode = mode
    try:
        if mode == "resume":
            from transformers.trainer_utils import get_last_checkpoint

            print(f"RESUMED FROM {get_last_checkpoint(out)}", flush=True)
            trainer.train(resume_from_checkpoint=True)
            print(f"DONE {trainer.state.global_step}", flush=True)
        else:
            trainer.train()
            print(f"DONE {trainer.state.global_step}", flush=True)
    except KeyboardInterrupt:
        alive = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        print(f"INTERRUPTED threads={alive}", flush=True)
        sys.exit(130)
    except Exception as e:
        print(f"FAILED rank={trainer.accelerator.process_index} {type(e).__name__}: {e}", flush=True)
        raise


if __name__ == "__main__":
    main()
