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


def trl_tables() -> str:
    """The README's two TRL tables, from `grpo_async.config` (the single source): deliberate default differences
    and TRL fields accepted only at TRL's default."""
    from grpo_async.config import _UNSUPPORTED, DEFAULT_DIFFERENCES

    def sentence(text: str) -> str:
        return text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")

    rows = ["| field | why |", "|---|---|"]
    rows += [f"| `{k}` | {sentence(v)} |" for k, v in DEFAULT_DIFFERENCES.items()]
    rows += ["", "| field | instead |", "|---|---|"]
    rows += [f"| `{k}` | {sentence(v)} |" for k, v in _UNSUPPORTED.items()]
    return "\n".join(rows)


def test_readme_trl_tables_are_the_config_s():
    """Regenerate with `python -c "import tests.test_readme as t; print(t.trl_tables())"` and paste."""
    text = open(README).read()
    for line in trl_tables().splitlines():
        if line.startswith("| `"):
            assert line in text, f"README's TRL compatibility tables lack or misstate: {line[:120]}"
    from grpo_async.config import _UNSUPPORTED, DEFAULT_DIFFERENCES

    section = text[text.index("### TRL 1.16 compatibility") : text.index("## Benchmarks")]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    extra = listed - set(_UNSUPPORTED) - set(DEFAULT_DIFFERENCES) - set(TRL_DIFFERENCE_ROWS)
    assert not extra, f"README lists as unsupported/different fields the config no longer does: {sorted(extra)}"


#: rows of the README's "what still differs" table (features, not config fields); checked only for being listed
TRL_DIFFERENCE_ROWS = (
    "rollout_func",
    "environment_factory",
    "tools",
    "evaluate()",
    "reward_funcs",
)
