"""Shared fixtures and helpers: small models of every family built fresh with a fixed seed, a saved checkpoint,
training configs, and the subprocess checks of peak memory and of command lines that several files use."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels run under the interpreter on CPU

import json
import subprocess
import sys
from pathlib import Path

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


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model():
    """A small sliding-window model, shared by a module's tests that only call it."""
    return small_model("sliding_window", window=8)


@pytest.fixture
def folder(tmp_path, model):
    """`model` saved as a checkpoint folder of the test's own."""
    return memviz.save(model, tmp_path / "ckpt")


def train_config(**changes) -> dict:
    config = {
        "name": "t",
        "model": {"family": "sliding_window", "d_model": 32, "n_layers": 2, "n_heads": 2},
        "data": {"mix": {"passkey": 1.0}, "curriculum": [[0, 256]]},
        "optim": {"steps": 10, "batch_size": 2, "lr": 1e-3},
        "eval": {"passkey_lengths": [256]},
        "out": "runs/unused",
    }
    for dotted, value in changes.items():
        section, _, key = dotted.rpartition(".")
        (config[section] if section else config)[key] = value
    return config


def tiny_run(out, steps=2, **overrides):
    """tests.test_train's tiny config, with whole sections (eval too) merged in."""
    from tests.test_train import tiny_config
    from training.config import TrainConfig

    config = tiny_config(out, steps=steps).to_dict()
    for key, value in overrides.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    return TrainConfig.from_dict(config)


def exits_2_with_one_line(command: list[str], named: str) -> None:
    """`python -W ignore COMMAND` exits with status 2 and one line, an error naming `named`."""
    out = subprocess.run(
        [sys.executable, "-W", "ignore", *command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], out.stderr


BPE_TOKENIZER = ROOT / "sample_checkpoints" / "memory_plus_shared" / "tokenizer.json"


@pytest.fixture(scope="module")
def bpe_model():
    from memviz.tokenizer import load_tokenizer

    if not BPE_TOKENIZER.is_file():
        pytest.skip("the BPE sample's tokenizer is not here")
    tokenizer = load_tokenizer(BPE_TOKENIZER)
    torch.manual_seed(0)
    return memviz.build_model(
        memviz.ModelConfig(
            family="sliding_window",
            d_model=32,
            n_layers=2,
            n_heads=2,
            d_mlp=64,
            window=8,
            vocab_size=tokenizer.vocab_size,
        ),
        tokenizer=tokenizer,
    ).eval()


PEAK_SCRIPT = (
    HIGH_WATER_KB
    + """
import json, resource, sys
import torch
import memviz
from memviz import ModelConfig
from memviz.tokenizer import load_tokenizer
case = sys.argv[1]
def model(tokenizer=None):
    torch.manual_seed(0)
    vocab = tokenizer.vocab_size if tokenizer is not None else 259
    return memviz.build_model(ModelConfig(family="sliding_window", d_model=32, n_layers=2, n_heads=2, d_mlp=64,
                                          window=16, vocab_size=vocab), tokenizer=tokenizer).eval()
if case == "emoji":
    m, text = model(), "\\N{GRINNING FACE}" * (10 * 2**20 // 4)
    call = lambda: memviz.trace(m, text)
elif case == "long text":
    import random
    m = model(load_tokenizer(sys.argv[2]))
    words = "the quick brown fox jumps over lazy dog memory state token segment".split()
    text = " ".join(random.Random(0).choice(words) for _ in range(3_500_000))
    call = lambda: memviz.trace(m, text)
elif case == "trace file":
    call = lambda: memviz.Trace.load(sys.argv[2])
else:
    from memviz_probes import passkey
    m = model()
    call = lambda: passkey.run(m, [100_000_000], [0.5], n=1, progress=False)
before = high_water_kb()
try:
    call()
    error = None
except ValueError as exc:
    error = str(exc)
after = high_water_kb()
print(json.dumps({"error": error, "growth_mb": (after - before) / 1024}))
"""
)


def refused_within_memory(*args) -> str:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] is not None, "not refused"
    assert result["growth_mb"] < 200, result
    return result["error"]
