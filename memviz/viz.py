"""Plotly figures of traces: what the app shows, one call each in a notebook.

`family_figures(trace)` gives the views of the trace's memory family, keyed by title: each
family registers its own (`memviz.registry`; the helpers they are built from are in
`memviz.figure_parts`), and they read only the trace, so a saved trace plots without its model.
The figures here serve every family: the evidence in the text, what the memory still holds of
it, an ablation sweep, training loss; the read at one token (`read_figures`, a family's `read_at`). Figures over
positions are pooled to `width` columns (`memviz.figure_parts`).
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from memviz.figure_parts import (
    WIDTH,
    answer_loss_note,
    line_mode,
    memory_share,
    outline_answer,
    outline_evidence,
    position_axis,
    timeline,
    window_of,
    with_array,
)
from memviz.models import get_family
from memviz.running import generic_hook_name
from memviz.trace import Trace, bin_size


def family_figures(trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict[str, go.Figure]:
    """The views of the trace's family (the registry's `figures`) and next-token loss, keyed by title."""
    family = get_family(trace.meta["family"]) if trace.meta.get("family") else None
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)
    if family is not None and family.hooks and not any(generic_hook_name(n) in family.hooks for n in trace.names):
        raise ValueError(
            f"the trace names the {family.name} family but holds none of its memory hooks "
            f"({', '.join(sorted(family.hooks))}): it was not traced from that family's model"
        )
    figs = family.figures(trace, **zoom) if family is not None and family.figures else {}
    figs["loss"] = loss_figure(trace, **zoom)
    note = non_finite_note(trace)
    for fig in figs.values() if note else ():
        fig.update_layout(title=f"{fig.layout.title.text or ''}<br><sub>{note}</sub>")
    return figs


def loss_figure(trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> go.Figure:
    """Next-token loss over positions [start, stop) (`timeline`: the mean of each bin, its range as a band), titled
    with the range's mean loss and bits a byte (`Trace.loss_summary`) and the answer's loss where there is one."""
    fig = timeline(trace, {"loss": "next-token loss (nats)"}, "Next-token loss", width=width, start=start, stop=stop)
    outline_answer(fig, trace, start, len(trace) if stop is None else stop)
    notes = [loss_note(trace, start, stop)]
    if trace.meta.get("answer"):
        notes.append(f"{answer_loss_note(trace)} (outlined, dotted)")
    fig.update_layout(title=f"Next-token loss<br><sub>{'; '.join(notes)}</sub>")
    return fig


def loss_note(trace: Trace, start: int = 0, stop: int | None = None) -> str:
    """What the loss over [start, stop) comes to: its mean a token and bits a byte, or why there is none."""
    summary = trace.loss_summary(start, stop)
    if not summary["tokens"]:
        if len(trace) == 1:
            return "no next-token loss: a one-token input has no next token to predict"
        if start == len(trace) - 1:
            return "no next-token loss here: the last token has no next token to predict"
        return "no finite next-token loss here: the model's logits are not finite over this range"
    per_byte = f", {summary['bits_per_byte']:.3f} bits a byte" if summary["bits_per_byte"] is not None else ""
    shown = (
        "the text"
        if (start, stop) in ((0, None), (0, len(trace)))
        else f"tokens {start:,}-{(stop or len(trace)) - 1:,}"
    )
    return f"{shown}: mean {summary['mean_nats']:.3f} nats a token over {summary['tokens']:,} predictions{per_byte}"


def read_figures(trace: Trace, position: int | None = None) -> dict[str, go.Figure]:
    """What the memory read at token `position` (default `trace.read_position`: where an appended answer's first
    non-blank token is predicted, else the last token), for a family that registers `read_at`; {} for others."""
    family = get_family(trace.meta["family"]) if trace.meta.get("family") else None
    if family is None or family.read_at is None:
        return {}
    position = trace.read_position if position is None else position
    if not 0 <= position < len(trace):
        raise ValueError(f"position {position} is outside the trace's {len(trace):,} tokens")
    return family.read_at(trace, position)


def with_memory_shares(trace: Trace) -> Trace:
    """The trace with, for each layer that keeps a memory gate beside its memory's and its local attention's output
    norms (Infini-attention, Gated DeltaNet), the memory's share of that output per token and head
    (`figure_parts.memory_share`) as "{layer prefix}.memory_share": a quantity the figures derive, to rank too."""
    for name in trace.names:
        prefix = name.removesuffix(".hook_gate")
        if prefix != name and {f"{prefix}.hook_mem_out", f"{prefix}.hook_local_out"} <= set(trace.names):
            trace = with_array(trace, f"{prefix}.memory_share", memory_share(trace, prefix))
    return trace


def figure_layer(title: str) -> str | None:
    """The layer a view's title names first ("blocks.2" of "blocks.2 gates" or "blocks.2.attn memory share"),
    or None for a view of the whole model."""
    found = re.match(r"(blocks\.\d+)(?:[. ]|$)", title)
    return found.group(1) if found else None


def non_finite_note(trace: Trace) -> str:
    """What every figure of a trace whose numbers stop being finite says (recorded while tracing, `meta["non_finite"]`):
    where the logits stop, and which kept quantity stops first; "" for a trace that stays finite."""
    found = trace.meta.get("non_finite", {})
    quantities = sorted((entry["first"], name) for name, entry in found.items() if name not in ("logits", "loss"))
    first = f"{quantities[0][1]} is not finite from token {quantities[0][0]:,}" if quantities else ""
    if trace.diverged_at is None:
        return first
    return (
        f"the model diverged: its logits are not finite from token {trace.diverged_at:,} "
        f"({found['logits']['count']:,} of {len(trace):,} tokens)" + (f"; {first}" if first else "")
    )


def text_with_evidence(trace: Trace, start: int = 0, stop: int | None = None, limit: int = 3000) -> str:
    """The input's text over [start, stop) (at most `limit` tokens) as HTML, evidence tokens
    highlighted, each token's position in its tooltip."""
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


