"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", arXiv 2412.06464, ICLR 2025), written against memviz's public family API only and found
through the `memviz.families` entry point, as a user's own package would be.

Per head a state S [d_k, d_v] (the paper's S^T) is written by the gated delta rule (eq. 10):

  S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t

  q_t, k_t  = l2norm(silu(x_t W_Q)), l2norm(silu(x_t W_K))       (Section 3.4)
  v_t       = silu(x_t W_V)
  alpha_t   = exp(-exp(A) softplus(x_t w_a + b_dt))  in (0, 1)   decay (Mamba2's parametrisation)
  beta_t    = sigmoid(x_t w_b)                       in (0, 1)   write strength
  output    = RMSNorm(o_t) * silu(x_t W_g)                        (the paper's output gate)

(memviz's linear-memory operator, `kernels/linear_memory/`, runs the recurrence in its chunked form.)
Here the memory sits beside a local attention, sharing its projections, and a learned gate per head
mixes them as Infini-attention does: z = g GDN + (1 - g) A_local, g = sigmoid(m). The paper's hybrids
(H1, H2) interleave Gated DeltaNet layers with sliding-window attention layers instead; the mix here lets a model
start from a trained sliding-window backbone (`init_from`), as the other long-context samples
do. Departures, said here: no short convolution after the projections; the memory reads the
projections before RoPE (the local path after).

Hooks per layer (`blocks.{l}.attn.`): `hook_alpha`, `hook_beta` [batch, pos, head]; `hook_state_norm`
[batch, pos, head] (||S_t||_F after the token's write); `hook_write_key` [batch, pos, head, d_k] and
`hook_write_value` [batch, pos, head, d_v] (what the token writes); `hook_read_query` [batch, pos, head, d_k]
and `hook_read` [batch, pos, head, d_v] (q_t and o_t); `hook_mem_out`, `hook_local_out` [batch, pos, head,
d_head]; `hook_gate` [batch, pos, head]. The read's split over its writers and the needle hold come from
`memviz.linear_memory`, over these hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, cast

import numpy as np
import plotly.graph_objects as go
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz import ConfigError, LocalCache, Memory, MemoryLM, register_family
from memviz.figure_parts import WIDTH, delta_rule_rate_heatmaps, layer_names, memory_share_heatmaps, timeline
from memviz.layers import AttentionSpan, LocalAttention, RMSNorm, SwiGLU
from memviz.linear_memory import span_hold, split_read
from memviz.model import Block
from memviz.options import check_positive
from memviz.protocol import HookDoc, Readout, ReadPath
from memviz.read_lens import captured_at, head_blocks, last_residual
from memviz.running import hooked
from memviz.trace import Trace
from memviz_kernels.dispatch import linear_memory

ALPHA = "blocks.{l}.attn.hook_alpha"  # [batch, pos, head]  decay
BETA = "blocks.{l}.attn.hook_beta"  # [batch, pos, head]  write strength
STATE_NORM = "blocks.{l}.attn.hook_state_norm"  # [batch, pos, head]  ||S_t||_F
GATE = "blocks.{l}.attn.hook_gate"  # [batch, pos, head]  the memory's share of the mix
MEM_OUT = "blocks.{l}.attn.hook_mem_out"  # [batch, pos, head, d_head]  the gated memory read
LOCAL_OUT = "blocks.{l}.attn.hook_local_out"  # [batch, pos, head, d_head]  local attention


@dataclass
class GatedDeltaNetOptions:
    chunk: int = 32  # tokens a step of the chunked form (any value gives the same result)
    gate_init: float = 0.0  # initial m; sigmoid(0) = 0.5 mixes memory and local attention equally

    def __post_init__(self) -> None:
        check_positive(chunk=self.chunk)


class GatedDeltaState(NamedTuple):
    """A layer's state: its local attention's cache and the memory S [B, H, d_k, d_v]."""

    local: LocalCache
    S: Memory[Tensor]


class GatedDeltaAttention(LocalAttention):
    """Local attention and a gated delta rule memory over the same projections (module docstring)."""

    def __init__(self, cfg, options: GatedDeltaNetOptions, span: AttentionSpan) -> None:
        super().__init__(cfg, span)
        H, inner = cfg.n_heads, cfg.n_heads * cfg.d_head
        self.options = options
        self.W_alpha = nn.Linear(cfg.d_model, H)  # its bias is b_dt
        self.W_beta = nn.Linear(cfg.d_model, H)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.W_g = nn.Linear(cfg.d_model, inner, bias=False)
        self.out_norm = RMSNorm(cfg.d_head, cfg.norm_eps)
        self.mix = nn.Parameter(torch.zeros(H))
        for name in (
            "alpha",
            "beta",
            "state_norm",
            "write_key",
            "write_value",
            "read_query",
            "read",
            "mem_out",
            "local_out",
            "gate",
        ):
            setattr(self, f"hook_{name}", HookPoint())

    def reset_memory_parameters(self) -> None:
        """A in [1, 16) and dt in [1e-3, 0.1) as Mamba2 draws them (a spread of decay rates)."""
        H = self.mix.shape[0]
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.empty(H).uniform_(1, 16)))
            dt = torch.exp(torch.empty(H).uniform_(np.log(1e-3), np.log(0.1)))
            self.W_alpha.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            self.mix.fill_(self.options.gate_init)

    def init_state(self, batch: int, device: torch.device) -> GatedDeltaState:
        S = torch.zeros(batch, self.n_heads, self.d_head, self.d_head, device=device)
        return GatedDeltaState(super().init_state(batch, device), S)

    def forward(self, x: Tensor, state: GatedDeltaState, pos: int) -> tuple[Tensor, GatedDeltaState]:
        B, T, _ = x.shape
        q, k, v = self.project(x)
        local, local_state = self.attend(q, k, v, state.local, pos)
        qm = self.hook_read_query(F.normalize(F.silu(q), dim=-1))
        km = self.hook_write_key(F.normalize(F.silu(k), dim=-1))
        vm = self.hook_write_value(F.silu(v))
        alpha = self.hook_alpha(torch.exp(-self.A_log.exp() * F.softplus(self.W_alpha(x))))
        beta = self.hook_beta(torch.sigmoid(self.W_beta(x)))
        (o, norms), S = linear_memory(
            qm.transpose(1, 2),
            km.transpose(1, 2),
            vm.transpose(1, 2),
            torch.log(alpha.clamp_min(1e-30)).transpose(1, 2),
            beta.transpose(1, 2),
            state.S,
            self.options.chunk,
            state_norms=hooked(self.hook_state_norm),  # computed only for a hook
        )
        assert o is not None  # the operator reads with the q it is given
        if norms is not None:
            self.hook_state_norm(norms.transpose(1, 2))
        o = self.hook_read(o.transpose(1, 2))
        mem = self.hook_mem_out(self.out_norm(o) * F.silu(self.heads(self.W_g(x))))
        local = self.hook_local_out(local)
        gate = self.hook_gate(torch.sigmoid(self.mix).expand(B, T, self.n_heads))
        z = self.hook_z(gate[..., None] * mem + (1 - gate[..., None]) * local)
        return self.W_O(z.flatten(2)), GatedDeltaState(local_state, S)


def gated_deltanet_figures(
    trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None
) -> dict[str, go.Figure]:
    """Per layer alpha and beta over tokens and heads; the state's norm; the memory's share of each head's output."""
    zoom = dict(width=width, start=start, stop=stop)
    figs = delta_rule_rate_heatmaps(trace, **zoom)
    figs["state norm"] = timeline(
        trace, {n: n for n in layer_names(trace, STATE_NORM)}, "||S_t|| (mean over heads)", **zoom
    )
    figs.update(memory_share_heatmaps(trace, GATE, **zoom))
    return figs


@register_family(
    "gated_deltanet",
    summary="Gated DeltaNet (arXiv 2412.06464): a per-head state written by the gated "
    "delta rule (decay alpha, write strength beta) beside local attention",
    matrix_state=("S",),
    figures=gated_deltanet_figures,
    quick={"attention": {"kind": "window", "span": 32}},
    tiny={"attention": {"kind": "window", "span": 8}},
    sample=str(Path(__file__).resolve().parent / "sample_32k"),
    readout=True,
    needle_hold=True,
    read_lens=True,
)
class GatedDeltaNetLM(MemoryLM):
    """Transformer whose attention layers carry a gated delta rule memory beside local attention."""

    Options = GatedDeltaNetOptions
    memory_hooks = {ALPHA: "none", BETA: "none", STATE_NORM: "none", GATE: "none", MEM_OUT: "norm", LOCAL_OUT: "norm"}
    hook_docs = {
        **MemoryLM.hook_docs,
        ALPHA: HookDoc(
            "[batch, pos, head]",
            "decay `alpha_t = exp(-exp(A) softplus(x w_a + b))`: the share of the state a token keeps",
        ),
        BETA: HookDoc("[batch, pos, head]", "write strength `beta_t = sigmoid(x w_b)`"),
        STATE_NORM: HookDoc("[batch, pos, head]", "`||S_t||_F`, the state after the token's write"),
        "blocks.{l}.attn.hook_write_key": HookDoc(
            "[batch, pos, head, d_head]", "`k_t = l2norm(silu(x W_K))`, where the token writes"
        ),
        "blocks.{l}.attn.hook_write_value": HookDoc(
            "[batch, pos, head, d_head]", "`v_t = silu(x W_V)`, what it writes"
        ),
        "blocks.{l}.attn.hook_read_query": HookDoc(
            "[batch, pos, head, d_head]", "`q_t = l2norm(silu(x W_Q))`, what the memory is read with"
        ),
        "blocks.{l}.attn.hook_read": HookDoc(
            "[batch, pos, head, d_head]", "the read `o_t = S_t^T q_t`, before the output norm and gate"
        ),
        MEM_OUT: HookDoc("[batch, pos, head, d_head]", "the memory read `RMSNorm(S_t^T q_t) * silu(x W_g)`"),
        LOCAL_OUT: HookDoc("[batch, pos, head, d_head]", "the local attention beside it"),
        GATE: HookDoc("[batch, pos, head]", "the memory's share of the mix per head, `sigmoid(m)`"),
    }

    def default_attention(self) -> None:
        return None

    def check_config(self) -> None:
        if self.attention is None or self.attention.kind == "causal":
            raise ConfigError(
                "gated_deltanet keeps a bounded local attention beside its memory: give attention "
                '{"kind": "window" or "segment", "span": tokens}'
            )

    def make_block(self, layer: int) -> nn.Module:
        cfg = self.cfg
        return Block(cfg, GatedDeltaAttention(cfg, self.options, self.attention), SwiGLU(cfg.d_model, cfg.d_mlp))

    def memory_readout(self, tokens, position: int) -> Readout:
        """o_t = S_t^T q_t at `position` (before the output norm and gate) as a sum over every token's write
        (`memviz.linear_memory.split_read`)."""
        layers = range(self.cfg.n_layers)
        return split_read(
            self, tokens, position, layers, "o_t = S_t^T q_t, the state's read before the output norm and gate"
        )

    def read_path(self, tokens, position: int) -> ReadPath:
        """From o_t to the logits at `position`: RMSNorm(o_t) * silu(x W_g) with o_t's RMS frozen, the diagonal
        g_norm silu(x W_g) / rms(o_t), the mix g per head, W_O's head block, then the frozen final norm and W_U."""
        names = {
            l: [f"blocks.{l}.hook_resid_pre", f"blocks.{l}.attn.hook_read", f"blocks.{l}.attn.hook_gate"]
            for l in range(self.cfg.n_layers)
        }
        at = captured_at(self, tokens, position, [*(n for hooks in names.values() for n in hooks), last_residual(self)])
        layers = {}
        with torch.no_grad():
            for l, block in enumerate(self.blocks):
                resid, read, mix = (at[n] for n in names[l])
                attention = cast(GatedDeltaAttention, cast(Block, block).attn)
                x = cast(Block, block).ln1(resid.to(self.device, self.dtype))
                gate = F.silu(attention.heads(attention.W_g(x))).to("cpu", torch.float64)  # [head, d_head]
                norm = attention.out_norm
                rms = torch.rsqrt(read.pow(2).mean(-1, keepdim=True) + norm.eps)
                diagonal = norm.weight.detach().to("cpu", torch.float64) * rms * gate * mix[:, None]
                layers[f"blocks.{l}"] = diagonal[..., None] * head_blocks(attention.W_O.weight, self.cfg.n_heads)
        return ReadPath(position, layers, *self.unembedding_at(at[last_residual(self)]))

    def needle_hold(self, tokens, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """Per layer, the part of the state the span's writes left over its peak (`memviz.linear_memory.span_hold`)."""
        return span_hold(self, tokens, span, range(self.cfg.n_layers), self.options.chunk)
