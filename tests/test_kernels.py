"""Every Triton kernel against its PyTorch reference, under TRITON_INTERPRET=1 on the CPU, and
the compiled CPU kernel (LM2 scan) against the same reference.

Inputs are fresh random numbers each run (the seed is in every failure message), shapes are
small and odd, the references run in float64, every buffer a launcher allocates starts as
NaN (so an element a kernel forgot to write fails the comparison), and gradients of the
kernels that have a backward are compared with autograd through the reference.
"""
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

import memviz
from kernels import dispatch, lm2_scan_cpu
from kernels.infini_memory import infini_memory_reference
from kernels.lm2_scan import lm2_scan_reference
from kernels.product_keys import product_key_topk as topk_reference
from kernels.product_keys import weighted_bag as bag_reference
from kernels.titans_memory import titans_linear_reference
from tests.conftest import scrambled, small_model

TOL = dict(rtol=1e-4, atol=2e-5)


@pytest.fixture
def seed():
    value = random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    return value


@pytest.fixture(autouse=True)
def poisoned_buffers(monkeypatch):
    """torch.empty hands out NaN (floats) or -7 (integers) instead of whatever memory held."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", poisoned)


def close(actual, expected, seed, what):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL, msg=lambda m: f"{what} (seed {seed}): {m}")


def leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


# ----- dispatcher --------------------------------------------------------------------------------
def test_the_reference_is_taken_on_cpu_unless_the_kernel_is_asked_for(monkeypatch):
    q = torch.randn(1, 3, 4)
    args = (q, torch.rand(1, 3, 4), torch.randn(1, 2, 4), torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
    assert not dispatch.use_triton("lm2_scan", q)
    for a, b in zip(dispatch.lm2_scan(*args), lm2_scan_reference(*args)):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert dispatch.use_triton("lm2_scan", q, impl="triton")
        monkeypatch.setenv("MEMVIZ_KERNELS", "triton")
        assert dispatch.use_triton("lm2_scan", q)
    assert not dispatch.use_triton("lm2_scan", q), "a forward-only kernel must leave training to the reference"
    with pytest.raises(ValueError, match="kernel implementation must be one of"):
        dispatch.lm2_scan(*args, impl="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        dispatch.weighted_bag(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3), torch.randn(5, 4))


# ----- product keys ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 5, 3, 13, 10, 6), (1, 3, 1, 7, 6, 7)])
def test_product_key_topk_matches_the_reference_with_gradients(seed, shape):
    B, T, H, n, d_k, k = shape
    q, keys = torch.randn(B, T, H, d_k), torch.randn(H, 2, n, d_k // 2)
    (q32, k32), (q64, k64) = leaves([q, keys], torch.float32), leaves([q, keys], torch.float64)
    scores, indices = dispatch.product_key_topk(q32, k32, k, impl="triton")
    ref_scores, ref_indices = topk_reference(q64, k64, k)
    close(scores, ref_scores, seed, "top-k scores")
    # indices: each must address a key whose exact score is the one reported (ties may reorder)
    s1 = torch.einsum("bthd,hnd->bthn", q64[..., : d_k // 2], k64[:, 0])
    s2 = torch.einsum("bthd,hnd->bthn", q64[..., d_k // 2:], k64[:, 1])
    exact = s1.gather(-1, indices // n) + s2.gather(-1, indices % n)
    close(exact, ref_scores, seed, "scores of the returned indices")
    assert indices.unique(dim=-1).shape == indices.shape and bool((indices >= 0).all() and (indices < n * n).all())
    grad = torch.randn_like(scores)
    scores.backward(grad)
    ref_scores.backward(grad.double())
    close(q32.grad, q64.grad, seed, "dq")
    close(k32.grad, k64.grad, seed, "dkeys")


@pytest.mark.parametrize("strategy", ["reverse", "atomic"])
def test_weighted_bag_matches_embedding_bag_with_gradients(seed, strategy):
    rows, k, n_values, D = 11, 5, 37, 9
    indices = torch.randint(0, n_values, (rows, k))
    indices[0] = indices[1]  # rows sharing values: the reverse index must sum them
    w, values = torch.rand(rows, k), torch.randn(n_values, D)
    (w32, v32), (w64, v64) = leaves([w, values], torch.float32), leaves([w, values], torch.float64)
    out = dispatch.triton_kernel("weighted_bag")(indices, w32, v32, strategy)
    ref = bag_reference(indices, w64, v64)
    close(out, ref, seed, "bag forward")
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    close(w32.grad, w64.grad, seed, "dweights")
    close(v32.grad, v64.grad, seed, f"dvalues ({strategy})")


def test_bag_value_gradient_rejects_an_unknown_strategy():
    from kernels.product_keys_triton import bag_value_grad

    with pytest.raises(ValueError, match="'reverse' or 'atomic'"):
        bag_value_grad(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.ones(1, 3), 4, "sorted")


# ----- Infini-attention ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", ["linear", "delta"])
@pytest.mark.parametrize("T,segment", [(23, 7), (14, 7), (5, 8)])
def test_infini_segment_memory_matches_the_reference_with_gradients(seed, rule, T, segment):
    B, H, D = 2, 3, 5
    sq, sk = F.elu(torch.randn(B, H, T, D)) + 1, F.elu(torch.randn(B, H, T, D)) + 1
    v, M, z = torch.randn(B, H, T, D), torch.randn(B, H, D, D) * 0.1, torch.rand(B, H, D)
    ins32, ins64 = leaves([sq, sk, v, M, z], torch.float32), leaves([sq, sk, v, M, z], torch.float64)
    out = dispatch.infini_memory(*ins32, segment, rule, impl="triton")
    ref = infini_memory_reference(*ins64, segment, rule)
    for name, a, b in zip(("read", "norms", "M", "z"), out, ref):
        close(a, b, seed, f"{rule} {name}")
    grads = [torch.randn_like(out[i]) for i in (0, 2, 3)]
    torch.autograd.backward([out[0], out[2], out[3]], grads)
    torch.autograd.backward([ref[0], ref[2], ref[3]], [g.double() for g in grads])
    for name, a, b in zip(("dsq", "dsk", "dv", "dM", "dz"), ins32, ins64):
        expected = torch.zeros_like(b) if b.grad is None else b.grad  # keys of an unfinished segment
        close(a.grad, expected, seed, f"{rule} {name}")


def test_infini_kernel_starts_from_an_empty_memory(seed):
    sq, sk, v = F.elu(torch.randn(1, 2, 9, 4)) + 1, F.elu(torch.randn(1, 2, 9, 4)) + 1, torch.randn(1, 2, 9, 4)
    M, z = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4)
    out = dispatch.infini_memory(sq, sk, v, M, z, 4, "delta", impl="triton")
    ref = infini_memory_reference(*(t.double() for t in (sq, sk, v, M, z)), 4, "delta")
    assert torch.equal(out[0][:, :, :4], torch.zeros(1, 2, 4, 4)), "the first segment has nothing to read"
    for a, b in zip(out, ref):
        close(a, b, seed, "empty start")


# ----- LM2 and Titans (forward-only kernels) ------------------------------------------------------
@pytest.mark.parametrize("B,T,N,D", [(2, 9, 5, 12), (1, 4, 3, 7)])
def test_lm2_scan_kernel_matches_the_reference(seed, B, T, N, D):
    args = [torch.randn(B, T, D), torch.rand(B, T, D), torch.randn(B, N, D), torch.randn(D, D) / 3,
            torch.randn(D, D) / 3, torch.randn(D)]
    with torch.no_grad():
        out = dispatch.lm2_scan(*args, impl="triton")
    for name, a, b in zip(("attention", "read", "forget", "norms", "bank"), out, lm2_scan_reference(*(x.double() for x in args))):
        close(a, b, seed, f"lm2 {name}")


needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="the LM2 CPU kernel needs a C compiler (cc)")


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,T,N,D", [(2, 9, 5, 12), (1, 1, 3, 7), (3, 40, 17, 33)])
def test_lm2_scan_cpu_kernel_matches_the_reference(seed, B, T, N, D, dtype):
    # weights scaled by 1/sqrt(D): larger gains make the recurrence amplify float32 rounding,
    # in the float32 reference as much as in the kernel
    args = [torch.randn(B, T, D), torch.rand(B, T, D), torch.randn(B, N, D), torch.randn(D, D) / D**0.5,
            torch.randn(D, D) / D**0.5, torch.randn(D)]
    with torch.no_grad():
        out = dispatch.lm2_scan(*(x.to(dtype) for x in args), impl="native")
    for name, a, b in zip(("attention", "read", "forget", "norms", "bank"), out, lm2_scan_reference(*(x.double() for x in args))):
        assert a.dtype == dtype, name
        close(a, b, seed, f"lm2 cpu {name}")


@pytest.fixture
def fresh_native_build(monkeypatch, tmp_path):
    """An empty build cache, and the loader's memo cleared before and after."""
    monkeypatch.setenv("MEMVIZ_CACHE", str(tmp_path))
    for memo in (lm2_scan_cpu.library, lm2_scan_cpu.available):
        memo.cache_clear()
    yield tmp_path
    for memo in (lm2_scan_cpu.library, lm2_scan_cpu.available):
        memo.cache_clear()