def needle_hold_figure(
    trace: Trace, hold: dict[str, np.ndarray], width: int = WIDTH, start: int = 0, stop: int | None = None
) -> go.Figure:
    """What the memory still holds of the evidence at each later token (`model.needle_hold`),
    one panel per quantity, pooled to `width` columns (`timeline`); the evidence is outlined."""
    derived = trace
    for label, values in hold.items():
        derived = with_array(derived, label, np.asarray(values, dtype=np.float32))
    fig = timeline(
        derived,
        {label: label for label in hold},
        "How much of the evidence the memory still holds",
        width=width,
        start=start,
        stop=stop,
    )
    fig.update_yaxes(range=[-0.02, 1.02])
    return fig


def readout_figures(readout, evidence: Sequence[Sequence[int]] = (), width: int = WIDTH) -> dict[str, go.Figure]:
    """Per layer of a `model.memory_readout`: each written token's share of the read at the chosen
    position, per head (rows) and source position (columns; bins of tokens summed, so a row sums
    to 1 less the initial state's share, named in the title), on a diverging scale around 0; the
    evidence outlined, and its share named."""
    figs = {}
    for layer in readout.parts:
        shares = readout.shares(layer).numpy()  # [source, head]
        n = len(shares)
        if n == 0:
            continue
        size = bin_size(n, width)
        starts = np.arange(0, n, size)
        pooled = np.add.reduceat(shares, starts, axis=0).T  # [head, bins]
        limit = float(np.abs(pooled).max()) or 1.0
        heads = pooled.shape[0]
        rows = [f"head {h}" for h in range(heads)] if heads > 1 else ["the read"]
        fig = go.Figure(
            go.Heatmap(
                z=pooled,
                x=starts,
                y=rows,
                colorscale="RdBu_r",
                zmin=-limit,
                zmax=limit,
                colorbar={"title": "share", "nticks": 5},
                hovertemplate="written at token %{x}<br>%{y}: %{z:.3f} of the read<extra></extra>",
            )
        )
        outline_evidence(fig, evidence, 0, n)
        in_evidence = np.zeros(n, dtype=bool)
        for a, b in evidence:
            in_evidence[a:b] = True
        notes = []
        if in_evidence.any():
            per_head = shares[in_evidence].sum(0)
            notes.append(
                f"the evidence carries {per_head.max():.2f} of "
                + (f"head {int(per_head.argmax())}'s read" if heads > 1 else "the read")
            )
        if layer in readout.initial:
            notes.append(f"the memory's initial state gives {float(readout.initial_share(layer).mean()):.2f}")
        fig.update_layout(
            title=f"{layer}: where the read at token {readout.position} came from"
            + (f"<br><sub>{'; '.join(notes)}</sub>" if notes else ""),
            xaxis_title=position_axis(size, "sum") if size > 1 else "written at token position",
            yaxis_title="head" if heads > 1 else "",
            height=max(300, 220 + 30 * heads),  # one row: room for a colour bar whose ticks do not overlap
        )
        figs[f"{layer} read-out"] = fig
    return figs


