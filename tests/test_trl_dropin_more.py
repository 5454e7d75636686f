"""TRL 1.16 drop-in, the last mile (issue 21.4): TRL's public trainer attributes and static helpers, `eval_loss` as
TRL computes it (and `load_best_model_at_end` on it), `generation_kwargs` applied per repeated row on the hf
backend (`num_beams=2`), a model whose `generate` returns a bare tensor, and TRL's warning texts verbatim."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from datasets import Dataset, IterableDataset
from transformers import AutoModelForCausalLM, AutoTokenizer

trl = pytest.importorskip("trl")
from support.warm_launch import run_2cpu  # noqa: E402
from trl import GRPOTrainer as TRLGRPOTrainer  # noqa: E402

from grpo_async import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_async.demo_task import letter_reward, make_dataset  # noqa: E402
from grpo_async.generation.base import SamplingConfig  # noqa: E402
from grpo_async.generation.hf import HFBackend  # noqa: E402
from grpo_async.testing import tiny_config  # noqa: E402


def _trainer(tiny_model_path, tmp_path, reward_funcs=letter_reward, **overrides):
    return GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=reward_funcs,
        args=tiny_config(tmp_path, **overrides),
        train_dataset=make_dataset(64),
    )


# ---- public attributes and static helpers ------------------------------------------------------------------------
def test_trl_public_attributes(tiny_model_path, tmp_path):
    def shout(text: str) -> str:
        """Upper-case the text.

        Args:
            text: the text.
        """
        return text.upper()

    t = _trainer(tiny_model_path, tmp_path / "a")
    assert t.aux_loss_enabled is False  # the tiny Llama is not a Mixture-of-Experts model
    assert t.reward_processing_classes == [None]  # a plain function has none (TRL's list, one per reward function)
    assert t.tools == []
    assert t.entropy_coef == 0.0

    t2 = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=tiny_config(tmp_path / "b", max_tool_calling_iterations=1),
        train_dataset=make_dataset(64),
        tools=[shout],
    )
    assert t2.tools == [shout]


def test_entropy_coef_is_the_live_adaptive_coefficient(tiny_model_path, tmp_path):
    """TRL's `trainer.entropy_coef` moves with the adaptive controller: after each optimizer step by ± delta."""
    t = _trainer(
        tiny_model_path,
        tmp_path,
        max_steps=2,
        entropy_coef=0.05,
        use_adaptive_entropy=True,
        entropy_coef_delta=0.01,
        entropy_target=100.0,  # every window's entropy is below it: the coefficient grows
    )
    assert t.entropy_coef == 0.05
    t.train()
    assert t.entropy_coef == pytest.approx(0.07)


def test_reward_processing_classes_of_a_reward_model(tiny_model_path, tmp_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=1)
    rm = AutoModelForSequenceClassification.from_config(config)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=[letter_reward, rm],
        reward_processing_classes=[None, tok],
        args=tiny_config(tmp_path),
        train_dataset=make_dataset(64),
    )
    assert t.reward_processing_classes == [None, tok]


def test_get_high_entropy_mask_equals_trls(tiny_model_path, tmp_path):
    """TRL's own method, run on our trainer (it only needs `self.accelerator`), against ours."""
    t = _trainer(tiny_model_path, tmp_path)
    g = torch.Generator().manual_seed(0)
    entropies = torch.rand(6, 9, generator=g) * 3
    mask = (torch.rand(6, 9, generator=g) > 0.3).long()
    for threshold in (0.0, 0.3, 0.8, 1.0):
        ours = t.get_high_entropy_mask(entropies, mask, threshold)
        assert torch.equal(ours, TRLGRPOTrainer.get_high_entropy_mask(t, entropies, mask, threshold)), threshold
        assert ours.dtype == torch.bool and not ours[mask == 0].any()
    assert not t.get_high_entropy_mask(entropies, torch.zeros_like(mask), 0.5).any()


def test_static_helpers_equal_trls_with_trls_keywords():
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(8, 1, generator=g)
    logps = -torch.rand(8, 5, generator=g) * 3
    sampling = logps + torch.randn(8, 5, generator=g) * 0.3
    sampling[0, 1] = float("nan")  # a token the sampler could not score
    mask = (torch.rand(8, 5, generator=g) > 0.2).float()
    kw = dict(
        advantages=adv, per_token_logps=logps, sampling_per_token_logps=sampling, mask=mask, off_policy_threshold=0.05
    )
    ours = GRPOTrainer.get_off_policy_mask(**kw)
    assert torch.equal(ours, TRLGRPOTrainer.get_off_policy_mask(**kw))
    assert 0 < ours.sum() < 8  # some sequences dropped, some kept

    kw = dict(
        advantages=adv,
        log_ratio_per_token=logps - sampling.nan_to_num(),
        mask=mask,
        importance_sampling_ratio=torch.rand(8, 5, generator=g) + 0.5,
        k_pos=2.5,
        lambda_neg=1.5,
    )
    torch.testing.assert_close(GRPOTrainer.get_gamma_weights(**kw), TRLGRPOTrainer.get_gamma_weights(**kw))


