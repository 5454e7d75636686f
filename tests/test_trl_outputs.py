"""What a TRL user finds on disk and in the logs after a run, as TRL 1.16 writes it: the model card at every checkpoint
and on `save_model`, TRL's metric names (`num_tokens`, `step_time`, `completions/*_terminated_length`) beside ours,
strict-JSON pipeline state, and the checks TRL users hit at construction (context length, DDP unused parameters)."""

import importlib.util
import json
import math
import os
import re

import pytest
import transformers
from transformers import AutoConfig, AutoTokenizer, TrainerCallback

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.algo.objective import EntropyController
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.model_config import needs_find_unused_parameters
from grpo_async.pipeline import checkpointing as ckpt

#: TRL 1.16's names for what `_generate_and_score_completions` and `training_step` log (trl/trainer/grpo_trainer.py)
TRL_NAMES = (
    "num_tokens",
    "step_time",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
)


def _strict_json(text: str):
    """`json.loads` that refuses `Infinity`/`NaN` (RFC 8259), as JavaScript's `JSON.parse` and `jq` do."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


class CardAtEverySave(TrainerCallback):
    """Reads `output_dir/README.md` right after each checkpoint save."""

    def __init__(self):
        self.cards = {}

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, "README.md")
        self.cards[state.global_step] = open(path).read() if os.path.exists(path) else None


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory):
    """3 optimizer steps of 8 completions (2 prompts x 4) of up to 32 tokens, a checkpoint at every step; a reward
    function records every round's completion ids (rounds are generated in order, one per step)."""
    out = str(tmp_path_factory.mktemp("trl_outputs") / "tiny-run")
    rounds = []

    def record(prompts, completions, completion_ids, **kwargs):
        rounds.append({"prompts": list(prompts), "ids": [list(c) for c in completion_ids]})
        return [0.0] * len(prompts)

    args = GRPOConfig(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=32,
        max_steps=3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    saves = CardAtEverySave()
    trainer = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=[letter_reward, record],
        args=args,
        train_dataset=make_dataset(64, conversational=False),
        callbacks=[saves],
    )
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return trainer, out, logs, rounds, saves


def test_trl_metric_names_are_logged(run):
    _, _, logs, _, _ = run
    assert len(logs) == 3
    for row in logs:
        missing = [k for k in TRL_NAMES if k not in row]
        assert not missing, f"TRL metrics missing from the step {row['step']} log: {missing}"
    trl_dir = os.path.dirname(importlib.util.find_spec("trl").origin)  # read, not imported (its import warns)
    with open(os.path.join(trl_dir, "trainer", "grpo_trainer.py")) as f:
        logged_by_trl = set(re.findall(r'_metrics\[(?:mode|"train")\]\["([^"]+)"\]', f.read()))
    assert set(TRL_NAMES) <= logged_by_trl  # the names are TRL's own, not a guess


def test_num_tokens_and_terminated_lengths_match_the_completions(run, tiny_model_path):
    """Recomputed from the completion ids the reward function saw, with TRL's definitions: `num_tokens` is the running
    total of prompt + completion tokens; a completion terminated when its last token is EOS (or PAD)."""
    _, _, logs, rounds, _ = run
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ends = {tok.eos_token_id, tok.pad_token_id}
    total, saw_both = 0, set()
    for row, rnd in zip(logs, rounds, strict=False):  # round r is trained at step r + 1 (the rest: generated ahead)
        lengths = [len(ids) for ids in rnd["ids"]]
        total += sum(len(tok(p)["input_ids"]) for p in rnd["prompts"]) + sum(lengths)
        assert row["num_tokens"] == total, (row["step"], row["num_tokens"], total)
        ended = [n for n, ids in zip(lengths, rnd["ids"], strict=True) if ids and ids[-1] in ends] or [0]
        saw_both |= {len(ended) < len(lengths), ended != [0]}
        assert row["completions/mean_terminated_length"] == pytest.approx(sum(ended) / len(ended))
        assert row["completions/min_terminated_length"] == min(ended)
        assert row["completions/max_terminated_length"] == max(ended)
        assert row["completions/clipped_ratio"] == pytest.approx(1 - sum(n > 0 for n in ended) / len(lengths))
    assert saw_both == {True}, "the run should have both terminated and truncated completions"
    assert run[0].state.num_input_tokens_seen == total  # the Trainer's own counter (saved in trainer_state.json)


def test_step_time_is_the_whole_training_step(run):
    """TRL's `step_time`: the wall time of an optimizer step's `training_step` calls, waits for generation included,
    so never below our `timing/train_step` (compute only)."""
    _, _, logs, _, _ = run
    for row in logs:
        assert row["step_time"] > 0 and row["step_time"] >= row["timing/train_step"]


