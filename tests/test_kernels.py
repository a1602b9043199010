"""The dispatcher and whole models on both paths. Each op's own tests (its kernels against its
reference on fresh random inputs, under TRITON_INTERPRET=1 on the CPU) are beside it, in
kernels/<op>/test_*.py."""

from pathlib import Path

import pytest
import torch

import memviz
from memviz_kernels import dispatch
from memviz_kernels.lm2.reference import lm2_scan_reference
from memviz_kernels.testing import close, needs_cc
from tests.conftest import scrambled, small_model

pytestmark = pytest.mark.usefixtures("poisoned_buffers")  # memviz_kernels.testing
ROOT = Path(__file__).resolve().parent.parent


# ----- dispatcher --------------------------------------------------------------------------------
@needs_cc
def test_on_cpu_auto_takes_the_compiled_kernel_and_reference_takes_none(monkeypatch, seed):
    monkeypatch.delenv("MEMVIZ_KERNELS", raising=False)
    B, T, N, d = 2, 17, 5, 8
    q_slot, g_in, W_V, W_f, b_f, bank = (
        torch.randn(B, T, d),
        torch.rand(B, T, d),
        torch.randn(d, d) / d**0.5,
        torch.randn(d, d) / d**0.5,
        torch.randn(d),
        torch.randn(B, N, d),
    )
    expected = lm2_scan_reference(q_slot, g_in, bank, W_V, W_f, b_f)
    handed_out: list[tuple[str, str]] = []
    for loader in ("native_kernel", "triton_kernel"):
        kernel = getattr(dispatch, loader)
        monkeypatch.setattr(dispatch, loader, lambda op, k=kernel, n=loader: handed_out.append((n, op)) or k(op))
    for mode, used in (("auto", [("native_kernel", "lm2_scan")]), ("reference", [])):
        handed_out.clear()
        outputs, final = dispatch.lm2_scan(q_slot, g_in, W_V, W_f, b_f, bank, impl=mode)
        assert handed_out == used, (mode, seed)
        for a, b in zip((*outputs, final), expected, strict=True):
            torch.testing.assert_close(a, b, msg=lambda m: f"{mode}, seed {seed}: {m}")


