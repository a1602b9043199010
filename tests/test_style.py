"""The habits of a maintained library: `ruff check`, `ruff format --check` and `mypy` are clean, with their
settings in pyproject.toml. The tools are in requirements.txt, so a missing one fails here rather than skips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PATHS = [
    "memviz",
    "kernels",
    "probes",
    "training",
    "app",
    "families",
    "benchmarks",
    "tests",
    "tasks.py",
    "setup.py",
    "conftest.py",
]


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    exe = BIN / tool
    assert exe.is_file(), f"{tool} is not installed beside {sys.executable}: pip install -r requirements.txt"
    return subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("args", [["check", *PATHS], ["format", "--check", *PATHS]], ids=["check", "format"])
def test_ruff_is_clean(args):
    out = run("ruff", *args)
    assert out.returncode == 0, f"ruff {' '.join(args)}:\n{out.stdout}{out.stderr}"


def test_mypy_is_clean_on_every_package():
    out = run("mypy")  # packages and settings from pyproject.toml's [tool.mypy]
    assert out.returncode == 0, f"mypy:\n{out.stdout}{out.stderr}"
