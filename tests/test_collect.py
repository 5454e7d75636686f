"""Full-parameter collection from sharded training models (weight_sync/collect.py)."""

import json
import os

import pytest
from support.warm_launch import run_2cpu

HERE = os.path.dirname(__file__)


@pytest.mark.multiprocess
def test_fsdp2_parameters_are_collected_whole_and_bit_identical(tiny_model_path, tmp_path):
    # 2 ranks with torchelastic's environment, forked from the warm interpreter (`warm_launch.run_2cpu`)
    proc = run_2cpu(os.path.join(HERE, "fsdp_collect.py"), [tiny_model_path, tmp_path], timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:]
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in range(2))
    assert r0["sharded"] > 0 and r0["sharded"] == r1["sharded"]  # the parameters really were DTensors
    assert r0["local_numel"] < r0["full_numel"]  # each rank held a shard only
    assert r0["bit_identical"] and r0["names_equal"]
    assert r0["missing"] in ([], ["lm_head.weight"])  # tied to the embedding: one tensor, not two
    assert r1["empty"]  # only the main process keeps the collected copy
    assert r0["groups"] == r1["groups"] and r0["groups"][0] == "model.embed_tokens"  # module order, every rank
