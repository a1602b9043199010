"""LM2 bank scan as a compiled CPU loop (kernels/lm2/cpu.c), forward only.

The scan is sequential over tokens, and in eager PyTorch each token costs about eleven small
op dispatches; the C loop does the same O(N d + d^2) arithmetic a token with no dispatch. Built
and loaded by kernels/native.py; `available()` says whether that worked, so callers can fall
back to the reference.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from kernels.lm2.reference import ScanResult, finish_scan, read_weights
from kernels.native import NativeKernelError, build

SOURCE = Path(__file__).with_suffix(".c")
FUNCTIONS = {torch.float32: "lm2_scan_f32", torch.float64: "lm2_scan_f64"}


@functools.cache
def library() -> ctypes.CDLL:
    """Compile (once per source version and machine) and load the shared library."""
    lib = build(SOURCE, "LM2")
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


def supports(q_slot: Tensor) -> bool:
    return q_slot.device.type == "cpu" and q_slot.dtype in FUNCTIONS


def lm2_scan(q_slot: Tensor, g_in: Tensor, M0: Tensor, W_V: Tensor, W_f: Tensor, b_f: Tensor) -> ScanResult:
    """The same contract as kernels.lm2.reference.lm2_scan_reference, with no autograd."""
    if not supports(q_slot):
        raise ValueError(f"the LM2 CPU kernel takes float32 or float64 CPU tensors, got {q_slot.dtype} on {q_slot.device}")
    B, T, d = q_slot.shape
    N = M0.shape[1]
    dtype = q_slot.dtype
    inputs = [x.detach().to(dtype).contiguous() for x in (q_slot, g_in, M0, read_weights(W_V, W_f), b_f)]
    attn = torch.empty(B, T, N, dtype=dtype)
    reads, forgets, decays, commons = (torch.empty(B, T, d, dtype=dtype) for _ in range(4))
    D_last, c_last = torch.empty(B, d, dtype=dtype), torch.empty(B, d, dtype=dtype)
    outputs = [attn, reads, forgets, decays, commons, D_last, c_last]
    status = getattr(library(), FUNCTIONS[dtype])(
        ctypes.c_long(B), ctypes.c_long(T), ctypes.c_long(N), ctypes.c_long(d),
        *(ctypes.c_void_p(t.data_ptr()) for t in inputs + outputs),
    )
    if status != 0:
        raise MemoryError("the LM2 CPU kernel could not allocate its work buffer")
    return finish_scan(inputs[2], *outputs)
