"""Two real training processes (accelerate launch, gloo on CPU): each rank trains only its slice of each round."""

import pytest
from mp_utils import check_disjoint_slices, launch_with_output


@pytest.mark.multiprocess
@pytest.mark.parametrize("ahead,mu", [(1, 1), (2, 2)])
def test_two_processes_train_disjoint_slices(tiny_model_path, tmp_path, ahead, mu):
    out = str(tmp_path)
    ranks, printed = launch_with_output([tiny_model_path, out, str(ahead), str(mu)], out)
    check_disjoint_slices(ranks, mu)
    # DDP's warning for a needless `find_unused_parameters=True` is gone (grpo_async.model_config's
    # needs_find_unused_parameters, unit-tested in tests/test_trl_outputs.py; this run is its 2-process proof)
    assert "find_unused_parameters=True was specified" not in printed
