"""Infini-attention (Munkhdalai et al. 2024, "Leave No Context Behind", arXiv 2404.07143).

Each head keeps a compressive associative memory M_s [d_k, d_v] and a normaliser z_s [d_k]
built from all earlier segments, with sigma(x) = ELU(x) + 1:

  retrieval (eq. 3)   A_mem = sigma(Q) M_{s-1} / (sigma(Q) z_{s-1})
  linear (eq. 4)      M_s = M_{s-1} + sigma(K)^T V
  delta rule (eq. 5)  M_s = M_{s-1} + sigma(K)^T (V - sigma(K) M_{s-1} / (sigma(K) z_{s-1}))
  normaliser          z_s = z_{s-1} + sum_t sigma(K_t)
  gating (eq. 6)      A = sigmoid(beta) * A_mem + (1 - sigmoid(beta)) * A_dot

A_dot is ordinary causal attention within the current segment (attention
{"kind": "segment", "span": segment_len}, the paper and the default). A window
({"kind": "window", "span": segment_len}) lets A_dot see the last tokens across the segment boundary
instead (a sliding window as in the baselines; Transformer-XL's cache of the previous
segment, trimmed to a window): a token at the start of a segment then still sees the text
just before it, while the memory is written per segment as before. Q, K, V are the same
projections for both paths; the memory sees them before RoPE (rotary phases would make the
memory's content depend on absolute position), the local path after. On the first segment
z = 0 and M = 0, so retrieval is defined as zero rather than 0/0. The memory is updated when
a segment completes; a partial segment's keys and values wait in the state, so streaming in
any chunk size gives the one-pass result.

State per layer (`InfiniState`): the memory, `memviz_kernels.dispatch.InfiniMemory` (M [B,H,d,d], z [B,H,d], the
open segment's sigma-mapped pre-RoPE keys and its values), and the local attention's `LocalCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict, cast

import numpy as np
import plotly.graph_objects as go
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz.config import ConfigError, ModelConfig
from memviz.figure_parts import WIDTH, layer_names, memory_share_heatmaps, timeline
from memviz.layers import AttentionSpan, LocalAttention, LocalCache, SwiGLU
from memviz.model import Block, MemoryLM
from memviz.options import check_choice
from memviz.protocol import HookDoc, Readout, ReadPath
from memviz.read_lens import captured_at, head_blocks, last_residual
from memviz.registry import register_family
from memviz.state import Memory
from memviz.trace import Trace
from memviz_kernels.dispatch import InfiniMemory, infini_memory

GATE = "blocks.{l}.attn.hook_gate"  # [batch, pos, head]  sigmoid(beta), the same at every token
MEM_OUT = "blocks.{l}.attn.hook_mem_out"  # [batch, pos, head, d_head]  A_mem
LOCAL_OUT = "blocks.{l}.attn.hook_local_out"  # [batch, pos, head, d_head]  A_dot
MEM_NORM = "blocks.{l}.attn.hook_mem_norm"  # [batch, pos, head]  ||M|| read at the token


@dataclass
class InfiniOptions:
    update: str = "delta"  # "linear" (eq. 4) or "delta" (eq. 5)
    gate_init: float = 0.0  # initial beta; sigmoid(0) = 0.5 mixes both paths equally

    def __post_init__(self) -> None:
        check_choice("update", self.update, ("linear", "delta"))


class InfiniState(NamedTuple):
    """An Infini-attention layer's state: its local attention's cache and its compressive memory."""

    local: LocalCache
    memory: Memory[InfiniMemory]


class SpanSums(TypedDict):
    """`InfiniLM.needle_hold`'s running sums for one layer: the written normaliser z [H, d], its part n
    the span's keys wrote, the open segment's parts pz and pn, and the tokens seen."""

    z: Tensor
    n: Tensor
    pz: Tensor
    pn: Tensor
    seen: int


def feature_map(x: Tensor) -> Tensor:
    """sigma(x) = ELU(x) + 1 > 0."""
    return F.elu(x) + 1.0


class InfiniAttention(LocalAttention[InfiniState]):
    def __init__(self, cfg: ModelConfig, options: InfiniOptions, span: AttentionSpan) -> None:
        super().__init__(cfg, span)
        self.options, self.memory_segment_len = options, cfg.segment_len
        self.beta = nn.Parameter(torch.zeros(cfg.n_heads))
        self.hook_mem_out = HookPoint()  # [batch, pos, head, d_head]  A_mem
        self.hook_local_out = HookPoint()  # [batch, pos, head, d_head]  A_dot
        self.hook_gate = HookPoint()  # [batch, pos, head]  sigmoid(beta)
        self.hook_mem_norm = HookPoint()  # [batch, pos, head]  ||M||_F of the memory each token reads

    def reset_memory_parameters(self) -> None:
        nn.init.constant_(self.beta, self.options.gate_init)

    def init_state(self, batch: int, device: torch.device) -> InfiniState:
        H, d = self.n_heads, self.d_head
        memory = InfiniMemory(
            M=torch.zeros(batch, H, d, d, device=device),
            z=torch.zeros(batch, H, d, device=device),
            open_k=torch.zeros(batch, H, 0, d, device=device),
            open_v=torch.zeros(batch, H, 0, d, device=device),
        )
        return InfiniState(self.empty_cache(batch, device), memory)

    def forward(self, x: Tensor, state: InfiniState, pos: int) -> tuple[Tensor, InfiniState]:
        assert self.memory_segment_len is not None  # InfiniLM.check_config: the family needs config.segment_len
        B, T, _ = x.shape
        q, k, v = self.project(x)
        local, local_state = self.attend(q, k, v, state.local, pos)
        sq, sk, vh = feature_map(q.transpose(1, 2)), feature_map(k.transpose(1, 2)), v.transpose(1, 2)
        (mem, norms), memory = infini_memory(sq, sk, vh, state.memory, self.memory_segment_len, self.options.update)
        mem = self.hook_mem_out(mem.transpose(1, 2))
        self.hook_mem_norm(norms.transpose(1, 2))
        local = self.hook_local_out(local)
        gate = self.hook_gate(torch.sigmoid(self.beta).expand(B, T, self.n_heads))
        z_out = self.hook_z(gate[..., None] * mem + (1 - gate[..., None]) * local)
        return self.W_O(z_out.flatten(2)), InfiniState(local_state, memory)


def gate_heatmap(trace: Trace) -> go.Figure:
    """sigmoid(beta) per layer x head: how much each head leans on its compressive memory."""
    names = layer_names(trace, GATE)
    z = np.stack([trace[n][0] for n in names])
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[f"head {h}" for h in range(z.shape[1])],
            y=[n.split(".attn")[0] for n in names],
            zmin=0,
            zmax=1,
            colorscale="RdBu_r",
            texttemplate="%{z:.2f}",
            hovertemplate="%{y} %{x}<br>sigmoid(beta) %{z:.3f}<extra></extra>",
        )
    )
    fig.update_layout(title="Infini-attention gate sigmoid(beta): memory share per head (1 = memory only)")
    return fig


def infini_figures(trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict[str, go.Figure]:
    """The gate per layer x head, each layer's memory share per token and head, and ||M||."""
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)  # the figure helpers' keywords
    figs = {"gates": gate_heatmap(trace), **memory_share_heatmaps(trace, GATE, **zoom)}
    figs["memory norm"] = timeline(
        trace, {n: n for n in layer_names(trace, MEM_NORM)}, "||M|| of the memory each token reads", **zoom
    )
    return figs


