"""TRL 1.16 usage patterns ported by changing the import: streaming train sets, optional reward functions,
`log_extra` / `log_metric`, `environment_factory`, `rollout_func`, the `padding_free` fallback, eval loss."""

from __future__ import annotations

import pytest
from datasets import Dataset, IterableDataset

from grpo_async import GRPOTrainer
from grpo_async.data.sampler import RepeatSampler, repeat_iterable
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.testing import tiny_config


class PromptLog:
    """A reward function that records the prompts (with their letter) of every call, in order."""

    __name__ = "prompt_log"

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, prompts, completions, letter, **kwargs):
        self.calls.append([p[-1]["content"] if isinstance(p, list) else p for p in prompts])
        return [1.0 if c else 0.0 for c in letter]


def _stream(ds: Dataset) -> IterableDataset:
    rows = ds.to_list()
    return IterableDataset.from_generator(lambda: (dict(r) for r in rows))


def test_repeat_iterable_is_the_sampler_order():
    ds = Dataset.from_dict({"x": list(range(11))})
    sampler = RepeatSampler(ds, mini_repeat_count=3, batch_size=4, repeat_count=2, shuffle=False)
    assert [r["x"] for r in repeat_iterable(_stream(ds), 3, 4, 2)] == list(sampler)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        repeat_iterable(_stream(ds), 3, 0, 2)


def test_streaming_train_set_trains_the_prompts_a_map_style_set_would(tiny_model_path, tmp_path):
    """Same prompts, same rounds, same order: a `datasets.IterableDataset` (unshuffled) against the same rows
    map-style, one round ahead; the stream needs max_steps and gets dispatch_batches=False, as in TRL."""
    data = make_dataset(40, seed=3)
    seen = {}
    for kind, ds in (("map", data), ("stream", _stream(data))):
        log = PromptLog()
        args = tiny_config(tmp_path / kind, shuffle_dataset=False, max_steps=4, num_batches_ahead=1)
        t = GRPOTrainer(model=tiny_model_path, reward_funcs=[letter_reward, log], args=args, train_dataset=ds)
        t.train()
        seen[kind] = log.calls
        assert t.state.global_step == 4
    assert seen["stream"] == seen["map"]
    # each prompt's G = 4 copies are consecutive in every round
    for call in seen["stream"]:
        assert all(len(set(call[i : i + 4])) == 1 for i in range(0, len(call), 4))
    assert len(seen["stream"]) >= 4


def test_streaming_train_set_errors_name_what_to_set(tiny_model_path, tmp_path):
    stream = _stream(make_dataset(40))
    with pytest.raises(ValueError, match="IterableDataset.*max_steps"):
        GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=tiny_config(tmp_path / "a", max_steps=-1, num_train_epochs=1),
            train_dataset=stream,
        )
    with pytest.warns(UserWarning, match=r"require `dataloader_num_workers=0` .*overriding the provided value \(2\)"):
        t = GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=tiny_config(tmp_path / "b", dataloader_num_workers=2),
            train_dataset=stream,
        )
    assert t.args.dataloader_num_workers == 0


def test_reward_functions_log_extra_columns_and_metrics_as_in_trl(tiny_model_path, tmp_path):
    """TRL passes `log_extra(column, values)` and `log_metric(name, value)` to reward functions: the metric is
    averaged into the logs, the column lands in the completions table (parquet) next to the rewards."""
    from grpo_async.logging_utils import read_completions

    def judged(prompts, completions, letter, log_extra, log_metric, **kwargs):
        texts = [c[-1]["content"] for c in completions]
        log_extra("verdict", ["hit" if t.startswith(c) else "miss" for t, c in zip(texts, letter)])
        log_metric("judge/calls", 1.0)
        log_metric("judge/mean_chars", sum(map(len, texts)) / len(texts))
        return [float(t.startswith(c)) for t, c in zip(texts, letter)]

    args = tiny_config(tmp_path / "out", max_steps=2, log_completions=True)
    t = GRPOTrainer(model=tiny_model_path, reward_funcs=judged, args=args, train_dataset=make_dataset(40))
    t.train()
    logs = [h for h in t.state.log_history if "reward" in h]
    assert all(h["judge/calls"] == 1.0 for h in logs)
    assert all(0 <= h["judge/mean_chars"] <= 8 for h in logs)
    table = read_completions(args.output_dir)
    assert set(table["verdict"]) <= {"hit", "miss"} and len(table) == 2 * 16
    assert ((table["verdict"] == "hit") == (table["judged"] == 1.0)).all()


