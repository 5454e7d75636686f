"""The model card and the saved folder (grpo_async/model_card.py), `push_to_hub` writing our card before the upload,
and the TRL-style model/LoRA options (grpo_async/model_config.py) through `recipes/demo.py --use_peft`."""

import json
import os

import pytest
import transformers.trainer
import yaml
from support.warm_launch import run_script
from transformers import HfArgumentParser

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.demo_task import ends_cleanly, letter_reward, make_dataset
from grpo_async.model_card import non_default_config
from grpo_async.model_config import ModelConfig, get_peft_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.fixture(scope="module")
def trained(tiny_model_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("card") / "tiny-grpo")
    args = GRPOConfig(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        beta=0.02,
        num_batches_ahead=2,
        learning_rate=1e-2,
        reward_weights=[1.0, 0.25],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        hub_token="hf_do_not_leak_me",
        seed=0,
    )
    trainer = GRPOTrainer(
        model=tiny_model_path, reward_funcs=[letter_reward, ends_cleanly], args=args, train_dataset=make_dataset(64)
    )
    trainer.train()
    return trainer, out


def test_saved_folder_and_card(trained, tiny_model_path):
    trainer, out = trained
    trainer.save_model()
    trainer.create_model_card(dataset_name="org/letters")
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= files
    card = open(os.path.join(out, "README.md")).read()
    meta = _front_matter(card)
    assert meta["base_model"] == tiny_model_path and meta["library_name"] == "transformers"
    assert meta["model_name"] == "tiny-grpo" and meta["datasets"] == ["org/letters"]
    assert {"grpo", "grpo_async"} <= set(meta["tags"])
    # the method and its async settings
    assert "**GRPO**" in card and "**asynchronous generation**" in card
    assert "`num_batches_ahead = 2` rounds ahead" in card
    assert "| `num_batches_ahead` | `2` |" in card and "| `beta` | `0.02` |" in card
    assert "Trained for 2 optimizer steps." in card
    # reward functions with their weights
    assert "| `letter_reward` | 1 |" in card and "| `ends_cleanly` | 0.25 |" in card
    # the non-default config, as YAML; secrets and paths left out
    config = yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])
    assert config["max_steps"] == 2 and config["reward_weights"] == [1.0, 0.25] and config["num_batches_ahead"] == 2
    assert config["learning_rate"] == 1e-2 and "per_device_train_batch_size" not in config  # 8 is the default
    assert "output_dir" not in config and "hub_token" not in config and "hf_do_not_leak_me" not in card
    assert "num_iterations" not in config  # default values are not listed
    # framework versions and the citation
    for name in ("grpo_async", "transformers", "torch", "accelerate"):
        assert f"- {name}: " in card
    assert "arXiv:2402.03300" in card
    # the saved model loads and is the trained one
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    trained_state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    assert all(v.equal(trained_state[k]) for k, v in reloaded.state_dict().items())


def test_push_to_hub_writes_our_card_then_uploads_the_folder(trained, monkeypatch):
    """Only the network call is faked (no internet here): the Trainer's own push_to_hub runs up to the upload."""
    trainer, out = trained
    uploads = []

    class OfflineHub:
        def upload_folder(self, **kw):
            folder = kw["folder_path"]
            uploads.append({**kw, "files": sorted(os.listdir(folder)), "card": open(f"{folder}/README.md").read()})
            return "https://huggingface.co/me/tiny-grpo/commit/0"

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: OfflineHub())
    if os.path.exists(os.path.join(out, "README.md")):
        os.remove(os.path.join(out, "README.md"))  # the card must come from push_to_hub itself
    trainer.hub_model_id = "me/tiny-grpo"  # the repo init_hf_repo would have created
    trainer.push_to_hub(dataset_name="org/letters", commit_message="GRPO run")
    (up,) = uploads
    assert up["repo_id"] == "me/tiny-grpo" and up["folder_path"] == out and up["commit_message"] == "GRPO run"
    assert {"README.md", "model.safetensors", "config.json"} <= set(up["files"])
    meta = _front_matter(up["card"])
    assert meta["model_name"] == "tiny-grpo" and meta["datasets"] == ["org/letters"]
    assert "| `ends_cleanly` | 0.25 |" in up["card"]


def test_non_default_config_leaves_out_secrets_and_defaults(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], hub_token="hf_x", beta=0.1)
    config = non_default_config(args)
    assert config["beta"] == 0.1
    assert not any("token" in k or "api_key" in k for k in config)
    assert "num_generations" not in config and "debug" not in config and "accelerator_config" not in config


def test_model_config_parses_trl_flags():
    parser = HfArgumentParser((ModelConfig,))
    parser.add_argument("--max_steps", type=int, default=5)  # a recipe's own flag
    (model_args, rest) = parser.parse_args_into_dataclasses(
        ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]
    )
    assert rest.max_steps == 5
    lora = get_peft_config(model_args)
    assert (lora.r, lora.lora_alpha, sorted(lora.target_modules)) == (4, 8, ["q_proj", "v_proj"])
    assert lora.task_type == "CAUSAL_LM"
    (all_linear,) = HfArgumentParser((ModelConfig,)).parse_args_into_dataclasses(
        ["--use_peft", "--lora_target_modules", "all-linear"]
    )
    assert get_peft_config(all_linear).target_modules == "all-linear"
    assert get_peft_config(ModelConfig()) is None  # no --use_peft: full fine-tuning
    assert ModelConfig(dtype="bfloat16").model_init_kwargs()["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"lora_r": 0}, "ModelConfig.lora_r"),
        ({"lora_dropout": 1.0}, "ModelConfig.lora_dropout"),
        ({"dtype": "fp8"}, "ModelConfig.dtype"),
        ({"lora_task_type": "CLM"}, "ModelConfig.lora_task_type"),
    ],
)
def test_model_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kw)


def test_demo_use_peft_saves_the_adapter_and_its_card(tmp_path):
    out = str(tmp_path / "demo")
    argv = ["--backend", "hf", "--output_dir", out]
    argv += ["--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4"]
    argv += ["--max_completion_length", "8", "--use_peft"]
    argv += ["--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj"]
    # `python recipes/demo.py ...` in a fork of the warm interpreter (`support.warm_launch`)
    demo = os.path.join(ROOT, "recipes", "demo.py")
    proc = run_script(demo, argv, env={"OMP_NUM_THREADS": "1"}, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:]
    files = set(os.listdir(out))
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= files
    assert "model.safetensors" not in files  # the adapter only, not the full model
    adapter = json.load(open(os.path.join(out, "adapter_config.json")))
    assert adapter["r"] == 8 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    from safetensors.torch import load_file

    weights = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert weights and all("lora_" in k for k in weights)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # B starts at 0: it was trained
    card = open(os.path.join(out, "README.md")).read()
    assert _front_matter(card)["library_name"] == "peft" and "### PEFT adapter" in card and "r: 8" in card
