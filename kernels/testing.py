"""What the kernel tests share: fresh random seeds, NaN-poisoned buffers, float64 comparison. The root conftest.py
registers this module's fixtures; a kernel test module asks for the poisoned buffers with
`pytestmark = pytest.mark.usefixtures("poisoned_buffers")`."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

TOL = dict(rtol=1e-4, atol=2e-5)
#: where the kernel tests make their tensors: "cpu" (the Triton kernels in the interpreter) or "cuda"
DEVICE = os.environ.get("MEMVIZ_TEST_DEVICE", "cpu")
cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="tests the compiled CPU kernel or the CPU dispatch")
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="the compiled CPU kernels need a C compiler (cc)")


@pytest.fixture
def seed():
    """A fresh seed each run (it is in every failure message)."""
    value = random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    return value


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """torch.empty hands out NaN (floats) or -7 (integers) instead of whatever memory held, so
    an element a kernel forgot to write fails the comparison."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned)


def close(actual, expected, seed, what):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL, msg=lambda m: f"{what} (seed {seed}): {m}")


def leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]