def test_log_extra_with_the_wrong_length_is_named(tiny_model_path, tmp_path):
    def bad(prompts, completions, log_extra, **kwargs):
        log_extra("note", ["x"])
        return [0.0] * len(completions)

    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=bad,
        args=tiny_config(tmp_path / "out", max_steps=1),
        train_dataset=make_dataset(40),
    )
    with pytest.raises(RuntimeError, match=r"log_extra\('note', ...\) logged 1 values for a round of 16"):
        t.train()


def _tiny_opt(tiny_model_path, path):
    """A tiny OPT (its attention ignores restarting position ids: packed rows would attend to each other) with the
    tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    config = OPTConfig(
        num_hidden_layers=1,
        hidden_size=64,
        num_attention_heads=2,
        ffn_dim=128,
        vocab_size=len(tok),
        word_embed_proj_dim=64,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    OPTForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_padding_free_default_falls_back_to_padding_for_a_model_that_cannot_pack(tiny_model_path, tmp_path, caplog):
    """TRL's default pads; ours packs when the model isolates packed rows. A model that cannot (OPT here) trains
    padded with a warning under the default, and an explicit padding_free=True is still refused, naming the model's
    attention."""
    opt = _tiny_opt(tiny_model_path, tmp_path / "opt")
    with caplog.at_level("WARNING", logger="grpo_async.trainer_setup"):
        t = GRPOTrainer(
            model=opt,
            reward_funcs=letter_reward,
            args=tiny_config(tmp_path / "a", max_steps=1),
            train_dataset=make_dataset(40),
        )
    assert t.args.padding_free is False
    assert "does not isolate packed sequences" in caplog.text and "Falling back to padded" in caplog.text
    t.train()
    assert t.state.global_step == 1
    with pytest.raises(ValueError, match="padding_free: this model's attention does not isolate"):
        GRPOTrainer(
            model=opt,
            reward_funcs=letter_reward,
            args=tiny_config(tmp_path / "b", padding_free=True),
            train_dataset=make_dataset(40),
        )
    llama = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=tiny_config(tmp_path / "c"),
        train_dataset=make_dataset(40),
    )
    assert llama.args.padding_free is True  # the default packs a model that isolates packed rows


def _vocab_id(tiny_model_path, char):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    (i,) = tok(char, add_special_tokens=False)["input_ids"]
    return i, tok


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_generation_kwargs_reach_the_sampler(tiny_model_path, tmp_path, backend):
    """TRL's `generation_kwargs` go to the backend's own sampling arguments: a token the extra arguments forbid
    is never sampled (hf: GenerationConfig.suppress_tokens; vLLM: SamplingParams.logit_bias)."""
    from grpo_async.testing import tiny_config as cfg

    banned, tok = _vocab_id(tiny_model_path, "a")
    extra = {"suppress_tokens": [banned]} if backend == "hf" else {"logit_bias": {banned: -100.0}}
    seen = []

    def spy(prompts, completions, completion_ids, **kwargs):
        seen.extend(completion_ids)
        return [0.0] * len(completions)

    args = cfg(
        tmp_path / "out", max_steps=2, generation_backend=backend, generation_kwargs=extra, max_completion_length=16
    )
    GRPOTrainer(model=tiny_model_path, reward_funcs=spy, args=args, train_dataset=make_dataset(40)).train()
    counted = sum(len(c) for c in seen)
    assert counted > 50 and not any(banned in c for c in seen)
    # the same run without the extra arguments samples that token (the tiny model's letters are near-uniform)
    seen.clear()
    args = cfg(tmp_path / "plain", max_steps=2, generation_backend=backend, max_completion_length=16)
    GRPOTrainer(model=tiny_model_path, reward_funcs=spy, args=args, train_dataset=make_dataset(40)).train()
    assert any(banned in c for c in seen)


def test_repetition_penalty_changes_what_the_sampler_samples_from(tiny_model_path, tmp_path):
    """With repetition_penalty the sampler's distribution is no longer π/T: the sampler/trainer logprob gap the
    trainer logs grows from float noise to the penalty's size."""
    gaps = {}
    for penalty in (1.0, 5.0):
        args = tiny_config(tmp_path / str(penalty), max_steps=1, repetition_penalty=penalty, max_completion_length=16)
        t = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(40))
        t.train()
        gaps[penalty] = next(h for h in t.state.log_history if "sampling/logp_diff/max" in h)["sampling/logp_diff/max"]
    assert gaps[1.0] < 1e-4 and gaps[5.0] > 0.1, gaps
    with pytest.raises(ValueError, match="GRPOConfig.repetition_penalty: must be a number > 0"):
        tiny_config(tmp_path / "bad", repetition_penalty=0)


