"""Launched by tests/test_grad_equivalence.py on 2 processes (gloo on CPU): the gradient `GRPOTrainer.compute_loss`
accumulates over GA = 2 micro-batches per process, averaged over the processes by DDP, against the gradient of the
whole batch (8 rows) in one pass of the loss's definition. float64 throughout.

argv: MODEL OUT_DIR. Rank 0 writes `result.json`: {"<loss_type>/<packed|padded>": max abs gradient difference}.
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from support.rank_result import exit_cleanly
from transformers import AutoModelForCausalLM

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.algo.logprobs import completion_logps
from grpo_async.algo.loss import LossContext, grpo_loss
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.pipeline.types import MicroBatch

N, GA, MICRO, P, T, BETA = 2, 2, 2, 5, 6, 0.1
ROWS = N * GA * MICRO


def batch(model) -> MicroBatch:
    """8 rows with skewed prompt/completion lengths and every loss input the trainer gets, seeded (same on ranks)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(7, 60, (ROWS, P + T), generator=g)
    mask = torch.zeros(ROWS, P + T, dtype=torch.long)
    for i in range(ROWS):
        mask[i, P - 1 - (i * 2) % P : P + 1 + (i * 5) % T] = 1
    ids = ids.masked_fill(mask == 0, 0)
    loss_mask = mask[:, P:].clone()
    loss_mask[3, 0] = 0  # a masked token inside a completion
    with torch.no_grad():
        logps = completion_logps(model, ids, mask, T)  # [R, T]
    return MicroBatch(
        prompt_ids=ids[:, :P],
        prompt_mask=mask[:, :P],
        completion_ids=ids[:, P:],
        completion_mask=mask[:, P:],
        loss_mask=loss_mask,
        rollout_logps=logps.clone(),
        advantages=torch.randn(ROWS, generator=g, dtype=torch.float64),
        old_logps=logps + 0.3 * torch.randn(ROWS, T, generator=g, dtype=torch.float64),  # some ratios clip
        ref_logps=logps + 0.2 * torch.randn(ROWS, T, generator=g, dtype=torch.float64),
        is_weights=0.5 + torch.rand(ROWS, 1, generator=g, dtype=torch.float64),
        policy_version=torch.zeros(ROWS, dtype=torch.long),
        round_id=torch.zeros(ROWS, dtype=torch.long),
        row_index=torch.arange(ROWS),
        num_items_in_batch=float(loss_mask.sum()),  # loss tokens of the whole round, all processes
    )


def whole_batch_grad(model_path: str, rows: MicroBatch, loss_type: str) -> torch.Tensor:
    """The definition: one pass over all rows on one process, no accumulation, padded rows."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], 1)
    am = torch.cat([rows["prompt_mask"], rows["completion_mask"]], 1)
    out = grpo_loss(
        completion_logps(model, ids, am, T),
        rows["advantages"],
        rows["loss_mask"],
        loss_type=loss_type,
        old_per_token_logps=rows["old_logps"],
        ref_per_token_logps=rows["ref_logps"],
        beta=BETA,
        importance_weights=rows["is_weights"],
        ctx=LossContext(max_completion_length=T, num_items_in_batch=rows["num_items_in_batch"]),
    )
    out.loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def trainer_grad(model_path: str, out_dir: str, rows: MicroBatch, loss_type: str, padding_free: bool) -> torch.Tensor:
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        save_metrics_plot=False,  # the end-of-training plot is not this run's subject (~1.3 CPU-s)
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=GA,
        num_generations=4,
        max_completion_length=T,
        beta=BETA,
        loss_type=loss_type,
        padding_free=padding_free,
        model_init_kwargs={"dtype": torch.float64},
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(model=model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(8))
    trainer.current_gradient_accumulation_steps = GA  # what the training loop sets before its micro-steps
    acc = trainer.accelerator
    ddp = acc.prepare_model(trainer.model)
    rank = acc.process_index
    local = rows.select(slice(rank * GA * MICRO, (rank + 1) * GA * MICRO))
    for m, micro in enumerate(local.split(GA)):
        sync = acc.no_sync(ddp) if m < GA - 1 else torch.enable_grad()  # DDP averages at the last micro-step
        with sync:
            acc.backward(trainer.compute_loss(ddp, micro))
    grad = torch.cat([p.grad.reshape(-1) for p in acc.unwrap_model(ddp).parameters()])
    del trainer, ddp
    gc.collect()
    return grad


def main():
    model_path, out_dir = sys.argv[1], sys.argv[2]
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    rows = batch(reference)
    result = {}
    cases = [(lt, True) for lt in ("grpo", "dr_grpo", "dapo", "bnpo")] + [("dapo", False)]
    for loss_type, padding_free in cases:
        want = whole_batch_grad(model_path, rows, loss_type)
        got = trainer_grad(model_path, out_dir, rows, loss_type, padding_free)
        key = f"{loss_type}/{'packed' if padding_free else 'padded'}"
        result[key] = (got - want).abs().max().item()
        result[key + "/scale"] = want.abs().max().item()
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_cleanly()  # the DDP reducer freed before the process group (tests/support/rank_result.py)