# ---- eval_loss -----------------------------------------------------------------------------------------------------
class Recorder:
    """A constant reward (so every advantage is 0) that records each eval completion with its prompt."""

    __name__ = "recorder"

    def __init__(self):
        self.rows: list[tuple] = []

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        self.rows += list(zip(prompts, completion_ids, strict=True))
        return [1.0] * len(prompts)


def _seq_kl(model, ref, prompt_ids: list[int], completion_ids: list[int]) -> float:
    """TRL's per-sequence KL term: k3 `exp(r − p) − (r − p) − 1` averaged over the completion's tokens, from plain
    unpadded forward passes."""
    ids = torch.tensor([prompt_ids + completion_ids])
    P, target = len(prompt_ids), torch.tensor(completion_ids)[:, None]

    def logps(m):
        return torch.log_softmax(m(ids).logits[0, P - 1 : -1].float(), -1).gather(-1, target)[:, 0]

    d = logps(ref) - logps(model)
    return (torch.exp(d) - d - 1).mean().item()


@torch.no_grad()
def test_eval_loss_is_trls_loss_on_the_eval_completions(tiny_model_path, tmp_path):
    """With zero advantages, TRL's eval loss (grpo loss type, ratio 1) is β · the mean over completions of each one's
    mean k3 KL to the reference: recomputed here from the completions the reward saw."""
    rec = Recorder()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    t = GRPOTrainer(
        model=model,
        reward_funcs=rec,
        args=tiny_config(tmp_path, beta=0.5, loss_type="grpo", per_device_eval_batch_size=4),
        train_dataset=make_dataset(64),
    )
    g = torch.Generator().manual_seed(0)
    for p in t.model.parameters():  # move the policy away from its reference (a frozen copy made at construction)
        p.add_(torch.randn(p.shape, generator=g) * 0.05)
    m = t.evaluate(make_dataset(3, seed=5))
    assert len(rec.rows) == 3 * 4
    kls = [_seq_kl(t.model, t.ref_model, t.producer.tokenize_prompts([p])[0][0], c) for p, c in rec.rows]
    assert min(kls) > 0
    assert m["eval_loss"] == pytest.approx(0.5 * sum(kls) / len(kls), rel=1e-3)


def test_eval_loss_of_named_eval_sets_and_load_best_model_at_end(tiny_model_path, tmp_path):
    sets = {"a": make_dataset(2, seed=1), "b": make_dataset(3, seed=2)}
    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=tiny_config(tmp_path, per_device_eval_batch_size=4, beta=0.1),
        train_dataset=make_dataset(64),
        eval_dataset=sets,
    )
    m = t.evaluate()
    assert {"eval_a_loss", "eval_b_loss"} <= set(m)

    args = tiny_config(
        tmp_path / "best",
        max_steps=3,
        beta=0.1,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        per_device_eval_batch_size=4,
    )
    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=make_dataset(64),
        eval_dataset=make_dataset(4, seed=9),
    )
    t.train()
    losses = {e["step"]: e["eval_loss"] for e in t.state.log_history if "eval_loss" in e}
    assert sorted(losses) == [1, 2, 3]
    best = min(losses, key=losses.get)
    assert t.state.best_metric == pytest.approx(losses[best])
    assert t.state.best_model_checkpoint.endswith(f"checkpoint-{best}")


# ---- generation_kwargs per repeated row, a generate that returns a tensor ----------------------------------------
def _prompts(tok) -> list[list[int]]:
    return [tok("Say A")["input_ids"], tok("Say hello there B")["input_ids"]]