def loss_comparison(traces: dict[str, Trace], width: int = WIDTH, start: int = 0, stop: int | None = None) -> go.Figure:
    """Next-token loss of several traces of the same input overlaid (bins of tokens averaged), and
    below it each one's difference from the first: where one model predicts the text better."""
    first_label, first = next(iter(traces.items()))
    stop = min(len(tr) for tr in traces.values()) if stop is None else stop
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=["next-token loss (nats)", f"difference from {first_label} (below 0: lower loss)"],
    )
    pooled = {label: tr.pool("loss", width, start, stop, reduce="mean") for label, tr in traces.items()}
    for label, p in pooled.items():
        fig.add_trace(go.Scatter(x=p.positions, y=p.values, mode=line_mode(len(p.values)), name=label), row=1, col=1)
    for label, p in list(pooled.items())[1:]:
        fig.add_trace(
            go.Scatter(
                x=p.positions,
                y=p.values - pooled[first_label].values,
                mode=line_mode(len(p.values)),
                name=f"{label} - {first_label}",
            ),
            row=2,
            col=1,
        )
    fig.add_hline(y=0, line_color="black", line_width=1, row=2, col=1)
    outline_evidence(fig, first.meta.get("evidence", []), start, stop)
    outline_answer(fig, first, start, stop)
    notes = [f"{label}: {answer_loss_note(tr)}" for label, tr in traces.items() if tr.meta.get("answer")]
    fig.update_layout(
        title="Next-token loss, overlaid" + (f"<br><sub>{'; '.join(notes)}</sub>" if notes else ""),
        height=540,
        legend={"orientation": "h", "yanchor": "top", "y": -0.16},  # below the axis title: the top holds two titles
        margin={"b": 110},
    )
    fig.update_xaxes(title_text=position_axis(pooled[first_label].bin_size, "mean"), row=2, col=1)
    return fig


#: a change in log p(answer) smaller than this (nats) is drawn and described as no effect
NO_EFFECT_NATS = 0.01


def sweep_spacing(rows) -> float:
    """Tokens between a sweep's resets: the closest pair's gap, or one segment for a lone reset."""
    positions = sorted(r.position for r in rows)
    gaps = [b - a for a, b in zip(positions, positions[1:]) if b > a]
    if gaps:
        return float(min(gaps))
    return float(positions[0] / rows[0].segment) if positions and rows[0].segment > 0 else 1.0


