"""Product-key lookup and the weighted bag of value rows (PyTorch references).

Product keys (Lample et al. 2019; Memory Layers at Scale, arXiv 2412.09764): a query q of
d_k dims is split into halves q1, q2; each half is scored against its own table of n sub-keys;
the full key (i, j) is the concatenation of sub-keys K1[i] and K2[j], so its score is
q1.K1[i] + q2.K2[j]. The top-k of all n^2 sums must pair a top-k entry of each half, so

  1. top-k of q1.K1^T and of q2.K2^T             (n scores each, not n^2)
  2. the k x k candidate sums s1[a] + s2[b]
  3. top-k of those, with value index i * n + j

is exact. The memory output is then the softmax-weighted sum of the k selected value rows,
an embedding bag: sum_i w_i V[idx_i].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def product_key_topk(q: Tensor, keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """q [..., H, d_k], keys [H, 2, n, d_k/2] -> (scores [..., H, k], indices [..., H, k]) of the
    k best full keys per head, best first; indices address a table of n^2 values."""
    n = keys.shape[2]
    halves = q.unflatten(-1, (2, q.shape[-1] // 2))  # [..., H, 2, d_k/2]
    sub_scores = torch.einsum("...hpd,hpnd->...hpn", halves, keys)  # both halves in one product
    top, idx = sub_scores.topk(k, dim=-1)  # [..., H, 2, k]
    sums = (top[..., 0, :, None] + top[..., 1, None, :]).flatten(-2)  # [..., H, k*k]
    best, flat = sums.topk(k, dim=-1)
    indices = idx[..., 0, :].gather(-1, flat // k) * n + idx[..., 1, :].gather(-1, flat % k)
    return best, indices


def weighted_bag(indices: Tensor, weights: Tensor, values: Tensor) -> Tensor:
    """sum_i weights[..., i] * values[indices[..., i]]: indices, weights [..., k]; values [n^2, d]
    -> [..., d], without materialising the gathered rows (torch's embedding_bag)."""
    lead = indices.shape[:-1]
    out = F.embedding_bag(
        indices.reshape(-1, indices.shape[-1]),
        values,
        per_sample_weights=weights.reshape(-1, weights.shape[-1]).to(values.dtype),
        mode="sum",
    )
    return out.view(*lead, values.shape[-1])
