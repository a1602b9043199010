"""The linear memory of `reference.py` a chunk of C tokens at a time: one triangular solve and a few matmuls a
chunk instead of C rank-one updates (Yang et al., arXiv 2412.06464, Section 3.3; derived here).

With u_t = beta_t (v_t - (Diag(alpha_t) S_{t-1})^T k_t) (u_t = v_t without the delta rule) every update is
S_t = Diag(alpha_t) S_{t-1} + k_t u_t^T, so from the chunk's start state S_0, with gamma_i = prod_{j<=i} alpha_j
inside the chunk (a scalar or a vector over key channels) and R_ij = gamma_i / gamma_j for j <= i:

  S_i = Diag(gamma_i) S_0 + sum_{j<=i} Diag(R_ij) k_j u_j^T
  U   = (I + diag(beta) strict(A))^-1 diag(beta) (V - (gamma o K) S_0),   A_ij = k_i^T Diag(R_ij) k_j
  O   = (gamma o Q) S_0 + (q_i^T Diag(R_ij) k_j, j <= i) U
  S_C = Diag(gamma_C) S_0 + (R_Cj o k_j)^T U

For a scalar decay A is R o KK^T and the state's norm after every token has a closed form that forms no
per-token state: ||S_i||^2 = gamma_i^2 ||S_0||^2 + 2 gamma_i (R p)_i + (R (KK^T o UU^T) R^T)_ii with
p_j = k_j^T S_0 u_j. Its terms cancel where the delta rule erases what the state held, so it is summed in float64.
Per channel the ratios are a [C, C, d_k] tensor (keep C small) and the norms come from the states themselves.
Ratios are exp of differences of cumulative log decays, masked before exp, so they never overflow.

Without the delta rule and with d_v = 1 (Mamba-1's channels, RG-LRU's) every entry of S evolves alone,
s_t = alpha_t s_{t-1} + k_t v_t: a diagonal recurrence, run as a parallel prefix scan over the chunk's tokens
(log2 C doubling steps of elementwise products, every factor at most 1) instead of the [C, C, d_k] ratios.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def chunked(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor | None,
    S: Tensor,
    chunk: int = 64,
    state_norms: bool = True,
) -> tuple[tuple[Tensor | None, Tensor | None], Tensor]:
    """`reference.recurrent`'s map (same arguments), `chunk` tokens a step; without q no read, with
    `state_norms` False no norms (None). The work is in float32 at least (the triangular solve has no bfloat16
    kernel), in float64 where v or the state is; the read comes back in v's dtype, the norms in the work's, the
    state in its own."""
    dtype, state_dtype = v.dtype, S.dtype
    work = torch.promote_types(torch.promote_types(dtype, state_dtype), torch.float32)
    if k.shape[2] == 0:  # no token: nothing read, the state as it was
        read = v.new_zeros(v.shape) if q is not None else None
        return (read, v.new_zeros(v.shape[:3], dtype=work) if state_norms else None), S
    k, v, g, S = (t.to(work) for t in (k, v, g, S))
    beta = None if beta is None else beta.to(work)
    if beta is None and g.dim() == 3 and v.shape[-1] > 1:
        o, n, S = all_chunks_at_once(q if q is None else q.to(work), k, v, g, S, chunk, state_norms)
        return (None if o is None else o.to(dtype), n), S.to(state_dtype)
    step = (
        diagonal_chunk
        if beta is None and v.shape[-1] == 1
        else per_channel_chunk
        if g.dim() == k.dim()
        else scalar_chunk
    )
    # The chunks come from split, not slicing: a slice's backward adds a zero tensor of the whole
    # input's length, which made a long input's backward grow with its length times its chunks.
    pieces = [t.split(chunk, dim=2) for t in (k, v, g)]
    queries = q.to(work).split(chunk, dim=2) if q is not None else [None] * len(pieces[0])
    strengths = beta.split(chunk, dim=2) if beta is not None else [None] * len(pieces[0])
    outputs: list[Tensor] = []
    norms: list[Tensor] = []
    for Q, K, V, G, B in zip(queries, *pieces, strengths):
        O, N, S = step(Q, K, V, G, B, S, state_norms)
        outputs += [O] if O is not None else []
        norms += [N] if N is not None else []
    o = torch.cat(outputs, 2).to(dtype) if q is not None else None
    return (o, torch.cat(norms, 2) if state_norms else None), S.to(state_dtype)


def scalar_chunk(
    Q: Tensor | None, K: Tensor, V: Tensor, g: Tensor, beta: Tensor | None, S: Tensor, state_norms: bool
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """One chunk with a decay per head, g [B,H,C] (module docstring) -> (O, ||S_i||, S_C); any leading dims."""
    C = K.shape[-2]
    G = g.cumsum(-1)  # log gamma_i
    diff = G[..., :, None] - G[..., None, :]  # log gamma_i / gamma_j
    lower = torch.ones(C, C, dtype=torch.bool, device=K.device).tril()
    ratio = torch.where(lower, diff, torch.full_like(diff, -torch.inf)).exp()  # j <= i
    gamma = G.exp()
    KS = K @ S
    if beta is None:
        U = V
    else:
        strict = ratio * (~torch.eye(C, dtype=torch.bool, device=K.device))
        A = strict * (K @ K.transpose(-1, -2))
        system = torch.eye(C, dtype=K.dtype, device=K.device) + beta[..., :, None] * A
        rhs = beta[..., None] * (V - gamma[..., None] * KS)
        U = torch.linalg.solve_triangular(system, rhs, upper=False)
    O = gamma[..., None] * (Q @ S) + (ratio * (Q @ K.transpose(-1, -2))) @ U if Q is not None else None
    norms = None
    if state_norms:  # summed in float64: the terms cancel where the delta rule erases
        K64, U64, r64, g64 = (t.double() for t in (K, U, ratio, gamma))
        square = (
            g64**2 * S.double().pow(2).sum((-1, -2))[..., None]
            + 2 * g64 * (r64 @ (KS.double() * U64).sum(-1)[..., None])[..., 0]
            + ((r64 @ ((K64 @ K64.transpose(-1, -2)) * (U64 @ U64.transpose(-1, -2)))) * r64).sum(-1)
        )
        norms = square.clamp_min(0).sqrt().to(K.dtype)
    S = gamma[..., -1, None, None] * S + K.transpose(-1, -2) @ ((G[..., -1:] - G).exp()[..., None] * U)
    return O, norms, S


def all_chunks_at_once(
    q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, S: Tensor, chunk: int, state_norms: bool
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """A scalar decay without the delta rule (Mamba-2's SSD, mLSTM): a chunk's writes do not depend on its start
    state, so the chunks' start states come first (each chunk's writes from zero, sum_j (gamma_C / gamma_j) k_j v_j^T,
    and its decay gamma_C, chained chunk to chunk), then `scalar_chunk` runs every chunk as one batch. The input is
    padded to whole chunks with tokens that neither decay nor write -> (o, ||S_t||, S_T)."""
    B, H, T, _ = k.shape
    n = -(-T // chunk)
    pad = n * chunk - T

    def chunks(t: Tensor) -> Tensor:  # [B, H, T, ...] -> [B, H, n, chunk, ...]
        return F.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad)).view(B, H, n, chunk, *t.shape[3:])

    K, V, G = chunks(k), chunks(v), chunks(g)
    total = G.cumsum(-1)
    written = K.transpose(-1, -2) @ ((total[..., -1:] - total).exp()[..., None] * V)  # [B, H, n, d_k, d_v]
    decay = total[..., -1].exp()
    starts = []
    for c in range(n):
        starts.append(S)
        S = decay[:, :, c, None, None] * S + written[:, :, c]
    O, norms, _ = scalar_chunk(None if q is None else chunks(q), K, V, G, None, torch.stack(starts, 2), state_norms)
    o = None if O is None else O.reshape(B, H, n * chunk, -1)[:, :, :T]
    return o, None if norms is None else norms.reshape(B, H, n * chunk)[:, :, :T], S


def per_channel_chunk(
    Q: Tensor | None, K: Tensor, V: Tensor, g: Tensor, beta: Tensor | None, S: Tensor, state_norms: bool
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """One chunk with a decay per key channel, g [B,H,C,d_k] (module docstring) -> (O, ||S_i||, S_C)."""
    C = K.shape[2]
    G = g.cumsum(2)  # log gamma_i per channel
    diff = G[..., :, None, :] - G[..., None, :, :]  # [B,H,C,C,d_k]
    lower = torch.ones(C, C, dtype=torch.bool, device=K.device).tril()[..., None]
    ratio = torch.where(lower, diff, torch.full_like(diff, -torch.inf)).exp()
    gamma = G.exp()
    if beta is None:
        U = V
    else:
        A = torch.einsum("bhic,bhijc,bhjc->bhij", K, ratio, K).tril(-1)
        system = torch.eye(C, dtype=K.dtype, device=K.device) + beta[..., :, None] * A
        rhs = beta[..., None] * (V - (gamma * K) @ S)
        U = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    O = None
    if Q is not None:
        O = (gamma * Q) @ S + torch.einsum("bhic,bhijc,bhjc->bhij", Q, ratio, K) @ U
    norms = None
    if state_norms:
        states = gamma[..., None] * S[:, :, None] + torch.einsum("bhijc,bhjc,bhjv->bhicv", ratio, K, U)
        norms = states.flatten(3).norm(dim=-1)
    S = gamma[:, :, -1, :, None] * S + ((G[:, :, -1:] - G).exp() * K).transpose(-1, -2) @ U
    return O, norms, S


def scan_step(x: Tensor, alpha: Tensor, span: int, into: Tensor | None, combine) -> Tensor:
    """One Hillis-Steele step along dim 2: the entries before `span` kept, each later one combine(x_i, alpha_i,
    x_{i-span}), written into `into` (None: a fresh buffer, as autograd needs when it keeps the old one)."""
    out = torch.empty_like(x) if into is None else into
    out[:, :, :span] = x[:, :, :span]
    out[:, :, span:] = combine(x[:, :, span:], alpha[:, :, span:], x[:, :, :-span])
    return out


def diagonal_chunk(
    Q: Tensor | None, K: Tensor, V: Tensor, g: Tensor, beta: Tensor | None, S: Tensor, state_norms: bool
) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """One chunk of a diagonal recurrence (no delta rule, d_v = 1; module docstring): the states s_i =
    alpha_i s_{i-1} + k_i v_i of every entry at once by a Hillis-Steele scan of the pairs (alpha, w) under
    (a1, w1) then (a2, w2) = (a1 a2, a2 w1 + w2), the start state folded into the first write -> (O, ||S_i||, S_C)."""
    C = K.shape[2]
    alpha = (g.exp() if g.dim() == K.dim() else g.exp()[..., None]).expand(K.shape)
    w = K * V  # [B,H,C,d_k]: the write of each entry
    w[:, :, :1] += alpha[:, :, :1] * S[:, :, None, :, 0]
    # each step writes a buffer, not a concatenation; without autograd two buffers take turns
    reuse = not (torch.is_grad_enabled() and any(t.requires_grad for t in (K, V, g, S)))
    spare_w: Tensor | None = None
    spare_alpha: Tensor | None = None
    span = 1
    while span < C:
        w, spare_w = scan_step(w, alpha, span, spare_w, torch.addcmul), w if reuse else None
        if 2 * span < C:
            kept = alpha if reuse and alpha.is_contiguous() else None  # not g's expanded exp, never written into
            alpha, spare_alpha = scan_step(alpha, alpha, span, spare_alpha, lambda a, b, prev: b * prev), kept
        span *= 2
    O = (Q * w).sum(-1, keepdim=True) if Q is not None else None
    norms = w.norm(dim=-1) if state_norms else None
    return O, norms, w[:, :, -1, :, None]
