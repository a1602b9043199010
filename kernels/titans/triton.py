"""Triton kernel for Titans' linear neural memory (reference: `kernels/titans/reference.py`).

One program per sequence keeps the weights W and the momentum S [d, d] on chip and walks the
chunks; per chunk of C tokens it forms

  read = q W,  r = k W - v,  loss_t = ||r_t||^2,  surprise_t = 2 ||k_t|| ||r_t||
  L_t = sum_{j<=t} log eta_j,  Lambda_t = sum_{j<=t} log(1 - alpha_j)          (tl.cumsum)
  w[t,i] = exp(L_t - L_i) (i <= t),  c_t = exp(Lambda_C - Lambda_t),  beta_i = sum_t c_t w[t,i]
  W' = exp(Lambda_C) W + (sum_t c_t exp(L_t)) S - k^T diag(beta theta) (2 r)
  S' = exp(L_C) S - k^T diag(w[C,:] theta) (2 r)

and the loss after the update, so the per-token gradients (k_t^T 2 r_t against the chunk-start
weights), the momentum and forgetting scans, the retrievals and the surprise come from one
launch. Forward only: training takes the reference (autograd through the closed form).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

#: launch settings: no software pipelining of the chunk loop's loads (with three stages the compiler asked
#: for 263,680 bytes of shared memory at d = 128, over an H100's 232,448). Other settings have not been timed.
LAUNCH = dict(num_warps=8, num_stages=1)


@triton.jit
def titans_linear_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    rates_ptr,
    w0_ptr,
    s0_ptr,
    read_ptr,
    surprise_ptr,
    loss_ptr,
    loss_after_ptr,
    w_out_ptr,
    s_out_ptr,
    T,
    D,
    C,
    n_chunks,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    w_offs = offs_d[:, None] * D + offs_d[None, :]
    w_mask = d_ok[:, None] & d_ok[None, :]
    W = tl.load(w0_ptr + b * D * D + w_offs, mask=w_mask, other=0.0).to(tl.float32)
    S = tl.load(s0_ptr + b * D * D + w_offs, mask=w_mask, other=0.0).to(tl.float32)
    causal = offs_c[None, :] <= offs_c[:, None]  # [t, i]: i <= t
    for chunk in range(0, n_chunks):
        t = chunk * C + offs_c
        rows = (offs_c < C) & (t < T)
        tile = (b * T + t)[:, None] * D + offs_d[None, :]
        tile_mask = rows[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)
        rate = rates_ptr + (b * T + t) * 3
        eta = tl.load(rate, mask=rows, other=1.0).to(tl.float32)
        theta = tl.load(rate + 1, mask=rows, other=0.0).to(tl.float32)
        alpha = tl.load(rate + 2, mask=rows, other=0.0).to(tl.float32)
        tl.store(read_ptr + tile, tl.dot(q, W, input_precision="ieee"), mask=tile_mask)
        r = tl.dot(k, W, input_precision="ieee") - v
        loss = tl.sum(r * r, axis=1)
        tl.store(loss_ptr + b * T + t, loss, mask=rows)
        tl.store(surprise_ptr + b * T + t, 2 * tl.sqrt(tl.sum(k * k, axis=1) * loss), mask=rows)
        log_eta = tl.cumsum(tl.log(tl.maximum(eta, 1e-12)), axis=0)
        log_keep = tl.cumsum(tl.log(tl.maximum(1 - alpha, 1e-12)), axis=0)
        last = offs_c == C - 1
        log_eta_end = tl.sum(tl.where(last, log_eta, 0.0), axis=0)
        log_keep_end = tl.sum(tl.where(last, log_keep, 0.0), axis=0)
        w = tl.where(causal, tl.exp(log_eta[:, None] - log_eta[None, :]), 0.0)
        c = tl.where(offs_c < C, tl.exp(log_keep_end - log_keep), 0.0)
        beta = tl.sum(c[:, None] * w, axis=0)
        carry_S = tl.sum(c * tl.exp(log_eta), axis=0)
        w_end = tl.where(offs_c < C, tl.exp(log_eta_end - log_eta), 0.0)
        complete = tl.cast((chunk + 1) * C <= T, tl.float32)
        g = 2 * r
        write_W = tl.dot(tl.trans(k * (beta * theta)[:, None]), g, input_precision="ieee")
        write_S = tl.dot(tl.trans(k * (w_end * theta)[:, None]), g, input_precision="ieee")
        W_new = tl.exp(log_keep_end) * W + carry_S * S - write_W
        S_new = tl.exp(log_eta_end) * S - write_S
        W = complete * W_new + (1 - complete) * W
        S = complete * S_new + (1 - complete) * S
        after = tl.dot(k, W, input_precision="ieee") - v
        tl.store(loss_after_ptr + b * T + t, tl.sum(after * after, axis=1), mask=rows)
    tl.store(w_out_ptr + b * D * D + w_offs, W, mask=w_mask)
    tl.store(s_out_ptr + b * D * D + w_offs, S, mask=w_mask)


def titans_linear_memory(q: Tensor, k: Tensor, v: Tensor, rates: Tensor, W: Tensor, S: Tensor, chunk: int):
    """Same contract as `titans_linear_reference` (forward only)."""
    B, T, D = q.shape
    f32: dict[str, Any] = dict(device=q.device, dtype=torch.float32)  # torch.empty's keywords
    read = torch.empty(B, T, D, **f32)
    surprise, loss, loss_after = (torch.empty(B, T, **f32) for _ in range(3))
    W_out, S_out = torch.empty(B, D, D, **f32), torch.empty(B, D, D, **f32)
    titans_linear_kernel[(B,)](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        rates.contiguous(),
        W.contiguous(),
        S.contiguous(),
        read,
        surprise,
        loss,
        loss_after,
        W_out,
        S_out,
        T,
        D,
        chunk,
        triton.cdiv(T, chunk),
        BLOCK_C=max(16, triton.next_power_of_2(chunk)),
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        **LAUNCH,
    )
    dtype = q.dtype
    return (
        read.to(dtype),
        surprise.to(dtype),
        loss.to(dtype),
        loss_after.to(dtype),
        W_out.to(W.dtype),
        S_out.to(S.dtype),
    )
