"""Plotly figures of traces: what the app shows, one call each in a notebook.

Every figure over token positions is max-pooled on the server to at most `width` columns
(`Trace.pool`), with the true token positions on the x axis, so a 1M-token trace draws as fast
as a 1k one and spikes survive. `start`/`stop` zoom in, re-pooling at finer resolution. Where
a trace carries evidence spans (the needle, the supporting facts) they are shaded.

`family_figures(model, trace)` gives the views of the model's memory family, keyed by title:
  memory_layer  the selected values per token (which, weight, head), value usage and dead share
  lm2           slot attention (token x slot), the three gates over tokens, slot norms, and with
                write='slots' the write weights (which tokens each slot stores)
  infini        sigmoid(beta) per layer x head, memory share per token and head, memory norm
  longmem       which past positions each token retrieved, coloured by score; the gate per head
  titans        surprise over tokens with eta / theta / alpha beneath
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from memviz.trace import Trace

WIDTH = 1500


def shade_evidence(fig: go.Figure, spans: Sequence[Sequence[int]], start: int, stop: int) -> None:
    for a, b in spans:
        if b > start and a < stop:
            fig.add_vrect(x0=max(a, start) - 0.5, x1=min(b, stop) - 0.5, fillcolor="gold", opacity=0.35, line_width=0,
                          annotation_text="evidence", annotation_position="top left")


def hover_text(trace: Trace, positions: np.ndarray, bin_size: int) -> list[str]:
    if bin_size == 1:
        return [f"{p}: {trace.token_text(int(p), int(p) + 1)[0]!r}" for p in positions]
    return [f"{p}-{p + bin_size - 1} (max of {bin_size})" for p in positions]


def window_of(trace: Trace, start: int, stop: int | None) -> tuple[int, int]:
    stop = len(trace) if stop is None else min(stop, len(trace))
    if not 0 <= start < stop:
        raise ValueError(f"empty position range [{start}, {stop}) for a trace of {len(trace)} tokens")
    return start, stop


def timeline(trace: Trace, names: dict[str, str], title: str, width: int = WIDTH, start: int = 0,
             stop: int | None = None, reduce: str = "max") -> go.Figure:
    """Per-token scalars (arrays [pos] or [pos, k], averaged over k) as stacked line panels,
    one per `names` entry {hook name: label}, sharing the position axis."""
    start, stop = window_of(trace, start, stop)
    fig = make_subplots(rows=len(names), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=list(names.values()))
    for row, name in enumerate(names, start=1):
        pooled = trace.pool(name, width, start, stop, reduce=reduce)
        values = pooled.values if pooled.values.ndim == 1 else np.nanmean(pooled.values.reshape(len(pooled.values), -1), 1)
        fig.add_trace(go.Scatter(x=pooled.positions, y=values, mode="lines", name=names[name],
                                 hovertext=hover_text(trace, pooled.positions, pooled.bin_size), hoverinfo="text+y"), row=row, col=1)
    shade_evidence(fig, trace.meta.get("evidence", []), start, stop)
    fig.update_layout(title=title, showlegend=False, height=160 + 170 * len(names))
    fig.update_xaxes(title_text="token position", row=len(names), col=1)
    return fig


def position_heatmap(trace: Trace, name: str, title: str, row_label: str, width: int = WIDTH, start: int = 0,
                     stop: int | None = None, colorscale: str = "Viridis", zmin: float | None = None,
                     zmax: float | None = None) -> go.Figure:
    """An array [pos, k] as a heatmap: rows k (slots, heads), columns pooled token positions."""
    start, stop = window_of(trace, start, stop)
    pooled = trace.pool(name, width, start, stop)
    z = pooled.values.reshape(len(pooled.values), -1).T
    hover = hover_text(trace, pooled.positions, pooled.bin_size)
    fig = go.Figure(go.Heatmap(z=z, x=pooled.positions, y=list(range(z.shape[0])), colorscale=colorscale, zmin=zmin, zmax=zmax,
                               customdata=np.broadcast_to(np.asarray(hover, dtype=object), z.shape),
                               hovertemplate=f"%{{customdata}}<br>{row_label} %{{y}}<br>%{{z:.3g}}<extra></extra>"))
    shade_evidence(fig, trace.meta.get("evidence", []), start, stop)
    fig.update_layout(title=title, xaxis_title="token position", yaxis_title=row_label)
    return fig


def segment_softmax(scores: np.ndarray, segment_len: int) -> np.ndarray:
    """Softmax over the positions of each `segment_len` segment of `scores` [pos, k] (the trace
    starts at position 0, so segments start at multiples of `segment_len`)."""
    out = np.empty(scores.shape, dtype=np.float64)
    for a in range(0, len(scores), segment_len):
        seg = scores[a : a + segment_len].astype(np.float64)
        e = np.exp(seg - seg.max(0))
        out[a : a + segment_len] = e / e.sum(0)
    return out


def layer_names(trace: Trace, suffix: str) -> list[str]:
    """Hook names in the trace ending with `suffix`, in layer order."""
    found = [n for n in trace.names if n.endswith(suffix)]
    return sorted(found, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])


def infini_gate_heatmap(trace: Trace) -> go.Figure:
    """sigmoid(beta) per layer x head: how much each head leans on its compressive memory."""
    names = layer_names(trace, "attn.hook_gate")
    z = np.stack([trace[n][0] for n in names])
    fig = go.Figure(go.Heatmap(z=z, x=[f"head {h}" for h in range(z.shape[1])], y=[n.split(".attn")[0] for n in names],
                               zmin=0, zmax=1, colorscale="RdBu_r", texttemplate="%{z:.2f}",
                               hovertemplate="%{y} %{x}<br>sigmoid(beta) %{z:.3f}<extra></extra>"))
    fig.update_layout(title="Infini-attention gate sigmoid(beta): memory share per head (1 = memory only)")
    return fig


def memory_share(trace: Trace, layer_prefix: str) -> np.ndarray:
    """Per token and head, the memory's share of the mixed output norm:
    g |A_mem| / (g |A_mem| + (1 - g) |A_local|)."""
    g = trace[f"{layer_prefix}.hook_gate"]
    mem, local = trace[f"{layer_prefix}.hook_mem_out"], trace[f"{layer_prefix}.hook_local_out"]
    num = g * mem
    return num / np.maximum(num + (1 - g) * local, 1e-12)


def with_array(trace: Trace, name: str, values: np.ndarray) -> Trace:
    """A view of `trace` with one more (derived) array, for pooling and plotting."""
    return Trace(trace.tokens, {**trace.arrays, name: values}, trace.vocab, trace.meta)


def longmem_retrieval_map(trace: Trace, layer_prefix: str, width: int = WIDTH, start: int = 0, stop: int | None = None) -> go.Figure:
    """Which past positions each token retrieved: x = reading token, y = retrieved chunk's first
    position, colour = retrieval score (head-averaged over the top chunks kept per bin)."""
    start, stop = window_of(trace, start, stop)
    pos = trace[f"{layer_prefix}.hook_retrieved_pos"][start:stop]  # [T, H, K]
    scores = trace[f"{layer_prefix}.hook_retrieved_scores"][start:stop]
    step = max(1, -(-len(pos) // width))
    xs, ys, cs = [], [], []
    for i in range(0, len(pos), step):
        p, s = pos[i].reshape(-1), scores[i].reshape(-1)
        keep = p >= 0
        xs.extend([start + i] * int(keep.sum()))
        ys.extend(p[keep].tolist())
        cs.extend(s[keep].tolist())
    fig = go.Figure(go.Scattergl(x=xs, y=ys, mode="markers", marker={"color": cs, "colorscale": "Viridis", "size": 4,
                                                                     "colorbar": {"title": "score"}},
                                 hovertemplate="token %{x} read chunk at %{y}<br>score %{marker.color:.3g}<extra></extra>"))
    for a, b in trace.meta.get("evidence", []):
        fig.add_hrect(y0=a - 0.5, y1=b - 0.5, fillcolor="gold", opacity=0.3, line_width=0, annotation_text="evidence")
    fig.update_layout(title="LongMem retrieval: past chunks read by each token", xaxis_title="reading token position",
                      yaxis_title="retrieved chunk position")
    return fig


def value_usage(trace: Trace, name: str, n_values: int) -> go.Figure:
    """How often each value of a memory layer was selected (sorted), with the dead share."""
    counts = np.bincount(np.asarray(trace[name]).reshape(-1).astype(np.int64), minlength=n_values)
    dead = float((counts == 0).mean())
    fig = go.Figure(go.Bar(y=np.sort(counts)[::-1], hovertemplate="rank %{x}: %{y} selections<extra></extra>"))
    fig.update_layout(title=f"{name.split('.mlp')[0]}: value usage, sorted ({dead:.0%} of {n_values} values never selected)",
                      xaxis_title="values, most used first", yaxis_title="selections", yaxis_type="log")
    return fig


def topk_selection_map(trace: Trace, name: str, width: int = WIDTH, start: int = 0, stop: int | None = None) -> go.Figure:
    """A memory layer's selections: x = token, y = selected value index, colour = its weight,
    one marker symbol per head. Long ranges show every `bin`-th token (indices do not pool)."""
    start, stop = window_of(trace, start, stop)
    idx = trace[name][start:stop]  # [T, H, k]
    weights = trace[name.replace("hook_topk_indices", "hook_topk_weights")][start:stop]
    step = max(1, -(-len(idx) // width))
    fig = go.Figure()
    symbols = ["circle", "square", "diamond", "cross", "x", "triangle-up", "star", "hexagon"]
    for h in range(idx.shape[1]):
        xs = np.repeat(np.arange(start, stop, step), idx.shape[2])
        fig.add_trace(go.Scattergl(
            x=xs, y=idx[::step, h].reshape(-1), mode="markers", name=f"head {h}",
            marker={"color": weights[::step, h].reshape(-1), "colorscale": "Viridis", "cmin": 0, "cmax": 1, "size": 5,
                    "symbol": symbols[h % len(symbols)], "colorbar": {"title": "weight"} if h == 0 else None},
            hovertemplate=f"token %{{x}}<br>head {h} picked value %{{y}}<br>weight %{{marker.color:.3f}}<extra></extra>"))
    fig.update_layout(title=f"{name.split('.mlp')[0]}: selected values per token (colour = weight)",
                      xaxis_title="token position", yaxis_title="value index i * n_keys + j")
    return fig


def text_with_evidence(trace: Trace, start: int = 0, stop: int | None = None, limit: int = 3000) -> str:
    """The input's text over [start, stop) (at most `limit` tokens) as HTML, evidence tokens
    highlighted, each token's position in its tooltip."""
    import html

    start, stop = window_of(trace, start, stop)
    stop = min(stop, start + limit)
    marked = np.zeros(len(trace), dtype=bool)
    for a, b in trace.meta.get("evidence", []):
        marked[a:b] = True
    pieces = []
    for pos, text in zip(range(start, stop), trace.token_text(start, stop)):
        safe = html.escape(text).replace("\n", "<br>")
        style = ' style="background:#ffd54f"' if marked[pos] else ""
        pieces.append(f'<span title="{pos}"{style}>{safe}</span>')
    return "".join(pieces)


