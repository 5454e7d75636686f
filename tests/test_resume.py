"""Exact resume: 2·s steps straight vs s steps, stop, resume for s steps — the same prompts (none skipped, none
repeated), the same completions, losses and final weights: with synchronous generation, and with rounds generated
ahead (`num_batches_ahead = k`: the checkpoint saves the k rounds in flight, generated from older weights than the
checkpoint's, and the resumed run trains them as saved)."""

import json
import os

import pytest
import torch
from mp_utils import launch
from support.recorders import recorded
from transformers import TrainerCallback

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.pipeline.checkpointing import PIPELINE_STATE_FILE

S = 3  # checkpoint step; dataset of 8 prompts, 4 per round → 2 optimizer steps per epoch: step 3 is mid-epoch 1


def _prompts_and_completions(micro_batch, state, processing_class):
    """The step a micro-batch trains, its prompts' text and its completions' token ids (each sorted)."""
    return {
        "step": state.global_step + 1,
        "prompts": sorted(processing_class.batch_decode(micro_batch.prompt_ids, skip_special_tokens=True)),
        "completions": sorted(map(tuple, micro_batch.completion_ids.tolist())),
    }


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def _args(out, ahead):
    return GRPOConfig(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        save_metrics_plot=False,  # the end-of-training plot is not this run's subject (~1.3 CPU-s)
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=6,
        max_steps=2 * S,
        save_strategy="steps",
        save_steps=S,
        learning_rate=1e-2,
        logging_steps=1,
        disable_tqdm=True,
        num_batches_ahead=ahead,
        seed=0,
    )


def _run(out, ahead, resume=None, callbacks=()):
    t, seen = recorded(
        model=_run.model_path,
        reward_funcs=letter_reward,
        args=_args(out, ahead),
        train_dataset=make_dataset(8),
        callbacks=list(callbacks),
        record=_prompts_and_completions,
    )
    t.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}
    return t, losses, seen.records


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_resume_trains_exactly_the_remaining_prompts(tiny_model_path, tmp_path, ahead):
    _run.model_path = tiny_model_path
    straight, straight_losses, straight_seen = _run(str(tmp_path / "straight"), ahead)
    first, _, first_seen = _run(str(tmp_path / "split"), ahead, callbacks=[StopAt(S)])
    assert first.state.global_step == S
    ckpt = str(tmp_path / "split" / f"checkpoint-{S}")
    state = json.load(open(os.path.join(ckpt, PIPELINE_STATE_FILE)))
    assert state["round"] == S and state["micro_steps"] == 2 * S and state["policy_version"] == S
    # generated ahead, not trained yet (round S + 1 would start the next epoch: generated when that epoch starts)
    assert state["submitted_rounds"] == list(range(S, S + min(ahead, 1)))
    # ... saved whole, generated from older weights than the checkpoint's (what the resumed run could not redo)
    in_flight = state.get("in_flight", [])
    assert [r["round_id"] for r in in_flight] == state["submitted_rounds"]
    assert all(r["policy_version"] < S for r in in_flight)
    resumed, resumed_losses, resumed_seen = _run(str(tmp_path / "split"), ahead, resume=ckpt)

    after = [b for b in straight_seen if b["step"] > S]
    assert [b["step"] for b in resumed_seen] == [b["step"] for b in after] == [4, 4, 5, 5, 6, 6]
    # the same prompts step by step (none skipped, none repeated), and with the first part exactly the straight run's
    assert per_step(resumed_seen) == per_step(after)
    assert per_step(first_seen + resumed_seen) == per_step(straight_seen)
    # deterministic: completions seeded by (seed, round, row) (seeded_generation), the rounds in flight restored as
    # generated, weights, optimizer and RNG restored
    assert per_step(resumed_seen, "completions") == per_step(after, "completions")
    for step in range(S + 1, 2 * S + 1):
        assert resumed_losses[step] == pytest.approx(straight_losses[step], abs=1e-6)
    for (name, p), q in zip(resumed.model.named_parameters(), straight.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
    if ahead == 0:
        assert [b["prompts"] for b in resumed_seen] == [b["prompts"] for b in after]  # same shuffle too
        assert [b["completions"] for b in resumed_seen] == [b["completions"] for b in after]


def per_step(seen, key="prompts"):
    """Sorted prompts (or completions) trained at each optimizer step (the micro-batch split is shuffled by an RNG
    that the generator thread also draws from while it runs ahead, so only the step's whole set is deterministic)."""
    out = {}
    for b in seen:
        out.setdefault(b["step"], []).extend(b[key])
    return {k: sorted(v) for k, v in out.items()}


def test_resume_refuses_a_changed_batch_geometry(tiny_model_path, tmp_path):
    _run.model_path = tiny_model_path
    _run(str(tmp_path / "run"), 0, callbacks=[StopAt(S)])
    args = _args(str(tmp_path / "run"), 0)
    args.num_generations = 2
    t = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(8))
    with pytest.raises(ValueError, match="batch geometry changed \\(num_generations: 4 → 2\\)"):
        t.train(resume_from_checkpoint=True)


def test_resume_from_the_last_checkpoint_trains_nothing_more(tiny_model_path, tmp_path):
    """A run that ended at `max_steps` mid-epoch (its last checkpoint at that step), launched again with
    `resume_from_checkpoint`, ends at once: no step N + 1 (transformers' loop trained one before its `max_steps` check;
    the chaos test's trainer, killed after its last checkpoint, logged step 21 of 20)."""
    _run.model_path = tiny_model_path
    args = _args(str(tmp_path / "run"), 1)
    args.max_steps = S  # 2 steps per epoch: step 3 is mid-epoch 1

    def run(resume=None):
        t, seen = recorded(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=args,
            train_dataset=make_dataset(8),
            record=_prompts_and_completions,
        )
        t.train(resume_from_checkpoint=resume)
        t.end()
        return t, seen.records

    first, _ = run()
    assert first.state.global_step == S and os.path.isdir(tmp_path / "run" / f"checkpoint-{S}")
    again, again_seen = run(resume=True)
    assert again_seen == []  # no micro-batch trained
    assert again.state.global_step == S
    assert [h["step"] for h in again.state.log_history if "loss" in h] == [1, 2, 3]  # restored, none added
    assert not os.path.isdir(tmp_path / "run" / f"checkpoint-{S + 1}")


@pytest.mark.multiprocess
def test_two_process_resume(tiny_model_path, tmp_path):
    def run(out, **env):
        env = {k.upper(): str(v) for k, v in env.items()}
        return launch([tiny_model_path, out, "1", "1"], out, env={"GRPO_TEST_MAX_STEPS": "6", **env})

    straight = run(str(tmp_path / "straight"), grpo_test_save_steps=S)
    first = run(str(tmp_path / "split"), grpo_test_save_steps=S, grpo_test_stop_at=S)
    resumed = run(str(tmp_path / "split"), grpo_test_resume=str(tmp_path / "split" / f"checkpoint-{S}"))

    def per_round(seen):
        out = {}
        for b in seen:
            out.setdefault(b["round"][0], []).extend(b["prompt"])
        return {k: sorted(v) for k, v in out.items()}

    for rank in (0, 1):
        assert len(resumed[rank]["seen"]) == 2 * S  # GA 2 micro-batches × S steps
        split = per_round(first[rank]["seen"] + resumed[rank]["seen"])
        assert split == per_round(straight[rank]["seen"]), f"rank {rank} trained other prompts after resuming"
        assert sorted(split) == list(range(2 * S))
