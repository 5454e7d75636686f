"""Two real training processes (accelerate launch, gloo on CPU): each rank trains only its slice of each round."""

import pytest
from mp_utils import check_disjoint_slices, launch_with_output


@pytest.mark.multiprocess
@pytest.mark.parametrize("ahead,mu", [(1, 1), (2, 2)])
def test_two_processes_train_disjoint_slices(tiny_model_path, tmp_path, ahead, mu):
    out = str(tmp_path)
    env = {"GRPO_TEST_TOP_P": "0.8"} if ahead == 1 else None
    ranks, printed = launch_with_output([tiny_model_path, out, str(ahead), str(mu)], out, env=env)
    check_disjoint_slices(ranks, mu)
    if env is not None:
        # top_p: the sampler's kept sets travelled with the main process's round to both ranks' slices. Round 0 is
        # trained from the weights that sampled it, so the IS ratio over both ranks' tokens is 1 (a rank whose rows
        # lost their sets would pull it to the kept mass, ~0.8 a token)
        first = [r["is_ratio_mean"][0] for r in ranks]
        assert first[0] == first[1] and abs(first[0] - 1.0) < 0.01, first
    # DDP's warning for a needless `find_unused_parameters=True` is gone (grpo_async.model_config's
    # needs_find_unused_parameters, unit-tested in tests/test_trl_outputs.py; this run is its 2-process proof)
    assert "find_unused_parameters=True was specified" not in printed
