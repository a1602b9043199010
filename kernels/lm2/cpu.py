"""LM2 bank scan as a compiled CPU loop (kernels/lm2/cpu.c), forward and backward.

The scan is sequential over tokens, and in eager PyTorch each token costs about eleven small
op dispatches (and autograd as many again backwards); the C loops do the same O(N d + d^2)
arithmetic a token with no dispatch, the backward by reverse-mode through the same loop (its
equations are in cpu.c). The read weights [W_V | W_V W_f] and the slot norms and last bank
(`finish_scan`) stay in PyTorch, so their gradients are autograd's. Built and loaded by
kernels/native.py; `available()` says whether that worked, so callers can fall back to the
reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from memviz_kernels.lm2.reference import ScanResult, finish_scan, read_weights
from memviz_kernels.native import loader, pointers, supports

SOURCE = Path(__file__).with_suffix(".c")
FUNCTIONS = {torch.float32: "lm2_scan_f32", torch.float64: "lm2_scan_f64"}
BACKWARD = {torch.float32: "lm2_scan_backward_f32", torch.float64: "lm2_scan_backward_f64"}


library, available = loader(SOURCE, "LM2", (*FUNCTIONS.values(), *BACKWARD.values()))


class FactoredScan(torch.autograd.Function):
    """The sequential part of the scan (reference `_factored_steps`): (q_slot, g_in, M0, W_read,
    b_f) -> (attn, reads, forgets, decays, commons, D_last, c_last)."""

    @staticmethod
    def forward(ctx, q_slot: Tensor, g_in: Tensor, M0: Tensor, W_read: Tensor, b_f: Tensor):
        B, T, d = q_slot.shape
        N = M0.shape[1]
        dtype = q_slot.dtype  # `lm2_scan` hands every input over in it
        inputs = [x.detach().contiguous() for x in (q_slot, g_in, M0, W_read, b_f)]
        attn = torch.empty(B, T, N, dtype=dtype)
        reads, forgets, decays, commons = (torch.empty(B, T, d, dtype=dtype) for _ in range(4))
        D_last, c_last = torch.empty(B, d, dtype=dtype), torch.empty(B, d, dtype=dtype)
        outputs = [attn, reads, forgets, decays, commons, D_last, c_last]
        status = getattr(library(), FUNCTIONS[dtype])(
            ctypes.c_long(B), ctypes.c_long(T), ctypes.c_long(N), ctypes.c_long(d), *pointers(inputs + outputs)
        )
        if status != 0:
            raise MemoryError("the LM2 CPU kernel could not allocate its work buffer")
        ctx.save_for_backward(*inputs[:4], *outputs[:5])
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outputs: Tensor | None):
        q_slot, g_in, M0, W_read, *outputs = ctx.saved_tensors
        B, T, d = q_slot.shape
        N, dtype = M0.shape[1], q_slot.dtype
        like = outputs + [outputs[3][:, 0], outputs[4][:, 0]]  # shapes of the seven outputs
        grads = [torch.zeros_like(x) if g is None else g.to(dtype).contiguous() for g, x in zip(grad_outputs, like)]
        results = [
            torch.empty_like(q_slot),
            torch.empty_like(g_in),
            torch.zeros_like(M0),
            torch.zeros_like(W_read),
            torch.zeros(d, dtype=dtype),
        ]
        status = getattr(library(), BACKWARD[dtype])(
            ctypes.c_long(B),
            ctypes.c_long(T),
            ctypes.c_long(N),
            ctypes.c_long(d),
            *pointers([q_slot, g_in, M0, W_read, *outputs, *grads, *results]),
        )
        if status != 0:
            raise MemoryError("the LM2 CPU kernel could not allocate its work buffer")
        return tuple(results)


def lm2_scan(q_slot: Tensor, g_in: Tensor, M0: Tensor, W_V: Tensor, W_f: Tensor, b_f: Tensor) -> ScanResult:
    """The same contract as memviz_kernels.lm2.reference.lm2_scan_reference, with gradients."""
    if not supports(q_slot):
        raise ValueError(
            f"the LM2 CPU kernel takes float32 or float64 CPU tensors, got {q_slot.dtype} on {q_slot.device}"
        )
    dtype = q_slot.dtype
    M0 = M0.to(dtype)
    steps = FactoredScan.apply(q_slot, g_in.to(dtype), M0, read_weights(W_V, W_f).to(dtype), b_f.to(dtype))
    return finish_scan(M0, *steps)
