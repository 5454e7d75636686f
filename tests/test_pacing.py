"""Staleness pacing (`GRPOConfig.staleness_policy="pace"`, `pipeline/staleness.py: StalenessPacer`): with a staleness
limit the generator does not start a round (rounds mode) or a prompt group (stream mode) whose rows would lag more
than `max_staleness` policy versions when trained; it waits for the trainer. `staleness_policy="drop"` generates them
and the consumer drops them (`async/dropped_stale`), which is what makes the pacing tests able to fail.

The order of events is read from the real path: the pipeline's own log records (`pacing: ... held`, `released`),
the reward calls (one per round in rounds mode, one per prompt group in stream mode; a dataset column `idx` says
which prompt) and the micro-batches the trainer trains; never timed.
"""

from __future__ import annotations

import logging

import pytest
from support.recorders import recorded
from test_streaming import ROUND, _args, _dataset, _rows

from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.pipeline.staleness import StalenessPacer
from grpo_async.testing import tiny_config

PROMPTS = 4  # tiny_config: a round of 16 rows = 4 prompts × G=4, two micro-steps (GA 2): one optimizer step


def test_pacer_clock_counts_optimizer_steps_not_rounds():
    """`step_at(j)` = s_r + ⌊(m_r + (j − r)·E) / GA⌋ − ⌊m_r / GA⌋ (E micro-steps a round, GA a step)."""
    one = StalenessPacer(1, micro_steps_per_round=2, gradient_accumulation_steps=2)  # one step a round
    one.advance(round_id=5, next_round=6, step=5, micro_step=0, published=5)
    assert [one.step_at(j) for j in (5, 6, 7)] == [5, 6, 7]
    assert [one.lag(j) for j in (6, 7)] == [1, 2] and one.allows(6) and not one.allows(7)
    half = StalenessPacer(1, micro_steps_per_round=1, gradient_accumulation_steps=2)  # two rounds a step
    half.advance(round_id=3, next_round=4, step=1, micro_step=3, published=1)  # round 3 ends step 1's window
    assert [half.step_at(j) for j in (3, 4, 5, 6, 7)] == [1, 2, 2, 3, 3]
    four = StalenessPacer(4, micro_steps_per_round=4, gradient_accumulation_steps=1)  # four steps a round
    four.advance(round_id=0, next_round=0, step=0, micro_step=0, published=0)
    assert [four.step_at(j) for j in (0, 1, 2)] == [0, 4, 8] and four.allows(1) and not four.allows(2)
    assert StalenessPacer(0, 1, 1).allows(99), "no clock yet (before the first round boundary): nothing is held"


class Events(logging.Handler):
    """The pacing log records of the pipeline, appended to the test's event list as they are emitted (any thread)."""

    def __init__(self, events: list):
        super().__init__(logging.INFO)
        self.events = events

    def emit(self, record):
        text = record.getMessage()
        if "pacing:" in text:
            self.events.append(("released" if "released" in text else "held", text))


def _watch(events: list):
    handler = Events(events)
    loggers = [logging.getLogger(f"grpo_async.pipeline.{m}") for m in ("scheduler", "group_stream")]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    return handler, loggers


def _unwatch(handler, loggers):
    for lg in loggers:
        lg.removeHandler(handler)
        lg.setLevel(logging.NOTSET)


def _scored(events: list):
    """`letter_reward` recording each call as `("scored", first prompt's idx)`: a round in rounds mode, a group in
    stream mode."""

    def letter(prompts, completions, completion_ids, idx, **kw):
        events.append(("scored", idx[0]))
        return letter_reward(prompts, completions, completion_ids, **kw)

    return letter


def _with_idx(ds):
    return ds.add_column("idx", list(range(len(ds))))


def _run(trainer, events):
    handler, loggers = _watch(events)
    try:
        trainer.train()
    finally:
        _unwatch(handler, loggers)
        trainer.close()
    return [h for h in trainer.state.log_history if "loss" in h]


def _trained_staleness(seen) -> list[int]:
    """Staleness of every row the trainer trained (loss mask not all zero): the step its round started at (the
    micro-batch's step: one optimizer step a round here) − the row's policy version."""
    out = []
    for b in seen.records:
        kept = b["loss_mask"].any(1)
        out += (b["step"] - b["policy_version"][kept]).tolist()
    return out


