"""`make install` on a machine whose pip sources lack torch's CPU build (the normal case: it is only on the PyTorch CPU
index) brings that index in for the `cpu` flavour; where the wheel is available offline it is taken from there. pip
runs with `--dry-run` (nothing is installed or changed)."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY = "TORCH_PIP_FLAGS=--dry-run --ignore-installed --no-deps"


def _make(env_overrides: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_overrides}
    return subprocess.run(
        ["make", "--no-print-directory", "torch-cpu", DRY],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_torch_cpu_build_comes_from_the_configured_sources_when_they_have_it():
    proc = _make({})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch-cpu: torch==2.13.0+cpu from the configured pip sources" in proc.stdout


def test_without_it_the_pytorch_cpu_index_is_added():
    """No package source at all (`PIP_NO_INDEX`, no find-links): the first try fails, the Makefile says what it runs
    next and runs pip with the PyTorch CPU index (which then also fails here, offline, and make reports it)."""
    proc = _make({"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull})
    assert "torch-cpu: not in the configured pip sources; running:" in proc.stdout, proc.stdout + proc.stderr
    assert "--extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu" in proc.stdout
    assert proc.returncode != 0  # pip was really asked (and, with no index allowed, could not find it)
