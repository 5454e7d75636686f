"""TRL's `TestGRPOTrainer` vision-language tests, ported (TRL's `test_training_vlm*`): each trains a tiny VLM for
TRL's 3 epochs with TRL's arguments (learning rate 0.1, 3 rows of 3 generations, 8-token completions, a reward that
pays a completion's length) and checks TRL's closing assertions (a train loss; the parameters moved), run on our
`GRPOTrainer` with only the import swapped.

What stands in for the Hub (built offline, `grpo_async.testing.vlm`): TRL's `trl-internal-testing/tiny-<Family>`
models are tiny random VLMs of the same classes (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`, `Gemma3ForConditionalGeneration`, `LlavaNextForConditionalGeneration`;
`Idefics3ForConditionalGeneration`, the class TRL's commented-out SmolVLM case names), with real image processors;
`trl-internal-testing/zen-image` is two Zen of Python aphorisms as conversational prompts, each with a square image
(so a run is 6 steps: 3 epochs of one prompt per step); `zen-multi-image` the same with an `images` column of one or
two images a row.

Where ours asserts more than TRL's: TRL skips the vision towers when it checks that parameters moved ("the
gradient does not flow properly through the vision parts" of its tiny models); ours checks every parameter the
forward reads (Gemma3's SigLIP pooling head is never read), vision towers included, and the multi-image run on
every family rather than Qwen2.5-VL alone.

Not ported: `test_training_vlm_and_liger` (`use_liger_kernel` is refused with its reason,
`tests/test_trl_config_compat.py`), `test_training_vlm_and_vllm` (skipped in TRL itself; our in-process vLLM engine
with a VLM is tested in `tests/test_vlm.py`).

`GRPO_ASYNC_TRL_PARITY=1 pytest tests/test_trl_vlm.py` runs this file on TRL 1.16's own `GRPOTrainer` instead.
"""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from support.qwen3 import zen_lines

from grpo_async.testing.vlm import COLOURS, UNUSED_PARAMETERS, TinyVLMSpec, build_tiny_vlm, square_image

PARITY = os.environ.get("GRPO_ASYNC_TRL_PARITY") == "1"  # run on TRL's GRPOTrainer (see the module docstring)
if PARITY:
    from trl import GRPOConfig, GRPOTrainer
else:
    from grpo_async import GRPOConfig, GRPOTrainer

FAMILIES = ["gemma3", "llava_next", "qwen2_5_vl", "qwen2_vl", "idefics3"]
VISION = ("model.visual.", "model.vision_tower.", "model.vision_model.", "model.multi_modal_projector.")


