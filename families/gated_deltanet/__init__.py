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

(`reference.py` holds the recurrence and its chunked form.) Here the memory sits beside a local
attention, sharing its projections, and a learned gate per head mixes them as Infini-attention
does: z = g GDN + (1 - g) A_local, g = sigmoid(m). The paper's hybrids (H1, H2) interleave
Gated DeltaNet layers with sliding-window attention layers instead; the mix here lets a model
start from a trained sliding-window backbone (`init_from`), as the other long-context samples
do. Departures, said here: no short convolution after the projections; the memory reads the
projections before RoPE (the local path after).

Hooks per layer (`blocks.{l}.attn.`): `hook_alpha`, `hook_beta` [batch, pos, head]; `hook_state_norm`
[batch, pos, head] (||S_t||_F after the token's write); `hook_write_key` [batch, pos, head, d_k] and
`hook_write_value` [batch, pos, head, d_v] (what the token writes); `hook_mem_out`, `hook_local_out`
[batch, pos, head, d_head]; `hook_gate` [batch, pos, head]. `needle_hold` follows the part of the state
a span wrote: S is linear in the writes beta_j k_j v_j^T with transitions alpha_t (I - beta_t k_t k_t^T)
that do not depend on S, so the span's part is the same recurrence fed only the span's writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz import ConfigError, LocalCache, Memory, MemoryLM, register_family
from memviz.figure_parts import WIDTH, delta_rule_rate_heatmaps, layer_names, memory_share_heatmaps, timeline
from memviz.layers import AttentionSpan, LocalAttention, RMSNorm, SwiGLU
from memviz.model import Block, HookDoc, Readout, hooked
from memviz.options import check_positive
from memviz.trace import Trace

from .reference import chunked

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
        for name in ("alpha", "beta", "state_norm", "write_key", "write_value", "mem_out", "local_out", "gate"):
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
        qm, km = F.normalize(F.silu(q), dim=-1), self.hook_write_key(F.normalize(F.silu(k), dim=-1))
        vm = self.hook_write_value(F.silu(v))
        alpha = self.hook_alpha(torch.exp(-self.A_log.exp() * F.softplus(self.W_alpha(x))))
        beta = self.hook_beta(torch.sigmoid(self.W_beta(x)))
        (o, norms), S = chunked(
            qm.transpose(1, 2),
            km.transpose(1, 2),
            vm.transpose(1, 2),
            alpha.transpose(1, 2),
            beta.transpose(1, 2),
            state.S,
            self.options.chunk,
            state_norms=hooked(self.hook_state_norm),  # every token's state, built only for a hook
        )
        if norms is not None:
            self.hook_state_norm(norms.transpose(1, 2))
        mem = self.hook_mem_out(self.out_norm(o.transpose(1, 2)) * F.silu(self.heads(self.W_g(x))))
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
    figures=gated_deltanet_figures,
    quick={"attention": {"kind": "window", "span": 32}},
    tiny={"attention": {"kind": "window", "span": 8}},
    sample=str(Path(__file__).resolve().parent / "sample_32k"),
    readout=True,
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
        """o_t = S_t^T q_t at `position` (before the output norm and gate) as a sum over every
        token's write. S_t is linear in the writes beta_j k_j v_j^T with transitions
        A_j = alpha_j (I - beta_j k_j k_j^T) that do not depend on S, so write j gives
        (r_j . k_j) beta_j v_j, where r_t = q_t and r_{j-1} = A_j r_j (A_j is symmetric)."""
        full = self.as_tokens(tokens)
        if not 0 <= position < full.shape[1]:
            raise ValueError(f"position must lie in [0, {full.shape[1]}), got {position}")
        names = [
            f"blocks.{l}.attn.hook_{w}"
            for l in range(self.cfg.n_layers)
            for w in ("q", "write_key", "write_value", "alpha", "beta")
        ]
        seen = self.capture(full[:, : position + 1], names)
        parts = {}
        for layer in range(self.cfg.n_layers):
            name = f"blocks.{layer}"
            c = {w: seen[f"{name}.attn.hook_{w}"] for w in ("q", "write_key", "write_value", "alpha", "beta")}
            r = F.normalize(F.silu(c["q"][position]), dim=-1)  # [H, d]
            weights = torch.zeros(position + 1, r.shape[0], dtype=torch.float64)  # [tokens, H]
            for j in range(position, -1, -1):
                k, b = c["write_key"][j], c["beta"][j]
                along = (r * k).sum(-1)  # r_j . k_j
                weights[j] = along * b
                r = c["alpha"][j][:, None] * (r - (b * along)[:, None] * k)
            parts[name] = weights[..., None] * c["write_value"]
        return Readout(position, "o_t = S_t^T q_t, the state's read before the output norm and gate", parts)

    @torch.no_grad()
    def needle_hold(self, tokens, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """Per layer, ||S^span_t||_F over its peak: the part of the state the span's writes left,
        carried by the run's own alpha, beta and keys (module docstring), the largest over heads."""
        ids, a, b = self.needle_ids(tokens, span)
        captured: dict[int, dict[str, Tensor]] = {}

        def keep(name: str):
            def hook(value: Tensor, hook) -> None:
                captured.setdefault(int(hook.name.split(".")[1]), {})[name] = value[0].transpose(0, 1).double().cpu()

            return hook

        names = ("alpha", "beta", "write_key", "write_value")
        hooks = [(f"blocks.{l}.attn.hook_{n}", keep(n)) for l in range(self.cfg.n_layers) for n in names]
        H, d = self.cfg.n_heads, self.cfg.d_head
        parts = [torch.zeros(1, H, d, d, dtype=torch.float64) for _ in range(self.cfg.n_layers)]
        norms: list[list[Tensor]] = [[] for _ in range(self.cfg.n_layers)]
        with self.hooks(fwd_hooks=hooks):
            for start, logits, _ in self.stream(ids):
                positions = torch.arange(start, start + logits.shape[1])
                in_span = ((positions >= a) & (positions < b)).double()[:, None]
                for layer, c in captured.items():
                    k, v = c["write_key"][None], c["write_value"][None] * in_span
                    (_, n), parts[layer] = chunked(
                        k, k, v, c["alpha"][None], c["beta"][None], parts[layer], self.options.chunk
                    )
                    norms[layer].append(n[0].amax(0))
        hold = {}
        for layer, per_chunk in enumerate(norms):
            values = torch.cat(per_chunk).numpy()
            hold[f"layer {layer}: share of the span's write still in the state"] = (
                values / max(values.max(), 1e-30)
            ).astype(np.float32)
        return hold
