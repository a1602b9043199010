"""The LM2 bank scan: the Triton kernel (interpreter) and the compiled CPU kernel (forward and
backward) against the reference in float64, and how the dispatcher picks the CPU kernel."""

import pytest
import torch

from memviz_kernels import dispatch
from memviz_kernels.lm2 import cpu
from memviz_kernels.lm2.reference import lm2_scan_reference
from memviz_kernels.native import NativeKernelError
from memviz_kernels.testing import close, cpu_only, needs_cc

pytestmark = pytest.mark.usefixtures("poisoned_buffers")  # memviz_kernels.testing

NAMES = ("attention", "read", "forget", "norms", "bank")


def scan_inputs(B, T, N, D, gain):
    """q_slot, g_in, W_V, W_f, b_f and the starting bank, in the op's order."""
    return [
        torch.randn(B, T, D),
        torch.rand(B, T, D),
        torch.randn(D, D) * gain,
        torch.randn(D, D) * gain,
        torch.randn(D),
        torch.randn(B, N, D),
    ]


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
    """In float32 the bar is the recurrence's own rounding (`within_float32_rounding`): a fixed tolerance failed
    on 2 of 400 seeds at 40 steps, where a value near zero carries the rounding of the steps before it."""
    # weights scaled by 1/sqrt(D): larger gains make the recurrence amplify float32 rounding,
    # in the float32 reference as much as in the kernel
    args = scan_inputs(B, T, N, D, D**-0.5)
    with torch.no_grad():
        outputs, bank = dispatch.lm2_scan(*(x.to(dtype) for x in args), impl="native")
        rounding = dispatch.lm2_scan(*(x.float() for x in args), impl="reference")
    for name, a, b, r in zip(NAMES, (*outputs, bank), reference(args), (*rounding[0], rounding[1])):
        assert a.dtype == dtype, name
        if dtype == torch.float64:
            close(a, b, seed, f"lm2 cpu {name}")
        else:
            within_float32_rounding(a, b, r, seed, f"lm2 cpu {name}")


def within_float32_rounding(actual, exact, rounding, seed, what):
    """`actual` (float32) within eight times the float32 reference's own error (`rounding` against `exact`, the
    float64 reference), or 5e-5 of the largest exact value, whichever is larger."""
    error, reference_error = ((x.double() - exact).abs().max().item() for x in (actual, rounding))
    bar = max(8 * reference_error, 5e-5 * exact.abs().max().item())
    assert error <= bar, f"{what} (seed {seed}): off by {error:.3g}, the float32 reference by {reference_error:.3g}"


@cpu_only
@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,T,N,D", [(2, 9, 5, 12), (1, 1, 3, 7), (3, 40, 17, 33)])
def test_lm2_scan_cpu_kernel_gradients_match_the_reference(seed, B, T, N, D, dtype):
    """The C backward against autograd through the float64 reference, every input, from a
    random weighting of every output (the norms and the bank included). In float32 the
    gradients sum over every token (the C loops in order, PyTorch's in blocks, and the C forward
    is itself two to four times further from float64 than PyTorch's), so the bar is float32
    rounding through the recurrence: eight times the float32 reference's own error, or 5e-5 of
    the largest gradient, whichever is larger (over 200 seeds the worst case used a third of it)."""
    args = scan_inputs(B, T, N, D, D**-0.5)
    weights = None

    def gradients(dtype, impl):
        nonlocal weights
        inputs = [x.to(dtype).clone().requires_grad_() for x in args]
        outputs, bank = dispatch.lm2_scan(*inputs, impl=impl)
        weights = weights or [torch.randn(x.shape, dtype=torch.float64) for x in (*outputs, bank)]
        sum((w.to(dtype) * x).sum() for w, x in zip(weights, (*outputs, bank))).backward()
        return [x.grad for x in inputs]

    exact = gradients(torch.float64, "reference")
    ours = gradients(dtype, "native")
    rounding = gradients(torch.float32, "reference") if dtype == torch.float32 else None
    for i, name in enumerate(("q_slot", "g_in", "W_V", "W_f", "b_f", "bank")):
        assert ours[i].dtype == dtype, name
        if rounding is None:
            close(ours[i], exact[i], seed, f"lm2 cpu d{name}")
        else:
            within_float32_rounding(ours[i], exact[i], rounding[i], seed, f"lm2 cpu d{name}")


@cpu_only
@needs_cc
def test_lm2_scan_cpu_kernel_passes_gradcheck():
    args = [x.double().requires_grad_() for x in scan_inputs(1, 5, 3, 4, 0.5)]

    def flat(*inputs):
        outputs, bank = dispatch.lm2_scan(*inputs, impl="native")
        return (*outputs, bank)

    assert torch.autograd.gradcheck(flat, args)


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
def test_auto_takes_the_cpu_kernel_for_inference_and_training(fresh_native_build, monkeypatch):
    q = torch.randn(1, 3, 4)
    assert dispatch.use_native("lm2_scan", q), "the kernel has a backward: training takes it too"
    assert list(fresh_native_build.glob("lm2_cpu-*.so")), "the kernel is built into the cache folder"
    with torch.no_grad():
        assert dispatch.use_native("lm2_scan", q)
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
        with pytest.raises(NativeKernelError, match="needs a C compiler"):
            dispatch.lm2_scan(*args, impl="native")
