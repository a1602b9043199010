"""Memory hot paths: each op in its own folder with its PyTorch reference (the specification),
its kernels and its tests; models call the ops here, never a kernel directly (kernels/dispatch.py)."""

from kernels.dispatch import (
    InfiniMemory,
    LinearMemory,
    infini_memory,
    lm2_scan,
    product_key_topk,
    titans_chunk_coefficients,
    titans_chunk_update,
    titans_linear_memory,
    weighted_bag,
)

__all__ = [
    "InfiniMemory",
    "LinearMemory",
    "infini_memory",
    "lm2_scan",
    "product_key_topk",
    "titans_chunk_coefficients",
    "titans_chunk_update",
    "titans_linear_memory",
    "weighted_bag",
]