def test_model_card_at_every_checkpoint(run, tiny_model_path):
    """As TRL: `output_dir/README.md` is (re)written before each checkpoint is saved."""
    _, out, _, _, saves = run
    assert sorted(saves.cards) == [1, 2, 3]
    for step, card in saves.cards.items():
        assert card is not None, f"no README.md in output_dir after the checkpoint at step {step}"
        assert f"Trained for {step} optimizer steps." in card and "# Model card for tiny-run" in card
    assert f"base_model: {tiny_model_path}" in open(os.path.join(out, "README.md")).read()


def test_save_model_writes_the_card_where_it_saves(run, tmp_path):
    trainer, _, _, _, _ = run
    target = str(tmp_path / "final")
    trainer.save_model(target)
    assert {"README.md", "model.safetensors", "config.json"} <= set(os.listdir(target))
    card = open(os.path.join(target, "README.md")).read()
    assert "Trained for 3 optimizer steps." in card and "| `record` | 1 |" in card


def test_pipeline_state_is_strict_json(run):
    _, out, _, _, _ = run
    text = open(os.path.join(out, "checkpoint-3", ckpt.PIPELINE_STATE_FILE)).read()
    state = _strict_json(text)  # Infinity / NaN would raise
    assert state["objective"]["entropy"]["last_world_entropy"] is None  # no entropy measured: inf written as null
    assert state["round"] == 3 and state["policy_version"] == 3


def test_old_state_with_infinity_still_resumes(tmp_path):
    """A checkpoint written before strict JSON (Python's `Infinity`) is read, and null restores "not measured"."""
    state = {
        "micro_steps": 2,
        "round": 2,
        "policy_version": 2,
        "submitted_rounds": [],
        "objective": {"entropy": {"entropy_coef": 0.1, "last_world_entropy": math.inf}},
        "geometry": {"seed": 0},
    }
    (tmp_path / ckpt.PIPELINE_STATE_FILE).write_text(json.dumps(state))  # Python's default: allow_nan
    assert "Infinity" in (tmp_path / ckpt.PIPELINE_STATE_FILE).read_text()
    saved = ckpt.read_pipeline_state(str(tmp_path), {"seed": 0})
    assert saved["objective"]["entropy"]["last_world_entropy"] == math.inf
    ckpt.write_pipeline_state(str(tmp_path), saved)  # the same state, rewritten: strict
    rewritten = _strict_json((tmp_path / ckpt.PIPELINE_STATE_FILE).read_text())
    for entropy in (saved["objective"]["entropy"], rewritten["objective"]["entropy"]):
        controller = EntropyController(0.1, adaptive=True)
        controller.load_state_dict(entropy)
        assert controller.last_world_entropy == math.inf and controller.coef == 0.1


@pytest.mark.parametrize("extra", [0, 1])
def test_max_completion_length_beyond_the_context_is_refused(tiny_model_path, tmp_path, extra):
    context = AutoConfig.from_pretrained(tiny_model_path).max_position_embeddings  # 256
    n = context + extra  # `context` tokens of completion leave no room for a prompt either
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_completion_length=n)
    with pytest.raises(ValueError, match=rf"GRPOConfig.max_completion_length={n} .*max_position_embeddings={context}"):
        GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(8))
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_completion_length=context - 1)
    GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(8))


def test_ddp_find_unused_parameters_only_when_needed(run, tiny_model_path):
    """transformers turns `find_unused_parameters` on for every model trained without gradient checkpointing (our
    default), and DDP then warns at every run; only MoE and vision-language models need it."""
    trainer = run[0]
    assert trainer.args.ddp_find_unused_parameters is False
    assert trainer.accelerator.ddp_handler.find_unused_parameters is False  # what DDP is built with
    args = trainer.args
    dense = AutoConfig.from_pretrained(tiny_model_path)
    moe = transformers.Qwen3MoeConfig(num_experts=4, num_hidden_layers=1, hidden_size=64)
    vlm = transformers.LlavaConfig()

    def model(config):
        return type("M", (), {"config": config})()

    assert needs_find_unused_parameters(model(dense), args) is False
    assert needs_find_unused_parameters(model(moe), args) is True
    assert needs_find_unused_parameters(model(vlm), args) is True
    reentrant = GRPOConfig(
        output_dir="/tmp/unused", report_to=[], use_cpu=True, gradient_checkpointing_kwargs={"use_reentrant": True}
    )
    assert needs_find_unused_parameters(model(vlm), reentrant) is False  # TRL: reentrant checkpointing fails with it


# The 2-process proof (DDP's warning for a needless `find_unused_parameters=True` is gone from a real gloo run) is
# asserted on the runs of tests/test_multiprocess.py, which launch the same `mp_train.py` (one launch instead of two).
