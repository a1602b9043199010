"""Shared fixtures: small models of every family, built fresh with a fixed seed."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run under the interpreter on CPU

import pytest
import torch

import memviz
from memviz import ModelConfig

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """A Trainer sets torch's thread count for the whole process (`threads` in its config); the
    tests after it get the suite's 2 threads back."""
    yield
    torch.set_num_threads(2)


#: the smallest extra config each family needs to build: its registration's `tiny` (copied, so no test edits the
#: registry's); installed packages' families included
FAMILY_CONFIGS = {
    family.name: copy.deepcopy(dict(family.tiny)) for family in memviz.families() if family.tiny is not None
}
SMALL = dict(d_model=32, n_layers=2, n_heads=2, d_mlp=64, vocab_size=259)


def small_model(family: str = "transformer", seed: int = 0, **overrides) -> memviz.MemoryLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(family=family, **{**SMALL, **overrides})
    return memviz.build_model(cfg).eval()


@pytest.fixture
def make_model():
    return small_model


def scrambled(model: memviz.MemoryLM, std: float = 0.3, seed: int = 1) -> memviz.MemoryLM:
    """Give every weight a large random value so that equality tests cannot pass by the logits
    being near-uniform (GPT-2 initialisation makes a fresh model's outputs almost constant)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("norm.weight"):
                continue
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def random_ids(n: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# A subprocess's own peak RSS in KiB, for scripts that measure memory: ru_maxrss would start from the forking
# parent's (pytest's) size, carried across exec, and hide a child's growth below it.
HIGH_WATER_KB = """
def high_water_kb():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM"))
"""
