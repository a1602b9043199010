"""Titans' attention: memviz's local attention (`memviz.layers.LocalAttention`) with the two things
Titans adds to it (Behrouz et al., arXiv 2501.00663, Section 4; the module docstring beside this file):
  * `n_persistent` learned persistent-memory tokens, prepended to every query's context (their keys
    and values go through W_K, W_V like any token's, and they carry no position);
  * side keys (MAC's [persistent, h, segment]): a second key/value pair at each position, the memory's
    retrieved token h_t, seen under the same mask as the ordinary key at that position and cached
    beside it (`LocalCache.side_k`, `side_v`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from memviz.config import ModelConfig
from memviz.layers import AttentionSpan, LocalAttention, LocalCache, apply_rotary


class TitansAttention(LocalAttention):
    """Local attention over persistent tokens and, with `side_keys`, the retrieved memory tokens."""

    def __init__(self, cfg: ModelConfig, span: AttentionSpan, n_persistent: int = 0, side_keys: bool = False) -> None:
        super().__init__(cfg, span)
        self.side_keys = side_keys
        self.persistent = nn.Parameter(torch.randn(n_persistent, cfg.d_model)) if n_persistent else None

    def init_state(self, batch: int, device: torch.device) -> LocalCache:
        cache = super().init_state(batch, device)
        return cache._replace(side_k=cache.k.clone(), side_v=cache.k.clone()) if self.side_keys else cache

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: LocalCache,
        pos: int,
        side: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, LocalCache]:
        """The chunk's queries over the persistent tokens, cache + chunk keys and, with side keys, the side
        keys `side` = (k, v) [B,T,H,dh] at the same positions; returns z [B,T,H,dh]."""
        cos, sin = self.rotation(pos, q.shape[1], q.device)
        keys, values, keep = self.extend(state.k, state.v, k, v, pos, cos, sin)
        new_state = LocalCache(keys[:, :, keep:], values[:, :, keep:])
        groups = [(keys, values)]
        if self.side_keys:
            if side is None or state.side_k is None or state.side_v is None:
                raise ValueError(
                    "this attention layer was built with side keys: pass side=(k, v) and its own init_state"
                )
            side_keys, side_values, _ = self.extend(state.side_k, state.side_v, *side, pos, cos, sin)
            groups.append((side_keys, side_values))
            new_state = new_state._replace(side_k=side_keys[:, :, keep:], side_v=side_values[:, :, keep:])
        fixed = None
        if self.persistent is not None:
            B = q.shape[0]
            fixed = (
                self.heads(self.W_K(self.persistent)).permute(1, 0, 2).expand(B, -1, -1, -1),
                self.heads(self.W_V(self.persistent)).permute(1, 0, 2).expand(B, -1, -1, -1),
            )
        return self.attend_over(apply_rotary(q, cos, sin), pos, state.k.shape[2], groups, fixed), new_state