def _reference(model, prompt: list[int], **kwargs) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kwargs)
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def test_hf_backend_applies_num_beams_per_repeated_row(tiny_model_path):
    """As TRL passes generation_kwargs: each of a prompt's n rows is its own beam search (n = 2 rows, 2 beams)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    backend = HFBackend(model, tok)
    prompts = _prompts(tok)
    s = SamplingConfig(n=2, max_tokens=6, extra={"num_beams": 2, "do_sample": False})
    out = backend.generate(prompts, s)
    assert len(out) == 4
    for i, c in enumerate(out):
        want = _reference(model, prompts[i // 2], num_beams=2, do_sample=False, max_new_tokens=6, pad_token_id=0)
        assert c.completion_ids == want[: len(c.completion_ids)]
        assert len(c.logprobs) == len(c.completion_ids) and all(lp <= 0 for lp in c.logprobs)


def test_trainer_trains_with_num_beams_2(tiny_model_path, tmp_path):
    t = _trainer(tiny_model_path, tmp_path, max_steps=1, generation_kwargs={"num_beams": 2})
    t.train()
    assert t.state.global_step == 1


@torch.no_grad()
def test_hf_backend_takes_a_generate_that_returns_a_tensor(tiny_model_path):
    """A model whose `generate` ignores `return_dict_in_generate` (a bare tensor): the copy scores the sequences
    itself, with the log-probabilities `generate`'s scores give."""
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    base = type(plain)

    class TensorGenerate(base):
        def generate(self, *args, **kwargs):
            kwargs["return_dict_in_generate"] = False
            return super().generate(*args, **kwargs)

    tensor_model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tensor_model.__class__ = TensorGenerate
    s = SamplingConfig(n=2, max_tokens=6, extra={"do_sample": False})
    want = HFBackend(plain, tok).generate(_prompts(tok), s)
    got = HFBackend(tensor_model, tok).generate(_prompts(tok), s)
    assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=1e-4)


# ---- TRL's warnings, verbatim --------------------------------------------------------------------------------------
TRL_TEXTS = {
    ("luspo", "token"): "When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to "
    "mirror the paper's setup.",
    ("vespo", "sequence"): "VESPO computes sequence-level importance weights internally. `importance_sampling_level` "
    "should be set to `'token'` (the default).",
    ("dapo", "sequence"): "When using `importance_sampling_level='sequence'`, the `'dapo'` loss sums per-token "
    "contributions, which effectively weights each sequence by its completion length instead of optimizing the "
    "per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'` (see "
    "https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-policy-optimization).",
}


@pytest.mark.parametrize("combo", list(TRL_TEXTS))
def test_known_bad_combinations_warn_with_trls_text(tmp_path, combo):
    loss_type, level = combo
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=4,
            num_generations=4,
            loss_type=loss_type,
            importance_sampling_level=level,
            importance_sampling_mode="token_mask",
        )
    assert any(TRL_TEXTS[combo] in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_experimental_and_ignored_argument_warnings_are_trls(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.delenv("TRL_EXPERIMENTAL_SILENCE", raising=False)

    def rollout(prompts, trainer):
        raise AssertionError("not called: nothing is trained")

    text = (
        "You are using 'rollout_func', which is an experimental feature. This API may change or be removed at any "
        "time without prior notice. Silence this warning by setting environment variable TRL_EXPERIMENTAL_SILENCE=1."
    )
    with pytest.warns(UserWarning) as caught:
        GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=tiny_config(tmp_path / "r"),
            train_dataset=make_dataset(64),
            rollout_func=rollout,
        )
    assert text in [str(w.message) for w in caught]

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=tiny_config(tmp_path / "s"),
            train_dataset=make_dataset(64),
            rollout_func=rollout,
        )
    assert text not in [str(w.message) for w in caught]

    # TRL ignores model_init_kwargs for a model object, with a warning (it was an error here)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with pytest.warns(UserWarning, match="The `model_init_kwargs` will be ignored."):
        t = GRPOTrainer(
            model=model,
            reward_funcs=letter_reward,
            args=tiny_config(tmp_path / "m", model_init_kwargs={"dtype": "float32"}),
            train_dataset=make_dataset(64),
        )
    assert t.model is not None


