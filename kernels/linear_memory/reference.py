"""The linear memory S_t = A_t S_{t-1} + write_t, token by token: the specification of every delta-rule and
state-space memory memviz reads, native or released.

Per head a state S [d_k, d_v] (the papers' S^T), keys k_t [d_k], values v_t [d_v], a decay alpha_t = exp(g_t)
given in log space, g_t a scalar per head [B,H,T] or a vector per key channel [B,H,T,d_k], and, for the delta
rule, a write strength beta_t:

  delta rule (beta given):   S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
  plain (beta None):         S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T
  read:                      o_t = S_t^T q_t

A scalar alpha_t gives Gated DeltaNet (Yang, Kautz and Hatamizadeh, arXiv 2412.06464, eq. 10), where
Diag(alpha_t) = alpha_t I commutes with the key removal, and with beta None Mamba-2's SSD and mLSTM's
forget gate (the caller folds dt or the input gate into k or v); a vector alpha_t gives Kimi Delta Attention
(Kimi Linear, arXiv 2510.26692, eq. 1) and, with beta None, Mamba-1's per-channel decay.

S is linear in the writes with transitions A_t that do not depend on S, so a read splits exactly over the
tokens that wrote it (`read_parts`), the part of the state a span wrote is the same recurrence fed only the
span's writes (the needle hold), and a reset or patch of S between tokens is exact.
"""

from __future__ import annotations

import torch
from torch import Tensor


def decay(g: Tensor, t: int) -> Tensor:
    """alpha_t as a factor on S [B,H,d_k,d_v] rows: [B,H,1,1] for a scalar per head, [B,H,d_k,1] per channel."""
    return (g[:, :, t, None, None] if g.dim() == 3 else g[:, :, t, :, None]).exp()


def recurrent(
    q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, S: Tensor
) -> tuple[tuple[Tensor | None, Tensor], Tensor]:
    """q, k [B,H,T,dk], v [B,H,T,dv], g [B,H,T] or [B,H,T,dk] (log alpha), beta [B,H,T] or None,
    S [B,H,dk,dv] -> ((o [B,H,T,dv] or None without q, ||S_t||_F [B,H,T]), S_T)."""
    outputs, norms = [], []
    for t in range(k.shape[2]):
        kt, vt = k[:, :, t, :, None], v[:, :, t, None, :]
        S = decay(g, t) * S
        if beta is None:
            S = S + kt * vt
        else:
            b = beta[:, :, t, None, None]
            S = S + b * kt * (vt - kt.transpose(-1, -2) @ S)
        if q is not None:
            outputs.append((q[:, :, t, None, :] @ S)[:, :, 0])
        norms.append(S.flatten(2).norm(dim=-1))
    return (torch.stack(outputs, 2) if q is not None else None, torch.stack(norms, 2)), S


def read_parts(q: Tensor, k: Tensor, g: Tensor, beta: Tensor | None) -> Tensor:
    """The read o_T = S_T^T q at the last token, split over the writers: weights w [B,H,T] with
    o_T = sum_j w_j v_j + (the start state's part, S_0^T r_0). With r_T = q and r_{j-1} = A_j^T r_j,
    A_j^T = Diag(alpha_j) (I - beta_j k_j k_j^T), write j gives (r_j . k_j) beta_j v_j.

    q [B,H,dk], k [B,H,T,dk], g [B,H,T] or [B,H,T,dk], beta [B,H,T] or None; in float32 at least."""
    work = torch.promote_types(q.dtype, torch.float32)
    r, k, g = q.to(work), k.to(work), g.to(work)
    beta = None if beta is None else beta.to(work)
    weights = r.new_zeros(k.shape[:3])
    for j in range(k.shape[2] - 1, -1, -1):
        kj = k[:, :, j]
        along = (r * kj).sum(-1)
        if beta is not None:
            along = along * beta[:, :, j]
            r = r - along[..., None] * kj
        weights[:, :, j] = along
        r = r * (g[:, :, j, None] if g.dim() == 3 else g[:, :, j]).exp()
    return weights
