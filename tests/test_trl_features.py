"""TRL 1.16 features with TRL's meaning: multi_objective_aggregation (GDPO), num_generations_eval and eval sets by
name, sync_ref_model (TR-DPO reference updates)."""

import inspect
import textwrap
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset, DatasetDict
from recording import recorded_trainer
from transformers import AutoModelForCausalLM, TrainerCallback

trl = pytest.importorskip("trl")
from trl import GRPOTrainer as TRLGRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd as trl_nanstd  # noqa: E402

from grpo_async import GRPOTrainer  # noqa: E402
from grpo_async.algo.advantages import aggregate_advantages  # noqa: E402
from grpo_async.algo.ref_sync import RefModelSyncCallback, mix_into  # noqa: E402
from grpo_async.demo_task import letter_reward, make_dataset  # noqa: E402
from grpo_async.testing import tiny_config  # noqa: E402

NAN = float("nan")


# ---- multi_objective_aggregation: TRL's own code on the same reward tensors ------------------------------------
def _trl_advantage_block():
    """TRL 1.16's advantage code, cut out of `GRPOTrainer._generate_and_score_completions` and run as is
    (grpo_trainer.py lines 2759-2810: `unscorable_mask = ...` through `advantages = torch.nan_to_num(...)`)."""
    src = inspect.getsource(TRLGRPOTrainer._generate_and_score_completions)
    start = src.index("        unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)\n")
    end = src.index("        # Slice to keep only the local part of the data")
    block = textwrap.dedent(src[start:end])
    assert 'elif self.multi_objective_aggregation == "normalize_then_sum":' in block  # the cut holds both branches
    return compile(block, "<trl advantages>", "exec")


def trl_advantages(rewards_per_func, weights, num_generations, scale_rewards, aggregation):
    ns = {
        "self": SimpleNamespace(
            multi_objective_aggregation=aggregation,
            scale_rewards=scale_rewards,
            reward_weights=weights,
            reward_funcs=[None] * rewards_per_func.size(1),
        ),
        "rewards_per_func": rewards_per_func.clone(),
        "num_generations": num_generations,
        "device": rewards_per_func.device,
        "nanstd": trl_nanstd,
        "torch": torch,
    }
    exec(_trl_advantage_block(), ns)
    return ns["advantages"]


def _reward_table(G: int) -> torch.Tensor:
    """`[4·G, 3]` rewards: random values, a group with zero spread, Nones (NaN) of one function, a function that is
    None for a whole group, and completions every function declined."""
    g = torch.Generator().manual_seed(G)
    r = torch.randint(0, 5, (4 * G, 3), generator=g).float()
    r[:, 2] = torch.rand(4 * G, generator=g) * 3
    r[G : 2 * G, 0] = 2.0  # function 0 has zero spread in group 1
    r[1, 1] = NAN  # function 1 declined one completion
    r[2 * G : 3 * G, 2] = NAN  # function 2 declined a whole group
    r[3 * G] = NAN  # a completion no function scored
    r[G + 1] = NAN
    return r


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("G", [2, 4])
def test_advantages_match_trl_code(aggregation, scale_rewards, G):
    rewards = _reward_table(G)
    weights = torch.tensor([1.0, 0.5, 2.0])
    ours = aggregate_advantages(rewards, weights, G, scale_rewards, aggregation)
    theirs = trl_advantages(rewards, weights, G, scale_rewards, aggregation)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert ours[3 * G] == 0 and ours[G + 1] == 0  # unscorable completions carry no signal


def test_normalize_then_sum_is_not_sum_then_normalize():
    rewards = _reward_table(4)
    weights = torch.tensor([1.0, 0.5, 2.0])
    gdpo = aggregate_advantages(rewards, weights, 4, "group", "normalize_then_sum")
    plain = aggregate_advantages(rewards, weights, 4, "group", "sum_then_normalize")
    assert not torch.allclose(gdpo, plain, atol=1e-3)
    # scale_rewards does not apply to normalize_then_sum (as in TRL)
    for scale in ("batch", "none"):
        torch.testing.assert_close(aggregate_advantages(rewards, weights, 4, scale, "normalize_then_sum"), gdpo)


def test_aggregation_is_validated(tmp_path):
    with pytest.raises(ValueError, match=r"GRPOConfig\.multi_objective_aggregation: must be one of"):
        tiny_config(tmp_path, multi_objective_aggregation="normalise_then_sum")


def id_sum(prompts, completions, completion_ids, **kw):
    return [float(sum(ids) % 7) for ids in completion_ids]


def first_id_or_none(prompts, completions, completion_ids, **kw):
    return [None if i % 3 == 0 else float(ids[0] % 5) for i, ids in enumerate(completion_ids)]