def _rows_and_step(micro_batch, state, processing_class):
    """`test_streaming`'s record of a micro-batch, and the optimizer step it is trained at."""
    return {**_rows(micro_batch, state, processing_class), "step": state.global_step}


# ---- rounds mode ------------------------------------------------------------------------------------------------
@pytest.fixture
def rounds_trainer(tiny_model_path, tmp_path):
    def make(policy: str):
        events: list = []
        args = tiny_config(
            tmp_path / policy,
            num_batches_ahead=2,  # round r + 2 generated from the weights of r: 2 versions behind when trained
            max_staleness=1,
            staleness_policy=policy,
            max_steps=4,
            shuffle_dataset=False,  # round j scores prompts 4j .. 4j + 3
        )
        trainer, seen = recorded(
            record=_rows_and_step,
            events=events,
            model=tiny_model_path,
            reward_funcs=_scored(events),
            args=args,
            train_dataset=_with_idx(make_dataset(64)),
        )
        return trainer, events, seen

    return make


def test_rounds_mode_paces_whole_rounds(rounds_trainer):
    """num_batches_ahead=2, max_staleness=1, one step a round: round r + 2 is held at round r's boundary (it would be
    trained 2 versions after the weights it would start on) and submitted at round r + 1's, after the trainer trained
    round r: nothing dropped, every trained row within 1 version."""
    trainer, events, seen = rounds_trainer("pace")
    logs = _run(trainer, events)
    assert sum(h["async/dropped_stale"] for h in logs) == 0
    assert max(_trained_staleness(seen)) <= 1
    assert "async/pace_wait_s" in logs[0]
    held = [e for e in events if e[0] == "held"]
    assert any("round 2 held back at step 0" in text for _, text in held), events
    # order: round 2 (prompts 8..11) is scored only after round 0's micro-batches were trained
    scored_r2 = events.index(("scored", 2 * PROMPTS))
    trained_r0 = [i for i, e in enumerate(events) if e[0] == "train" and e[1][0][0] == 0]
    assert len(trained_r0) == 2 and max(trained_r0) < scored_r2, events
    # decided when round 0's rounds ahead are submitted: the hf engine shares the trainer's cores, so that is at the
    # end of the first step, after round 0 was trained (`SchedulerSettings.first_round_alone`)
    assert max(trained_r0) < events.index(held[0]) < scored_r2, events


def test_rounds_mode_drop_policy_generates_then_drops(rounds_trainer):
    """The same run with `staleness_policy="drop"` (today's behaviour): rounds 2 and 3 are generated 2 rounds ahead,
    2 versions behind when trained: every one of their rows is dropped and counted; nothing is held."""
    trainer, events, seen = rounds_trainer("drop")
    logs = _run(trainer, events)
    assert sum(h["async/dropped_stale"] for h in logs) == 2 * ROUND  # rounds 2 and 3, one process
    assert not [e for e in events if e[0] in ("held", "released")]
    assert "async/pace_wait_s" not in logs[0]
    # the hf engine shares the trainer's cores: the rounds ahead of round 0 are submitted when the first step ends
    # (`SchedulerSettings.first_round_alone`), so round 1 (prompts 4..7) is generated after round 0 was trained
    trained_r0 = [i for i, e in enumerate(events) if e[0] == "train" and e[1][0][0] == 0]
    assert len(trained_r0) == 2 and max(trained_r0) < events.index(("scored", PROMPTS)), events


# ---- stream mode ------------------------------------------------------------------------------------------------
def _stream_run(tiny_model_path, tmp_path, policy: str):
    """tests/test_streaming.py's straggler run (prompt 0's group 10× longer, 4 groups a round, 8 in flight, 3 rounds
    submitted) with max_staleness=1."""
    events: list = []
    args = _args(tmp_path / policy, max_staleness=1, staleness_policy=policy)
    trainer, seen = recorded(
        record=_rows_and_step,
        events=events,
        model=tiny_model_path,
        reward_funcs=_scored(events),
        args=args,
        train_dataset=_with_idx(_dataset()),
    )
    return trainer, events, _run(trainer, events), seen


