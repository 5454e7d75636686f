"""The package's floors: nothing imports upward. Each module of `grpo_async` belongs to a floor (`FLOORS`); an import
(at the top of a module or inside a function, relative or absolute) may reach its own floor or one below, never one
above. A new module must be given a floor here, so the test also fails on a module nobody placed.

```txt
7  trainer, trainer_setup, trainer_pipeline, trl_*, callbacks, data, scripts, cli, testing, demo, ...
6  config                     (GRPOConfig's rules read the registries below)
5  pipeline                   (scheduler, producer, consumer, publisher, build)
4  envs, rewards
3  generation                 (backends, servers' client side, the registry)
2  weight_sync                (collect, buckets, transports, the worker extension)
1  algo                       (pure math)
0  net, parent_watch, gc_tuning, loading, logging_utils, plotting, interrupt, vision_processor   (ground floor)
```
"""

import ast
import os

import grpo_async

ROOT = os.path.dirname(grpo_async.__file__)

FLOORS = {
    "net": 0,
    "parent_watch": 0,
    "gc_tuning": 0,
    "loading": 0,
    "logging_utils": 0,
    "plotting": 0,
    "interrupt": 0,
    "vision_processor": 0,
    "algo": 1,
    "weight_sync": 2,
    "generation": 3,
    "envs": 4,
    "rewards": 4,
    "pipeline": 5,
    "config": 6,
    "callbacks": 7,
    "data": 7,
    "trainer": 7,
    "trainer_setup": 7,
    "vlm_setup": 7,
    "trainer_pipeline": 7,
    "trl_attributes": 7,
    "trl_async": 7,
    "model_card": 7,
    "model_config": 7,
    "recipe_parser": 7,
    "scripts": 7,
    "cli": 7,
    "testing": 7,
    "demo_task": 7,
    "__init__": 8,  # the package's own namespace: re-exports from every floor
}


def _area(module: str) -> str:
    """`grpo_async.pipeline.build` → `pipeline`; `grpo_async` → `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> list[tuple[str, str, int]]:
    """Every `(importer, imported, line)` between modules of the package."""
    found = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
            module = rel.removesuffix(".__init__")
            package = module if name == "__init__.py" else module.rsplit(".", 1)[0]
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    targets = [".".join(base + ([node.module] if node.module else []))]
                elif isinstance(node, ast.ImportFrom):
                    targets = [node.module or ""]
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                else:
                    continue
                found += [(module, t, node.lineno) for t in targets if t.split(".")[0] == "grpo_async"]
    return found


def test_every_module_has_a_floor():
    areas = {_area(m) for m, _, _ in _imports()} | {_area(t) for _, t, _ in _imports()}
    assert not areas - FLOORS.keys(), f"give these a floor in FLOORS: {sorted(areas - FLOORS.keys())}"


def test_nothing_imports_upward():
    upward = [
        f"{m}:{line} imports {t} ({_area(m)} is floor {FLOORS[_area(m)]}, {_area(t)} floor {FLOORS[_area(t)]})"
        for m, t, line in _imports()
        if _area(m) in FLOORS and _area(t) in FLOORS and FLOORS[_area(t)] > FLOORS[_area(m)]
    ]
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The parser follows relative imports inside functions: a planted `from ..pipeline import x` in `algo` is
    found (so the test above can fail)."""
    pkg = tmp_path / "grpo_async"
    (pkg / "algo").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "algo" / "__init__.py").write_text("def f():\n    from ..pipeline import build\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(pkg))
    assert ("grpo_async.algo", "grpo_async.pipeline", 2) in _imports()


def test_no_module_is_over_600_lines_and_the_trainer_over_350():
    """The house's size limits (issue 42): a module that grows past them splits by job, as `weight_sync/worker.py`'s
    receivers went to `worker_receive.py`."""
    limits = {os.path.join(ROOT, "trainer.py"): 350}
    over = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py"):
                lines = sum(1 for _ in open(path))
                if lines > limits.get(path, 600):
                    over.append(f"{os.path.relpath(path, ROOT)}: {lines} lines (limit {limits.get(path, 600)})")
    assert not over, over