def family_figures(model, trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict[str, go.Figure]:
    """The views of `model`'s memory family over `trace` (module docstring), keyed by title."""
    family, figs = model.family, {}
    zoom = dict(width=width, start=start, stop=stop)
    if family == "infini":
        figs["gates"] = infini_gate_heatmap(trace)
        for prefix in [n[: -len(".hook_gate")] for n in layer_names(trace, "attn.hook_gate")]:
            derived = with_array(trace, "share", memory_share(trace, prefix))
            figs[f"{prefix} memory share"] = position_heatmap(
                derived, "share", f"{prefix}: memory share of each head's output", "head", zmin=0, zmax=1, colorscale="RdBu_r", **zoom)
        figs["memory norm"] = timeline(trace, {n: n for n in layer_names(trace, "attn.hook_mem_norm")}, "||M|| of the memory each token reads", **zoom)
    elif family == "lm2":
        for name in layer_names(trace, "memory.hook_slot_attn"):
            figs[f"{name} slot attention"] = position_heatmap(trace, name, f"{name.split('.memory')[0]}: slot attention", "slot", zmin=0, **zoom)
        last = layer_names(trace, "memory.hook_slot_attn")[-1].split(".memory")[0]
        figs["gates"] = timeline(trace, {f"{last}.memory.hook_{g}_gate": f"{last} {g} gate (mean over dims)" for g in ("input", "forget", "output")},
                                 "LM2 gates over tokens", reduce="mean", **zoom)
        figs["slot norms"] = position_heatmap(trace, f"{last}.memory.hook_slot_norm", f"{last}: slot norms", "slot", **zoom)
        if model.options.write == "slots":
            writes = segment_softmax(trace[f"{last}.memory.hook_write_score"], model.cfg.segment_len)
            figs["slot writes"] = position_heatmap(with_array(trace, "writes", writes), "writes",
                                                   f"{last}: each slot's write weights over its segment's tokens", "slot", zmin=0, **zoom)
    elif family == "titans":
        for prefix in [n[: -len(".hook_surprise")] for n in layer_names(trace, "memory.hook_surprise")]:
            figs[f"{prefix} surprise"] = timeline(trace, {
                f"{prefix}.hook_surprise": "surprise ||grad||", f"{prefix}.hook_loss": "memory loss before update",
                f"{prefix}.hook_eta": "eta (momentum)", f"{prefix}.hook_theta": "theta (step)", f"{prefix}.hook_alpha": "alpha (forget)",
            }, f"{prefix.split('.memory')[0]}: where the memory is surprised", **zoom)
    elif family == "longmem":
        for prefix in [n[: -len(".hook_retrieved_pos")] for n in layer_names(trace, "attn.hook_retrieved_pos")]:
            figs["retrieval"] = longmem_retrieval_map(trace, prefix, **zoom)
            figs["gate"] = position_heatmap(trace, f"{prefix}.hook_gate", "LongMem gate sigmoid(g) per head", "head", zmin=0, zmax=1, **zoom)
    elif family == "memory_layer":
        n_values = model.options.n_keys**2
        for name in layer_names(trace, "mlp.hook_topk_indices"):
            figs[f"{name} selections"] = topk_selection_map(trace, name, **zoom)
            figs[f"{name} usage"] = value_usage(trace, name, n_values)
    figs["loss"] = timeline(trace, {"loss": "next-token loss (nats)"}, "Next-token loss", **zoom)
    return figs


def needle_hold_figure(trace: Trace, hold: dict[str, np.ndarray], width: int = WIDTH, start: int = 0,
                       stop: int | None = None) -> go.Figure:
    """What the memory still holds of the evidence at each later token (`model.needle_hold`),
    one panel per quantity, max-pooled per bin to `width` columns; the evidence is shaded."""
    derived = trace
    for label, values in hold.items():
        derived = with_array(derived, label, np.asarray(values, dtype=np.float32))
    fig = timeline(derived, {label: label for label in hold}, "How much of the evidence the memory still holds",
                   width=width, start=start, stop=stop)
    fig.update_yaxes(range=[-0.02, 1.02])
    return fig


def ablation_sweep_figure(rows, evidence: Sequence[Sequence[int]] = (), title: str = "Memory ablation sweep") -> go.Figure:
    """Change in log p(answer) when the memory is reset at each segment boundary
    (`memviz.interventions.ablation_sweep`); the needle's segment is where it starts to matter."""
    fig = go.Figure(go.Bar(x=[r.position for r in rows], y=[r.delta for r in rows],
                           customdata=[[r.segment, r.greedy] for r in rows],
                           hovertemplate="reset at token %{x} (segment %{customdata[0]})<br>"
                                         "delta log p %{y:.2f}<br>answer %{customdata[1]}<extra></extra>"))
    for a, b in evidence:
        fig.add_vrect(x0=a, x1=b, fillcolor="gold", opacity=0.35, line_width=0, annotation_text="evidence")
    fig.update_layout(title=title, xaxis_title="memory reset at token position", yaxis_title="change in log p(answer)")
    return fig


def training_loss(metrics: str | Path) -> go.Figure:
    """Loss and answer loss over steps from a training run's metrics.jsonl (empty while absent)."""
    metrics = Path(metrics)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "loss" in r]
    steps = [r["step"] for r in rows]
    fig = go.Figure([go.Scatter(x=steps, y=[r["loss"] for r in rows], name="loss"),
                     go.Scatter(x=steps, y=[r["answer_loss"] for r in rows], name="answer loss")])
    fig.update_layout(title="Training loss", xaxis_title="step", yaxis_title="nats", height=350)
    return fig
