"""Memory layers: product-key memory (PKM) and Memory+ (Memory Layers at Scale, arXiv 2412.09764).

A memory layer replaces the FFN of a few blocks, spread through the depth. Per head h of H:

  query          q = x W_q^h                      (d_k dims; with qk_norm, each half and each
                                                   sub-key is l2-normalised)
  lookup         (s, I) = top-k over the n^2 product keys of q  (exact; kernels/product_keys/)
  weights        w = softmax(s)
  read           y = sum_h sum_i w_i V[I_i]        (an embedding bag over the value table)
  Memory+ gate   out = (y * silu(x W_1)) W_2        (swilu; plain PKM returns y)

Memory+ shares one value table V [n^2, d_v] among all memory layers of the model (`shared_values`),
so a model with three memory layers has three sets of keys and one pool of values. The
memory is parametric: nothing is carried across segments, so a streamed run equals a one-pass run.

`usage_report` reads the top-k indices of a trace and reports what a user inspects: the share
of values and sub-keys ever selected, the entropy and Gini coefficient of value usage, and the
dead values; `usage_figure` draws the same counts. The intervention point is "silence": zero a
layer's selection weights, or those of chosen values (`silence_hooks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import numpy as np
import plotly.graph_objects as go
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz.config import ConfigError, ModelConfig
from memviz.figure_parts import WIDTH, layer_names, outline_evidence, table_figure, window_of
from memviz.layers import LocalAttention, SwiGLU
from memviz.model import Block, MemoryLM
from memviz.options import check_positive
from memviz.protocol import HookDoc, MemoryModel
from memviz.registry import Intervention, NamedHook, register_family
from memviz.trace import Trace, bin_size
from memviz_kernels.dispatch import product_key_topk, weighted_bag

TOPK_INDICES = "blocks.{l}.mlp.hook_topk_indices"  # [batch, pos, head, topk]  value index i * n_keys + j
TOPK_WEIGHTS = "blocks.{l}.mlp.hook_topk_weights"  # [batch, pos, head, topk]  softmax weights


@dataclass
class MemoryLayerOptions:
    n_keys: int = 64  # sub-keys per half: n^2 values
    heads: int = 4
    topk: int = 16
    d_key: int = 64  # query / full-key width (two halves)
    swilu: bool = True  # Memory+ gate; False is plain PKM
    qk_norm: bool = True
    shared_values: bool = True  # one value pool for all memory layers (Memory+)
    layers: list[int] = field(default_factory=list)  # which blocks get a memory layer; [] = spread 2

    def __post_init__(self) -> None:
        check_positive(n_keys=self.n_keys, heads=self.heads, topk=self.topk, d_key=self.d_key)
        if self.d_key % 2:
            raise ValueError(f"d_key must be even (two halves), got {self.d_key}")
        if self.topk > self.n_keys:
            raise ValueError(f"topk ({self.topk}) cannot exceed n_keys ({self.n_keys})")


def spread_layers(n_layers: int, count: int = 2) -> list[int]:
    """`count` block indices spread evenly through the depth (centre of each of `count` bands)."""
    count = min(count, n_layers)
    return sorted({int((i + 0.5) * n_layers / count) for i in range(count)})


class ProductKeyMemory(nn.Module):
    """One memory layer; `values` is the (possibly shared) value table [n^2, d_model]."""

    def __init__(self, cfg: ModelConfig, options: MemoryLayerOptions, values: nn.Parameter) -> None:
        super().__init__()
        self.options, self.values = options, values
        H, dk, n = options.heads, options.d_key, options.n_keys
        self.W_q = nn.Linear(cfg.d_model, H * dk, bias=False)
        self.keys = nn.Parameter(torch.empty(H, 2, n, dk // 2))
        if options.swilu:
            self.W_1 = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
            self.W_2 = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.hook_query = HookPoint()  # [batch, pos, head, d_key]
        self.hook_topk_indices = HookPoint()  # [batch, pos, head, topk]  value index i * n + j
        self.hook_topk_weights = HookPoint()  # [batch, pos, head, topk]  softmax weights
        self.hook_read = HookPoint()  # [batch, pos, d_model]  y, before the gate

    def reset_memory_parameters(self) -> None:
        bound = 1 / math.sqrt(self.options.d_key // 2)
        nn.init.uniform_(self.keys, -bound, bound)

    def lookup_keys(self) -> Tensor:
        return F.normalize(self.keys, dim=-1) if self.options.qk_norm else self.keys

    def forward(self, x: Tensor) -> Tensor:
        o = self.options
        q = self.W_q(x).view(*x.shape[:-1], o.heads, o.d_key)
        if o.qk_norm:
            q = torch.cat([F.normalize(h, dim=-1) for h in q.split(o.d_key // 2, dim=-1)], dim=-1)
        q = self.hook_query(q)
        scores, indices = product_key_topk(q, self.lookup_keys(), o.topk)
        if o.qk_norm:  # cosine scores lie in [-2, 2]; a temperature lets the softmax be sharp
            scores = scores * math.sqrt(o.d_key)
        indices = self.hook_topk_indices(indices)
        weights = self.hook_topk_weights(torch.softmax(scores, dim=-1))
        y = weighted_bag(indices.flatten(-2), weights.flatten(-2), self.values)
        y = self.hook_read(y)
        return self.W_2(y * F.silu(self.W_1(x))) if o.swilu else y


def silence_hooks(layer: int, values=None) -> list:
    """fwd_hooks zeroing a memory layer's selection weights: all of them, or only those that
    select the given value indices (the remaining weights are not renormalised)."""
    chosen = None if values is None else torch.as_tensor(list(values))
    seen: dict[str, Tensor] = {}

    def remember(indices, hook):
        seen["indices"] = indices
        return indices

    def zero(weights, hook):
        if chosen is None:
            return torch.zeros_like(weights)
        return weights.masked_fill(torch.isin(seen["indices"], chosen), 0.0)

    return [(TOPK_INDICES.format(l=layer), remember), (TOPK_WEIGHTS.format(l=layer), zero)]


class Silenceable(MemoryModel, Protocol):
    """A model with memory layers whose top-k reads the "silence" point zeroes."""

    @property
    def memory_layers(self) -> list[int]: ...
    def silence_hooks(self, layer: int, values: Sequence[int] | None = None) -> list[NamedHook]: ...


def silence_point(whose: str) -> Intervention:
    """The "silence" intervention point of a model with memory layers (`model.memory_layers`,
    `model.silence_hooks`); `whose` names the layer in its summary."""
    return Intervention(
        f"zero {whose} top-k selection weights, or those of chosen values (model.silence_hooks)",
        sites=lambda model: cast(Silenceable, model).memory_layers,
        hooks=lambda model, layer: cast(Silenceable, model).silence_hooks(layer),
    )


def selection_map(trace: Trace, name: str, width: int = WIDTH, start: int = 0, stop: int | None = None) -> go.Figure:
    """A memory layer's selections: x = token, y = selected value index, colour = its weight,
    one marker symbol per head. Long ranges show every `bin`-th token (indices do not pool)."""
    start, stop = window_of(trace, start, stop)
    idx = trace[name][start:stop]  # [T, H, k]
    weights = trace[name.replace("hook_topk_indices", "hook_topk_weights")][start:stop]
    step = bin_size(len(idx), width)
    shown = weights[::step]
    low, high = float(np.nanmin(shown)), float(np.nanmax(shown))  # top-k weights sit near 1/k: fit the scale to them
    fig = go.Figure()
    symbols = ["circle", "square", "diamond", "cross", "x", "triangle-up", "star", "hexagon"]
    for h in range(idx.shape[1]):
        xs = np.repeat(np.arange(start, stop, step), idx.shape[2])
        fig.add_trace(
            go.Scattergl(
                x=xs,
                y=idx[::step, h].reshape(-1),
                mode="markers",
                name=f"head {h}",
                marker={
                    "color": shown[:, h].reshape(-1),
                    "colorscale": "Viridis",
                    "cmin": low,
                    "cmax": max(high, low + 1e-6),
                    "size": 5,
                    "symbol": symbols[h % len(symbols)],
                    "colorbar": {"title": "weight"} if h == 0 else None,
                },
                hovertemplate=f"token %{{x}}<br>head {h} picked value %{{y}}<br>weight "
                f"%{{marker.color:.3f}}<extra></extra>",
            )
        )
    outline_evidence(fig, trace.meta.get("evidence", []), start, stop)
    fig.update_layout(
        title=f"{name.split('.mlp')[0]}: selected values per token (colour = weight, scaled to the shown range)",
        xaxis_title=f"token position{f' (every {step}-th token)' if step > 1 else ''}",
        yaxis_title="value index i * n_keys + j",
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
    )  # clear of the colour bar
    return fig


def selected_at(trace: Trace, name: str, position: int, others: int = 5) -> dict[str, go.Figure]:
    """What one token read from a memory layer: its selected values ranked by weight (a bar each), and a table of
    each value with the `others` other tokens of the input that select it with the most weight."""
    idx, weights = trace[name], trace[name.replace("hook_topk_indices", "hook_topk_weights")]  # [T, H, k]
    here, w = idx[position].reshape(-1), weights[position].reshape(-1)
    heads = np.repeat(np.arange(idx.shape[1]), idx.shape[2])
    order = np.argsort(-w)
    hit = np.isin(idx, here) & (np.arange(len(idx)) != position)[:, None, None]  # one pass: every other selection
    where, _, _ = np.nonzero(hit)
    found_values, found_weights = idx[hit], weights[hit]
    counts, tops = [], []
    for value in here[order]:
        mine = found_values == value
        ranked = np.argsort(-found_weights[mine], kind="stable")
        strongest: dict[int, float] = {}  # each token once, at its largest weight on this value
        for p, weight in zip(where[mine][ranked].tolist(), found_weights[mine][ranked].tolist()):
            strongest.setdefault(p, weight)
        counts.append(len(strongest))
        best = list(strongest.items())[:others]
        tops.append(", ".join(f"{p} {trace.token_text(p, p + 1)[0]!r} ({x:.2f})" for p, x in best))
    labels = [f"value {v} (head {h})" for v, h in zip(here[order], heads[order])]
    layer = name.split(".mlp")[0]
    token = trace.token_text(position, position + 1)[0]
    bars = go.Figure(
        go.Bar(
            x=labels,
            y=w[order],
            customdata=list(zip(counts, tops)),
            hovertemplate="%{x}: weight %{y:.3f}<br>selected by %{customdata[0]} other tokens, most: "
            "%{customdata[1]}<extra></extra>",
        )
    )
    bars.update_layout(
        title=f"{layer}: the values token {position} ({token!r}) read, by weight",
        yaxis_title="weight",
        xaxis_title="selected value",
    )
    table = table_figure(
        {
            "value (head)": labels,
            "weight": [f"{x:.3f}" for x in w[order]],
            "other tokens selecting it": counts,
            f"the {others} that select it most (position, token, weight)": tops,
        },
        f"{layer}: who else reads the values token {position} read",
    )
    return {f"{layer} values read": bars, f"{layer} values read, and who else reads them": table}


def value_counts(indices: np.ndarray, n_values: int) -> np.ndarray:
    """How often each value was selected over `indices` (any shape)."""
    return np.bincount(np.asarray(indices).reshape(-1).astype(np.int64), minlength=n_values)


def usage_figure(trace: Trace, name: str, n_values: int) -> go.Figure:
    """How often each value of a memory layer was selected (sorted), with the dead share."""
    counts = value_counts(trace[name], n_values)
    dead = float((counts == 0).mean())
    # thousands of sub-pixel bars: plotly's default outline would cover their fill
    bars = go.Bar(
        y=np.sort(counts)[::-1], marker_line_width=0, hovertemplate="rank %{x}: %{y} selections<extra></extra>"
    )
    fig = go.Figure(bars)
    fig.update_layout(
        title=f"{name.split('.mlp')[0]}: value usage, sorted ({dead:.0%} of {n_values} values never selected)",
        xaxis_title="values, most used first",
        yaxis_title="selections",
        yaxis_type="log",
    )
    return fig


def memory_layer_figures(
    trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None
) -> dict[str, go.Figure]:
    """Per memory layer: the selected values per token and the value usage (what one token read: `read_at`)."""
    n_values = trace.meta.get("figure_settings", {}).get("n_values")
    figs = {}
    for name in layer_names(trace, TOPK_INDICES):
        figs[f"{name} selections"] = selection_map(trace, name, width=width, start=start, stop=stop)
        figs[f"{name} usage"] = usage_figure(trace, name, n_values or int(trace[name].max()) + 1)
    return figs


def memory_layer_read_at(trace: Trace, position: int) -> dict[str, go.Figure]:
    """Per memory layer, what token `position` read (`selected_at`)."""
    return {
        title: fig
        for name in layer_names(trace, TOPK_INDICES)
        for title, fig in selected_at(trace, name, position).items()
    }


@register_family(
    "memory_layer",
    summary="memory layers (PKM, Memory+; arXiv 2412.09764): product-key lookups into a "
    "value table in place of some FFNs; parametric, nothing carried across segments",
    figures=memory_layer_figures,
    read_at=memory_layer_read_at,
    figure_settings=lambda model: {"n_values": cast(MemoryLayerLM, model).options.n_keys ** 2},
    interventions={"silence": silence_point("a memory layer's")},
    quick={
        "attention": {"kind": "window", "span": 32},
        "memory": {"n_keys": 16, "topk": 4, "heads": 2, "d_key": 16, "layers": [1]},
    },
    tiny={
        "attention": {"kind": "window", "span": 8},
        "memory": {"n_keys": 8, "topk": 4, "heads": 2, "d_key": 8, "layers": [1]},
    },
    sample="memory_plus_english",
)
class MemoryLayerLM(MemoryLM):
    """Transformer (sliding-window or full attention) with memory layers in place of some FFNs."""

    Options = MemoryLayerOptions
    memory_hooks = {TOPK_INDICES: "none", TOPK_WEIGHTS: "none"}
    hook_docs = {
        **MemoryLM.hook_docs,
        "blocks.{l}.mlp.hook_query": HookDoc(
            "[batch, pos, head, d_key]",
            "product-key query (each half unit-norm with `qk_norm`); only in memory-layer blocks",
        ),
        TOPK_INDICES: HookDoc("[batch, pos, head, topk]", "selected value indices `i * n_keys + j`, best first"),
        TOPK_WEIGHTS: HookDoc("[batch, pos, head, topk]", "softmax weights of the selected values"),
        "blocks.{l}.mlp.hook_read": HookDoc(
            "[batch, pos, d_model]", "the weighted sum of value rows `y`, before the swilu gate"
        ),
    }

    def silence_hooks(self, layer: int, values=None) -> list:
        """The "silence" intervention at memory layer `layer` (module function `silence_hooks`)."""
        if layer not in self.memory_layers:
            raise ValueError(f"layer {layer} has no memory layer; the memory layers are {self.memory_layers}")
        return silence_hooks(layer, values)

    def check_config(self) -> None:
        layers = self.options.layers
        if (
            not isinstance(layers, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
            or len(set(layers)) != len(layers)
        ):
            raise ConfigError(f"memory_layer layers must be a list of distinct block indices, got {layers!r}")
        bad = [i for i in layers if not 0 <= i < self.cfg.n_layers]
        if bad:
            raise ConfigError(f"memory_layer layers {bad} are outside 0..{self.cfg.n_layers - 1}")

    def build(self) -> None:
        o, d = self.options, self.cfg.d_model
        self.memory_layers = o.layers or spread_layers(self.cfg.n_layers)
        n_values = o.n_keys**2
        if o.shared_values:
            self.values = nn.Parameter(torch.randn(n_values, d) / math.sqrt(d))
        self.blocks = nn.ModuleList(self.make_block(layer) for layer in range(self.cfg.n_layers))

    def replaces_baseline_weight(self, name: str) -> bool:
        return any(name.startswith(f"blocks.{layer}.mlp.") for layer in self.memory_layers)

    def value_tables(self) -> list[nn.Parameter]:
        if self.options.shared_values:
            return [self.values]
        return [cast(ProductKeyMemory, self.blocks[layer].mlp).values for layer in self.memory_layers]

    def make_block(self, layer: int) -> nn.Module:
        cfg, o = self.cfg, self.options
        assert self.attention is not None  # default_attention is causal
        if layer not in self.memory_layers:
            return Block(cfg, LocalAttention(cfg, self.attention), SwiGLU(cfg.d_model, cfg.d_mlp))
        values = (
            self.values
            if o.shared_values
            else nn.Parameter(torch.randn(o.n_keys**2, cfg.d_model) / math.sqrt(cfg.d_model))
        )
        return Block(cfg, LocalAttention(cfg, self.attention), ProductKeyMemory(cfg, o, values))


def usage_report(indices: np.ndarray, n_values: int, n_keys: int) -> dict[str, float]:
    """Usage of a memory layer over a trace: `indices` [pos, head, topk] of selected values.

    Returns the share of values selected at least once, the share of sub-keys selected at
    least once (both halves, averaged over heads, whose sub-keys are their own), the normalised entropy of value
    usage (1 = uniform), its Gini coefficient
    (0 = uniform, 1 = one value takes everything), and the number of dead values."""
    if np.size(indices) == 0:
        raise ValueError("no selections to report on")
    counts = value_counts(indices, n_values).astype(np.float64)
    p = counts / counts.sum()
    nz = p[p > 0]
    entropy = float(-(nz * np.log(nz)).sum() / math.log(n_values)) if n_values > 1 else 1.0
    sorted_counts = np.sort(counts)
    cum = np.cumsum(sorted_counts)
    gini = float((n_values + 1 - 2 * (cum / cum[-1]).sum()) / n_values)
    per_head = np.asarray(indices).astype(np.int64).reshape(-1, *np.shape(indices)[1:2], np.shape(indices)[-1])
    keys_used = np.mean(
        [
            (np.unique(head // n_keys).size + np.unique(head % n_keys).size) / (2 * n_keys)
            for head in np.moveaxis(per_head, 1, 0)
        ]
    )
    return {
        "values_used": float((counts > 0).mean()),
        "keys_used": float(keys_used),
        "usage_entropy": entropy,
        "gini": gini,
        "dead_values": int((counts == 0).sum()),
    }
