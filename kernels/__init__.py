"""Memory hot paths: each operation has a PyTorch reference (the specification) and, where
written, a Triton kernel; models call the functions here, never a kernel directly."""
from kernels.dispatch import infini_memory, lm2_scan, product_key_topk, titans_linear_memory, weighted_bag

__all__ = ["infini_memory", "lm2_scan", "product_key_topk", "titans_linear_memory", "weighted_bag"]
