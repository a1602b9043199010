"""The LM2 bank scan: the Triton kernel (interpreter) and the compiled CPU kernel against the
reference in float64, and how the dispatcher picks the CPU kernel."""

import pytest
import torch

from kernels import dispatch
from kernels.lm2 import cpu
from kernels.lm2.reference import lm2_scan_reference
from kernels.testing import close, cpu_only, needs_cc

NAMES = ("attention", "read", "forget", "norms", "bank")


def scan_inputs(B, T, N, D, gain):
    """q_slot, g_in, W_V, W_f, b_f and the starting bank, in the op's order."""
    return [torch.randn(B, T, D), torch.rand(B, T, D), torch.randn(D, D) * gain, torch.randn(D, D) * gain,
            torch.randn(D), torch.randn(B, N, D)]


def reference(args):
    q, g_in, W_V, W_f, b_f, bank = (x.double() for x in args)
    return lm2_scan_reference(q, g_in, bank, W_V, W_f, b_f)


@pytest.mark.parametrize("B,T,N,D", [(2, 9, 5, 12), (1, 4, 3, 7)])
def test_lm2_scan_kernel_matches_the_reference(seed, B, T, N, D):
    args = scan_inputs(B, T, N, D, 1 / 3)
    with torch.no_grad():
        outputs, bank = dispatch.lm2_scan(*args, impl="triton")
    for name, a, b in zip(NAMES, (*outputs, bank), reference(args)):
        close(a, b, seed, f"lm2 {name}")


@cpu_only
@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,T,N,D", [(2, 9, 5, 12), (1, 1, 3, 7), (3, 40, 17, 33)])
def test_lm2_scan_cpu_kernel_matches_the_reference(seed, B, T, N, D, dtype):
    # weights scaled by 1/sqrt(D): larger gains make the recurrence amplify float32 rounding,
    # in the float32 reference as much as in the kernel
    args = scan_inputs(B, T, N, D, D**-0.5)
    with torch.no_grad():
        outputs, bank = dispatch.lm2_scan(*(x.to(dtype) for x in args), impl="native")
    for name, a, b in zip(NAMES, (*outputs, bank), reference(args)):
        assert a.dtype == dtype, name
        close(a, b, seed, f"lm2 cpu {name}")


@pytest.fixture
def fresh_native_build(monkeypatch, tmp_path):
    """An empty build cache, and the loader's memo cleared before and after."""
    monkeypatch.setenv("MEMVIZ_CACHE", str(tmp_path))
    for memo in (cpu.library, cpu.available):
        memo.cache_clear()
    yield tmp_path
    for memo in (cpu.library, cpu.available):
        memo.cache_clear()


@cpu_only
@needs_cc
def test_auto_takes_the_cpu_kernel_for_inference_only(fresh_native_build, monkeypatch):
    q = torch.randn(1, 3, 4)
    assert not dispatch.use_native("lm2_scan", q), "training needs the reference's gradients"
    with torch.no_grad():
        assert dispatch.use_native("lm2_scan", q)
        assert list(fresh_native_build.glob("lm2_cpu-*.so")), "the kernel is built into the cache folder"
        assert not dispatch.use_native("lm2_scan", q.half()), "float16 falls back to the reference"
        assert not dispatch.use_native("lm2_scan", q, impl="reference")
        with pytest.raises(ValueError, match="float32 or float64 CPU tensors"):
            dispatch.use_native("lm2_scan", q.half(), impl="native")
        with pytest.raises(NotImplementedError, match="no compiled CPU kernel for infini_memory"):
            dispatch.use_native("infini_memory", q, impl="native")
        assert not dispatch.use_triton("lm2_scan", q, impl="native")


@cpu_only
def test_without_a_compiler_auto_falls_back_and_native_says_why(fresh_native_build, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    args = scan_inputs(1, 3, 2, 4, 1.0)
    with torch.no_grad():
        assert not dispatch.use_native("lm2_scan", args[0])
        outputs, bank = dispatch.lm2_scan(*args)
        for a, b in zip((*outputs, bank), lm2_scan_reference(args[0], args[1], args[5], args[2], args[3], args[4])):
            assert torch.equal(a, b)
        with pytest.raises(cpu.NativeKernelError, match="needs a C compiler"):
            dispatch.lm2_scan(*args, impl="native")
