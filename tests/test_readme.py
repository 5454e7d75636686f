"""The README and `docs/` say what the code does.

The configuration reference (`docs/configuration.md`) and the TRL tables (`docs/trl_compatibility.md`) are generated
from `grpo_async.config`, the single source, between `<!-- generated: NAME ... -->` and `<!-- end generated: NAME -->`
markers. Regenerate them after changing a field, its help or a TRL table of the config with

    python tests/test_readme.py --write

The tests below fail when a generated block differs from what the generator produces now, when a field's row is
missing or states another default, and when a relative link of README.md or docs/*.md points nowhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
CONFIG_DOC = os.path.join(DOCS, "configuration.md")
TRL_DOC = os.path.join(DOCS, "trl_compatibility.md")

#: rows of docs/trl_compatibility.md's "what still differs" table (features, not config fields; written by hand)
TRL_DIFFERENCE_ROWS = ("rollout_func", "environment_factory", "tools", "evaluate()", "reward_funcs")


# ---- the generator ---------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    """`text` as one Markdown table cell: `|` escaped, no line breaks."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + ("" if text.endswith(".") else ".")


def own_fields() -> list[dataclasses.Field]:
    """The `GRPOConfig` fields it adds to `TrainingArguments` or re-defaults, in the order the class declares them."""
    from grpo_async import GRPOConfig
    from grpo_async.config import FIELD_GROUPS

    declared = [name for cls in (GRPOConfig, *FIELD_GROUPS) for name in inspect.get_annotations(cls)]
    by_name = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    return [by_name[name] for name in declared if name in by_name]


def config_reference_table() -> str:
    """`| field | default | meaning |`, one row per field of `own_fields()`: its default's `repr` and its help."""
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in own_fields():
        rows.append(f"| `{f.name}` | `{f.default!r}` | {_cell(f.metadata.get('help', ''))} |")
    return "\n".join(rows)


def default_differences_table() -> str:
    """`grpo_async.config.DEFAULT_DIFFERENCES`: the defaults that differ from TRL's on purpose."""
    from grpo_async.config import DEFAULT_DIFFERENCES

    rows = ["| field | why |", "|---|---|"]
    rows += [f"| `{k}` | {_cell(_sentence(v))} |" for k, v in DEFAULT_DIFFERENCES.items()]
    return "\n".join(rows)


def unsupported_fields_table() -> str:
    """TRL fields accepted only at TRL's default (`grpo_async.config.UNSUPPORTED_TRL_FIELDS`) and what to do
    instead."""
    from grpo_async.config import UNSUPPORTED_TRL_INSTEAD

    rows = ["| field | instead |", "|---|---|"]
    rows += [f"| `{k}` | {_cell(_sentence(v))} |" for k, v in UNSUPPORTED_TRL_INSTEAD.items()]
    return "\n".join(rows)


def aliases_table() -> str:
    """TRL's names of knobs named otherwise here (`TRL_ALIASES`) and the deprecated ones (`TRL_DEPRECATED`)."""
    from grpo_async.config import TRL_ALIASES, TRL_DEPRECATED

    rows = ["| TRL name | field here | kind |", "|---|---|---|"]
    rows += [f"| `{k}` | `{v}` | alias: one value, either name |" for k, v in TRL_ALIASES.items()]
    rows += [f"| `{k}` | `{v}` | deprecated: sets it with a `FutureWarning` |" for k, v in TRL_DEPRECATED.items()]
    return "\n".join(rows)


#: marker name → (the doc that holds the block, its generator)
GENERATED = {
    "config-reference": (CONFIG_DOC, config_reference_table),
    "trl-default-differences": (TRL_DOC, default_differences_table),
    "trl-unsupported-fields": (TRL_DOC, unsupported_fields_table),
    "trl-aliases": (TRL_DOC, aliases_table),
}


def _block_re(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- generated: {re.escape(name)} [^\n]*-->\n)(.*?)(<!-- end generated: {re.escape(name)} -->)", re.S
    )


def generated_block(path: str, name: str) -> str:
    """The text between the markers of block `name` in `path`, its last newline dropped."""
    with open(path, encoding="utf-8") as f:
        found = _block_re(name).findall(f.read())
    assert len(found) == 1, f"{os.path.relpath(path, ROOT)}: expected one generated block {name!r}, found {len(found)}"
    return found[0][1].removesuffix("\n")


def write() -> None:
    """Rewrites every generated block with what its generator produces now."""
    for name, (path, generate) in GENERATED.items():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        generated_block(path, name)  # exactly one block
        table = generate()
        text = _block_re(name).sub(lambda m: m.group(1) + table + "\n" + m.group(3), text)  # noqa: B023 (used at once)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {name} into {os.path.relpath(path, ROOT)}")


