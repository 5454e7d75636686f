"""Two real training processes (accelerate launch, gloo on CPU): each rank trains only its slice of each round."""

import pytest
from mp_utils import check_disjoint_slices, launch


@pytest.mark.multiprocess
@pytest.mark.parametrize("ahead,mu", [(1, 1), (2, 2)])
def test_two_processes_train_disjoint_slices(tiny_model_path, tmp_path, ahead, mu):
    out = str(tmp_path)
    ranks = launch([tiny_model_path, out, str(ahead), str(mu)], out)
    check_disjoint_slices(ranks, mu)
