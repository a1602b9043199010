"""Triton kernels for the product-key lookup and the weighted bag (reference: `kernels/product_keys/reference.py`).

  * `pk_topk_kernel`: per (token, head) row, both half-key score vectors, the top-k of each,
    the k x k candidate sums and their top-k, in one program; nothing of size n^2 or k x k
    leaves the chip. Returns the scores and value indices the traces show.
  * `bag_forward_kernel`: out[r] = sum_i w[r, i] V[idx[r, i]], ROWS rows per program.
  * `bag_weight_grad_kernel`: dw[r, i] = dout[r] . V[idx[r, i]].
  * `bag_value_grad_kernel`: dV[v] = sum over the (r, i) with idx[r, i] = v of w[r, i] dout[r],
    one program per block of value rows walking a reverse index (the selections sorted by
    value row), so every row of dV is written exactly once and no atomics contend; rows no
    token selected get zeros. `bag_value_grad_atomic_kernel` is the atomic-add fallback.

The top-k's backward reuses the bag kernels: the score of selection (i, j) is q1.K1[i] +
q2.K2[j], so dq1 = sum_i g_i K1[i] is a weighted bag over the sub-key table and dK1 is the
value gradient of that bag.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS = 4  # rows per program: the interpreter's cost grows with the number of programs


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


@triton.jit
def _topk_of(s, offs, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K largest entries of the 1-D block s (best first) and their offsets."""
    lanes = tl.arange(0, BLOCK_K)
    best = tl.full([BLOCK_K], float("-inf"), tl.float32)
    where = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(K):
        top = tl.max(s, axis=0)
        at = tl.argmax(s, axis=0)
        best = tl.where(lanes == i, top, best)
        where = tl.where(lanes == i, at, where)
        s = tl.where(offs == at, float("-inf"), s)
    return best, where


