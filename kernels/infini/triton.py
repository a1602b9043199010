"""Triton kernels for Infini-attention's segment memory (reference: `kernels/infini/reference.py`).

One program per (batch, head) walks the segments with M [d, dv] and z [d] held on chip:
retrieval, the linear or delta-rule update, and ||M_s||_F, in one launch for the whole input.
The forward stores each segment's starting (M_s, z_s) (n_segments * d * dv floats per head,
as chunked linear-attention kernels do), so the backward walks the segments in reverse with
dM, dz on chip and recomputes every segment's retrieval from its stored state:

  A = N / D, N = sq M, D = sq.z      dN = dA / D,  dD = -sum_j dA A / D,
                                     dsq = dN M^T + dD z,  dM += sq^T dN,  dz += sq^T dD
  M' = M + sk^T u,  z' = z + sum sk  du = sk dM',  dsk = u dM'^T + dz',  dv = du
  u = v - sk M / (sk.z)   (delta)   the retrieval's rule again with dN = -du / D.

Where the denominator is clamped (nothing stored yet) its gradient is zero, as in torch.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from memviz_kernels.infini.reference import EPS as _EPS

EPS = tl.constexpr(_EPS)  # a kernel reads a global only as a constexpr (the interpreter does not check)
#: launch settings: no software pipelining of the segment loop's loads (by count, three stages of its
#: [256, 64] float32 tiles would pass an H100's 227 KB of shared memory, as Titans' did on one); eight warps
#: halve each thread's share of the tiles. Other settings have not been timed.
LAUNCH = dict(num_warps=8, num_stages=1)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs at least 16 on a GPU


@triton.jit
def _tile(ptr, rows, cols, row_mask, D):
    return tl.load(ptr + rows[:, None] * D + cols[None, :], mask=row_mask[:, None] & (cols[None, :] < D), other=0.0).to(
        tl.float32
    )


@triton.jit
def _square_state(m_ptr, z_ptr, bh, D, offs_d):
    """Head bh's [D, D] matrix and [D] vector, with the offsets and masks to store such a pair."""
    d_ok = offs_d < D
    m_offs = offs_d[:, None] * D + offs_d[None, :]
    m_mask = d_ok[:, None] & d_ok[None, :]
    M = tl.load(m_ptr + bh * D * D + m_offs, mask=m_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + bh * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    return M, z, m_offs, m_mask, d_ok


@triton.jit
def infini_forward_kernel(
    sq_ptr,
    sk_ptr,
    v_ptr,
    m0_ptr,
    z0_ptr,
    a_ptr,
    m_states_ptr,
    z_states_ptr,
    norm_ptr,
    m_out_ptr,
    z_out_ptr,
    T,
    D,
    S,
    n_seg,
    DELTA: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    M, z, m_offs, m_mask, d_ok = _square_state(m0_ptr, z0_ptr, bh, D, offs_d)
    base = bh * T * D
    for s in range(0, n_seg):
        t = s * S + offs_s
        rows = (offs_s < S) & (t < T)
        sq = _tile(sq_ptr + base, t, offs_d, rows, D)
        sk = _tile(sk_ptr + base, t, offs_d, rows, D)
        v = _tile(v_ptr + base, t, offs_d, rows, D)
        state = bh * n_seg + s
        tl.store(m_states_ptr + state * D * D + m_offs, M, mask=m_mask)
        tl.store(z_states_ptr + state * D + offs_d, z, mask=d_ok)
        tl.store(norm_ptr + state, tl.sqrt(tl.sum(tl.sum(M * M, axis=1), axis=0)))
        den = tl.maximum(tl.sum(sq * z[None, :], axis=1), EPS)
        read = tl.dot(sq, M, input_precision="ieee") / den[:, None]
        tl.store(a_ptr + base + t[:, None] * D + offs_d[None, :], read, mask=rows[:, None] & d_ok[None, :])
        complete = tl.cast((s + 1) * S <= T, tl.float32)
        u = v
        if DELTA:
            den_k = tl.maximum(tl.sum(sk * z[None, :], axis=1), EPS)
            u = v - tl.dot(sk, M, input_precision="ieee") / den_k[:, None]
        sk = sk * complete
        M += tl.dot(tl.trans(sk), u, input_precision="ieee")
        z += tl.sum(sk, axis=0)
    tl.store(m_out_ptr + bh * D * D + m_offs, M, mask=m_mask)
    tl.store(z_out_ptr + bh * D + offs_d, z, mask=d_ok)


@triton.jit
def infini_backward_kernel(
    sq_ptr,
    sk_ptr,
    v_ptr,
    m_states_ptr,
    z_states_ptr,
    da_ptr,
    dm_out_ptr,
    dz_out_ptr,
    dsq_ptr,
    dsk_ptr,
    dv_ptr,
    dm0_ptr,
    dz0_ptr,
    T,
    D,
    S,
    n_seg,
    DELTA: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    dM, dz, m_offs, m_mask, d_ok = _square_state(dm_out_ptr, dz_out_ptr, bh, D, offs_d)
    base = bh * T * D
    for i in range(0, n_seg):
        s = n_seg - 1 - i
        t = s * S + offs_s
        rows = (offs_s < S) & (t < T)
        out_mask = rows[:, None] & d_ok[None, :]
        state = bh * n_seg + s
        M = tl.load(m_states_ptr + state * D * D + m_offs, mask=m_mask, other=0.0)
        z = tl.load(z_states_ptr + state * D + offs_d, mask=d_ok, other=0.0)
        sq = _tile(sq_ptr + base, t, offs_d, rows, D)
        sk = _tile(sk_ptr + base, t, offs_d, rows, D)
        v = _tile(v_ptr + base, t, offs_d, rows, D)
        dA = _tile(da_ptr + base, t, offs_d, rows, D)
        complete = tl.cast((s + 1) * S <= T, tl.float32)
        # the update M' = M + sk^T u, z' = z + sum sk (dM, dz are the gradients of M', z')
        du = tl.dot(sk, dM, input_precision="ieee") * complete
        u = v
        dM_prev = dM
        dz_prev = dz
        if DELTA:
            raw_k = tl.sum(sk * z[None, :], axis=1)
            den_k = tl.maximum(raw_k, EPS)
            r = tl.dot(sk, M, input_precision="ieee") / den_k[:, None]
            u = v - r
            dnum_k = -du / den_k[:, None]
            dden_k = tl.where(raw_k >= EPS, tl.sum(du * r, axis=1) / den_k, 0.0)
            dsk_delta = tl.dot(dnum_k, tl.trans(M), input_precision="ieee") + dden_k[:, None] * z[None, :]
            dM_prev += tl.dot(tl.trans(sk), dnum_k, input_precision="ieee")
            dz_prev += tl.sum(sk * dden_k[:, None], axis=0)
        dsk = (tl.dot(u, tl.trans(dM), input_precision="ieee") + dz[None, :]) * complete
        if DELTA:
            dsk += dsk_delta
        # the retrieval A = sq M / (sq.z)
        raw = tl.sum(sq * z[None, :], axis=1)
        den = tl.maximum(raw, EPS)
        read = tl.dot(sq, M, input_precision="ieee") / den[:, None]
        dnum = dA / den[:, None]
        dden = tl.where(raw >= EPS, -tl.sum(dA * read, axis=1) / den, 0.0)
        dsq = tl.dot(dnum, tl.trans(M), input_precision="ieee") + dden[:, None] * z[None, :]
        dM = dM_prev + tl.dot(tl.trans(sq), dnum, input_precision="ieee")
        dz = dz_prev + tl.sum(sq * dden[:, None], axis=0)
        ptrs = t[:, None] * D + offs_d[None, :]
        tl.store(dsq_ptr + base + ptrs, dsq, mask=out_mask)
        tl.store(dsk_ptr + base + ptrs, dsk, mask=out_mask)
        tl.store(dv_ptr + base + ptrs, du, mask=out_mask)
    tl.store(dm0_ptr + bh * D * D + m_offs, dM, mask=m_mask)
    tl.store(dz0_ptr + bh * D + offs_d, dz, mask=d_ok)


class InfiniMemory(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sq: Tensor, sk: Tensor, v: Tensor, M: Tensor, z: Tensor, segment_len: int, rule: str):
        B, H, T, D = sq.shape
        if v.shape[-1] != D or M.shape[-2:] != (D, D):
            raise ValueError("the Infini memory kernel needs d_k == d_v")
        n_seg = triton.cdiv(T, segment_len)
        f32: dict[str, Any] = dict(device=sq.device, dtype=torch.float32)  # torch.empty's keywords
        sq_c, sk_c, v_c = (x.contiguous() for x in (sq, sk, v))
        read = torch.empty(B, H, T, D, **f32)
        m_states = torch.empty(B, H, n_seg, D, D, **f32)
        z_states = torch.empty(B, H, n_seg, D, **f32)
        norms = torch.empty(B, H, n_seg, **f32)
        M_out, z_out = torch.empty(B, H, D, D, **f32), torch.empty(B, H, D, **f32)
        infini_forward_kernel[(B * H,)](
            sq_c,
            sk_c,
            v_c,
            M.contiguous(),
            z.contiguous(),
            read,
            m_states,
            z_states,
            norms,
            M_out,
            z_out,
            T,
            D,
            segment_len,
            n_seg,
            DELTA=rule == "delta",
            BLOCK_S=_block(segment_len),
            BLOCK_D=_block(D),
            **LAUNCH,
        )
        ctx.save_for_backward(sq_c, sk_c, v_c, m_states, z_states)
        ctx.segment_len, ctx.rule, ctx.dtypes = segment_len, rule, (sq.dtype, M.dtype, z.dtype)
        ctx.mark_non_differentiable(norms)
        return read.to(sq.dtype), norms.to(sq.dtype), M_out.to(M.dtype), z_out.to(z.dtype)

    @staticmethod
    def backward(ctx, d_read: Tensor, _d_norms, d_M: Tensor, d_z: Tensor):
        sq, sk, v, m_states, z_states = ctx.saved_tensors
        B, H, T, D = sq.shape
        f32: dict[str, Any] = dict(device=sq.device, dtype=torch.float32)  # torch.empty's keywords
        d_read = torch.zeros(B, H, T, D, **f32) if d_read is None else d_read.float().contiguous()
        d_M = torch.zeros(B, H, D, D, **f32) if d_M is None else d_M.float().contiguous()
        d_z = torch.zeros(B, H, D, **f32) if d_z is None else d_z.float().contiguous()
        dsq, dsk, dv = (torch.empty(B, H, T, D, **f32) for _ in range(3))
        dM0, dz0 = torch.empty(B, H, D, D, **f32), torch.empty(B, H, D, **f32)
        infini_backward_kernel[(B * H,)](
            sq,
            sk,
            v,
            m_states,
            z_states,
            d_read,
            d_M,
            d_z,
            dsq,
            dsk,
            dv,
            dM0,
            dz0,
            T,
            D,
            ctx.segment_len,
            m_states.shape[2],
            DELTA=ctx.rule == "delta",
            BLOCK_S=_block(ctx.segment_len),
            BLOCK_D=_block(D),
            **LAUNCH,
        )
        x_dtype, m_dtype, z_dtype = ctx.dtypes
        return dsq.to(x_dtype), dsk.to(x_dtype), dv.to(x_dtype), dM0.to(m_dtype), dz0.to(z_dtype), None, None


def infini_memory(sq: Tensor, sk: Tensor, v: Tensor, M: Tensor, z: Tensor, segment_len: int, rule: str):
    """Same contract as `infini_memory_reference`."""
    return InfiniMemory.apply(sq, sk, v, M, z, segment_len, rule)
