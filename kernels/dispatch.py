"""The memory ops, one convention: `op(inputs..., initial_state) -> (outputs, final_state)`.

Each op lives in a folder of its own (`kernels/infini`, `lm2`, `titans`, `product_keys`, `linear_memory`: its
`reference.py`, the specification; its Triton and compiled CPU kernels; its tests) and is
called only through the functions here, which take and return plain tensors (named tuples of
them for a state of several parts: `InfiniMemory`, `LinearMemory`):

  infini_memory(q, k, v, InfiniMemory(M, z, open_k, open_v), segment_len, rule) -> ((A_mem, ||M||), state)
  lm2_scan(q_slot, g_in, W_V, W_f, b_f, bank) -> ((slot attn, read, forget gate, slot norms), bank)
  titans_linear_memory(q, k, v, rates, LinearMemory(W, S), chunk) -> ((read, surprise, loss, loss after), state)
  titans_chunk_coefficients(rates) -> the chunk's closed-form scalars   stateless
  titans_chunk_update(factors, coefficients, (params, momentum)) -> ((), (params, momentum))
  linear_memory(q, k, v, g, beta, S, chunk) -> ((read, ||S_t||), S)   the delta rule and state-space memories
  linear_memory_read_parts(q, k, g, beta) -> each writer's weight in the last token's read   stateless
  product_key_topk(q, keys, k) -> (scores, indices)          stateless
  weighted_bag(indices, weights, values) -> output            stateless

Each asks `kernel_mode` which path to take:
  * `impl="triton"`, `"native"` or `"reference"` forces a path for one call;
  * otherwise the environment variable MEMVIZ_KERNELS ("triton", "native", "reference" or "auto");
  * "auto" (the default) takes the Triton kernel for CUDA tensors where one exists, the
    compiled CPU kernel for CPU tensors where one exists and builds (the LM2 scan, the
    product-key top-k and bag; all with gradients), and the reference elsewhere.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import Tensor

from memviz_kernels.infini.reference import InfiniMemory, infini_memory_reference, infini_memory_stream
from memviz_kernels.linear_memory.chunked import chunked as linear_memory_chunked
from memviz_kernels.linear_memory.reference import read_parts as linear_memory_read_parts_reference
from memviz_kernels.lm2.reference import lm2_scan_reference
from memviz_kernels.product_keys.reference import product_key_topk as product_key_topk_reference
from memviz_kernels.product_keys.reference import weighted_bag as weighted_bag_reference
from memviz_kernels.titans.reference import LinearMemory, chunk_coefficients, chunk_update, titans_linear_reference

CHOICES = ("auto", "triton", "native", "reference")
#: operation -> "module:function" of its Triton kernel, imported on first use (so importing
#: memviz never imports triton)
TRITON_KERNELS: dict[str, str] = {
    "product_key_topk": "memviz_kernels.product_keys.triton:product_key_topk",
    "weighted_bag": "memviz_kernels.product_keys.triton:weighted_bag",
    "infini_memory": "memviz_kernels.infini.triton:infini_memory",
    "lm2_scan": "memviz_kernels.lm2.triton:lm2_scan",
    "titans_linear_memory": "memviz_kernels.titans.triton:titans_linear_memory",
}
#: operation -> "module:function" of its compiled CPU kernel; the module has `available()`
NATIVE_KERNELS: dict[str, str] = {
    "lm2_scan": "memviz_kernels.lm2.cpu:lm2_scan",
    "product_key_topk": "memviz_kernels.product_keys.cpu:product_key_topk",
    "weighted_bag": "memviz_kernels.product_keys.cpu:weighted_bag",
}
#: Triton kernels without a backward: when a gradient is needed the reference runs instead
#: (every compiled CPU kernel has one)
FORWARD_ONLY = {"lm2_scan", "titans_linear_memory"}


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
    "auto" for CPU tensors when it builds on this machine, with or without gradients."""
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
            raise ValueError(
                f"the CPU kernel for {op} takes float32 or float64 CPU tensors, got {tensor.dtype} on {tensor.device}"
            )
        module.library()  # raises with the compiler's message
    return module.supports(tensor) and module.available()


def _resolve(spec: str):
    """The function named by "module:function", imported on first use."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def native_kernel(op: str):
    return _resolve(NATIVE_KERNELS[op])


def triton_kernel(op: str):
    return _resolve(TRITON_KERNELS[op])


def lm2_scan(
    q_slot: Tensor, g_in: Tensor, W_V: Tensor, W_f: Tensor, b_f: Tensor, initial_state: Tensor, impl: str | None = None
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The LM2 per-token bank scan from the bank `initial_state` [B,N,d] (kernels/lm2/); the
    Triton kernel under no_grad only."""
    if use_triton("lm2_scan", q_slot, impl):
        kernel = triton_kernel("lm2_scan")
    elif use_native("lm2_scan", q_slot, impl):
        kernel = native_kernel("lm2_scan")
    else:
        kernel = lm2_scan_reference
    *outputs, bank = kernel(q_slot, g_in, initial_state, W_V, W_f, b_f)
    return tuple(outputs), bank