@pytest.fixture(scope="module")
def tiny_vlms(tmp_path_factory):
    """family -> the path of its tiny VLM, built on first use."""
    root, built = tmp_path_factory.mktemp("tiny_vlms"), {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = build_tiny_vlm(root / family, TinyVLMSpec(family=family))
        return built[family]

    return get


def zen_image(multi: bool = False) -> Dataset:
    """A stand-in for `trl-internal-testing/zen-image` (`conversational_prompt_only`): two aphorisms, each without
    its last word, with an `image`; `multi`: `zen-multi-image`, an `images` column of 1 and 2 images (the second
    one twice as tall)."""
    colours = list(COLOURS)
    rows = []
    for i, line in enumerate(zen_lines()[:2]):
        row = {"prompt": [{"role": "user", "content": line.rsplit(" ", 1)[0]}]}
        images = [square_image(colours[(i + j) % len(colours)], 40, 10 * i + j) for j in range(1 + i)]
        images[1:] = [image.resize((40, 80)) for image in images[1:]]  # LLaVA-NeXT: 3 crops where a square has 5
        row.update({"images": images} if multi else {"image": images[0]})
        rows.append(row)
    return Dataset.from_list(rows)


def reward_func(completions, **kwargs):
    """Reward function that rewards longer completions (TRL's)."""
    return [float(len(completion[0]["content"])) for completion in completions]


def _args(tmp_path, **overrides) -> GRPOConfig:
    """TRL's arguments in these tests (TRL on a CPU also needs `use_cpu` and no bf16)."""
    cpu = {"use_cpu": True, "bf16": False} if PARITY else {}
    trl = dict(learning_rate=0.1, per_device_train_batch_size=3, num_generations=3, max_completion_length=8)
    return GRPOConfig(output_dir=str(tmp_path), report_to="none", **{**trl, **cpu, **overrides})


def _train_and_check_every_used_parameter_moved(trainer) -> set[str]:
    """TRL's closing checks, over every parameter the forward reads; returns the names that moved."""
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    moved = set()
    for n, param in previous_trainable_params.items():
        if n.startswith(UNUSED_PARAMETERS.get(trainer.model.config.model_type, ())):
            continue
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
        moved.add(n)
    assert any(n.startswith(VISION) for n in moved), sorted(moved)[:5]  # the vision tower trained too
    return moved


def _steps(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("family", FAMILIES)
def test_training_vlm(family, tiny_vlms, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_vlms(family), reward_funcs=reward_func, args=_args(tmp_path), train_dataset=zen_image()
    )
    _train_and_check_every_used_parameter_moved(trainer)
    assert trainer.state.global_step == 6  # 3 epochs of 2 prompts, one a step


def test_training_vlm_beta_non_zero(tiny_vlms, tmp_path):
    args = _args(tmp_path, beta=0.1, logging_steps=1)  # the reference model scores every row, with its images
    trainer = GRPOTrainer(
        model=tiny_vlms("qwen2_5_vl"), reward_funcs=reward_func, args=args, train_dataset=zen_image()
    )
    _train_and_check_every_used_parameter_moved(trainer)
    kl = [h["kl"] for h in _steps(trainer)]
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and max(kl) > 0, kl  # the policy left the reference


def test_training_vlm_peft(tiny_vlms, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlms("qwen2_5_vl"))
    base_param_names = [f"base_model.model.{n}" for n, _ in model.named_parameters()]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_func,
        args=_args(tmp_path),
        train_dataset=zen_image(),
        peft_config=LoraConfig(target_modules=["q_proj", "v_proj"]),
    )
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    lora = 0
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        if n in base_param_names:  # the base model's parameters stay as they were
            assert torch.allclose(param, new_param), f"Parameter {n} has changed."
        elif "base_layer" not in n:  # the adapters' moved
            assert not torch.allclose(param, new_param), f"Parameter {n} has not changed."
            lora += 1
    assert lora > 0


def test_training_vlm_and_importance_sampling(tiny_vlms, tmp_path):
    args = _args(tmp_path, steps_per_generation=2, logging_steps=1)  # a round trains 2 steps, the second off-policy
    trainer = GRPOTrainer(
        model=tiny_vlms("qwen2_5_vl"), reward_funcs=reward_func, args=args, train_dataset=zen_image()
    )
    _train_and_check_every_used_parameter_moved(trainer)
    # the second step of a round trains rows generated before the first step's update: its ratio π/π_old (each row
    # scored with its own images) leaves 1, and the clip range cuts some tokens (TRL logs the same metric)
    clipped = [h["clip_ratio/region_mean"] for h in _steps(trainer)]
    assert clipped[0] == 0 and max(clipped[1::2]) > 0, clipped


@pytest.mark.parametrize("family", FAMILIES)
def test_training_vlm_multi_image(family, tiny_vlms, tmp_path):
    """Rows with one and with two images (`images`), the images of each row kept with it."""
    trainer = GRPOTrainer(
        model=tiny_vlms(family), reward_funcs=reward_func, args=_args(tmp_path), train_dataset=zen_image(multi=True)
    )
    _train_and_check_every_used_parameter_moved(trainer)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_with_one_and_two_images_share_a_micro_batch(family, tiny_vlms, tmp_path):
    """Beyond TRL's test: two prompts a step (6 rows), one with one image and one with two, in one micro-batch; the
    trainer's forward over the padded rows (Idefics3: a zero image pads the one-image rows, as its processor pads a
    batch) gives the sampler's log-probs (round 0: the same weights)."""
    args = _args(tmp_path, per_device_train_batch_size=6, logging_steps=1)
    trainer = GRPOTrainer(
        model=tiny_vlms(family), reward_funcs=reward_func, args=args, train_dataset=zen_image(multi=True)
    )
    _train_and_check_every_used_parameter_moved(trainer)
    if not PARITY:
        assert _steps(trainer)[0]["sampling/logp_diff/max"] < 1e-4, _steps(trainer)[0]
