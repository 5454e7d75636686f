"""`bench/vs_trl.py`'s 2-process mode on SmolLM2, as a bench of its own (its own record in `bench/results/`).

What it measures: seconds per optimizer step of TRL 1.16's `GRPOTrainer` and ours, both under `accelerate launch` on
2 CPU processes with the README's flags (`--multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no
--dynamo_backend no`, gloo), each as shipped, alternated `--repeats` times in fresh processes (TRL, ours, TRL, ours):

- `trl_hf` / `ours_hf`: transformers `generate`, both trainers' default backend. TRL generates on every process,
  each its own slice; ours too (an engine on every rank: `grpo_async/pipeline/join.py`), one round ahead;
- `trl_colocate` / `ours_colocate`: in-process vLLM on every rank (TRL: `use_vllm=True, vllm_mode="colocate"`, its
  engine in the dtype TRL gives it; ours: `generation_backend="vllm"`, float32), both engines inside their rank's
  process (vLLM's `external_launcher`; until 2026-11-27 ours ran its engine core and worker in child processes of
  each rank; the published record is the rerun of 18:49 that day, after the change), each rank on its own core.

Same everywhere: SmolLM2-135M-Instruct (`grpo_async.testing.build_smollm2`, offline), 2-digit addition chats,
4 prompts × G = 4 × T = 32 forced tokens per step (`min_new_tokens` / `ignore_eos`), 2 prompts (8 rows) per process,
β = 0, learning rate 1e-6; each trainer keeps its other defaults (TRL's gradient checkpointing among them).

The limit it compares to: TRL on the same 2 processes and cores. How to read the ratio: `speedup = TRL s/step ÷
ours s/step` per generation (> 1: ours is faster), each mode's least-disturbed repeat (lowest median step after
`--warmup`). Ends with `RESULT speedup_vs_trl_2proc=<ours_hf vs trl_hf>` and
`RESULT speedup_vs_trl_colocate_2proc=<ours_colocate vs trl_colocate>`; writes `bench/out/vs_trl_2proc.json` with the
load average around every run. Run: `python bench/vs_trl_2proc.py` (~15 min on 2 cores); any `bench/vs_trl.py`
option passes through (`--modes trl_hf ours_hf`, `--repeats 3`, `--smoke`: the tiny model, seconds per step).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import vs_trl  # noqa: E402


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--smoke" not in argv:
        argv = ["--model", "smollm2", "--out", os.path.join(HERE, "out", "vs_trl_2proc.json"), *argv]
    return vs_trl.main(["--processes", "2", *argv])


if __name__ == "__main__":
    main()
