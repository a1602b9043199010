"""LM2 memory scan: the token-by-token gated update of the memory bank (PyTorch reference).

With the bank M_t [N, d] read by token t (memviz/models/lm2/__init__.py has the paper's equations):

  a_t     = softmax(q_t (M_t W_K)^T / sqrt(d))      slot attention          [N]
  E_mem,t = a_t (M_t W_V)                           memory read             [d]
  g_f,t   = sigmoid(E_mem,t W_f + b_f)              forget gate             [d]
  M_t+1   = g_in,t * tanh(E_mem,t) + g_f,t * M_t    the same write for every slot

Algebraic structure. Every slot receives the same elementwise decay and the same write, so
from the bank M_0 at the start of a scan

  M_t[n] = D_t * M_0[n] + c_t,   D_t+1 = g_f,t * D_t,   c_t+1 = g_f,t * c_t + g_in,t * tanh(E_mem,t)

and the common vector c_t adds the same score to every slot, which the softmax cancels:

  a_t     = softmax(((q~_t * D_t) M_0^T)),  q~_t = q_t W_K^T / sqrt(d)
  E_mem,t = (D_t * (a_t M_0) + c_t) W_V

so a step costs O(N d + d^2) with no bank-sized projection, against O(N d^2) for projecting
the whole bank with W_K and W_V every token (`lm2_scan_naive`, the benchmark's baseline and a
second check of the reference). q~, the input gates and all of M_0's products are computed
once per scan, outside the loop. The same loop compiled for the CPU is kernels/lm2/cpu.c.
"""

from __future__ import annotations

import torch
from torch import Tensor

ScanResult = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def _factored_steps(q_slot: Tensor, g_in: Tensor, M0: Tensor, W_read: Tensor, b_f: Tensor) -> list[Tensor]:
    """The sequential part: per token the slot attention, the read and the forget gate, and the
    (D_t, c_t) each token reads: eleven small ops a token."""
    B, T, d = q_slot.shape
    D = torch.ones(B, d, dtype=M0.dtype, device=M0.device)
    c = torch.zeros(B, d, dtype=M0.dtype, device=M0.device)
    M0_t = M0.transpose(1, 2)
    attn: list[Tensor] = []
    reads: list[Tensor] = []
    forgets: list[Tensor] = []
    decays: list[Tensor] = []
    commons: list[Tensor] = []
    for t in range(T):
        a = torch.softmax(torch.bmm((q_slot[:, t] * D).unsqueeze(1), M0_t), dim=-1)  # [B,1,N]
        read_pre = torch.matmul(D * torch.bmm(a, M0).squeeze(1) + c, W_read)  # [e | e W_f]
        e = read_pre[:, :d]
        g_f = torch.sigmoid(read_pre[:, d:] + b_f)
        attn.append(a.squeeze(1))
        reads.append(e)
        forgets.append(g_f)
        decays.append(D)
        commons.append(c)
        D = g_f * D
        c = torch.addcmul(g_f * c, g_in[:, t], torch.tanh(e))
    return [
        torch.stack(attn, 1),
        torch.stack(reads, 1),
        torch.stack(forgets, 1),
        torch.stack(decays, 1),
        torch.stack(commons, 1),
        D,
        c,
    ]


def lm2_scan_reference(q_slot: Tensor, g_in: Tensor, M0: Tensor, W_V: Tensor, W_f: Tensor, b_f: Tensor) -> ScanResult:
    """Scan tokens in order using the factored bank.

    q_slot [B,T,d] = q W_K^T / sqrt(d);  g_in [B,T,d] input gates;  M0 [B,N,d];  W_V, W_f [d,d];
    b_f [d]. Returns (slot attention [B,T,N], memory read E_mem [B,T,d], forget gate [B,T,d],
    slot norms of the bank each token reads [B,T,N], the bank after the last token [B,N,d]).
    The loop carries only D and c; the read and the forget gate's input come from one product
    with [W_V | W_V W_f], and the slot norms are formed for all tokens after the loop:
    ||D*M0[n] + c||^2 = (D^2).M0[n]^2 + 2 (D*c).M0[n] + c.c.
    """
    return finish_scan(M0, *_factored_steps(q_slot, g_in, M0, read_weights(W_V, W_f), b_f))


def read_weights(W_V: Tensor, W_f: Tensor) -> Tensor:
    """[W_V | W_V W_f]: the memory read and the forget gate's input from one product."""
    return torch.cat([W_V, W_V @ W_f], dim=1)


def finish_scan(
    M0: Tensor, attn: Tensor, reads: Tensor, forgets: Tensor, D: Tensor, c: Tensor, D_last: Tensor, c_last: Tensor
) -> ScanResult:
    """The scan's outputs from what the sequential loop carried (shared with the CPU kernel):
    slot norms of every token's bank at once, and the bank after the last token."""
    sq = (
        torch.einsum("btd,bnd->btn", D * D, M0.pow(2))
        + 2 * torch.einsum("btd,bnd->btn", D * c, M0)
        + (c * c).sum(-1, keepdim=True)
    )
    M_last = D_last[:, None, :] * M0 + c_last[:, None, :]
    return attn, reads, forgets, sq.clamp_min(0).sqrt(), M_last


def lm2_scan_naive(
    q: Tensor, g_in: Tensor, M0: Tensor, W_K: Tensor, W_V: Tensor, W_f: Tensor, b_f: Tensor
) -> ScanResult:
    """The same scan written directly from the equations: the bank is materialised and
    projected with W_K and W_V every token, O(N d^2) per token. q [B,T,d] is the raw query."""
    d = q.shape[-1]
    M = M0
    attn, reads, forgets, norms = [], [], [], []
    for t in range(q.shape[1]):
        K, V = M @ W_K, M @ W_V
        a = torch.softmax(torch.einsum("bd,bnd->bn", q[:, t], K) / d**0.5, dim=-1)
        e = torch.einsum("bn,bnd->bd", a, V)
        g_f = torch.sigmoid(e @ W_f + b_f)
        attn.append(a)
        reads.append(e)
        forgets.append(g_f)
        norms.append(M.norm(dim=-1))
        M = g_in[:, t, None, :] * torch.tanh(e)[:, None, :] + g_f[:, None, :] * M
    return torch.stack(attn, 1), torch.stack(reads, 1), torch.stack(forgets, 1), torch.stack(norms, 1), M
