"""Product-key top-k with the selection compiled for the CPU (kernels/product_keys/cpu.c).

torch.topk costs about a microsecond a row at n = 64 on this CPU, and the reference calls it on
every (query, head) twice (each half's sub-keys, then the k^2 candidate sums), which made it
most of a product-key layer's forward. Here the sub-key scores are one product in PyTorch, the
selection is the C loop (insertion into sorted buffers of k, and only the ~k ln k candidate
pairs that can win), and the chosen keys' scores are gathered from the sub-key scores, so
autograd works as in the reference. Built and loaded by kernels/native.py.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from kernels.native import NativeKernelError, build

SOURCE = Path(__file__).with_suffix(".c")
FUNCTIONS = {torch.float32: "product_key_topk_f32", torch.float64: "product_key_topk_f64"}
MAX_K = 256


@functools.cache
def library() -> ctypes.CDLL:
    lib = build(SOURCE, "product-key top-k")
    for name in FUNCTIONS.values():
        getattr(lib, name).restype = ctypes.c_int
    return lib


@functools.cache
def available() -> bool:
    try:
        library()
    except (NativeKernelError, OSError):
        return False
    return True


def supports(q: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in FUNCTIONS


def product_key_topk(q: Tensor, keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The contract of kernels.product_keys.reference.product_key_topk, with gradients to q and keys."""
    if not supports(q):
        raise ValueError(f"the product-key CPU kernel takes float32 or float64 CPU tensors, got {q.dtype} on {q.device}")
    n = keys.shape[2]
    if not 1 <= k <= min(n, MAX_K):
        raise ValueError(f"top-k must be between 1 and min(n_keys, {MAX_K}) = {min(n, MAX_K)}, got {k}")
    halves = q.unflatten(-1, (2, q.shape[-1] // 2))  # [..., H, 2, d_k/2]
    sub_scores = torch.einsum("...hpd,hpnd->...hpn", halves, keys.to(q.dtype))  # [..., H, 2, n]
    flat = sub_scores.detach().contiguous()
    rows = flat.numel() // (2 * n)
    first, second = (torch.empty(*flat.shape[:-2], k, dtype=torch.long) for _ in range(2))
    status = getattr(library(), FUNCTIONS[flat.dtype])(
        ctypes.c_long(rows), ctypes.c_long(n), ctypes.c_long(k),
        *(ctypes.c_void_p(t.data_ptr()) for t in (flat, first, second)))
    if status != 0:
        raise ValueError(f"the product-key CPU kernel rejected k={k} with n={n}")
    scores = sub_scores[..., 0, :].gather(-1, first) + sub_scores[..., 1, :].gather(-1, second)
    return scores, first * n + second
