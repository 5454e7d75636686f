"""Launch `mp_train.py` on 2 real training processes (gloo on CPU, forked from a warm interpreter:
`support.warm_launch`) and check what each rank trained on: shared by the HF-backend and vLLM-server
multi-process tests."""

import json
import os
import sys

import pytest
from support.warm_launch import run_2cpu

HERE = os.path.dirname(__file__)

#: `accelerate launch` on 2 CPU processes with the README's flags, on a free rendezvous port (`0`): the suite runs its
#: files on parallel workers (`make test`: pytest-xdist), so launches may overlap and the default port 29500 clash
ACCELERATE_2CPU = [
    sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
    "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
]  # fmt: skip


def launch(script_args, out_dir, timeout=420, env=None):
    """`mp_train.py script_args` on 2 processes (forked from a warm interpreter: `warm_launch.run_2cpu`); each rank's
    record (`rank{r}.json` in `out_dir`)."""
    return launch_with_output(script_args, out_dir, timeout, env)[0]


def launch_with_output(script_args, out_dir, timeout=420, env=None) -> tuple[list[dict], str]:
    """`launch`, and what the run printed (stdout + stderr of both ranks)."""
    proc = run_2cpu(os.path.join(HERE, "mp_train.py"), script_args, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-8000:]
    ranks = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(2)]
    return ranks, proc.stdout  # both ranks' stdout and stderr


def check_disjoint_slices(ranks, mu: int, steps: int = 4, R: int = 16, G: int = 4) -> None:
    """Each rank trained exactly its half of every round, μ times; no row twice across ranks; groups intact.

    A round: per_device 4 × 2 processes × steps_per_generation 2 = `R` rows; each rank gets `R / 2`."""
    assert [r["world"] for r in ranks] == [2, 2]
    L = R // 2
    by_round = {}
    for r in ranks:
        for batch in r["seen"]:
            (round_id,) = set(batch["round"])
            by_round.setdefault(round_id, {}).setdefault(r["rank"], []).append(batch["row"])
    assert len(by_round) == steps // mu  # `steps` optimizer steps, GA 2 micro-batches each, μ passes per round
    for round_id, per_rank in by_round.items():
        assert set(per_rank) == {0, 1}
        for rank, batches in per_rank.items():
            rows = [x for b in batches for x in b]
            # μ passes over the same rows: each row exactly μ times on this rank
            assert sorted(rows) == sorted(list(range(rank * L, (rank + 1) * L)) * mu), (round_id, rank, rows)
        # no row is trained by both ranks, and together they cover the round
        r0 = set(x for b in per_rank[0] for x in b)
        r1 = set(x for b in per_rank[1] for x in b)
        assert not r0 & r1 and r0 | r1 == set(range(R))
    # the G completions of a prompt are consecutive rows: every row of a group carries the same prompt,
    # whichever rank trained it and however often
    group_prompt = {}
    for r in ranks:
        for batch in r["seen"]:
            (round_id,) = set(batch["round"])
            for row, prompt in zip(batch["row"], batch["prompt"], strict=True):
                assert group_prompt.setdefault((round_id, row // G), prompt) == prompt
    assert len(group_prompt) == len(by_round) * R // G
    # DDP keeps replicas identical; rewards were logged
    assert ranks[0]["param_checksum"] == pytest.approx(ranks[1]["param_checksum"], rel=0, abs=1e-9)
    assert ranks[0]["rewards"]
