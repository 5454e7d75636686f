"""Launched by test_collect.py with `torchrun --nproc_per_node 2` (gloo, CPU): FSDP2-sharded parameters are
collected whole (`DTensor.full_tensor()`), bit-identical to the unsharded model's, with HF names."""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from grpo_async.weight_sync.collect import collect_state_dict, iter_full_params


def main():
    model_path, out = sys.argv[1], sys.argv[2]
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = sum(hasattr(p, "full_tensor") for p in model.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    groups = [m for m, _ in iter_full_params(model)]
    state = collect_state_dict(model, is_main_process=rank == 0)
    result = {"rank": rank, "sharded": sharded, "local_numel": local, "groups": groups}
    if rank == 0:
        result["names_equal"] = sorted(state) == sorted(k for k in reference if k in state)
        result["missing"] = sorted(set(reference) - set(state))
        result["bit_identical"] = all(torch.equal(state[k], reference[k]) for k in state)
        result["full_numel"] = sum(v.numel() for v in state.values())
    else:
        result["empty"] = state == {}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        main()
    finally:  # the sharded model is freed before the group is destroyed (see mp_train.py)
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
