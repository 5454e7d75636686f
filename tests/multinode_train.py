"""Launched by `test_multinode.py` on 2 "machines" × 1 process each (accelerate `--num_machines 2 --machine_rank R
--main_process_ip 127.0.0.1`): trains against two `grpo-async serve` servers reached only over HTTP and the
broadcast transport, and checks each server's weights against the trainer's after every push.

argv: MODEL OUT_DIR URL0 URL1 API_KEY. The test kills URL1's server at the end of step 1: the main process writes
`OUT_DIR/kill.request` and waits for `OUT_DIR/killed` (the kill comes from outside, as a node failure would).

After each optimizer step s the servers must hold version s − 1 (published at the start of step s, before its
training): the main process asks every server still in rotation for its version (`/ws/info`) and for the logprobs of
fixed sequences (`/ws/logprobs`), and compares them with a copy of the trainer's model taken when version s − 1 was
the trainer's. After training, `sync_weights()` pushes the final version, checked the same way.
"""

import copy
import json
import os
import sys
import time

import torch
from support.rank_result import exit_cleanly
from transformers import TrainerCallback
from vllm_utils import hf_logprobs

from grpo_async import GRPOTrainer
from grpo_async.demo_task import make_dataset
from grpo_async.net import ServerClient
from grpo_async.testing import tiny_config

SEQUENCES = [([7, 8, 9, 10, 11], [12, 40, 41, 3]), ([20, 21, 22], [23, 24, 60, 61, 62]), ([30, 31], [5])]


def distinct_tokens(completions, completion_ids, **kw):
    """Share of distinct tokens in each completion: varies within every group, so every step moves the weights
    (the letter task's reward is 0 for this untrained model, which would leave every version equal)."""
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


class CheckServers(TrainerCallback):
    """On the main process: after every step, each live server's version and logprobs vs the trainer's."""

    def __init__(self, urls, api_key, out_dir):
        self.clients = {u: ServerClient(u, api_key=api_key, timeout=60) for u in urls}
        self.out_dir = out_dir
        self.trainer = None  # set once the trainer exists
        self.snapshots = {}  # version -> copy of the trainer's model at that version
        self.checks = []  # {"after_step", "url", "version", "worst"}

    def snapshot(self, model, version):
        self.snapshots[version] = copy.deepcopy(model).eval()

    def check(self, after_step, version):
        """Every live server holds `version`: its logprobs equal that version's (`worst`), and differ from the
        version before it (`moved`: the check could tell a missed push)."""

        def worst(model, served):
            return max(
                abs(a - b)
                for (p, c), got in zip(SEQUENCES, served, strict=True)
                for a, b in zip(hf_logprobs(model, p, c), got, strict=True)
            )

        for url in self.trainer.backend.live_urls:
            client = self.clients[url]
            info = client.get("/ws/info")
            body = {"sequences": [{"prompt_ids": p, "completion_ids": c} for p, c in SEQUENCES]}
            served = client.post("/ws/logprobs", body)["logprobs"]
            self.checks.append(
                {
                    "after_step": after_step,
                    "url": url,
                    "version": info["version"],
                    "expected_version": version,
                    "worst": worst(self.snapshots[version], served),
                    "moved": worst(self.snapshots[version - 1], served) if version > 0 else None,
                    "received": info["workers"][0]["received"],
                }
            )

    def on_train_begin(self, args, state, control, model=None, **kw):
        if state.is_world_process_zero:
            self.snapshot(self.trainer.accelerator.unwrap_model(model), 0)

    def on_step_end(self, args, state, control, model=None, **kw):
        if not state.is_world_process_zero:
            return
        self.check(state.global_step, state.global_step - 1)
        self.snapshot(self.trainer.accelerator.unwrap_model(model), state.global_step)
        if state.global_step == 1:  # a node failure: the test kills the second server from outside
            open(os.path.join(self.out_dir, "kill.request"), "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(self.out_dir, "killed")):
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never killed the server")
                time.sleep(0.1)


def main():
    model_path, out_dir, url0, url1, api_key = sys.argv[1:6]
    args = tiny_config(
        out_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_completion_length=6,
        num_batches_ahead=1,
        generation_backend="vllm_server",
        vllm_server_urls=[url0, url1],
        vllm_api_key=api_key,
        vllm_server_timeout=30,
        weight_sync_transport="broadcast",  # as if the servers were on other hosts: no shared memory, no IPC
    )
    check = CheckServers([url0, url1], api_key, out_dir)
    trainer = GRPOTrainer(
        model=model_path, reward_funcs=distinct_tokens, args=args, train_dataset=make_dataset(64), callbacks=[check]
    )
    check.trainer = trainer
    trainer.train()
    result = {
        "rank": trainer.accelerator.process_index,
        "world": trainer.accelerator.num_processes,
        "node": int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", -1))),
        "local_rank": trainer.accelerator.local_process_index,
        "steps": trainer.state.global_step,
        "rewards": [h["reward"] for h in trainer.state.log_history if "reward" in h],
        "param_checksum": float(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]).double().sum()),
    }
    if trainer.accelerator.is_main_process:
        trainer.sync_weights()  # the final version, checked like the others
        check.check(trainer.state.global_step, trainer.state.global_step)
        result.update(
            checks=check.checks,
            live_urls=trainer.backend.live_urls,
            transport=trainer.backend.transport_name,
        )
    trainer.close()
    with open(os.path.join(out_dir, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_cleanly()  # the DDP reducer freed before the process group (tests/support/rank_result.py)
