"""Titans' neural-memory update over chunks (PyTorch reference; memviz/models/titans/__init__.py has the
paper's equations and the closed form derived there).

Within a chunk every token's gradient is taken against the chunk-start weights; momentum
(eta), inner learning rate (theta) and forgetting (alpha) are linear recurrences, so a whole
chunk's update is a few matmuls (`chunk_coefficients`, then `chunk_update`, for any memory whose
per-token gradient is a sum of outer products). `titans_linear_reference` runs the linear memory M(k) = k W over
whole chunks and returns everything the traces show: the retrievals, the per-token loss and
surprise against the chunk-start weights and the loss after the chunk's update.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class LinearMemory(NamedTuple):
    """The linear memory op's state: weights W and momentum S [B,d,d]."""

    W: Tensor
    S: Tensor


def chunk_coefficients(rates: Tensor) -> tuple[Tensor, ...]:
    """The scalars of eqs. 10 and 13's closed form over a chunk of b tokens (memviz/models/titans/__init__.py)
    from its rates [..., b, 3] = (eta, theta, alpha), for any leading shape: they depend on the
    rates alone, so a caller may form them for all its chunks at once. Returns (beta_i theta_i,
    w[b,i] theta_i) [..., b], the weights of the two writes, and prod (1 - alpha), sum_t c_t
    prod_{j<=t} eta_j, prod eta [...]."""
    eta, theta, alpha = rates.unbind(-1)
    log_eta = torch.log(eta.clamp_min(1e-12)).cumsum(-1)  # L_t = sum_{j<=t} log eta_j
    log_keep = torch.log((1 - alpha).clamp_min(1e-12)).cumsum(-1)  # Lambda_t
    b = eta.shape[-1]
    diff = log_eta[..., :, None] - log_eta[..., None, :]  # L_t - L_i
    causal = torch.ones(b, b, dtype=torch.bool, device=eta.device).tril()
    w = torch.where(causal, diff, torch.full_like(diff, -torch.inf)).exp()  # w[t,i]
    c = (log_keep[..., -1:] - log_keep).exp()  # c_t = prod_{t<j<=b} (1 - alpha_j)
    beta = torch.einsum("...t,...ti->...i", c, w)
    carry_S = (c * log_eta.exp()).sum(-1)  # sum_t c_t prod_{j<=t} eta_j
    return beta * theta, w[..., -1, :] * theta, log_keep[..., -1].exp(), carry_S, log_eta[..., -1].exp()


def chunk_update(params, momentum, factors, coefficients):
    """Apply eqs. 10 and 13 over one chunk in closed form: factors {name: (a [B,b,m], g [B,b,n])},
    the chunk's `chunk_coefficients`. Returns new params, momentum."""
    write_M_scale, write_S_scale, keep_all, carry_S, eta_all = coefficients
    new_params, new_momentum = {}, {}
    for name, (a, g) in factors.items():
        write_M = torch.einsum("bim,bi,bin->bmn", a, write_M_scale, g)
        write_S = torch.einsum("bim,bi,bin->bmn", a, write_S_scale, g)
        new_params[name] = keep_all[:, None, None] * params[name] + carry_S[:, None, None] * momentum[name] - write_M
        new_momentum[name] = eta_all[:, None, None] * momentum[name] - write_S
    return new_params, new_momentum


def titans_linear_reference(q: Tensor, k: Tensor, v: Tensor, rates: Tensor, W: Tensor, S: Tensor, chunk: int):
    """q, k, v [B,T,d] (query and key already normalised), rates [B,T,3] = (eta, theta, alpha),
    W, S [B,d,d] weights and momentum at a chunk boundary -> (read [B,T,d], surprise, loss,
    loss_after [B,T], W, S after the last complete chunk). A final partial chunk reads and
    scores but does not update."""
    reads, surprise, loss, loss_after = [], [], [], []
    # split, not sliced: a slice's backward adds a zero tensor of the whole input's length
    for cq, ck, cv, cr in zip(*(t.split(chunk, dim=1) for t in (q, k, v, rates))):
        reads.append(cq @ W)
        r = ck @ W - cv
        loss.append(r.pow(2).sum(-1))
        surprise.append(2 * ck.norm(dim=-1) * r.norm(dim=-1))  # ||k^T (2 r)||_F
        if ck.shape[1] == chunk:
            new, momentum = chunk_update({"W": W}, {"W": S}, {"W": (ck, 2 * r)}, chunk_coefficients(cr))
            W, S = new["W"], momentum["W"]
        loss_after.append((ck @ W - cv).pow(2).sum(-1))
    return torch.cat(reads, 1), torch.cat(surprise, 1), torch.cat(loss, 1), torch.cat(loss_after, 1), W, S
