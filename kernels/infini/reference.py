"""Infini-attention's compressive memory over whole segments (PyTorch reference).

For each (batch, head), segments of S tokens in order, with sigma-mapped queries and keys
(memviz/models/infini/__init__.py has the paper's equations):

  A_mem,s = sigma(Q_s) M_s / (sigma(Q_s) z_s)                          retrieval (eq. 3)
  M_s+1   = M_s + sigma(K_s)^T (V_s - [sigma(K_s) M_s / (sigma(K_s) z_s)])  the bracket only
                                                                        for the delta rule (eq. 5)
  z_s+1   = z_s + sum_t sigma(K_s,t)

The input starts at a segment boundary; a final partial segment retrieves but does not update
(its keys wait for the rest of the segment, which the caller keeps). Also returned: ||M_s||_F,
the size of the memory each segment reads (the trace's memory norm).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

EPS = 1e-6


class InfiniMemory(NamedTuple):
    """The op's state: M [B,H,d,dv], z [B,H,d], and the open segment's sigma(K) [B,H,P,d] and V [B,H,P,dv]
    (P < segment_len tokens that wait for the rest of their segment)."""

    M: Tensor
    z: Tensor
    open_k: Tensor
    open_v: Tensor


def memory_retrieve(sq: Tensor, M: Tensor, z: Tensor) -> Tensor:
    """A_mem = sigma(Q) M / (sigma(Q) z); zero where nothing has been stored (z = 0).

    sq [B,H,T,d], M [B,H,d,dv], z [B,H,d] -> [B,H,T,dv]."""
    num = sq @ M
    den = (sq * z[:, :, None, :]).sum(-1, keepdim=True)
    return num / den.clamp_min(EPS)


def memory_update(sk: Tensor, v: Tensor, M: Tensor, z: Tensor, rule: str) -> tuple[Tensor, Tensor]:
    """One segment's update of (M, z) from sigma(K) [B,H,S,d] and V [B,H,S,dv] (eqs. 4, 5)."""
    if rule == "delta":
        v = v - memory_retrieve(sk, M, z)
    return M + sk.transpose(-1, -2) @ v, z + sk.sum(2)


def infini_memory_reference(
    sq: Tensor, sk: Tensor, v: Tensor, M: Tensor, z: Tensor, segment_len: int, rule: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """sq, sk [B,H,T,d], v [B,H,T,dv], M [B,H,d,dv], z [B,H,d] -> (A_mem [B,H,T,dv],
    ||M_s||_F for each segment [B,H,n_segments], M and z after the last complete segment)."""
    reads, norms = [], []
    # split, not slices: the backward pass then concatenates the segments' gradients (O(T)) instead
    # of adding each into a zero tensor of the whole length (O(T^2 / segment_len))
    for q_s, k_s, v_s in zip(*(x.split(segment_len, dim=2) for x in (sq, sk, v))):
        reads.append(memory_retrieve(q_s, M, z))
        norms.append(M.flatten(2).norm(dim=-1))
        if q_s.shape[2] == segment_len:
            M, z = memory_update(k_s, v_s, M, z, rule)
    return torch.cat(reads, dim=2), torch.stack(norms, dim=-1), M, z


def infini_memory_stream(
    sq: Tensor,
    sk: Tensor,
    v: Tensor,
    state: InfiniMemory,
    segment_len: int,
    rule: str,
    whole_segments=infini_memory_reference,
) -> tuple[tuple[Tensor, Tensor], InfiniMemory]:
    """The op at any offset into a segment, as the dispatcher presents it: state -> ((A_mem [B,H,T,dv],
    ||M||_F each token read [B,H,T]), the state after the input). The open segment is finished
    here; whole segments from its end go to `whole_segments` (the reference or a kernel)."""
    M, z, open_k, open_v = state
    T, S = sq.shape[2], segment_len
    reads, norms, start = [], [], 0
    if open_k.shape[2]:  # finish the segment an earlier call left open
        start = min(T, S - open_k.shape[2])
        reads.append(memory_retrieve(sq[:, :, :start], M, z))
        norms.append(M.flatten(2).norm(dim=-1)[..., None].expand(-1, -1, start))
        open_k, open_v = torch.cat([open_k, sk[:, :, :start]], dim=2), torch.cat([open_v, v[:, :, :start]], dim=2)
        if open_k.shape[2] == S:
            M, z = memory_update(open_k, open_v, M, z, rule)
            open_k, open_v = open_k[:, :, :0], open_v[:, :, :0]
    if start < T:  # whole segments from a boundary: one call
        read, segment_norms, M, z = whole_segments(sq[:, :, start:], sk[:, :, start:], v[:, :, start:], M, z, S, rule)
        reads.append(read)
        norms.append(segment_norms.repeat_interleave(S, dim=-1)[..., : T - start])
        open_len = (T - start) % S
        open_k, open_v = sk[:, :, T - open_len :], v[:, :, T - open_len :]
    return (torch.cat(reads, dim=2), torch.cat(norms, dim=2)), InfiniMemory(M, z, open_k, open_v)
