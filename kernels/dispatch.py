"""Choose between a Triton kernel and its PyTorch reference.

Models call the functions here (never a kernel directly); each asks `kernel_mode` which path
to take:
  * `impl="triton"` or `"reference"` forces a path for one call;
  * otherwise the environment variable MEMVIZ_KERNELS ("triton", "reference" or "auto");
  * "auto" (the default) takes the kernel for CUDA tensors where one exists, the reference
    elsewhere.
"""
from __future__ import annotations

import os

from torch import Tensor

from kernels.lm2_scan import ScanResult, lm2_scan_reference
from kernels.product_keys import product_key_topk as product_key_topk_reference
from kernels.product_keys import weighted_bag as weighted_bag_reference

CHOICES = ("auto", "triton", "reference")
#: operations that have a Triton kernel so far
TRITON_KERNELS: dict[str, object] = {}


def kernel_mode(impl: str | None = None) -> str:
    mode = impl or os.environ.get("MEMVIZ_KERNELS", "auto")
    if mode not in CHOICES:
        raise ValueError(f"kernel implementation must be one of {CHOICES}, got {mode!r}")
    return mode


def use_triton(op: str, tensor: Tensor, impl: str | None = None) -> bool:
    mode = kernel_mode(impl)
    if mode == "reference":
        return False
    if mode == "triton" and op not in TRITON_KERNELS:
        raise NotImplementedError(f"there is no Triton kernel for {op} yet; use MEMVIZ_KERNELS=reference or auto")
    return op in TRITON_KERNELS and (mode == "triton" or tensor.is_cuda)


def lm2_scan(q_slot: Tensor, g_in: Tensor, M0: Tensor, W_V: Tensor, W_f: Tensor, b_f: Tensor, impl: str | None = None) -> ScanResult:
    """The LM2 per-token bank scan (see kernels/lm2_scan.py)."""
    if use_triton("lm2_scan", q_slot, impl):
        return TRITON_KERNELS["lm2_scan"](q_slot, g_in, M0, W_V, W_f, b_f)
    return lm2_scan_reference(q_slot, g_in, M0, W_V, W_f, b_f)


def product_key_topk(q: Tensor, keys: Tensor, k: int, impl: str | None = None) -> tuple[Tensor, Tensor]:
    """Exact top-k over n^2 product keys (see kernels/product_keys.py)."""
    if use_triton("product_key_topk", q, impl):
        return TRITON_KERNELS["product_key_topk"](q, keys, k)
    return product_key_topk_reference(q, keys, k)


def weighted_bag(indices: Tensor, weights: Tensor, values: Tensor, impl: str | None = None) -> Tensor:
    """Softmax-weighted sum of the selected value rows (see kernels/product_keys.py)."""
    if use_triton("weighted_bag", weights, impl):
        return TRITON_KERNELS["weighted_bag"](indices, weights, values)
    return weighted_bag_reference(indices, weights, values)