def test_tokenizer_without_pad_token_pads_with_eos_as_trl(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.pad_token = None
    assert tok.pad_token is None
    args = tiny_config(tmp_path / "out", max_steps=1)
    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=make_dataset(40),
        processing_class=tok,
    )
    assert t.processing_class.pad_token == t.processing_class.eos_token
    t.train()
    assert t.state.global_step == 1


def test_cast_lm_head_to_fp32_gives_float32_logits_for_a_bf16_model(tiny_model_path, tmp_path):
    """TRL's `cast_lm_head_to_fp32`: a bf16 model's head computes in float32, the body stays bf16, and the policy
    trains; the head's float32 weights reach the sampler."""
    import torch

    args = tiny_config(
        tmp_path / "out", max_steps=1, cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "bfloat16"}
    )
    t = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(40))
    ids = torch.tensor([[3, 4, 5]])
    out = t.model(input_ids=ids)
    assert out.logits.dtype == torch.float32
    assert t.model.get_output_embeddings().weight.dtype == torch.float32
    assert t.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    head_before = t.model.get_output_embeddings().weight.detach().clone()
    t.train()
    assert not torch.equal(head_before, t.model.get_output_embeddings().weight.detach())


def test_log_unique_prompts_prints_one_completion_per_prompt():
    from rich.console import Console

    from grpo_async.logging_utils import completions_table

    samples = {
        "prompt": ["say a", "say a", "say b", "say b"],
        "completion": ["first-a", "second-a", "first-b", "second-b"],
        "rewards": {"r": [1.0, 0.0, 1.0, 0.0]},
        "reward": [1.0, 0.0, 1.0, 0.0],
        "advantage": [0.7, -0.7, 0.7, -0.7],
        "policy_version": [1] * 4,
        "round": 1,
    }
    for unique, shown in ((False, ["first-a", "second-a", "first-b"]), (True, ["first-a", "first-b"])):
        console = Console(record=True, width=200)
        console.print(completions_table(samples, step=1, n=3, unique_prompts=unique))
        text = console.export_text()
        assert [c for c in samples["completion"] if c in text] == shown


def test_chat_template_kwargs_reach_every_template_call(tiny_model_path, tmp_path):
    """TRL's `chat_template_kwargs` are arguments of apply_chat_template: the prompts a round is generated from are
    rendered with them (here a template variable switches a system line on)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = (
        "{% if terse %}<|system|>be terse{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    messages = [{"role": "user", "content": "Say a"}]
    ids = {}
    for terse in (None, {"terse": True}):
        args = tiny_config(tmp_path / str(terse), chat_template_kwargs=terse)
        t = GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=args,
            train_dataset=make_dataset(40),
            processing_class=tok,
        )
        (ids[bool(terse)],), _ = t.producer.tokenize_prompts([messages])
    assert tok.decode(ids[True]).startswith("<|system|>be terse")
    assert ids[True][-len(ids[False]) :] == ids[False] and len(ids[True]) > len(ids[False])
    with pytest.raises(ValueError, match="GRPOConfig.chat_template_kwargs: must be a dict"):
        tiny_config(tmp_path / "bad", chat_template_kwargs=["terse"])


def test_max_tool_calling_iterations_bounds_tool_turns(tiny_model_path, tmp_path):
    from grpo_async.envs.tools import calculator

    data = make_dataset(40)
    for iterations, turns in ((2, 3), (None, 8)):  # None: until max_completion_length (8 tokens here)
        args = tiny_config(tmp_path / str(iterations), max_tool_calling_iterations=iterations)
        t = GRPOTrainer(
            model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=data, tools=[calculator]
        )
        assert t.environment.max_turns == turns


def test_streaming_eval_set_is_evaluated_like_the_same_rows_map_style(tiny_model_path, tmp_path):
    """An `IterableDataset` eval set: every prompt generated num_generations_eval times, the same prompts as the
    map-style set gives (the rewards are per-prompt constants here, so the means must match exactly)."""
    data = make_dataset(12, seed=5)
    log = PromptLog()
    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=[log],
        args=tiny_config(tmp_path / "out", num_generations_eval=2, per_device_eval_batch_size=4),
        train_dataset=make_dataset(40),
    )
    metrics = {kind: t.evaluate(ds) for kind, ds in (("map", data), ("stream", _stream(data)))}
    assert metrics["stream"]["eval_reward"] == metrics["map"]["eval_reward"] == 1.0
    prompts = [p for call in log.calls for p in call]
    assert len(prompts) == 2 * 2 * 12 and prompts[: len(prompts) // 2] == prompts[len(prompts) // 2 :]
