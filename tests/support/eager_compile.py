"""Imported by `warm_launch`'s fork server (its `PRELOAD`): in the processes forked from it, vLLM's sampler counts
token ranks with the eager original of its one `torch.compile`d CPU helper.

On CPU a vLLM engine compiles that helper in the first step that returns log-probs: the rank of each sampled token
among the vocabulary's log-probs (`vllm.v1.sample.ops.logprobs.batched_count_greater_than`, which
`vllm.v1.sample.sampler` imports by name; grpo_async keeps each token's log-prob, not its rank). Compiled in every
process that starts an engine, it cost ~3 CPU-s in the first round of each run of a bench smoke (`vs_trl --smoke`:
3.5 → 0.07 s; dynamo's trace, inductor's cache keys, a hash of every source file of torch and Triton, and its check of
the CPU's vector ISAs in a child interpreter per candidate ISA). The sampling itself is a fused C++ op on CPU
(`forward_cpu`), not compiled: the tokens and log-probs are the same.

Only that helper: an engine started without `--enforce-eager` (the README's `grpo-async serve` lines) still compiles
its model, and the engines the pytest processes build themselves (the shared engines of `test_vllm_backends`,
`test_real_model`, ...) and the servers started as real commands (`test_cli`, `test_hardening`, ...) compile the helper
too, as a user's engine does.
"""

import vllm.v1.sample.sampler as sampler

sampler.batched_count_greater_than = sampler.batched_count_greater_than._torchdynamo_orig_callable