def ablation_sweep_figure(
    rows, evidence: Sequence[Sequence[int]] = (), title: str = "Memory ablation sweep"
) -> go.Figure:
    """Change in log p(answer) when the memory is reset at each segment boundary
    (`memviz.interventions.ablation_sweep`); the needle's segment is where it starts to matter.
    The axis always shows zero and at least +-NO_EFFECT_NATS, so rounding noise stays flat; bars
    within that floor are grey, and a sweep with none beyond it says "no effect"."""
    deltas = [r.delta for r in rows]
    positions = [r.position for r in rows]
    spacing = sweep_spacing(rows)
    colours = ["#1f77b4" if abs(d) >= NO_EFFECT_NATS else "#b0b0b0" for d in deltas]
    fig = go.Figure(
        go.Bar(
            x=positions,
            y=deltas,
            width=0.8 * spacing,
            marker_color=colours,
            customdata=[[r.segment, r.greedy] for r in rows],
            hovertemplate="reset at token %{x} (segment %{customdata[0]})<br>"
            "delta log p %{y:.3g}<br>answer %{customdata[1]}<extra></extra>",
        )
    )
    outline_evidence(fig, evidence)
    low, high = min([*deltas, -NO_EFFECT_NATS]), max([*deltas, NO_EFFECT_NATS])
    pad = 0.1 * (high - low)
    fig.update_yaxes(range=[low - pad, high + pad], zeroline=True, zerolinewidth=2, zerolinecolor="black")
    if positions:  # every bar and frame whole, a lone bar too (plotly's autorange cuts it at its centre)
        ends = [*positions, *(x for span in evidence for x in span)]
        fig.update_xaxes(range=[min(ends) - spacing, max(ends) + spacing])
    if all(abs(d) < NO_EFFECT_NATS for d in deltas):
        fig.add_annotation(
            text=f"no effect: every change is below {NO_EFFECT_NATS} nats",
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.9,
            showarrow=False,
        )
    fig.update_layout(title=title, xaxis_title="memory reset at token position", yaxis_title="change in log p(answer)")
    return fig


def training_loss(metrics: str | Path) -> go.Figure:
    """Loss and answer loss over steps from a training run's metrics.jsonl (empty while absent); a line that is no
    step's record (one being written as it is read, a note) is passed over."""
    metrics = Path(metrics)
    rows = []
    for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines() if metrics.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record and "loss" in record:
            rows.append(record)
    steps = [r["step"] for r in rows]
    fig = go.Figure(
        [
            go.Scatter(x=steps, y=[r["loss"] for r in rows], name="loss"),
            go.Scatter(x=steps, y=[r.get("answer_loss") for r in rows], name="answer loss"),
        ]
    )
    fig.update_layout(title="Training loss", xaxis_title="step", yaxis_title="nats", height=350)
    return fig


def state_rank_figures(ranks, width: int = WIDTH) -> dict[str, go.Figure]:
    """Per layer and matrix memory of `memviz.state_rank.state_ranks(...)`'s table: its heads' effective rank (top)
    and stable rank (bottom) over the tokens read, as heatmaps (head x position; more positions than `width` are
    averaged in bins)."""
    figs = {}
    for (layer, memory), part in ranks.groupby(["layer", "memory"], sort=False):
        fig = make_subplots(
            rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12, subplot_titles=["effective rank", "stable rank"]
        )
        for row, measure in enumerate(("effective_rank", "stable_rank"), start=1):
            table = part.pivot(index="head", columns="position", values=measure)
            positions, z = table.columns.to_numpy(), table.to_numpy()
            size = bin_size(len(positions), width)
            if size > 1:  # each bin's mean over the states that have a value
                starts = np.arange(0, len(positions), size)
                known = np.isfinite(z)
                with np.errstate(invalid="ignore", divide="ignore"):
                    z = np.add.reduceat(np.where(known, z, 0), starts, axis=1) / np.add.reduceat(known, starts, axis=1)
                positions = positions[starts]
            fig.add_trace(
                go.Heatmap(
                    z=z,
                    x=positions,
                    y=table.index.to_numpy(),
                    colorscale="Viridis",
                    zmin=0,
                    colorbar={"title": "rank", "len": 0.42, "y": 0.79 if row == 1 else 0.21},
                    hovertemplate=f"after token %{{x}}<br>head %{{y}}<br>{measure.replace('_', ' ')} %{{z:.2f}}"
                    "<extra></extra>",
                ),
                row=row,
                col=1,
            )
            fig.update_yaxes(title_text="head", row=row, col=1)
        fig.update_layout(
            title=f"{layer} {memory}: how many directions each head's state uses",
            height=520,
            xaxis2_title="tokens read"
            + (f" (each column the mean of up to {size} states from there)" if size > 1 else ""),
        )
        figs[f"{layer} {memory} state rank"] = fig
    return figs