@triton.jit
def pk_topk_kernel(
    q_ptr,
    keys_ptr,
    score_ptr,
    index_ptr,
    n_rows,
    H,
    n,
    HALF,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kk = tl.arange(0, BLOCK_K * BLOCK_K)
    for r in tl.static_range(ROWS):
        row = pid * ROWS + r
        h = row % H
        live_d = (offs_d * 0 + row) < n_rows  # (a scalar mask does not broadcast in the interpreter)
        key_mask = (offs_n[:, None] < n) & (offs_d[None, :] < HALF) & live_d[None, :]
        q_mask = (offs_d < HALF) & live_d
        q1 = tl.load(q_ptr + row * 2 * HALF + offs_d, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_ptr + row * 2 * HALF + HALF + offs_d, mask=q_mask, other=0.0).to(tl.float32)
        table = keys_ptr + h * 2 * n * HALF + offs_n[:, None] * HALF + offs_d[None, :]
        k1 = tl.load(table, mask=key_mask, other=0.0).to(tl.float32)
        k2 = tl.load(table + n * HALF, mask=key_mask, other=0.0).to(tl.float32)
        s1 = tl.where(offs_n < n, tl.sum(k1 * q1[None, :], axis=1), float("-inf"))
        s2 = tl.where(offs_n < n, tl.sum(k2 * q2[None, :], axis=1), float("-inf"))
        top1, idx1 = _topk_of(s1, offs_n, K, BLOCK_K)
        top2, idx2 = _topk_of(s2, offs_n, K, BLOCK_K)
        pair_ok = (offs_k[:, None] < K) & (offs_k[None, :] < K)
        sums = tl.where(pair_ok, top1[:, None] + top2[None, :], float("-inf"))
        best, flat = _topk_of(tl.reshape(sums, [BLOCK_K * BLOCK_K]), offs_kk, K, BLOCK_K)
        a, b = flat // BLOCK_K, flat % BLOCK_K
        i = tl.sum(tl.where(offs_k[None, :] == a[:, None], idx1[None, :], 0), axis=1)
        j = tl.sum(tl.where(offs_k[None, :] == b[:, None], idx2[None, :], 0), axis=1)
        out_mask = (offs_k < K) & ((offs_k * 0 + row) < n_rows)
        tl.store(score_ptr + row * K + offs_k, best, mask=out_mask)
        tl.store(index_ptr + row * K + offs_k, (i * n + j).to(tl.int64), mask=out_mask)


@triton.jit
def _selections(idx_ptr, w_ptr, row, n_rows, K, offs_k):
    """Row `row`'s k value indices and weights (masked past K and past the last row)."""
    sel = (offs_k < K) & ((offs_k * 0 + row) < n_rows)
    idx = tl.load(idx_ptr + row * K + offs_k, mask=sel, other=0)
    w = tl.load(w_ptr + row * K + offs_k, mask=sel, other=0.0).to(tl.float32)
    return sel, idx, w


@triton.jit
def bag_forward_kernel(
    idx_ptr, w_ptr, v_ptr, out_ptr, n_rows, K, D, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr
):
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    for r in tl.static_range(ROWS):
        row = pid * ROWS + r
        sel, idx, w = _selections(idx_ptr, w_ptr, row, n_rows, K, offs_k)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs_d
            rows_v = tl.load(
                v_ptr + idx[:, None] * D + cols[None, :], mask=sel[:, None] & (cols[None, :] < D), other=0.0
            )
            acc = tl.sum(rows_v.to(tl.float32) * w[:, None], axis=0)
            tl.store(out_ptr + row * D + cols, acc, mask=(cols < D) & ((cols * 0 + row) < n_rows))


@triton.jit
def bag_weight_grad_kernel(
    idx_ptr, v_ptr, dout_ptr, dw_ptr, n_rows, K, D, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr
):
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    for r in tl.static_range(ROWS):
        row = pid * ROWS + r
        sel = (offs_k < K) & ((offs_k * 0 + row) < n_rows)
        idx = tl.load(idx_ptr + row * K + offs_k, mask=sel, other=0)
        acc = tl.zeros([BLOCK_K], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs_d
            g = tl.load(dout_ptr + row * D + cols, mask=(cols < D) & ((cols * 0 + row) < n_rows), other=0.0).to(
                tl.float32
            )
            rows_v = tl.load(
                v_ptr + idx[:, None] * D + cols[None, :], mask=sel[:, None] & (cols[None, :] < D), other=0.0
            )
            acc += tl.sum(rows_v.to(tl.float32) * g[None, :], axis=1)
        tl.store(dw_ptr + row * K + offs_k, acc, mask=sel)


@triton.jit
def bag_value_grad_kernel(
    order_ptr, start_ptr, w_ptr, dout_ptr, dv_ptr, n_values, K, D, BLOCK_D: tl.constexpr, ROWS: tl.constexpr
):
    """start[v]..start[v+1] are the positions in `order` of the selections of value row v."""
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    for r in tl.static_range(ROWS):
        v = pid * ROWS + r
        v_safe = tl.minimum(v, n_values - 1)
        first = tl.load(start_ptr + v_safe)
        last = tl.where(v < n_values, tl.load(start_ptr + v_safe + 1), first)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs_d
            acc = tl.zeros([BLOCK_D], tl.float32)
            for p in range(first, last):
                sel = tl.load(order_ptr + p)
                w = tl.load(w_ptr + sel).to(tl.float32)
                acc += w * tl.load(dout_ptr + (sel // K) * D + cols, mask=cols < D, other=0.0).to(tl.float32)
            tl.store(dv_ptr + v * D + cols, acc, mask=(cols < D) & ((cols * 0 + v) < n_values))


@triton.jit
def bag_value_grad_atomic_kernel(
    idx_ptr, w_ptr, dout_ptr, dv_ptr, n_rows, K, D, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr
):
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    for r in tl.static_range(ROWS):
        row = pid * ROWS + r
        sel, idx, w = _selections(idx_ptr, w_ptr, row, n_rows, K, offs_k)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + offs_d
            g = tl.load(dout_ptr + row * D + cols, mask=(cols < D) & ((cols * 0 + row) < n_rows), other=0.0).to(
                tl.float32
            )
            mask = sel[:, None] & (cols[None, :] < D)
            tl.atomic_add(dv_ptr + idx[:, None] * D + cols[None, :], w[:, None] * g[None, :], mask=mask)


# ----- launchers ------------------------------------------------------------------------------
def _grid(rows: int):
    return (triton.cdiv(rows, ROWS),)


def topk_launch(q: Tensor, keys: Tensor, k: int, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Forward of the fused lookup: q [..., H, d_k], keys [H, 2, n, d_k/2] -> (scores, indices)."""
    H, _, n, half = keys.shape
    if q.shape[-1] != 2 * half or q.shape[-2] != H or not 0 < k <= n:
        raise ValueError(f"product_key_topk: q {tuple(q.shape)}, keys {tuple(keys.shape)}, k={k}")
    q2d, keys = q.reshape(-1, 2 * half).contiguous(), keys.contiguous()
    rows = q2d.shape[0]
    scores, indices = out or (
        torch.empty(rows, k, device=q.device, dtype=torch.float32),
        torch.empty(rows, k, device=q.device, dtype=torch.int64),
    )
    pk_topk_kernel[_grid(rows)](
        q2d,
        keys,
        scores,
        indices,
        rows,
        H,
        n,
        half,
        K=k,
        BLOCK_N=_pow2(n),
        BLOCK_D=_pow2(half),
        BLOCK_K=_pow2(k),
        ROWS=ROWS,
    )
    lead = q.shape[:-1]
    return scores.view(*lead, k).to(q.dtype), indices.view(*lead, k)


def bag_forward(indices: Tensor, weights: Tensor, values: Tensor, out: Tensor | None = None) -> Tensor:
    rows, k = indices.shape
    D = values.shape[1]
    out = torch.empty(rows, D, device=values.device, dtype=torch.float32) if out is None else out
    bag_forward_kernel[_grid(rows)](
        indices, weights, values, out, rows, k, D, BLOCK_K=_pow2(k), BLOCK_D=min(128, _pow2(D)), ROWS=ROWS
    )
    return out


def bag_weight_grad(indices: Tensor, values: Tensor, grad: Tensor) -> Tensor:
    rows, k = indices.shape
    dw = torch.empty(rows, k, device=values.device, dtype=torch.float32)
    bag_weight_grad_kernel[_grid(rows)](
        indices,
        values,
        grad,
        dw,
        rows,
        k,
        values.shape[1],
        BLOCK_K=_pow2(k),
        BLOCK_D=min(128, _pow2(values.shape[1])),
        ROWS=ROWS,
    )
    return dw


def bag_value_grad(indices: Tensor, weights: Tensor, grad: Tensor, n_values: int, strategy: str = "reverse") -> Tensor:
    """dV [n_values, D]; `strategy` "reverse" (sorted reverse index, no atomics) or "atomic"."""
    rows, k = indices.shape
    D = grad.shape[1]
    block_d = min(128, _pow2(D))
    if strategy == "atomic":
        dv = torch.zeros(n_values, D, device=grad.device, dtype=torch.float32)
        bag_value_grad_atomic_kernel[_grid(rows)](
            indices, weights, grad, dv, rows, k, D, BLOCK_K=_pow2(k), BLOCK_D=block_d, ROWS=ROWS
        )
        return dv
    if strategy != "reverse":
        raise ValueError(f"bag value-gradient strategy must be 'reverse' or 'atomic', got {strategy!r}")
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    start = torch.zeros(n_values + 1, device=grad.device, dtype=torch.int64)
    start[1:] = torch.bincount(flat, minlength=n_values).cumsum(0)
    dv = torch.empty(n_values, D, device=grad.device, dtype=torch.float32)
    bag_value_grad_kernel[_grid(n_values)](order, start, weights, grad, dv, n_values, k, D, BLOCK_D=block_d, ROWS=ROWS)
    return dv


class WeightedBag(torch.autograd.Function):
    """sum_i w_i V[idx_i] with the kernels above for the forward and all gradients."""

    @staticmethod
    def forward(ctx, indices: Tensor, weights: Tensor, values: Tensor, strategy: str) -> Tensor:
        idx2d = indices.reshape(-1, indices.shape[-1]).contiguous()
        w2d = weights.reshape(-1, weights.shape[-1]).contiguous()
        values_c = values.contiguous()
        ctx.save_for_backward(idx2d, w2d, values_c)
        ctx.strategy, ctx.lead, ctx.w_shape = strategy, indices.shape[:-1], weights.shape
        return bag_forward(idx2d, w2d, values_c).to(values.dtype).view(*indices.shape[:-1], values.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        idx2d, w2d, values = ctx.saved_tensors
        g = grad.reshape(-1, values.shape[1]).contiguous()
        dw = dv = None
        if ctx.needs_input_grad[1]:
            dw = bag_weight_grad(idx2d, values, g).to(w2d.dtype).view(ctx.w_shape)
        if ctx.needs_input_grad[2]:
            dv = bag_value_grad(idx2d, w2d, g, values.shape[0], ctx.strategy).to(values.dtype)
        return None, dw, dv, None


def weighted_bag(indices: Tensor, weights: Tensor, values: Tensor, strategy: str = "reverse") -> Tensor:
    return WeightedBag.apply(indices, weights, values, strategy)


class ProductKeyTopk(torch.autograd.Function):
    """Scores and indices of the fused lookup; scores are differentiable in q and the keys."""

    @staticmethod
    def forward(ctx, q: Tensor, keys: Tensor, k: int):
        scores, indices = topk_launch(q, keys, k)
        ctx.save_for_backward(q, keys, indices)
        ctx.mark_non_differentiable(indices)
        return scores, indices

    @staticmethod
    def backward(ctx, grad_scores: Tensor, _grad_indices):
        q, keys, indices = ctx.saved_tensors
        H, _, n, half = keys.shape
        k = indices.shape[-1]
        head = torch.arange(H, device=q.device).view(H, 1) * n  # row offset of head h in a [H*n, half] table
        g = grad_scores.reshape(-1, k).contiguous()
        flat_idx = indices.reshape(-1, H, k)
        dq: list[Tensor] = []
        dkeys: list[Tensor] = []
        for part, sub in ((0, flat_idx // n), (1, flat_idx % n)):
            table_idx = (sub + head).reshape(-1, k).contiguous()
            table = keys[:, part].reshape(H * n, half).contiguous()
            q_part = q[..., part * half : (part + 1) * half].reshape(-1, half).contiguous()
            if ctx.needs_input_grad[0]:
                dq.append(weighted_bag(table_idx, g, table).view(*q.shape[:-1], half))
            if ctx.needs_input_grad[1]:
                dkeys.append(bag_value_grad(table_idx, g, q_part.float(), H * n).view(H, n, half))
        dq_out = torch.cat(dq, dim=-1).to(q.dtype) if ctx.needs_input_grad[0] else None
        dk_out = torch.stack(dkeys, dim=1).to(keys.dtype) if ctx.needs_input_grad[1] else None
        return dq_out, dk_out, None


def product_key_topk(q: Tensor, keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    return ProductKeyTopk.apply(q, keys, k)
