"""Triton kernel for the LM2 memory scan (reference: `kernels/lm2/reference.py`, whose factored form it runs).

One program per sequence walks the tokens with everything a step touches on chip: the
scan-start bank M_0 [N, d], its squares, W_V and W_f [d, d], and the running decay D and
common write c [d] (M_t[n] = D_t * M_0[n] + c_t). A step is O(N d + d^2) and reads only that
token's query and input gate from memory; it writes what the traces show (slot attention,
read, forget gate, slot norms) and, at the end, the bank.

Forward only: LM2 training takes the reference (autograd through its loop); the kernel
serves inference and tracing, where the scan is the whole cost.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from memviz_kernels.lm2.reference import ScanResult


@triton.jit
def lm2_scan_kernel(
    q_ptr,
    gin_ptr,
    m0_ptr,
    wv_ptr,
    wf_ptr,
    bf_ptr,
    attn_ptr,
    read_ptr,
    forget_ptr,
    norm_ptr,
    m_out_ptr,
    T,
    N,
    D,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    d_ok = offs_d < D
    bank_offs = offs_n[:, None] * D + offs_d[None, :]
    bank_mask = n_ok[:, None] & d_ok[None, :]
    w_offs = offs_d[:, None] * D + offs_d[None, :]
    w_mask = d_ok[:, None] & d_ok[None, :]
    M0 = tl.load(m0_ptr + b * N * D + bank_offs, mask=bank_mask, other=0.0).to(tl.float32)
    M0_sq = M0 * M0
    W_V = tl.load(wv_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32)
    W_f = tl.load(wf_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32)
    b_f = tl.load(bf_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    decay = tl.where(d_ok, 1.0, 0.0)
    common = tl.zeros([BLOCK_D], tl.float32)
    for t in range(0, T):
        row = (b * T + t) * D
        q = tl.load(q_ptr + row + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        g_in = tl.load(gin_ptr + row + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        scores = tl.where(n_ok, tl.sum(M0 * (q * decay)[None, :], axis=1), float("-inf"))
        weights = tl.exp(scores - tl.max(scores, axis=0))
        attn = weights / tl.sum(weights, axis=0)
        bank_read = decay * tl.sum(attn[:, None] * M0, axis=0) + common
        e = tl.sum(bank_read[:, None] * W_V, axis=0)
        g_f = tl.sigmoid(tl.sum(e[:, None] * W_f, axis=0) + b_f)
        sq = (
            tl.sum(M0_sq * (decay * decay)[None, :], axis=1)
            + 2 * tl.sum(M0 * (decay * common)[None, :], axis=1)
            + tl.sum(common * common, axis=0)
        )
        tl.store(attn_ptr + (b * T + t) * N + offs_n, attn, mask=n_ok)
        tl.store(norm_ptr + (b * T + t) * N + offs_n, tl.sqrt(tl.maximum(sq, 0.0)), mask=n_ok)
        tl.store(read_ptr + row + offs_d, e, mask=d_ok)
        tl.store(forget_ptr + row + offs_d, g_f, mask=d_ok)
        tanh_e = 1.0 - 2.0 / (tl.exp(2.0 * e) + 1.0)
        decay = g_f * decay
        common = g_f * common + g_in * tanh_e
    M_last = decay[None, :] * M0 + common[None, :]
    tl.store(m_out_ptr + b * N * D + bank_offs, M_last, mask=bank_mask)


def lm2_scan(q_slot: Tensor, g_in: Tensor, M0: Tensor, W_V: Tensor, W_f: Tensor, b_f: Tensor) -> ScanResult:
    """Same contract as `lm2_scan_reference` (forward only)."""
    B, T, D = q_slot.shape
    N = M0.shape[1]
    f32: dict[str, Any] = dict(device=q_slot.device, dtype=torch.float32)  # torch.empty's keywords
    attn, norms = torch.empty(B, T, N, **f32), torch.empty(B, T, N, **f32)
    read, forget = torch.empty(B, T, D, **f32), torch.empty(B, T, D, **f32)
    M_last = torch.empty(B, N, D, **f32)
    lm2_scan_kernel[(B,)](
        q_slot.contiguous(),
        g_in.contiguous(),
        M0.contiguous(),
        W_V.contiguous(),
        W_f.contiguous(),
        b_f.contiguous(),
        attn,
        read,
        forget,
        norms,
        M_last,
        T,
        N,
        D,
        BLOCK_N=triton.next_power_of_2(N),
        BLOCK_D=triton.next_power_of_2(D),
    )
    dtype = q_slot.dtype
    return attn.to(dtype), read.to(dtype), forget.to(dtype), norms.to(dtype), M_last.to(M0.dtype)