def product_key_topk(q: Tensor, keys: Tensor, k: int, impl: str | None = None) -> tuple[Tensor, Tensor]:
    """Exact top-k over n^2 product keys (kernels/product_keys/)."""
    if use_triton("product_key_topk", q, impl):
        return triton_kernel("product_key_topk")(q, keys, k)
    if use_native("product_key_topk", q, impl):
        return native_kernel("product_key_topk")(q, keys, k)
    return product_key_topk_reference(q, keys, k)


def weighted_bag(indices: Tensor, weights: Tensor, values: Tensor, impl: str | None = None) -> Tensor:
    """Softmax-weighted sum of the selected value rows (kernels/product_keys/)."""
    if use_triton("weighted_bag", weights, impl):
        return triton_kernel("weighted_bag")(indices, weights, values)
    if use_native("weighted_bag", values, impl):
        return native_kernel("weighted_bag")(indices, weights, values)
    return weighted_bag_reference(indices, weights, values)


def infini_memory(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    initial_state: InfiniMemory,
    segment_len: int,
    rule: str,
    impl: str | None = None,
) -> tuple[tuple[Tensor, Tensor], InfiniMemory]:
    """Infini-attention's compressive memory from any point in a segment (kernels/infini/):
    sigma-mapped q, k [B,H,T,d], v [B,H,T,dv], state (M, z, the open segment's keys and values)."""
    whole_segments = triton_kernel("infini_memory") if use_triton("infini_memory", q, impl) else infini_memory_reference
    return infini_memory_stream(q, k, v, initial_state, segment_len, rule, whole_segments)


def titans_linear_memory(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rates: Tensor,
    initial_state: LinearMemory,
    chunk: int,
    impl: str | None = None,
) -> tuple[tuple[Tensor, ...], LinearMemory]:
    """Titans' linear memory over whole chunks from weights and momentum (W, S) at a chunk
    boundary (kernels/titans/); the kernel under no_grad only."""
    kernel = (
        triton_kernel("titans_linear_memory")
        if use_triton("titans_linear_memory", q, impl)
        else titans_linear_reference
    )
    *outputs, W, S = kernel(q, k, v, rates, *initial_state, chunk)
    return tuple(outputs), LinearMemory(W, S)


def titans_chunk_coefficients(rates: Tensor) -> tuple[Tensor, ...]:
    """The scalars of a Titans chunk's closed-form update from its rates [..., b, 3] = (eta,
    theta, alpha), for any leading shape: a caller forms them for all its chunks in one call
    (kernels/titans/; reference only)."""
    return chunk_coefficients(rates)


def titans_chunk_update(
    factors: dict[str, tuple[Tensor, Tensor]],
    coefficients: tuple[Tensor, ...],
    initial_state: tuple[dict[str, Tensor], dict[str, Tensor]],
):
    """One chunk's update of any Titans memory whose per-token gradients are sums of outer
    products, `factors` {weight name: (a, g)}, the chunk's `titans_chunk_coefficients`, state
    (params, momentum) -> ((), (params, momentum)) (kernels/titans/; reference only)."""
    params, momentum = chunk_update(*initial_state, factors, coefficients)
    return (), (params, momentum)


def linear_memory(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor | None,
    initial_state: Tensor,
    chunk: int = 64,
    state_norms: bool = True,
) -> tuple[tuple[Tensor | None, Tensor | None], Tensor]:
    """The linear memory S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T (without beta:
    Diag(exp g_t) S_{t-1} + k_t v_t^T), read o_t = S_t^T q_t (kernels/linear_memory/): q, k [B,H,T,dk],
    v [B,H,T,dv], g [B,H,T] (a decay per head) or [B,H,T,dk] (per key channel), beta [B,H,T] or None,
    S [B,H,dk,dv] -> ((o or None without q, ||S_t||_F or None), S_T); the chunked form on every path."""
    return linear_memory_chunked(q, k, v, g, beta, initial_state, chunk, state_norms)


def linear_memory_read_parts(q: Tensor, k: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
    """The last token's read o_T = S_T^T q split over the tokens that wrote it: weights [B,H,T] with
    o_T = sum_j w_j v_j (and the start state's part); q [B,H,dk] (kernels/linear_memory/reference.py)."""
    return linear_memory_read_parts_reference(q, k, g, beta)