@needs_cc
def test_auto_takes_the_cpu_kernel_for_inference_only(fresh_native_build, monkeypatch):
    q = torch.randn(1, 3, 4)
    assert not dispatch.use_native("lm2_scan", q), "training needs the reference's gradients"
    with torch.no_grad():
        assert dispatch.use_native("lm2_scan", q)
        assert list(fresh_native_build.glob("lm2_scan_cpu-*.so")), "the kernel is built into the cache folder"
        assert not dispatch.use_native("lm2_scan", q.half()), "float16 falls back to the reference"
        assert not dispatch.use_native("lm2_scan", q, impl="reference")
        with pytest.raises(ValueError, match="float32 or float64 CPU tensors"):
            dispatch.use_native("lm2_scan", q.half(), impl="native")
        with pytest.raises(NotImplementedError, match="no compiled CPU kernel for weighted_bag"):
            dispatch.use_native("weighted_bag", q, impl="native")
        assert not dispatch.use_triton("lm2_scan", q, impl="native")


def test_without_a_compiler_auto_falls_back_and_native_says_why(fresh_native_build, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    q = torch.randn(1, 3, 4)
    args = (q, torch.rand(1, 3, 4), torch.randn(1, 2, 4), torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
    with torch.no_grad():
        assert not dispatch.use_native("lm2_scan", q)
        for a, b in zip(dispatch.lm2_scan(*args), lm2_scan_reference(*args)):
            assert torch.equal(a, b)
        with pytest.raises(lm2_scan_cpu.NativeKernelError, match="needs a C compiler"):
            dispatch.lm2_scan(*args, impl="native")


@pytest.mark.parametrize("T,chunk", [(19, 5), (10, 5), (3, 4)])
def test_titans_linear_kernel_matches_the_reference(seed, T, chunk):
    B, D = 2, 6
    q, k = F.normalize(torch.randn(B, T, D), dim=-1), F.normalize(torch.randn(B, T, D), dim=-1)
    args = [q, k, torch.randn(B, T, D), torch.rand(B, T, 3), torch.randn(B, D, D) * 0.3, torch.randn(B, D, D) * 0.1]
    with torch.no_grad():
        out = dispatch.titans_linear_memory(*args, chunk, impl="triton")
    ref = titans_linear_reference(*(x.double() for x in args), chunk)
    for name, a, b in zip(("read", "surprise", "loss", "loss_after", "W", "S"), out, ref):
        close(a, b, seed, f"titans {name}")


# ----- whole models ------------------------------------------------------------------------------
MODELS = {
    "memory_layer": {"window": 8, "memory": {"n_keys": 8, "topk": 4, "heads": 2, "d_key": 8, "layers": [1]}},
    "infini": {"segment_len": 5, "memory": {"update": "delta"}},
    "lm2": {"window": 8, "memory": {"slots": 3}},
    "titans": {"segment_len": 5, "memory": {"variant": "mac"}},
}

KERNELS_OF = {"memory_layer": {"product_key_topk", "weighted_bag"}, "infini": {"infini_memory"}, "lm2": {"lm2_scan"},
              "titans": {"titans_linear_memory"}}


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
def test_lm2_model_gives_the_same_logits_and_trace_with_the_cpu_kernel(monkeypatch, seed):
    model = scrambled(small_model("lm2", **MODELS["lm2"]))
    ids = torch.randint(0, 256, (2, 15))
    ref_logits, ref_cache, logits, cache, used = run_on_both_paths(model, ids, monkeypatch, "auto", "native_kernel")
    assert used and set(used) == {"lm2_scan"}, "auto takes the CPU kernel for inference"
    close(logits, ref_logits, seed, "lm2 logits")
    for name in ref_cache:
        close(cache[name], ref_cache[name], seed, f"lm2 {name}")


def test_memviz_import_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, memviz, kernels; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", memviz.__name__