def test_reward_processing_classes_length_error_is_trls(tiny_model_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    with pytest.raises(ValueError, match=r"The number of reward processing classes \(2\) must match the number of "):
        GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            reward_processing_classes=[tok, tok],
            args=tiny_config(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": ["a"] * 8, "letter": ["a"] * 8}),
        )


def test_iterable_dataset_texts_are_trls(tiny_model_path, tmp_path):
    rows = make_dataset(16).to_list()
    stream = IterableDataset.from_generator(lambda: (dict(r) for r in rows))
    args = tiny_config(tmp_path, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match=r"Iterable datasets require `dispatch_batches=False`, but it is set to"):
        GRPOTrainer(tiny_model_path, letter_reward, args, stream)
    with pytest.warns(UserWarning) as caught:
        t = GRPOTrainer(tiny_model_path, letter_reward, tiny_config(tmp_path, dataloader_num_workers=3), stream)
    text = "Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding the provided "
    assert text + "value (3)." in [str(w.message) for w in caught]
    assert t.args.dataloader_num_workers == 0


# ---- loss_type='vespo' with TRL's defaults, environment-owned prompts ------------------------------------------
def test_vespo_with_trls_defaults_trains_on_hf(tiny_model_path, tmp_path):
    """TRL refuses VESPO's sequence-level IS modes only with vLLM; on hf its defaults train (the sequence ratio of the
    default `sequence_mask` mode joins VESPO's sequence weight)."""
    t = _trainer(tiny_model_path, tmp_path, loss_type="vespo", max_steps=2, num_batches_ahead=1)
    assert t.args.importance_sampling_mode == "sequence_mask" and t.args.importance_sampling_correction
    t.train()
    losses = [e["loss"] for e in t.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert any("vespo/phi_seq_mean" in e for e in t.state.log_history)


class OwnsPrompts:
    """An environment that owns the data: `reset` writes the whole prompt (the dataset has only `environment`)."""

    rows: list[dict] = []

    def reset(self, **row) -> str:
        OwnsPrompts.rows.append(row)
        return "Say b"

    def get_reward(self) -> float:
        return 1.0


def test_a_dataset_of_only_an_environment_column(tiny_model_path, tmp_path):
    """As TRL: with an `environment_factory`, `prompt` is optional; each rollout starts from an empty user message
    that `reset()` completes, and the placeholder is not passed to `reset()`."""
    seen = []

    def prompts_seen(prompts, **kwargs):
        seen.extend(prompts)
        return [0.0] * len(prompts)

    OwnsPrompts.rows = []
    ds = Dataset.from_dict({"environment": ["own"] * 8})
    args = tiny_config(tmp_path, max_steps=1, per_device_train_batch_size=4)
    t = GRPOTrainer(tiny_model_path, prompts_seen, args, ds, environment_factory={"own": OwnsPrompts})
    t.train()
    t.close()
    assert seen == [[{"role": "user", "content": "Say b"}]] * 8
    assert OwnsPrompts.rows and all(r == {} for r in OwnsPrompts.rows)
    with pytest.raises(ValueError, match="train_dataset needs a 'prompt' column"):  # without an environment: refused
        GRPOTrainer(tiny_model_path, prompts_seen, tiny_config(tmp_path / "b"), ds)


def test_eval_dataloader_as_trls(tiny_model_path, tmp_path):
    """TRL's `get_eval_dataloader`: each prompt num_generations_eval times in a row; a streaming eval set read by one
    worker for that loader only (the config keeps its workers for the map-style loaders)."""
    ev = make_dataset(6, seed=4)
    stream = IterableDataset.from_generator(lambda: (dict(r) for r in ev.to_list()))
    args = tiny_config(tmp_path, dataloader_num_workers=2, num_generations_eval=2, per_device_eval_batch_size=4)
    t = GRPOTrainer(tiny_model_path, letter_reward, args, make_dataset(64), eval_dataset={"map": ev, "stream": stream})
    assert t.num_generations_eval == 2
    for name in ("map", "stream"):
        loader = t.get_eval_dataloader(name)
        rows = [r for batch in loader for r in batch]
        assert loader.num_workers == (0 if name == "stream" else 2), name
        assert len(rows) == 12 and sorted(r["prompt"][0]["content"] for r in rows[::2]) == sorted(
            r["prompt"][0]["content"] for r in ev
        )
        assert all(rows[i] == rows[i + 1] for i in range(0, 12, 2)), name
    assert t.args.dataloader_num_workers == 2


EVAL_SCRIPT = """
import json, sys
from grpo_async import GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.testing import tiny_config

model, out = sys.argv[1], sys.argv[2]
args = tiny_config(out, max_steps=1, beta=0.1, per_device_eval_batch_size=2, top_entropy_quantile=0.5)
t = GRPOTrainer(model, letter_reward, args, make_dataset(64))
before = t.evaluate(make_dataset(3, seed=1))
t.train()
after = t.evaluate(make_dataset(3, seed=1))
json.dump([before["eval_loss"], after["eval_loss"]], open(f"{out}/rank{t.accelerator.process_index}.json", "w"))
t.end()
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_eval_loss_on_two_processes(tiny_model_path, tmp_path):
    """Two real processes (accelerate launch, DDP over gloo): evaluate() before and after a training step returns
    the same eval_loss on both ranks (every process computes every share: the wrapped model stays in step)."""
    import json

    script = tmp_path / "eval_mp.py"
    script.write_text(EVAL_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = run_2cpu(str(script), [tiny_model_path, out], timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    assert all(math.isfinite(v) for v in ranks[0])