def test_trainer_trains_on_normalize_then_sum_advantages(tiny_model_path, tmp_path):
    args = tiny_config(
        tmp_path,
        max_steps=1,
        num_batches_ahead=0,
        multi_objective_aggregation="normalize_then_sum",
        reward_weights=[1.0, 0.5],
        scale_rewards="none",  # ignored by normalize_then_sum, as in TRL
    )
    t, seen = recorded_trainer(
        model=tiny_model_path, reward_funcs=[id_sum, first_id_or_none], args=args, train_dataset=make_dataset(64)
    )
    t.train()
    samples = t.rounds.last_samples  # the round trained at step 1
    rewards = torch.tensor([samples["rewards"]["id_sum"], samples["rewards"]["first_id_or_none"]]).T  # [R, 2]
    assert rewards[:, 1].isnan().any() and not rewards[:, 1].isnan().all()
    weights = torch.tensor([1.0, 0.5])
    expected = trl_advantages(rewards, weights, 4, "none", "normalize_then_sum")
    torch.testing.assert_close(torch.tensor(samples["advantage"]), expected, atol=1e-5, rtol=0)
    plain = trl_advantages(rewards, weights, 4, "none", "sum_then_normalize")
    assert not torch.allclose(expected, plain, atol=1e-3)
    # the micro-batches trained carry exactly these advantages
    for batch in seen:
        torch.testing.assert_close(batch["advantages"], expected[batch["row_index"]], atol=1e-5, rtol=0)
    assert sum(len(b["advantages"]) for b in seen) == len(expected)
    # the logged reward is still the weighted sum of the raw rewards (as TRL logs it)
    raw = (rewards * weights).nansum(1)
    raw[rewards.isnan().all(1)] = NAN
    torch.testing.assert_close(torch.tensor(samples["reward"]), raw, equal_nan=True)


# ---- num_generations_eval, eval sets by name ------------------------------------------------------------------
def _eval_set(n: int, name: str) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Say {'abcd'[i % 4]}"}] for i in range(n)],
            "letter": ["abcd"[i % 4] for i in range(n)],
            "key": [f"{name}{i}" for i in range(n)],
        }
    )


def _counting_reward(counts: dict):
    def letter_counted(prompts, completions, completion_ids, letter, key, **kw):
        for k in key:
            counts[k] = counts.get(k, 0) + 1
        return letter_reward(prompts, completions, completion_ids, letter)

    return letter_counted


def test_eval_samples_num_generations_eval_completions_per_prompt(tiny_model_path, tmp_path):
    counts: dict[str, int] = {}
    args = tiny_config(tmp_path, num_generations=4, num_generations_eval=3, per_device_eval_batch_size=6)
    t = GRPOTrainer(
        model=tiny_model_path, reward_funcs=_counting_reward(counts), args=args, train_dataset=make_dataset(64)
    )
    m = t.evaluate(_eval_set(5, "p"))
    assert counts == {f"p{i}": 3 for i in range(5)}
    assert m["eval_completions/mean_length"] > 0 and "eval_rewards/letter_counted" in m

    counts.clear()  # None: num_generations, as TRL
    t2 = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=_counting_reward(counts),
        args=tiny_config(tmp_path, num_generations=4),
        train_dataset=make_dataset(64),
    )
    t2.evaluate(_eval_set(2, "q"))
    assert counts == {"q0": 4, "q1": 4}


@pytest.mark.parametrize("as_dict", [False, True])
def test_eval_sets_by_name_are_prefixed(tiny_model_path, tmp_path, as_dict):
    counts: dict[str, int] = {}
    sets = {"short": _eval_set(2, "s"), "long": _eval_set(3, "l")}
    eval_dataset = dict(sets) if as_dict else DatasetDict(sets)
    args = tiny_config(tmp_path, num_generations=4, num_generations_eval=2, per_device_eval_batch_size=4)
    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=_counting_reward(counts),
        args=args,
        train_dataset=make_dataset(64),
        eval_dataset=eval_dataset,
    )
    m = t.evaluate()
    for name in sets:
        for key in ("reward", "reward_std", "rewards/letter_counted", "completions/mean_length", "runtime"):
            assert f"eval_{name}_{key}" in m, (name, key, sorted(m))
    assert counts == {**{f"s{i}": 2 for i in range(2)}, **{f"l{i}": 2 for i in range(3)}}
    counts.clear()
    one = t.evaluate("long")  # the Trainer's convention: the name of one eval set
    assert "eval_reward" in one and counts == {f"l{i}": 2 for i in range(3)}


def test_num_generations_eval_is_validated_like_trl(tmp_path):
    with pytest.raises(ValueError, match=r"GRPOConfig\.num_generations_eval: must be an int >= 1"):
        tiny_config(tmp_path, num_generations_eval=0)
    # evaluating during training: the global eval batch holds whole groups (TRL's rule)
    with pytest.raises(ValueError, match=r"GRPOConfig\.num_generations_eval: the global eval batch.*8 rows.*\(3\)"):
        tiny_config(tmp_path, num_generations_eval=3, eval_strategy="steps", eval_steps=1)
    with pytest.raises(ValueError, match=r"GRPOConfig\.num_generations_eval: .*\(3, num_generations since"):
        tiny_config(tmp_path, num_generations=3, gradient_accumulation_steps=3, eval_strategy="steps", eval_steps=1)
    tiny_config(tmp_path, num_generations_eval=3, per_device_eval_batch_size=6, eval_strategy="steps", eval_steps=1)
    tiny_config(tmp_path, num_generations_eval=3)  # no evaluation during training: TRL checks nothing either


