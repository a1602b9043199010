"""Layers every family shares: RMSNorm, rotary embeddings, SwiGLU and local causal attention.

`LocalAttention` is one attention core for the three kinds of `AttentionSpan`, all streaming
through a key/value cache so that a chunked run equals a one-pass run:
  * "causal": full causal attention (the cache grows with the input),
  * "window": sliding-window attention (query at p sees keys in (p - span, p]),
  * "segment": segment-local attention (query sees only earlier keys of its own segment of
    `span` tokens, as Infini-attention's and Titans-MAC's local attention do).
The cache keeps only the keys a later query can still see, so its size is bounded by the
window or the segment.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz.config import ConfigError, ModelConfig

ATTENTION_KINDS = ("causal", "window", "segment")


@dataclass(frozen=True)
class AttentionSpan:
    """What a token's local attention sees (module docstring): a model config's `attention`."""

    kind: str = "causal"
    span: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ConfigError(f"attention kind must be one of {list(ATTENTION_KINDS)}, got {self.kind!r}")
        if self.kind == "causal" and self.span is not None:
            raise ConfigError(f"causal attention sees every earlier token and takes no span, got span {self.span!r}")
        if self.kind != "causal" and (not isinstance(self.span, int) or isinstance(self.span, bool) or self.span <= 0):
            raise ConfigError(f"{self.kind} attention needs a span, a positive number of tokens, got {self.span!r}")

    @classmethod
    def parse(cls, data: dict[str, Any]) -> AttentionSpan:
        if not isinstance(data, dict) or set(data) - {"kind", "span"}:
            raise ConfigError(f"attention must be an object with 'kind' and 'span', got {data!r}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind} if self.span is None else {"kind": self.kind, "span": self.span}

    @property
    def window(self) -> int | None:
        return self.span if self.kind == "window" else None

    @property
    def segment_len(self) -> int | None:
        return self.span if self.kind == "segment" else None


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g."""

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_cos_sin(positions: Tensor, d_head: int, base: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables [T, d_head/2] for absolute positions.

    Angles and tables are float64: at position 10^6 a float32 angle is off by ~0.06 rad,
    which would blur relative positions on long streams. `apply_rotary` rounds the tables to
    the activations' dtype.
    """
    inv_freq = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64, device=positions.device) / d_head)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) of x [B, T, H, d] by the position angles (RoFormer eq. 34)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype)[None, :, None, :], sin.to(x.dtype)[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class SwiGLU(nn.Module):
    """FFN(x) = W_down(silu(W_gate x) * W_up x)."""

    def __init__(self, d_model: int, d_mlp: int) -> None:
        super().__init__()
        self.W_gate = nn.Linear(d_model, d_mlp, bias=False)
        self.W_up = nn.Linear(d_model, d_mlp, bias=False)
        self.W_down = nn.Linear(d_mlp, d_model, bias=False)
        self.hook_post = HookPoint()  # [batch, pos, d_mlp]

    def forward(self, x: Tensor) -> Tensor:
        return self.W_down(self.hook_post(F.silu(self.W_gate(x)) * self.W_up(x)))


def local_mask(q_pos: Tensor, k_pos: Tensor, window: int | None, segment_len: int | None) -> Tensor:
    """Boolean [Tq, Tk]: True where query position may attend to key position."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    if segment_len is not None:
        mask &= (q_pos[:, None] // segment_len) == (k_pos[None, :] // segment_len)
    return mask


def joined(tensors: list[Tensor], dim: int = 2) -> Tensor:
    """torch.cat, without the copy when there is one tensor."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def segment_pieces(pos: int, length: int, segment_len: int | None) -> list[tuple[int, int]]:
    """Split the chunk [pos, pos+length) at segment boundaries; offsets are chunk-relative."""
    if segment_len is None:
        return [(0, length)]
    pieces, start = [], 0
    while start < length:
        end = min(length, start + segment_len - (pos + start) % segment_len)
        pieces.append((start, end))
        start = end
    return pieces


class LocalCache(NamedTuple):
    """A local attention's key/value cache in a model's state, [B, H, L, d_head] each for the L cached
    positions just before the chunk (keys rotated), and with side keys (Titans-MAC's retrieved memory
    tokens) theirs too. A cache, not memory: no field is `Memory`, so reset and patch keep it."""

    k: Tensor
    v: Tensor
    side_k: Tensor | None = None
    side_v: Tensor | None = None


class LocalAttention(nn.Module):
    """Multi-head causal attention with RoPE, an optional window and optional segment locality.

    Two extensions serve the Titans family:
      * `n_persistent` learned persistent-memory tokens, prepended to every query's context
        (their keys and values go through W_K, W_V like any token; they carry no position);
      * `side` keys/values: a second key/value pair at each position (Titans-MAC's retrieved
        memory tokens), visible under the same mask as the ordinary key at that position.

    State: a `LocalCache`.
    """

    def __init__(self, cfg: ModelConfig, span: AttentionSpan, n_persistent: int = 0, side_keys: bool = False) -> None:
        super().__init__()
        self.n_heads, self.d_head, self.rope_base = cfg.n_heads, cfg.d_head, cfg.rope_base
        self.window, self.segment_len, self.side_keys = span.window, span.segment_len, side_keys
        inner = cfg.n_heads * cfg.d_head
        self.W_Q = nn.Linear(cfg.d_model, inner, bias=False)
        self.W_K = nn.Linear(cfg.d_model, inner, bias=False)
        self.W_V = nn.Linear(cfg.d_model, inner, bias=False)
        self.W_O = nn.Linear(inner, cfg.d_model, bias=False)
        self.persistent = nn.Parameter(torch.randn(n_persistent, cfg.d_model)) if n_persistent else None
        self.hook_q = HookPoint()  # [batch, pos, head, d_head], before rotation
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_z = HookPoint()  # [batch, pos, head, d_head], attention output per head

    def init_state(self, batch: int, device: torch.device) -> LocalCache:
        empty = torch.zeros(batch, self.n_heads, 0, self.d_head, device=device)
        if self.side_keys:
            return LocalCache(empty, empty.clone(), empty.clone(), empty.clone())
        return LocalCache(empty, empty.clone())

    def heads(self, x: Tensor) -> Tensor:
        return x.view(*x.shape[:-1], self.n_heads, self.d_head)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = self.hook_q(self.heads(self.W_Q(x)))
        k = self.hook_k(self.heads(self.W_K(x)))
        v = self.hook_v(self.heads(self.W_V(x)))
        return q, k, v

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        state: LocalCache,
        pos: int,
        side: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, LocalCache]:
        """Local attention of the chunk's queries over cache + chunk keys; returns z [B,T,H,dh]."""
        B, T = q.shape[:2]
        positions = torch.arange(pos, pos + T, device=q.device)
        cos, sin = rotary_cos_sin(positions, self.d_head, self.rope_base)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys = torch.cat([state.k, k.transpose(1, 2)], dim=2)
        values = torch.cat([state.v, v.transpose(1, 2)], dim=2)
        cached = state.k.shape[2]
        k_pos = torch.arange(pos - cached, pos + T, device=q.device)
        keep = self._cache_keep(pos + T, k_pos)
        new_state = LocalCache(keys[:, :, keep:], values[:, :, keep:])
        groups = [(keys, values)]  # key groups that share the positions k_pos (the side keys are a second)
        if self.side_keys:
            if side is None or state.side_k is None or state.side_v is None:
                raise ValueError(
                    "this attention layer was built with side keys: pass side=(k, v) and its own init_state"
                )
            side_keys = torch.cat([state.side_k, apply_rotary(side[0], cos, sin).transpose(1, 2)], dim=2)
            side_values = torch.cat([state.side_v, side[1].transpose(1, 2)], dim=2)
            groups.append((side_keys, side_values))
            new_state = new_state._replace(side_k=side_keys[:, :, keep:], side_v=side_values[:, :, keep:])
        fixed_k = fixed_v = None
        if self.persistent is not None:
            fixed_k = self.heads(self.W_K(self.persistent)).permute(1, 0, 2).expand(B, -1, -1, -1)
            fixed_v = self.heads(self.W_V(self.persistent)).permute(1, 0, 2).expand(B, -1, -1, -1)
        q = q.transpose(1, 2)
        span = self.window or self.segment_len
        # Blocks of `span` queries, each against the keys it may see: the cache and the block before
        # it (O(T span), not O(T^2)). The pieces come from split, not slicing, so the backward pass
        # concatenates their gradients instead of adding each into a zero tensor of the full length.
        block = T if span is None or T <= 2 * span else span
        sizes = [cached] + [min(block, T - a) for a in range(0, T, block)]
        offsets = list(itertools.accumulate(sizes, initial=0))  # piece j + 1 is query block j; piece 0 the cache
        pieces = [[part.split(sizes, dim=2) for part in group] for group in groups]
        parts = []
        for j, q_block in enumerate(q.split(block, dim=2)):
            lo, a, hi = offsets[j], offsets[j + 1], offsets[j + 2]  # keys: the piece before the block and its own
            mask = local_mask(positions[a - cached : hi - cached], k_pos[lo:hi], self.window, self.segment_len)
            ks = [piece for k_parts, _ in pieces for piece in k_parts[j : j + 2]]
            vs = [piece for _, v_parts in pieces for piece in v_parts[j : j + 2]]
            masks = [mask] * len(groups)
            if fixed_k is not None:
                ks.insert(0, fixed_k)
                vs.insert(0, fixed_v)
                masks.insert(0, torch.ones(q_block.shape[2], fixed_k.shape[2], dtype=torch.bool, device=q.device))
            parts.append(
                F.scaled_dot_product_attention(q_block, joined(ks), joined(vs), attn_mask=joined(masks, dim=1))
            )
        z = joined(parts)
        return z.transpose(1, 2), new_state

    def _cache_keep(self, next_pos: int, k_pos: Tensor) -> int:
        """Index of the first key a query at next_pos or later can still see."""
        first = 0
        if self.window is not None:
            first = max(first, next_pos - self.window + 1)
        if self.segment_len is not None:
            first = max(first, next_pos - next_pos % self.segment_len)
        return int((k_pos < first).sum())

    def forward(self, x: Tensor, state: LocalCache, pos: int) -> tuple[Tensor, LocalCache]:
        q, k, v = self.project(x)
        z, state = self.attend(q, k, v, state, pos)
        z = self.hook_z(z)
        return self.W_O(z.flatten(2)), state
