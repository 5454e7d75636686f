"""Launched by the multi-process tests with 2 processes (gloo on CPU). Writes what each rank trained on.

argv: MODEL OUT_DIR NUM_BATCHES_AHEAD NUM_ITERATIONS [SERVER_URL API_KEY] (with a server: the vllm_server backend).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset


class Recorder(GRPOTrainer):
    def compute_loss(self, model, inputs, *a, **k):
        self.seen = getattr(self, "seen", [])
        self.seen.append(
            {
                "round": inputs["round_id"].tolist(),
                "row": inputs["row_index"].tolist(),
                "prompt": self.processing_class.batch_decode(inputs["prompt_ids"], skip_special_tokens=True),
            }
        )
        return super().compute_loss(model, inputs, *a, **k)


def main():
    model_path, out_dir, ahead, mu = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    server = {}
    if len(sys.argv) > 5:
        server = dict(generation_backend="vllm_server", vllm_server_urls=[sys.argv[5]], vllm_api_key=sys.argv[6])
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        num_iterations=mu,
        max_completion_length=6,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        num_batches_ahead=ahead,
        beta=0.05,
        seed=0,
        **server,
    )
    trainer = Recorder(model=model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    trainer.train()
    trainer.close()
    rank = trainer.accelerator.process_index
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "rank": rank,
                "world": trainer.accelerator.num_processes,
                "seen": trainer.seen,
                "param_checksum": float(params.double().sum()),
                "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
            },
            f,
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