# ---- sync_ref_model (TR-DPO) ----------------------------------------------------------------------------------
def test_ref_sync_config_follows_trl(tmp_path):
    with pytest.raises(ValueError, match=r"GRPOConfig\.sync_ref_model: is True but beta=0"):
        tiny_config(tmp_path, sync_ref_model=True)
    with pytest.raises(NotImplementedError, match=r"GRPOConfig\.sync_ref_model=True with GRPOConfig\.ref_server_url"):
        tiny_config(tmp_path, sync_ref_model=True, beta=0.1, ref_server_url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"GRPOConfig\.ref_model_mixup_alpha: must be in \[0, 1\]"):
        tiny_config(tmp_path, sync_ref_model=True, beta=0.1, ref_model_mixup_alpha=1.5)
    with pytest.raises(ValueError, match=r"GRPOConfig\.ref_model_sync_steps: must be an int >= 1"):
        tiny_config(tmp_path, sync_ref_model=True, beta=0.1, ref_model_sync_steps=0)
    # unused without sync_ref_model, as in TRL
    tiny_config(tmp_path, ref_model_mixup_alpha=1.5, ref_model_sync_steps=0)


def test_ref_sync_with_peft_is_refused_like_trl(tiny_model_path, tmp_path):
    from peft import LoraConfig

    args = tiny_config(tmp_path, sync_ref_model=True, beta=0.1)
    with pytest.raises(NotImplementedError, match="sync_ref_model=True with a peft_config"):
        GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=args,
            train_dataset=make_dataset(64),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )


def test_mix_into_is_trls_update():
    torch.manual_seed(0)
    policy, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref_copy = torch.nn.Linear(3, 2)
    ref_copy.load_state_dict(ref.state_dict())
    mix_into(ref, policy, 0.3)
    trl.trainer.callbacks.SyncRefModelCallback._sync_target_model(policy, ref_copy, 0.3)
    for a, b in zip(ref.parameters(), ref_copy.parameters(), strict=True):
        assert torch.equal(a, b)


class _PolicyAt(TrainerCallback):
    """Snapshots the policy's parameters at the end of optimizer step `step`."""

    def __init__(self, step: int):
        self.step, self.params = step, None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            self.params = {n: p.detach().clone() for n, p in model.named_parameters()}


def _row_logps(model, batch, i: int) -> torch.Tensor:
    """Logps of row `i`'s completion tokens under `model`, from an unpadded forward of that row alone."""
    prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
    completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()]
    ids = torch.cat([prompt, completion]).unsqueeze(0)  # [1, P+T]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # [T, V]
    return torch.log_softmax(logits.float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)  # [T]


def test_ref_model_mixes_in_the_policy_every_sync_steps(tiny_model_path, tmp_path):
    alpha = 0.3
    args = tiny_config(
        tmp_path,
        max_steps=3,
        gradient_accumulation_steps=1,  # one round per optimizer step: round r is trained at step r + 1
        beta=0.1,
        sync_ref_model=True,
        ref_model_mixup_alpha=alpha,
        ref_model_sync_steps=2,
    )
    at_step_2 = _PolicyAt(2)
    t, seen = recorded_trainer(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=make_dataset(64),
        callbacks=[at_step_2],
    )
    assert any(isinstance(c, RefModelSyncCallback) for c in t.callback_handler.callbacks)
    ref0 = {n: p.detach().clone() for n, p in t.ref_model.named_parameters()}
    t.train()

    # after step 2 (and not after steps 1 or 3): ref = α · policy(step 2) + (1 − α) · ref0
    expected = {n: alpha * at_step_2.params[n] + (1 - alpha) * ref0[n] for n in ref0}
    for n, p in t.ref_model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], atol=1e-6, rtol=0)
    final_policy = dict(t.model.named_parameters())
    assert any(not torch.allclose(final_policy[n].detach(), at_step_2.params[n]) for n in ref0)  # step 3 moved it

    # the reference logps of each round: rounds 0 and 1 (steps 1, 2) from ref0, round 2 (step 3) from the mix
    frozen = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    mixed = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    mixed.load_state_dict(expected, strict=False)
    moved = 0.0
    for batch in seen:
        rnd = int(batch["round_id"][0])
        for i in range(len(batch["advantages"])):
            T = int(batch["completion_mask"][i].sum())
            used = batch["ref_logps"][i, :T]
            torch.testing.assert_close(used, _row_logps(mixed if rnd == 2 else frozen, batch, i), atol=1e-4, rtol=0)
            if rnd == 2:
                moved = max(moved, (used - _row_logps(frozen, batch, i)).abs().max().item())
    assert {int(b["round_id"][0]) for b in seen} == {0, 1, 2}
    assert moved > 1e-2, "the mixed reference scores like the frozen one: the test could not tell them apart"
