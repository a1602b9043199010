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
from typing import Any, Generic, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from typing_extensions import TypeVar  # typing's takes a default from Python 3.13

from memviz.config import MAX_SPAN, ConfigError, ModelConfig

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
        if self.kind != "causal" and (
            not isinstance(self.span, int) or isinstance(self.span, bool) or not 0 < self.span <= MAX_SPAN
        ):
            raise ConfigError(
                f"{self.kind} attention needs a span, a whole number of tokens from 1 to {MAX_SPAN:,}, "
                f"got {self.span!r}"
            )

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


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """F.scaled_dot_product_attention with a boolean mask; under the CPU's autocast in float32, as the
    CPU's bfloat16 flash-attention backward is slower than its float32 one."""
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


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


#: A local attention's state: its `LocalCache`, or what a subclass keeps beside it (`LocalAttention`)
StateT = TypeVar("StateT", default=LocalCache)


class LocalAttention(nn.Module, Generic[StateT]):
    """Multi-head causal attention with RoPE, an optional window and optional segment locality.

    `attend` is built from parts a family's attention can reuse (Titans' adds persistent tokens and
    side keys, memviz/models/titans/attention.py): `rotation` (the chunk's RoPE tables), `extend` (a
    cache and the chunk's keys and values joined, and what a later query can still see) and
    `attend_over` (the chunk's queries over groups of keys that share positions, and fixed keys every
    query sees).

    State: a `LocalCache` (`empty_cache`). A subclass that keeps more beside it (Infini-attention's
    memory) is a `LocalAttention[ItsState]` and overrides `init_state` and `forward`; `attend` keeps
    taking the cache.
    """

    def __init__(self, cfg: ModelConfig, span: AttentionSpan) -> None:
        super().__init__()
        self.n_heads, self.d_head, self.rope_base = cfg.n_heads, cfg.d_head, cfg.rope_base
        self.window, self.segment_len = span.window, span.segment_len
        inner = cfg.n_heads * cfg.d_head
        self.W_Q = nn.Linear(cfg.d_model, inner, bias=False)
        self.W_K = nn.Linear(cfg.d_model, inner, bias=False)
        self.W_V = nn.Linear(cfg.d_model, inner, bias=False)
        self.W_O = nn.Linear(inner, cfg.d_model, bias=False)
        self.hook_q = HookPoint()  # [batch, pos, head, d_head], before rotation
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_z = HookPoint()  # [batch, pos, head, d_head], attention output per head

    def empty_cache(self, batch: int, device: torch.device) -> LocalCache:
        empty = torch.zeros(batch, self.n_heads, 0, self.d_head, device=device)
        return LocalCache(empty, empty.clone())

    def init_state(self, batch: int, device: torch.device) -> StateT:
        # StateT is LocalCache here: a subclass with a state of its own overrides init_state and forward
        return cast(StateT, self.empty_cache(batch, device))

    def heads(self, x: Tensor) -> Tensor:
        return x.view(*x.shape[:-1], self.n_heads, self.d_head)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = self.hook_q(self.heads(self.W_Q(x)))
        k = self.hook_k(self.heads(self.W_K(x)))
        v = self.hook_v(self.heads(self.W_V(x)))
        return q, k, v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, state: LocalCache, pos: int) -> tuple[Tensor, LocalCache]:
        """Local attention of the chunk's queries over cache + chunk keys; returns z [B,T,H,dh]."""
        cos, sin = self.rotation(pos, q.shape[1], q.device)
        keys, values, keep = self.extend(state.k, state.v, k, v, pos, cos, sin)
        z = self.attend_over(apply_rotary(q, cos, sin), pos, state.k.shape[2], [(keys, values)])
        return z, LocalCache(keys[:, :, keep:], values[:, :, keep:])

    def rotation(self, pos: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """RoPE's cos/sin tables for the chunk's positions pos .. pos + length."""
        return rotary_cos_sin(torch.arange(pos, pos + length, device=device), self.d_head, self.rope_base)

    def extend(
        self, cached_k: Tensor, cached_v: Tensor, k: Tensor, v: Tensor, pos: int, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor, int]:
        """A cache's keys and values [B,H,L,dh] joined with the chunk's k, v [B,T,H,dh] (keys rotated), and
        the index of the first key a later query can still see."""
        keys = torch.cat([cached_k, apply_rotary(k, cos, sin).transpose(1, 2)], dim=2)
        values = torch.cat([cached_v, v.transpose(1, 2)], dim=2)
        cached = cached_k.shape[2]
        k_pos = torch.arange(pos - cached, pos + k.shape[1], device=k.device)
        return keys, values, self._cache_keep(pos + k.shape[1], k_pos)

    def attend_over(
        self,
        q: Tensor,
        pos: int,
        cached: int,
        groups: list[tuple[Tensor, Tensor]],
        fixed: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """z [B,T,H,dh] of the chunk's rotated queries q [B,T,H,dh] over key groups, each (keys, values)
        [B,H,cached+T,dh] at the positions pos - cached .. pos + T under the local mask, and `fixed` keys
        and values [B,H,F,dh] that every query sees."""
        T = q.shape[1]
        positions = torch.arange(pos, pos + T, device=q.device)
        k_pos = torch.arange(pos - cached, pos + T, device=q.device)
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
            if fixed is not None:
                ks.insert(0, fixed[0])
                vs.insert(0, fixed[1])
                masks.insert(0, torch.ones(q_block.shape[2], fixed[0].shape[2], dtype=torch.bool, device=q.device))
            parts.append(scaled_dot_product_attention(q_block, joined(ks), joined(vs), joined(masks, dim=1)))
        z = joined(parts)
        return z.transpose(1, 2)

    def _cache_keep(self, next_pos: int, k_pos: Tensor) -> int:
        """Index of the first key a query at next_pos or later can still see."""
        first = 0
        if self.window is not None:
            first = max(first, next_pos - self.window + 1)
        if self.segment_len is not None:
            first = max(first, next_pos - next_pos % self.segment_len)
        return int((k_pos < first).sum())

    def forward(self, x: Tensor, state: StateT, pos: int) -> tuple[Tensor, StateT]:
        q, k, v = self.project(x)
        z, cache = self.attend(q, k, v, cast(LocalCache, state), pos)  # StateT is LocalCache (init_state)
        z = self.hook_z(z)
        return self.W_O(z.flatten(2)), cast(StateT, cache)