@pytest.mark.vllm
def test_stream_mode_paces_groups_and_drops_nothing(tiny_model_path, tmp_path):
    """Pace: round 2's groups wait until the trainer's step-1 weights are loaded (started on step 0's they would be
    trained 2 versions later); the trainer waits for the straggler instead of training round 1 without it, so the
    straggler is trained within the bound too: no row dropped, none trained beyond max_staleness. The generator's
    wait shows in the order of events (held → the trainer trains → released → round 2's groups scored) and in
    `async/pace_wait_s`."""
    trainer, events, logs, seen = _stream_run(tiny_model_path, tmp_path, "pace")
    rows = [r for b in seen.records for r in b["rows"]]
    assert sorted(rows) == [(r, i) for r in range(4) for i in range(ROUND)], "every row of rounds 0..3 once"
    assert sum(h["async/dropped_stale"] for h in logs) == 0
    assert max(_trained_staleness(seen)) <= 1
    held = next(i for i, e in enumerate(events) if e[0] == "held")
    first_train = next(i for i, e in enumerate(events) if e[0] == "train")
    released = next(i for i, e in enumerate(events) if e[0] == "released" and i > first_train)
    assert held < first_train < released, events
    later = [i for i, e in enumerate(events) if e[0] == "scored" and e[1] >= 2 * PROMPTS]  # rounds 2, 3's groups
    assert later and min(later) > released, events
    assert sum(h["async/pace_wait_s"] for h in logs) > 0


@pytest.mark.vllm
def test_stream_mode_drop_policy_generates_then_drops(tiny_model_path, tmp_path):
    """The same run with `staleness_policy="drop"`: round 2's groups start on step 0's weights as soon as workers
    are free, and rows trained 2 versions later (the straggler's among them) are generated, then dropped."""
    trainer, events, logs, seen = _stream_run(tiny_model_path, tmp_path, "drop")
    assert sum(h["async/dropped_stale"] for h in logs) > 0
    assert not [e for e in events if e[0] in ("held", "released")]


def _slow_engine(monkeypatch):
    """Every engine step ≥ 10 ms (as tests/test_streaming.py's in-flight test): the straggler's 200 tokens outlast
    several optimizer steps whatever the machine's speed."""
    import time

    from vllm.v1.engine.llm_engine import LLMEngine

    step = LLMEngine.step

    def slow_step(self):
        time.sleep(0.01)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", slow_step)


@pytest.mark.vllm
@pytest.mark.parametrize("policy", ["pace", "drop"])
def test_stream_mode_waits_for_a_straggler_on_its_last_chance(tiny_model_path, tmp_path, monkeypatch, policy):
    """In-flight weight updates and max_staleness=2: no start is ever held (the stream's 2 rounds of groups never
    reach 2 versions ahead), so only the assembly can keep the straggler (prompt 0, started on v0) within the bound:
    round 2 is its last chance (s_3 − 0 = 3 > 2). Pace: round 2 waits for it and takes it; nothing is dropped, no
    row trained beyond 2 versions. Drop: rounds 0..2 are assembled from the short groups and the straggler, trained
    later, is dropped."""
    _slow_engine(monkeypatch)
    events: list = []
    args = _args(tmp_path, max_staleness=2, staleness_policy=policy, weight_sync_inflight=True)
    trainer, seen = recorded(
        record=_rows_and_step,
        events=events,
        model=tiny_model_path,
        reward_funcs=_scored(events),
        args=args,
        train_dataset=_with_idx(_dataset()),
    )
    logs = _run(trainer, events)
    dropped = sum(h["async/dropped_stale"] for h in logs)
    straggler = [b["step"] for b in seen.records if any(r == (0, 0) for r in b["rows"])]
    if policy == "drop":
        # dropped when it came late; a run where it finished in time for round 2 (the machine's speed decides: the
        # full suite saw both) drops nothing and trains it within the bound
        assert dropped > 0 or (straggler and straggler[0] <= 2), (dropped, straggler)
        return
    assert dropped == 0
    assert max(_trained_staleness(seen)) <= 2
    assert straggler and straggler[0] <= 2, "the straggler was trained after its last chance"
    # whether round 2 had to wait for it (logged "waits for 1 running group") depends on whether it was still running
    # when round 2 was assembled, which the machine's speed decides (the full suite saw both); the order of a held
    # start, the training and the release is asserted by test_stream_mode_paces_groups_and_drops_nothing
