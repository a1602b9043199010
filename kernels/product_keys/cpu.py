"""Product-key top-k and the weighted bag's backward compiled for the CPU (kernels/product_keys/cpu.c).

torch.topk costs about a microsecond a row at n = 64 on this CPU, and the reference calls it on
every (query, head) twice (each half's sub-keys, then the k^2 candidate sums), which made it
most of a product-key layer's forward. Here the sub-key scores are one product in PyTorch, the
selection is the C loop (cpu.c: rank counting behind a bound, and only the ~k ln k candidate
pairs that can win), and the chosen keys' scores are gathered from the sub-key scores, so
autograd works as in the reference. Rows are split over torch's thread count (OpenMP, on torch's
own threads). Built and loaded by kernels/native.py.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from memviz_kernels.native import loader, pointers, supports
from memviz_kernels.product_keys.reference import weighted_bag as weighted_bag_reference

SOURCE = Path(__file__).with_suffix(".c")
FUNCTIONS = {torch.float32: "product_key_topk_f32", torch.float64: "product_key_topk_f64"}
MAX_K = 256
BAG_BACKWARD = {torch.float32: "weighted_bag_backward_f32", torch.float64: "weighted_bag_backward_f64"}
library, available = loader(SOURCE, "product-key", (*FUNCTIONS.values(), *BAG_BACKWARD.values()))


def threads(rows: int) -> int:
    """torch's thread count, fewer for few rows (a thread's start costs more than 256 rows' work)."""
    return max(1, min(torch.get_num_threads(), rows // 256))


def product_key_topk(q: Tensor, keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The contract of memviz_kernels.product_keys.reference.product_key_topk, with gradients to q and keys."""
    if not supports(q):
        raise ValueError(
            f"the product-key CPU kernel takes float32 or float64 CPU tensors, got {q.dtype} on {q.device}"
        )
    n = keys.shape[2]
    if not 1 <= k <= min(n, MAX_K):
        raise ValueError(f"top-k must be between 1 and min(n_keys, {MAX_K}) = {min(n, MAX_K)}, got {k}")
    halves = q.unflatten(-1, (2, q.shape[-1] // 2))  # [..., H, 2, d_k/2]
    sub_scores = torch.einsum("...hpd,hpnd->...hpn", halves, keys.to(q.dtype))  # [..., H, 2, n]
    flat = sub_scores.detach().contiguous()
    rows = flat.numel() // (2 * n)
    first, second = (torch.empty(*flat.shape[:-2], k, dtype=torch.long) for _ in range(2))
    status = getattr(library(), FUNCTIONS[flat.dtype])(
        ctypes.c_long(rows),
        ctypes.c_long(n),
        ctypes.c_long(k),
        *pointers((flat, first, second)),
        ctypes.c_int(threads(rows)),
    )
    if status != 0:
        raise ValueError(f"the product-key CPU kernel rejected k={k} with n={n}")
    scores = sub_scores[..., 0, :].gather(-1, first) + sub_scores[..., 1, :].gather(-1, second)
    return scores, first * n + second


class WeightedBag(torch.autograd.Function):
    """torch's embedding bag forward; the backward in one C pass over the chosen rows, where
    torch makes two (a sort of the indices for the values' gradient, a gather for the weights')."""

    @staticmethod
    def forward(ctx, indices: Tensor, weights: Tensor, values: Tensor) -> Tensor:
        ctx.save_for_backward(indices, weights, values)
        return weighted_bag_reference(indices, weights, values)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        indices, weights, values = ctx.saved_tensors
        k, D = indices.shape[-1], values.shape[-1]
        index = indices.reshape(-1, k).contiguous()
        w = weights.reshape(-1, k).to(values.dtype).contiguous()
        g = grad_out.reshape(-1, D).to(values.dtype).contiguous()
        table = values.contiguous()
        grad_weights, grad_values = torch.empty_like(w), torch.zeros_like(table)
        status = getattr(library(), BAG_BACKWARD[values.dtype])(
            ctypes.c_long(index.shape[0]),
            ctypes.c_long(k),
            ctypes.c_long(D),
            ctypes.c_long(table.shape[0]),
            *pointers((index, w, table, g, grad_weights, grad_values)),
            ctypes.c_int(threads(index.shape[0])),
        )
        if status != 0:
            raise MemoryError("the weighted-bag CPU kernel could not allocate its per-thread tables")
        return None, grad_weights.view(weights.shape).to(weights.dtype), grad_values


def weighted_bag(indices: Tensor, weights: Tensor, values: Tensor) -> Tensor:
    """The contract of memviz_kernels.product_keys.reference.weighted_bag, with the C backward."""
    if not supports(values):
        raise ValueError(
            f"the weighted-bag CPU kernel takes float32 or float64 CPU values, got {values.dtype} on {values.device}"
        )
    return WeightedBag.apply(indices, weights, values)