def test_triton_is_taken_only_when_asked_for_and_never_for_training(monkeypatch):
    monkeypatch.delenv("MEMVIZ_KERNELS", raising=False)
    q = torch.randn(1, 3, 4)
    q_slot, g_in, W_V, W_f, b_f, bank = (
        q,
        torch.rand(1, 3, 4),
        torch.randn(4, 4),
        torch.randn(4, 4),
        torch.randn(4),
        torch.randn(1, 2, 4),
    )
    assert not dispatch.use_triton("lm2_scan", q)
    with torch.no_grad():
        assert dispatch.use_triton("lm2_scan", q, impl="triton")
        monkeypatch.setenv("MEMVIZ_KERNELS", "triton")
        assert dispatch.use_triton("lm2_scan", q)
    assert not dispatch.use_triton("lm2_scan", q), "a forward-only kernel must leave training to the reference"
    with pytest.raises(ValueError, match="kernel implementation must be one of"):
        dispatch.lm2_scan(q_slot, g_in, W_V, W_f, b_f, bank, impl="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        dispatch.weighted_bag(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3), torch.randn(5, 4))


def test_models_reach_kernels_only_through_the_dispatcher():
    models = Path(memviz.__file__).parent / "models"
    imports = [
        (path, line.strip())
        for path in models.rglob("*.py")
        if not path.name.startswith("test_")
        for line in path.read_text().splitlines()
        if line.startswith(("from memviz_kernels", "import memviz_kernels"))
    ]
    assert len(imports) >= 4  # the families that call a kernel: infini, lm2, memory_layer, titans
    direct = [f"{path.name}: {line}" for path, line in imports if not line.startswith("from memviz_kernels.dispatch ")]
    assert direct == []


def test_every_kernel_test_module_poisons_its_buffers():
    """An element a kernel forgot to write is NaN (memviz_kernels.testing.poisoned_buffers), in every op's tests."""
    import importlib

    modules = sorted(ROOT.glob("kernels/*/test_*.py"))
    assert len(modules) >= 4
    for path in modules:
        module = importlib.import_module(f"memviz_kernels.{path.parent.name}.{path.stem}")
        marks = getattr(module, "pytestmark", [])
        marks = marks if isinstance(marks, list) else [marks]
        assert any(m.name == "usefixtures" and "poisoned_buffers" in m.args for m in marks), path


# ----- whole models ------------------------------------------------------------------------------
MODELS = {
    "memory_layer": {"window": 8, "memory": {"n_keys": 8, "topk": 4, "heads": 2, "d_key": 8, "layers": [1]}},
    "infini": {"segment_len": 5, "memory": {"update": "delta"}},
    "lm2": {"window": 8, "memory": {"slots": 3}},
    "titans": {"segment_len": 5, "memory": {"variant": "mac"}},
}

KERNELS_OF = {
    "memory_layer": {"product_key_topk", "weighted_bag"},
    "infini": {"infini_memory"},
    "lm2": {"lm2_scan"},
    "titans": {"titans_linear_memory"},
}


def run_on_both_paths(model, ids, monkeypatch, mode: str, loader: str):
    """The reference run, then the `mode` run under no_grad, recording which kernels the
    dispatcher's `loader` (triton_kernel or native_kernel) handed out."""
    monkeypatch.setenv("MEMVIZ_KERNELS", "reference")
    ref_logits, ref_cache = model.run_with_cache(ids)
    monkeypatch.setenv("MEMVIZ_KERNELS", mode)
    used = []
    kernel = getattr(dispatch, loader)
    monkeypatch.setattr(dispatch, loader, lambda op: used.append(op) or kernel(op))
    with torch.no_grad():
        logits, cache = model.run_with_cache(ids)
    return ref_logits, ref_cache, logits, cache, used


@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_model_gives_the_same_logits_and_trace_on_both_paths(family, monkeypatch, seed):
    model = scrambled(small_model(family, **MODELS[family]))
    ids = torch.randint(0, 256, (1, 12))
    ref_logits, ref_cache, logits, cache, used = run_on_both_paths(model, ids, monkeypatch, "triton", "triton_kernel")
    assert set(used) == KERNELS_OF[family]
    close(logits, ref_logits, seed, f"{family} logits")
    assert cache.keys() == ref_cache.keys()
    for name in ref_cache:
        if ref_cache[name].is_floating_point():
            close(cache[name], ref_cache[name], seed, f"{family} {name}")
        else:
            assert torch.equal(cache[name], ref_cache[name]), name
    if family in ("memory_layer", "infini"):  # kernels with a backward: training takes them too
        used.clear()
        model(ids).logsumexp(-1).mean().backward()
        assert set(used) == KERNELS_OF[family]
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@needs_cc
@pytest.mark.parametrize(
    "family,kernels", [("lm2", {"lm2_scan"}), ("memory_layer", {"product_key_topk", "weighted_bag"})]
)
def test_a_model_gives_the_same_logits_and_trace_with_the_cpu_kernels(family, kernels, monkeypatch, seed):
    model = scrambled(small_model(family, **MODELS[family]))
    ids = torch.randint(0, 256, (2, 15))
    ref_logits, ref_cache, logits, cache, used = run_on_both_paths(model, ids, monkeypatch, "auto", "native_kernel")
    assert set(used) == kernels, "auto takes the CPU kernels"
    close(logits, ref_logits, seed, f"{family} logits")
    for name in ref_cache:
        close(cache[name], ref_cache[name], seed, f"{family} {name}")
    if family == "memory_layer":  # its kernels have a backward: training takes them too
        used.clear()
        model(ids).logsumexp(-1).mean().backward()
        assert set(used) == kernels


def test_memviz_import_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, memviz, kernels; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", memviz.__name__
