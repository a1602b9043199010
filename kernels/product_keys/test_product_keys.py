"""The product-key Triton kernels and the CPU top-k against the references, with gradients."""

import pytest
import torch

from memviz_kernels import dispatch
from memviz_kernels.product_keys.reference import product_key_topk as topk_reference
from memviz_kernels.product_keys.reference import weighted_bag as bag_reference
from memviz_kernels.testing import close, cpu_only, leaves, needs_cc

pytestmark = pytest.mark.usefixtures("poisoned_buffers")  # memviz_kernels.testing


@pytest.mark.parametrize("impl", ["triton", pytest.param("native", marks=[cpu_only, needs_cc])])
@pytest.mark.parametrize(
    "shape", [(2, 5, 3, 13, 10, 6), (1, 3, 1, 7, 6, 7), (1, 4, 2, 64, 8, 16), (1, 2, 1, 512, 4, 200)]
)
def test_product_key_topk_matches_the_reference_with_gradients(seed, shape, impl):
    B, T, H, n, d_k, k = shape
    if impl == "triton" and n > 64:
        pytest.skip(
            "the interpreter's cost grows with the key count (the large case is the CPU kernel's insertion path)"
        )
    q, keys = torch.randn(B, T, H, d_k), torch.randn(H, 2, n, d_k // 2)
    (q32, k32), (q64, k64) = leaves([q, keys], torch.float32), leaves([q, keys], torch.float64)
    scores, indices = dispatch.product_key_topk(q32, k32, k, impl=impl)
    ref_scores, ref_indices = topk_reference(q64, k64, k)
    close(scores, ref_scores, seed, "top-k scores")
    # indices: each must address a key whose exact score is the one reported (ties may reorder)
    s1 = torch.einsum("bthd,hnd->bthn", q64[..., : d_k // 2], k64[:, 0])
    s2 = torch.einsum("bthd,hnd->bthn", q64[..., d_k // 2 :], k64[:, 1])
    exact = s1.gather(-1, indices // n) + s2.gather(-1, indices % n)
    close(exact, ref_scores, seed, "scores of the returned indices")
    assert indices.unique(dim=-1).shape == indices.shape and bool((indices >= 0).all() and (indices < n * n).all())
    # gradients through the kernel's own selection: near-ties (within float32) may swap two ranks, and
    # the upstream gradient follows the index, not the rank
    grad = torch.randn_like(scores)
    scores.backward(grad)
    exact.backward(grad.double())
    close(q32.grad, q64.grad, seed, "dq")
    close(k32.grad, k64.grad, seed, "dkeys")


@pytest.mark.parametrize("strategy", ["reverse", "atomic", pytest.param("native", marks=[cpu_only, needs_cc])])
def test_weighted_bag_matches_embedding_bag_with_gradients(seed, strategy):
    rows, k, n_values, D = 11, 5, 37, 9
    indices = torch.randint(0, n_values, (rows, k))
    indices[0] = indices[1]  # rows sharing values: the reverse index must sum them
    w, values = torch.rand(rows, k), torch.randn(n_values, D)
    (w32, v32), (w64, v64) = leaves([w, values], torch.float32), leaves([w, values], torch.float64)
    if strategy == "native":  # the CPU kernel's backward
        out = dispatch.weighted_bag(indices, w32, v32, impl="native")
    else:
        out = dispatch.triton_kernel("weighted_bag")(indices, w32, v32, strategy)
    ref = bag_reference(indices, w64, v64)
    close(out, ref, seed, "bag forward")
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    close(w32.grad, w64.grad, seed, "dweights")
    close(v32.grad, v64.grad, seed, f"dvalues ({strategy})")


def test_bag_value_gradient_rejects_an_unknown_strategy():
    from memviz_kernels.product_keys.triton import bag_value_grad

    with pytest.raises(ValueError, match="'reverse' or 'atomic'"):
        bag_value_grad(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.ones(1, 3), 4, "sorted")


@cpu_only
@needs_cc
def test_cpu_kernels_split_rows_over_threads_with_the_single_block_result(seed, monkeypatch):
    """With two torch threads the rows run in two blocks at once: the same top-k as one block,
    and the bag's gradients summed over the blocks in row order (the same every run)."""
    q, keys = torch.randn(3, 200, 2, 16), torch.randn(2, 2, 64, 8)
    values, weights = torch.randn(64 * 64, 5), torch.rand(3, 200, 2, 16)

    def run(threads):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        scores, indices = dispatch.product_key_topk(q, keys, 16, impl="native")
        w, v = weights.clone().requires_grad_(), values.clone().requires_grad_()
        dispatch.weighted_bag(indices, w, v, impl="native").pow(2).sum().backward()
        return scores, indices, w.grad, v.grad

    one, two, again = run(1), run(2), run(2)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    close(two[2], one[2], seed, "dweights in two blocks")
    close(two[3], one[3], seed, "dvalues in two blocks")
    assert all(torch.equal(a, b) for a, b in zip(two, again)), "two-block gradients must not depend on thread timing"
