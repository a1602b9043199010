"""The gated delta rule (Yang, Kautz and Hatamizadeh, arXiv 2412.06464, eq. 10) in two forms.

Per head, with the state S [d_k, d_v] (the transpose of the paper's S [d_v, d_k]), unit-norm
keys k_t, decay alpha_t in (0, 1] and write strength beta_t in (0, 1):

  S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

`recurrent` runs it token by token (the specification). `chunked` is the same map over chunks
of C tokens (the paper's Section 3.3, derived here). With u_t = beta_t (v_t - alpha_t S_{t-1}^T k_t)
the update is S_t = alpha_t S_{t-1} + k_t u_t^T, so from the chunk's start state S_0, with
gamma_i = prod_{j<=i} alpha_j inside the chunk:

  S_i = gamma_i S_0 + sum_{j<=i} (gamma_i / gamma_j) k_j u_j^T
  U   = (I + diag(beta) A)^{-1} diag(beta) (V - diag(gamma) K S_0),   A_ij = (gamma_i/gamma_j) k_i.k_j, j < i
  O   = diag(gamma) Q S_0 + ((gamma_i/gamma_j) q_i.k_j, j <= i) U
  S_C = gamma_C S_0 + K^T diag(gamma_C / gamma) U

one triangular solve and a few matmuls a chunk. Ratios of gammas are exp of differences of
cumulative log alpha, masked before exp, so they never overflow. Both forms also return the
state's Frobenius norm after every token (for the trace).
"""

from __future__ import annotations

import torch
from torch import Tensor


def recurrent(
    q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, S: Tensor
) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """q, k [B,H,T,dk], v [B,H,T,dv], alpha, beta [B,H,T], S [B,H,dk,dv] ->
    ((o [B,H,T,dv], ||S_t||_F [B,H,T]), S_T)."""
    outputs, norms = [], []
    for t in range(q.shape[2]):
        kt, vt, a, b = k[:, :, t], v[:, :, t], alpha[:, :, t, None, None], beta[:, :, t, None, None]
        S = a * (S - b * kt[..., :, None] * (kt[..., None, :] @ S)) + b * kt[..., :, None] * vt[..., None, :]
        outputs.append((q[:, :, t, None, :] @ S)[:, :, 0])
        norms.append(S.flatten(2).norm(dim=-1))
    return (torch.stack(outputs, 2), torch.stack(norms, 2)), S


def chunked(
    q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, beta: Tensor, S: Tensor, chunk: int = 32, state_norms: bool = True
) -> tuple[tuple[Tensor, Tensor | None], Tensor]:
    """The same map as `recurrent`, a chunk of `chunk` tokens at a time (module docstring);
    with `state_norms` False the per-token norms are skipped (None), the costly part. Half
    precision inputs are computed in float32 (the triangular solve has no bfloat16 kernel)."""
    dtype, state_dtype = q.dtype, S.dtype
    work = torch.promote_types(dtype, torch.float32)
    q, k, v, alpha, beta, S = (t.to(work) for t in (q, k, v, alpha, beta, S))
    outputs, norms = [], []
    log_alpha = torch.log(alpha.clamp_min(1e-30))
    # The chunks come from split, not slicing: a slice's backward adds a zero tensor of the whole
    # input's length, which made a long input's backward grow with its length times its chunks.
    for Q, K, V, beta_c, log_alpha_c in zip(*(t.split(chunk, dim=2) for t in (q, k, v, beta, log_alpha))):
        C = Q.shape[2]
        G = log_alpha_c.cumsum(-1)  # log gamma_i
        diff = G[..., :, None] - G[..., None, :]  # log gamma_i / gamma_j
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        ratio = torch.where(lower, diff, torch.full_like(diff, -torch.inf)).exp()  # j <= i
        strict = ratio * (~torch.eye(C, dtype=torch.bool, device=q.device))
        gamma = G.exp()
        A = strict * (K @ K.transpose(-1, -2))
        system = torch.eye(C, dtype=q.dtype, device=q.device) + beta_c[..., :, None] * A
        rhs = beta_c[..., None] * (V - gamma[..., None] * (K @ S))
        U = torch.linalg.solve_triangular(system, rhs, upper=False)
        outputs.append(gamma[..., None] * (Q @ S) + (ratio * (Q @ K.transpose(-1, -2))) @ U)
        if state_norms:  # S_i for every i: gamma_i S_0 + sum_{j<=i} ratio_ij k_j u_j^T
            states = gamma[..., None, None] * S[:, :, None] + torch.einsum("bhij,bhjk,bhjv->bhikv", ratio, K, U)
            norms.append(states.flatten(3).norm(dim=-1))
        S = gamma[..., -1, None, None] * S + K.transpose(-1, -2) @ ((G[..., -1:] - G).exp()[..., None] * U)
    out_norms = torch.cat(norms, 2).to(dtype) if state_norms else None
    return (torch.cat(outputs, 2).to(dtype), out_norms), S.to(state_dtype)
