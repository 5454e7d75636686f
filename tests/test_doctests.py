"""The examples in the package's docstrings run: every `>>>` example is a doctest (lines that need a model or a
server say `# doctest: +SKIP`), and every ```python block in a docstring at least parses."""

from __future__ import annotations

import ast
import doctest
import importlib
import re
from pathlib import Path

import pytest

import grpo_async

#: modules whose import needs what the suite does not load here (vLLM's worker extension runs inside vLLM)
NOT_IMPORTED = {"grpo_async.weight_sync.worker"}


def modules() -> list[str]:
    """Every module file under grpo_async/ (folders without an `__init__.py` included, which pkgutil skips)."""
    root = Path(grpo_async.__file__).parent
    names = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(n for n in names if n not in NOT_IMPORTED)


def with_examples() -> list[str]:
    out = []
    for name in modules():
        spec = importlib.util.find_spec(name)
        with open(spec.origin) as f:
            if ">>>" in f.read():
                out.append(name)
    return out


def test_modules_with_examples_are_found():
    found = with_examples()
    # a few we know carry runnable examples: if discovery breaks, the doctests below would pass by running nothing
    assert {"grpo_async.weight_sync.collect", "grpo_async.pipeline.overlap", "grpo_async.data.sampler"} <= set(found)


@pytest.mark.parametrize("name", with_examples())
def test_docstring_examples_run(name):
    try:  # deepspeed prints an accelerator notice to stdout on its first import (by transformers): not an output
        importlib.import_module("deepspeed")
    except ImportError:
        pass
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = [t for t in finder.find(module, module.__name__) if t.examples]
    assert tests, f"{name} has '>>>' in its source but no doctest was found"
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (output above)"


BLOCK = re.compile(r"```python\n(.*?)```", re.S)


@pytest.mark.parametrize("name", modules())
def test_python_blocks_in_docstrings_parse(name):
    module = importlib.import_module(name)
    docs = [module.__doc__ or ""]
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) == name and getattr(obj, "__doc__", None):
            docs.append(obj.__doc__)
            docs += [getattr(m, "__doc__", None) or "" for m in vars(obj).values() if callable(m)]
    for doc in docs:
        for block in BLOCK.findall(doc):
            code = "\n".join(line for line in __import__("textwrap").dedent(block).splitlines())
            try:
                ast.parse(code)
            except SyntaxError as e:  # pragma: no cover (the failure message is the point)
                pytest.fail(f"{name}: a ```python block in a docstring does not parse: {e}\n{code}")