@register_family(
    "infini",
    summary="Infini-attention (arXiv 2404.07143): a compressive memory M, z per head beside "
    "segment-local attention, mixed by a learned gate",
    matrix_state=("memory.M",),
    figures=infini_figures,
    quick={"segment_len": 32, "memory": {"update": "delta"}},
    tiny={"segment_len": 8},
    sample="infini_english_16k",
    readout=True,
    needle_hold=True,
    read_lens=True,
)
class InfiniLM(MemoryLM):
    """Transformer whose attention layers are Infini-attention layers."""

    Options = InfiniOptions
    memory_hooks = {GATE: "none", MEM_OUT: "norm", LOCAL_OUT: "norm", MEM_NORM: "none"}
    hook_docs = {
        **MemoryLM.hook_docs,
        GATE: HookDoc(
            "[batch, pos, head]", "`sigmoid(beta)` per head: the share of the memory read in the head's output (eq. 6)"
        ),
        MEM_OUT: HookDoc(
            "[batch, pos, head, d_head]",
            "`A_mem`, what the token reads from the compressive memory of earlier segments (eq. 3)",
        ),
        LOCAL_OUT: HookDoc(
            "[batch, pos, head, d_head]",
            "`A_dot`, the local attention (`attention`: within the token's own segment by default, or a window)",
        ),
        MEM_NORM: HookDoc(
            "[batch, pos, head]", "Frobenius norm of the memory `M` the token reads (constant within a segment)"
        ),
    }

    def default_attention(self) -> dict | None:
        return {"kind": "segment", "span": self.cfg.segment_len} if self.cfg.segment_len else None

    def check_config(self) -> None:
        if self.cfg.segment_len is None:
            raise ConfigError("the 'infini' family needs config.segment_len")
        assert self.attention is not None  # default_attention is a segment when segment_len is set
        if self.attention.kind == "causal":
            raise ConfigError(
                "Infini-attention's local attention is bounded: 'segment' (the paper) or 'window', not 'causal'"
            )

    def make_block(self, layer: int) -> nn.Module:
        cfg = self.cfg
        assert self.attention is not None  # check_config: a segment or a window
        return Block(cfg, InfiniAttention(cfg, self.options, self.attention), SwiGLU(cfg.d_model, cfg.d_mlp))

    def memory_layers(self) -> list[InfiniAttention]:
        return [cast(InfiniAttention, cast(Block, block).attn) for block in self.blocks]

    def read_path(self, tokens, position: int) -> ReadPath:
        """From A_mem to the logits at `position`: the gate sigmoid(beta) per head (eq. 6), W_O's head block,
        then the final norm frozen at the token and W_U."""
        gates = [f"blocks.{l}.attn.hook_gate" for l in range(self.cfg.n_layers)]
        at = captured_at(self, tokens, position, [*gates, last_residual(self)])
        layers = {
            f"blocks.{l}": at[gate][:, None, None] * head_blocks(attention.W_O.weight, self.cfg.n_heads)
            for l, (gate, attention) in enumerate(zip(gates, self.memory_layers()))
        }
        return ReadPath(position, layers, *self.unembedding_at(at[last_residual(self)]))

    def memory_readout(self, tokens, position: int) -> Readout:
        """A_mem at `position` (eq. 3) as a sum over the tokens of the segments before its own.
        Linear update: token s gives sigma(q) . sigma(k_s) v_s / sigma(q) . z. Delta rule: each
        segment's write M_m = P_m M_{m-1} + sigma(K_m)^T V_m, P_m = I - sigma(K_m)^T D_m sigma(K_m),
        D_m = diag(1 / sigma(K_m) z_{m-1}), is linear in M with transitions that do not depend on
        it, so token s of segment m gives (r_m . sigma(k_s)) v_s, the read's row vector
        r = sigma(q) / sigma(q) . z carried back through the later segments' P^T."""
        full = self.as_tokens(tokens)
        if not 0 <= position < full.shape[1]:
            raise ValueError(f"position must lie in [0, {full.shape[1]}), got {position}")
        ids = full[:, : position + 1]
        names = [f"blocks.{l}.attn.hook_{w}" for l in range(self.cfg.n_layers) for w in ("q", "k", "v")]
        seen = self.capture(ids, names)
        S = self.cfg.segment_len
        assert S is not None  # check_config: the family needs it
        written = position // S * S  # the tokens of the complete segments before the read's
        parts = {}
        for layer in range(self.cfg.n_layers):
            name = f"blocks.{layer}"
            sq = feature_map(seen[f"{name}.attn.hook_q"][position])  # [H, d]
            sk = feature_map(seen[f"{name}.attn.hook_k"][:written])  # [N, H, d]
            v = seen[f"{name}.attn.hook_v"][:written]
            den = (sq * sk.sum(0)).sum(-1, keepdim=True)  # sigma(q) . z, [H, 1]
            r = torch.where(den > 0, sq / den.clamp_min(1e-300), 0.0)
            weights = torch.zeros(written, sq.shape[0], dtype=torch.float64)  # [N, H]: the read's weight on v_s
            z_after = sk.unflatten(0, (-1, S)).sum(1).cumsum(0)  # z after each segment, [segments, H, d]
            for a in reversed(range(0, written, S)):
                K = sk[a : a + S]
                weights[a : a + S] = (K * r).sum(-1)
                if self.options.update == "delta" and a > 0:  # r <- P_m^T r
                    scale = 1 / (K * z_after[a // S - 1]).sum(-1)  # 1 / sigma(k_s) . z_{m-1}, [S, H]
                    r = r - ((K * r).sum(-1) * scale)[..., None].mul(K).sum(0)
            parts[name] = weights[..., None] * v
        return Readout(position, "A_mem, the compressive memory's read (eq. 3) before the gate", parts)

    @torch.no_grad()
    def needle_hold(self, tokens, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """Per layer, the span's share of each token's memory read, the largest over heads:
        sigma(q_t) . n_t / sigma(q_t) . z_t, with z_t the normaliser of eq. 3 (every key written
        before t's segment) and n_t the part of it the span's keys wrote. Under the linear update
        (eq. 4) this is exactly the weight of the span's values in A_mem; under the delta rule
        (eq. 5) it is their weight in the normaliser, which later writes dilute."""
        ids, a, b = self.needle_ids(tokens, span)
        S, H, d, L, T = self.cfg.segment_len, self.cfg.n_heads, self.cfg.d_head, self.cfg.n_layers, ids.shape[1]
        assert S is not None  # check_config: the family needs it
        shares = np.zeros((L, T), dtype=np.float32)
        # per layer: written normaliser z, its span part n, the open segment's parts, tokens seen
        sums: list[SpanSums] = [
            {
                "z": torch.zeros(H, d),
                "n": torch.zeros(H, d),
                "pz": torch.zeros(H, d),
                "pn": torch.zeros(H, d),
                "seen": 0,
            }
            for _ in range(L)
        ]
        queries: dict[int, Tensor] = {}

        def keep_q(q: Tensor, hook) -> None:
            queries[int(hook.name.split(".")[1])] = q[0].float().cpu()

        def read_k(k: Tensor, hook) -> None:
            layer = int(hook.name.split(".")[1])
            acc, sq, sk = sums[layer], feature_map(queries.pop(layer)), feature_map(k[0].float().cpu())
            t, pos = 0, acc["seen"]
            while t < sk.shape[0]:
                g = pos + t
                stop = min(sk.shape[0], g - g % S + S - pos)
                num, den = (sq[t:stop] * acc["n"]).sum(-1), (sq[t:stop] * acc["z"]).sum(-1)  # [tokens, H]
                shares[layer, g : pos + stop] = torch.where(den > 0, num / den.clamp_min(1e-30), 0.0).amax(-1).numpy()
                positions = torch.arange(g, pos + stop)
                in_span = ((positions >= a) & (positions < b)).float()
                acc["pz"] += sk[t:stop].sum(0)
                acc["pn"] += (sk[t:stop] * in_span[:, None, None]).sum(0)
                if (pos + stop) % S == 0:  # the segment is complete: its keys are written
                    acc["z"], acc["n"] = acc["z"] + acc["pz"], acc["n"] + acc["pn"]
                    acc["pz"], acc["pn"] = torch.zeros(H, d), torch.zeros(H, d)
                t = stop
            acc["seen"] = pos + sk.shape[0]

        hooks = [(f"blocks.{l}.attn.hook_{w}", fn) for l in range(L) for w, fn in (("q", keep_q), ("k", read_k))]
        with self.hooks(fwd_hooks=hooks):
            for _ in self.stream(ids):
                pass
        return {f"layer {l}: span's share of the memory read (max over heads)": shares[l] for l in range(L)}
