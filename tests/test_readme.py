import dataclasses
import os

from transformers import TrainingArguments

from grpo_async import GRPOConfig

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_documents_every_added_config_field():
    text = open(README).read()
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    missing = [f.name for f in dataclasses.fields(GRPOConfig) if f.name not in base and f"`{f.name}`" not in text]
    assert not missing, f"README config reference lacks {missing}"
    assert "make demo" in text and "make test" in text
