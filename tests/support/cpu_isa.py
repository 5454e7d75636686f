"""Imported by `warm_launch`'s fork server (its `PRELOAD`): runs inductor's check of the CPU's vector instruction sets
once, so that every process forked from it inherits the answer.

vLLM compiles a few small ops with `torch.compile` on CPU (the sampler's log-probability ranks, ...), and inductor's
first C++ compile in a process picks the widest vector ISA that builds and loads here
(`torch._inductor.cpu_vec_isa.valid_vec_isa_list`): it compiles a probe library and `dlopen`s it in a child Python
process per candidate ISA. The answer is cached per process, so every engine core of a forked test server asked again:
~3 child interpreters each, ~140 in a run of the suite (~25 CPU-s). Asked here, the forks inherit the cached answer.
"""

from torch._inductor.cpu_vec_isa import valid_vec_isa_list

#: the ISAs this machine builds and loads (empty on a machine without a C++ compiler: inductor then asks nothing)
VALID = valid_vec_isa_list()
