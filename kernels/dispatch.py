"""Choose between a Triton kernel, a compiled CPU kernel and the PyTorch reference.

Models call the functions here (never a kernel directly); each asks `kernel_mode` which path
to take:
  * `impl="triton"`, `"native"` or `"reference"` forces a path for one call;
  * otherwise the environment variable MEMVIZ_KERNELS ("triton", "native", "reference" or "auto");
  * "auto" (the default) takes the Triton kernel for CUDA tensors where one exists, the
    compiled CPU kernel for CPU tensors where one exists and builds (the LM2 scan, forward
    only), and the reference elsewhere.
"""
from __future__ import annotations

import importlib
import os

import torch
from torch import Tensor

from kernels.infini_memory import infini_memory_reference
from kernels.lm2_scan import ScanResult, lm2_scan_reference
from kernels.product_keys import product_key_topk as product_key_topk_reference
from kernels.product_keys import weighted_bag as weighted_bag_reference
from kernels.titans_memory import titans_linear_reference

CHOICES = ("auto", "triton", "native", "reference")
#: operation -> "module:function" of its Triton kernel, imported on first use (so importing
#: memviz never imports triton)
TRITON_KERNELS: dict[str, str] = {
    "product_key_topk": "kernels.product_keys_triton:product_key_topk",
    "weighted_bag": "kernels.product_keys_triton:weighted_bag",
    "infini_memory": "kernels.infini_memory_triton:infini_memory",
    "lm2_scan": "kernels.lm2_scan_triton:lm2_scan",
    "titans_linear_memory": "kernels.titans_memory_triton:titans_linear_memory",
}
#: operation -> "module:function" of its compiled CPU kernel; the module has `available()`
NATIVE_KERNELS: dict[str, str] = {"lm2_scan": "kernels.lm2_scan_cpu:lm2_scan"}
#: kernels without a backward: when a gradient is needed the reference runs instead
FORWARD_ONLY = {"lm2_scan", "titans_linear_memory"}  # Triton and native alike


def kernel_mode(impl: str | None = None) -> str:
    mode = impl or os.environ.get("MEMVIZ_KERNELS", "auto")
    if mode not in CHOICES:
        raise ValueError(f"kernel implementation must be one of {CHOICES}, got {mode!r}")
    return mode


def use_triton(op: str, tensor: Tensor, impl: str | None = None) -> bool:
    mode = kernel_mode(impl)
    if mode in ("reference", "native"):
        return False
    if mode == "triton" and op not in TRITON_KERNELS:
        raise NotImplementedError(f"there is no Triton kernel for {op} yet; use MEMVIZ_KERNELS=reference or auto")
    if mode == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"the Triton kernel for {op} needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
            "imported to run it in the interpreter on the CPU"
        )
    if op in FORWARD_ONLY and torch.is_grad_enabled():
        return False
    return op in TRITON_KERNELS and (mode == "triton" or tensor.is_cuda)


def use_native(op: str, tensor: Tensor, impl: str | None = None) -> bool:
    """The compiled CPU kernel: forced by "native" (an error where it cannot run), taken by
    "auto" for CPU tensors when it builds on this machine; never when a gradient is needed."""
    mode = kernel_mode(impl)
    if mode not in ("auto", "native"):
        return False
    if op not in NATIVE_KERNELS:
        if mode == "native":
            raise NotImplementedError(f"there is no compiled CPU kernel for {op}; use MEMVIZ_KERNELS=reference or auto")
        return False
    module = importlib.import_module(NATIVE_KERNELS[op].partition(":")[0])
    if mode == "native":
        if not module.supports(tensor):
            raise ValueError(f"the CPU kernel for {op} takes float32 or float64 CPU tensors, got {tensor.dtype} on {tensor.device}")
        module.library()  # raises with the compiler's message
    if op in FORWARD_ONLY and torch.is_grad_enabled():
        return False
    return module.supports(tensor) and module.available()


def _resolve(spec: str):
    """The function named by "module:function", imported on first use."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def native_kernel(op: str):
    return _resolve(NATIVE_KERNELS[op])


def triton_kernel(op: str):
    return _resolve(TRITON_KERNELS[op])


def lm2_scan(q_slot: Tensor, g_in: Tensor, M0: Tensor, W_V: Tensor, W_f: Tensor, b_f: Tensor, impl: str | None = None) -> ScanResult:
    """The LM2 per-token bank scan (see kernels/lm2_scan.py); the kernels under no_grad only."""
    if use_triton("lm2_scan", q_slot, impl):
        return triton_kernel("lm2_scan")(q_slot, g_in, M0, W_V, W_f, b_f)
    if use_native("lm2_scan", q_slot, impl):
        return native_kernel("lm2_scan")(q_slot, g_in, M0, W_V, W_f, b_f)
    return lm2_scan_reference(q_slot, g_in, M0, W_V, W_f, b_f)


def product_key_topk(q: Tensor, keys: Tensor, k: int, impl: str | None = None) -> tuple[Tensor, Tensor]:
    """Exact top-k over n^2 product keys (see kernels/product_keys.py)."""
    if use_triton("product_key_topk", q, impl):
        return triton_kernel("product_key_topk")(q, keys, k)
    return product_key_topk_reference(q, keys, k)


def weighted_bag(indices: Tensor, weights: Tensor, values: Tensor, impl: str | None = None) -> Tensor:
    """Softmax-weighted sum of the selected value rows (see kernels/product_keys.py)."""
    if use_triton("weighted_bag", weights, impl):
        return triton_kernel("weighted_bag")(indices, weights, values)
    return weighted_bag_reference(indices, weights, values)


def infini_memory(sq: Tensor, sk: Tensor, v: Tensor, M: Tensor, z: Tensor, segment_len: int, rule: str,
                  impl: str | None = None):
    """Infini-attention's retrieval and update over whole segments (see kernels/infini_memory.py)."""
    if use_triton("infini_memory", sq, impl):
        return triton_kernel("infini_memory")(sq, sk, v, M, z, segment_len, rule)
    return infini_memory_reference(sq, sk, v, M, z, segment_len, rule)


def titans_linear_memory(q: Tensor, k: Tensor, v: Tensor, rates: Tensor, W: Tensor, S: Tensor, chunk: int,
                         impl: str | None = None):
    """Titans' linear memory over whole chunks (see kernels/titans_memory.py); the kernel under
    no_grad only."""
    if use_triton("titans_linear_memory", q, impl):
        return triton_kernel("titans_linear_memory")(q, k, v, rates, W, S, chunk)
    return titans_linear_reference(q, k, v, rates, W, S, chunk)
