"""Loss scaling: the gradient accumulated over GA = 2 micro-batches on N = 2 real processes (gloo, DDP averaging)
equals the gradient of the whole batch in one pass, in float64, for the loss types whose definition is a
whole-batch normalisation (grpo: mean over sequences, dr_grpo: / (B · max_completion_length), dapo: / the round's
loss tokens, TRL's global token count). bnpo normalises by each micro-batch's own tokens (TRL's definition too), so
with skewed lengths it is NOT the whole-batch token mean: checked to differ, which also shows the check can fail."""

import json
import os

import pytest
from support.warm_launch import run_2cpu  # noqa: E402

HERE = os.path.dirname(__file__)

pytestmark = pytest.mark.multiprocess


def test_accumulated_gradient_equals_whole_batch_gradient(tiny_model_path, tmp_path):
    proc = run_2cpu(os.path.join(HERE, "grad_equiv_worker.py"), [tiny_model_path, tmp_path], timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:]
    result = json.load(open(tmp_path / "result.json"))
    for key in ("grpo/packed", "dr_grpo/packed", "dapo/packed", "dapo/padded"):
        assert result[key + "/scale"] > 1e-3, result  # a real gradient, not zeros
        assert result[key] <= 1e-5, (key, result)
    assert result["bnpo/packed"] > 1e-5, result  # per-micro-batch normalisation: not the whole-batch token mean
