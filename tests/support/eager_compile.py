"""Imported by `warm_launch`'s fork server (its `PRELOAD`): the processes forked from it run `torch.compile`d
functions as plain eager PyTorch (`torch._dynamo.config.disable`, read at each call).

On CPU a vLLM engine compiles one function it runs: the sampler's rank of each sampled token among the vocabulary's
log-probs (`vllm.v1.sample.ops.logprobs.batched_count_greater_than`, in the first step that returns log-probs; the
rank is not something grpo_async reads: it keeps each token's log-prob). Compiled in every process that starts an
engine, it cost ~1.1 CPU-s there (py-spy of `bench/vs_trl.py --smoke`): dynamo's trace, inductor's cache keys (a hash
of every source file of torch and Triton) and its check of the CPU's vector ISAs (a child interpreter per candidate
ISA). Four bench smokes (`vs_trl`, `first_step`, `lora_sync`, `weight_sync`) took 107 CPU-s with it, 83 without.
The sampling itself is a fused C++ op on CPU (`forward_cpu`), not compiled: the tokens and log-probs are the same.

Not everywhere: the engines the pytest processes build themselves (the shared engines of `test_vllm_backends`,
`test_real_model`, ...) and the servers started as real commands (`test_cli`, `test_hardening`, ...) compile it, as a
user's engine does.
"""

import torch._dynamo

torch._dynamo.config.disable = True
