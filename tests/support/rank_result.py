"""What a 2-process training script (`tests/mp_train.py`, `tests/mp_train_vlm.py`) writes per rank; how it exits."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist


def write_rank_result(trainer, out_dir: str, seen, metrics: dict[str, str]) -> None:
    """`out_dir/rank<i>.json`: the rank, the world size, the micro-batch rows it trained (`seen.records`), a checksum
    of its parameters, and under each key of `metrics` its metric at every logged step that has it."""
    rank = trainer.accelerator.process_index
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    history = trainer.state.log_history
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "seen": seen.records,
        "param_checksum": float(params.double().sum()),
        **{key: [h[metric] for h in history if metric in h] for key, metric in metrics.items()},
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def exit_cleanly() -> None:
    """Free the trainer (its DDP reducer holds the process group) BEFORE destroying the group: a reducer collected
    after `destroy_process_group` joins gloo's worker threads in its destructor and can hang forever (seen here).
    Then exit without interpreter finalizers: whatever else still holds gloo state must not hang the test."""
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