# ---- reading the docs ------------------------------------------------------------------------------------------
def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def table_rows(text: str) -> dict[str, list[str]]:
    """`| \\`name\\` | a | b |` rows of `text` → {name: [a, b]} (cells split on unescaped `|`)."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `([^`]+)` \|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
    return rows


def doc_files() -> list[str]:
    """README.md and every docs/*.md."""
    return [README] + sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped (not `-`/`_`), spaces → `-`."""
    text = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading anchor of the Markdown file `path` (duplicates numbered `-1`, `-2` as on GitHub)."""
    out, seen = set(), {}
    in_code = False
    for line in _read(path).splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            slug = github_anchor(m.group(1))
            n = seen.get(slug, 0)
            out.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return out


def relative_links(path: str) -> list[str]:
    """The targets of the Markdown links of `path` that are not URLs (code blocks and inline code skipped)."""
    text = re.sub(r"```.*?```", "", _read(path), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


# ---- the tests -------------------------------------------------------------------------------------------------
def test_generated_tables_are_what_the_generator_produces():
    """Each generated block of docs/ equals its generator's output today (`python tests/test_readme.py --write`)."""
    stale = [name for name, (path, generate) in GENERATED.items() if generated_block(path, name) != generate()]
    assert not stale, f"generated doc tables out of date: {stale}; run `python tests/test_readme.py --write`"


def test_every_config_field_has_its_row_with_its_real_default():
    """Read from the dataclass, not from the generator: a generator that skips a field or misstates a default
    fails here too."""
    from transformers import TrainingArguments

    from grpo_async import GRPOConfig

    rows = table_rows(generated_block(CONFIG_DOC, "config-reference"))
    base = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    problems = []
    for f in dataclasses.fields(GRPOConfig):
        if f.name in base and f.default == base[f.name] and f.name not in rows:
            continue  # a TrainingArguments field GRPOConfig leaves as it is: documented by transformers
        if f.name not in rows:
            problems.append(f"{f.name}: no row")
        elif rows[f.name][0] != f"`{f.default!r}`":
            problems.append(f"{f.name}: row says {rows[f.name][0]}, the default is {f.default!r}")
        elif not rows[f.name][1]:
            problems.append(f"{f.name}: no meaning")
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    problems += [f"{name}: row for a field GRPOConfig does not have" for name in rows if name not in names]
    assert not problems, "docs/configuration.md: " + "; ".join(problems)


def test_trl_tables_list_only_what_the_config_says():
    """The TRL doc's field rows are the config's unsupported / different / aliased fields or a known feature row."""
    from grpo_async.config import DEFAULT_DIFFERENCES, TRL_ALIASES, TRL_DEPRECATED, UNSUPPORTED_TRL_INSTEAD

    listed = set(table_rows(_read(TRL_DOC)))
    known = set(UNSUPPORTED_TRL_INSTEAD) | set(DEFAULT_DIFFERENCES) | set(TRL_ALIASES) | set(TRL_DEPRECATED)
    extra = listed - known - set(TRL_DIFFERENCE_ROWS)
    assert not extra, f"docs/trl_compatibility.md lists fields the config no longer has as TRL differences: {extra}"
    missing = set(TRL_DIFFERENCE_ROWS) - listed
    assert not missing, f"docs/trl_compatibility.md's 'what still differs' table lacks {missing}"


def test_every_relative_link_resolves():
    """Every relative link of README.md and docs/*.md names an existing file, and an existing heading when it has
    an anchor."""
    broken = []
    for doc in doc_files():
        for target in relative_links(doc):
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(doc), file)) if file else doc
            where = f"{os.path.relpath(doc, ROOT)} → {target}"
            if not os.path.exists(dest):
                broken.append(f"{where}: no such file")
            elif anchor and (not dest.endswith(".md") or anchor not in anchors(dest)):
                broken.append(f"{where}: no heading #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_links_the_moved_references_and_names_the_make_targets_that_exist():
    """The config reference and the TRL tables live in docs/ and the README links them; every `make <target>` the
    README names is a target of the Makefile."""
    readme = _read(README)
    for doc in ("docs/configuration.md", "docs/trl_compatibility.md"):
        assert f"]({doc}" in readme, f"README does not link {doc}"
    assert "<!-- generated:" not in readme, "generated tables belong in docs/, not the README"
    targets = set(re.findall(r"^([a-z][a-z-]*):", _read(os.path.join(ROOT, "Makefile")), re.M))
    named = set(re.findall(r"(?:`|^)make ([a-z][a-z-]*)", readme, re.M))  # in inline code or a command line
    assert {"demo", "test", "test-fast", "lint", "bench"} <= named, named
    assert named <= targets, f"README names make targets the Makefile lacks: {named - targets}"


def test_anchor_slugs_follow_github():
    """The slug rule the link check relies on, on headings of this README's kind."""
    assert github_anchor("Multi-process and multi-node") == "multi-process-and-multi-node"
    assert github_anchor("TRL 1.16 compatibility") == "trl-116-compatibility"
    assert github_anchor("Coming from `trl vllm-serve`") == "coming-from-trl-vllm-serve"
    assert github_anchor("Checkpoints and exact resume") == "checkpoints-and-exact-resume"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_readme.py --write   (rewrites the generated tables of docs/)")
    sys.path.insert(0, ROOT)
    write()
