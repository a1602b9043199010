"""Figure helpers every family's views are built from (plotly over a `Trace`).

Every figure over token positions is pooled on the server to at most `width` columns
(`Trace.pool`), with the true token positions on the x axis, so a 1M-token trace draws as fast
as a 1k one and spikes survive: a line is each bin's mean inside a band of its min to max, a
heatmap each bin's max (or min, where dips are the events). `start`/`stop` zoom in, re-pooling
at finer resolution. Where a trace carries evidence spans (the needle, the supporting facts) they
are outlined.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from memviz.running import generic_hook_name
from memviz.trace import Trace, position_window

WIDTH = 1500
#: a timeline's mean line, and the band of each pooled bin's min to max around it
LINE_COLOUR = "#1f77b4"
BAND_COLOUR = "rgba(31,119,180,0.25)"


# Frames, no tint, each a line over a wider one of another shade, so that it shows on every colour scale
# (goldenrod alone vanishes in Viridis's yellow, seagreen in its green) and on a white plot.
CLEAR = "rgba(0,0,0,0)"
EVIDENCE_OUTLINE = (
    dict(line_color="black", line_width=4, fillcolor=CLEAR),
    dict(line_color="goldenrod", line_width=2, fillcolor=CLEAR),
)
ANSWER_OUTLINE = (
    dict(line_color="white", line_width=4, fillcolor=CLEAR),
    dict(line_color="seagreen", line_width=2, line_dash="dot", fillcolor=CLEAR),
)


def frame_positions(fig: go.Figure, x0: float, x1: float, label: str, side: str, style: Sequence[dict]) -> None:
    """A rectangle over [x0, x1] on the position axis of every subplot, drawn as the layers of
    `style` from the bottom up, and labelled at its top `side` on the first (top) panel: what
    fig.add_vrect draws, added in one layout update (add_vrect validates the whole layout once per
    subplot, about 20 ms a call on a four-panel figure)."""
    axes = [(axis.plotly_name.replace("axis", ""), axis.anchor or "y") for axis in fig.select_xaxes()] or [("x", "y")]
    shapes = [
        dict(type="rect", xref=x, yref=f"{y} domain", x0=x0, x1=x1, y0=0, y1=1, **layer)
        for layer in style
        for x, y in axes
    ]
    labels = [
        dict(
            text=label,
            showarrow=False,
            xref=x,
            yref=f"{y} domain",
            x=x0 if side == "left" else x1,
            y=1,
            xanchor=side,
            yanchor="top",
            xshift=4 if side == "left" else -4,  # clear of the frame's line
            yshift=-2,
        )
        for x, y in axes[:1]  # once, on the top panel: a label on every panel would hide the data under it
    ]
    fig.update_layout(shapes=[*fig.layout.shapes, *shapes], annotations=[*fig.layout.annotations, *labels])


def outline_evidence(
    fig: go.Figure, spans: Sequence[Sequence[int]], start: int = 0, stop: float = float("inf")
) -> None:
    """Frame the evidence spans [a, b) of token positions within [start, stop): an outline, never a
    fill, so the data under it keeps its colours."""
    for a, b in spans:
        if b > start and a < stop:
            frame_positions(fig, max(a, start) - 0.5, min(b, stop) - 0.5, "evidence", "left", EVIDENCE_OUTLINE)


def answer_positions(trace: Trace) -> tuple[int, int] | None:
    """The positions whose next-token loss is the appended answer's, [a, b): from the token
    before the answer to the one before its last; None without an answer."""
    answer = trace.meta.get("answer")
    return (answer[0] - 1, answer[1] - 1) if answer else None


def outline_answer(fig: go.Figure, trace: Trace, start: int = 0, stop: float = float("inf")) -> None:
    """Frame the positions that predict the appended answer (dotted, apart from the evidence)."""
    span = answer_positions(trace)
    if span is not None and span[1] > start and span[0] < stop:
        frame_positions(fig, max(span[0], start) - 0.5, min(span[1], stop) - 0.5, "answer", "right", ANSWER_OUTLINE)


def answer_loss_note(trace: Trace) -> str:
    """ "the answer's n token(s): x nats a token", or "" for a trace without an answer."""
    span = answer_positions(trace)
    if span is None:
        return ""
    loss = float(np.mean(trace["loss"][span[0] : span[1]]))
    return f"the answer's {span[1] - span[0]} token(s): {loss:.2f} nats a token"


def hover_text(trace: Trace, positions: np.ndarray, bin_size: int) -> list[str]:
    if bin_size == 1:
        return [f"{p}: {trace.token_text(int(p), int(p) + 1)[0]!r}" for p in positions]
    return [f"{p}-{p + bin_size - 1} (max of {bin_size})" for p in positions]


def window_of(trace: Trace, start: int, stop: int | None) -> tuple[int, int]:
    return position_window(start, stop, len(trace))


def line_mode(points: int) -> str:
    """A line over two points or more; a single point (a one-token input or zoom) as a marker, which a line
    of one point would not draw."""
    return "lines" if points > 1 else "markers"


def timeline(
    trace: Trace,
    names: dict[str, str],
    title: str,
    width: int = WIDTH,
    start: int = 0,
    stop: int | None = None,
) -> go.Figure:
    """Per-token scalars (arrays [pos], or [pos, k] averaged over k: `Trace.series`) as stacked line panels, one
    per `names` entry {hook name: label}, sharing the position axis. Where a point pools several tokens the line
    is their mean (so its centre is the text's) and a band spans their min to max (so spikes and dips survive)."""
    start, stop = window_of(trace, start, stop)
    broken = {name: non_finite_within(trace, name, stop) for name in names}
    fig = make_subplots(
        rows=len(names),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        subplot_titles=[
            label + (f" (not finite from token {broken[name]:,})" if broken[name] is not None else "")
            for name, label in names.items()
        ],
    )
    size = 1
    for row, name in enumerate(names, start=1):
        values = np.full(len(trace), np.nan)  # averaged over heads and channels in the window only
        values[start:stop] = trace.series(name, start, stop)
        series = with_array(trace, name, values)
        mean = series.pool(name, width, start, stop, reduce="mean")
        size = mean.bin_size
        if size == 1:
            hover: dict = dict(hovertext=hover_text(trace, mean.positions, 1), hoverinfo="text+y")
        else:  # numbers, not a string a bin: plotly sends arrays as they are and validates strings one by one
            low, high = (series.pool(name, width, start, stop, reduce=r).values for r in ("min", "max"))
            ends = np.minimum(mean.positions + size, stop)  # the last bin may hold fewer tokens
            hover = dict(
                customdata=np.stack([ends - 1, low, high, ends - mean.positions], axis=-1),
                hovertemplate="%{x}-%{customdata[0]}: mean of %{customdata[3]} %{y:.3g}; "
                "min %{customdata[1]:.3g}, max %{customdata[2]:.3g}<extra></extra>",
            )
        fig.add_trace(
            go.Scatter(
                x=mean.positions,
                y=mean.values,
                mode=line_mode(len(mean.values)),
                name=names[name],
                line_color=LINE_COLOUR,
                **hover,
            ),
            row=row,
            col=1,
        )
        if size > 1:  # the band: one shape per run of bins with values, along its top edge and back its bottom
            band_x, band_y = band_outline(mean.positions, low, high)
            fig.add_trace(
                go.Scatter(
                    x=band_x,
                    y=band_y,
                    mode="lines",
                    line_width=0,
                    fill="toself",
                    fillcolor=BAND_COLOUR,
                    hoverinfo="skip",
                    name=f"{names[name]} range",
                ),
                row=row,
                col=1,
            )
        first = broken[name]
        if first is not None:
            mark_non_finite(fig, max(first, start), row)
    outline_evidence(fig, trace.meta.get("evidence", []), start, stop)
    fig.update_layout(title=title, showlegend=False, height=160 + 170 * len(names))
    fig.update_xaxes(title_text=position_axis(size, "mean", band=True), row=len(names), col=1)
    return fig


def band_outline(x: np.ndarray, low: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The outline of the band between `low` and `high` over `x`: for each run of bins where both are finite, its
    top edge then its bottom edge backwards, runs apart by NaN (plotly closes each piece of a "toself" fill on
    itself, so a bin without values must end one shape, not join a top edge to a bottom one)."""
    finite = np.isfinite(low) & np.isfinite(high)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], finite.astype(np.int8), [0]])))
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    gap = np.array([np.nan])
    for a, b in zip(edges[::2], edges[1::2]):
        xs += [x[a:b], x[a:b][::-1], gap]
        ys += [high[a:b], low[a:b][::-1], gap]
    if not xs:
        return np.array([]), np.array([])
    return np.concatenate(xs[:-1]).astype(np.float64), np.concatenate(ys[:-1]).astype(np.float64)


def position_axis(bin_size: int, reduce: str, band: bool = False) -> str:
    """The position axis's title, saying when each point pools several tokens and how (`band`: a line's band
    spans each bin's min to max)."""
    if bin_size <= 1:
        return "token position"
    spans = "; the band spans its min to max" if band else ""
    return f"token position (pooled: the {reduce} over each bin of {bin_size:,} tokens{spans})"


def position_heatmap(
    trace: Trace,
    name: str,
    title: str,
    row_label: str,
    width: int = WIDTH,
    start: int = 0,
    stop: int | None = None,
    colorscale: str = "Viridis",
    zmin: float | None = None,
    zmax: float | None = None,
    reduce: str = "max",
) -> go.Figure:
    """An array [pos, k] as a heatmap: rows k (slots, heads), columns pooled token positions (`reduce`
    over each bin: "max", or "min" where low values are the events)."""
    start, stop = window_of(trace, start, stop)
    pooled = trace.pool(name, width, start, stop, reduce)
    z = pooled.values.reshape(len(pooled.values), -1).T
    hover = hover_text(trace, pooled.positions, pooled.bin_size)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=pooled.positions,
            y=list(range(z.shape[0])),
            colorscale=colorscale,
            zmin=zmin,
            zmax=zmax,
            customdata=np.broadcast_to(np.asarray(hover, dtype=object), z.shape),
            hovertemplate=f"%{{customdata}}<br>{row_label} %{{y}}<br>%{{z:.3g}}<extra></extra>",
        )
    )
    outline_evidence(fig, trace.meta.get("evidence", []), start, stop)
    broken = non_finite_within(trace, name, stop)
    if broken is not None:
        title += f"<br><sub>not finite from token {broken:,} (NaN or infinite: no colour)</sub>"
        mark_non_finite(fig, max(broken, start))
    fig.update_layout(title=title, xaxis_title=position_axis(pooled.bin_size, reduce), yaxis_title=row_label)
    return fig


def non_finite_within(trace: Trace, name: str, stop: int) -> int | None:
    """The first token before `stop` where array `name` is not finite, or None."""
    first = trace.non_finite_from(name)
    return first if first is not None and first < stop else None


def mark_non_finite(fig: go.Figure, position: int, row: int | None = None) -> None:
    """A dashed red line where a quantity stops being finite (in subplot `row`, or the only plot)."""
    where = dict(row=row, col=1) if row is not None else {}
    fig.add_vline(x=position - 0.5, line_color="crimson", line_width=1, line_dash="dash", **where)


def layer_names(trace: Trace, generic: str) -> list[str]:
    """The trace's hook names of the generic form `generic` (e.g. "blocks.{l}.attn.hook_gate"),
    in layer order."""
    found = [n for n in trace.names if generic_hook_name(n) == generic]
    return sorted(found, key=lambda n: [int(p) if p.isdigit() else p for p in n.split(".")])


def layer_prefix(name: str, generic: str) -> str:
    """The part of a concrete hook name before the generic name's last component:
    layer_prefix("blocks.2.attn.hook_gate", "blocks.{l}.attn.hook_gate") -> "blocks.2.attn"."""
    return name[: len(name) - len(generic.rsplit(".", 1)[1]) - 1]


def with_array(trace: Trace, name: str, values: np.ndarray) -> Trace:
    """A view of `trace` with one more (derived) array, for pooling and plotting."""
    return Trace(trace.tokens, {**trace.arrays, name: values}, trace.vocab, trace.meta)


def memory_share(trace: Trace, prefix: str) -> np.ndarray:
    """Per token and head, a gated memory's share of the mixed output norm, for a layer whose
    output is g A_mem + (1 - g) A_local (Infini-attention's eq. 6, Gated DeltaNet's mix here):
    g |A_mem| / (g |A_mem| + (1 - g) |A_local|), from the norm-reduced `hook_mem_out` and `hook_local_out`."""
    g = trace[f"{prefix}.hook_gate"]
    mem, local = trace[f"{prefix}.hook_mem_out"], trace[f"{prefix}.hook_local_out"]
    num = g * mem
    return num / np.maximum(num + (1 - g) * local, 1e-12)


def memory_share_heatmaps(
    trace: Trace, gate: str, width: int = WIDTH, start: int = 0, stop: int | None = None
) -> dict[str, go.Figure]:
    """`memory_share` per layer of the generic gate hook `gate`, as heatmaps over tokens and heads."""
    figs = {}
    for prefix in (layer_prefix(n, gate) for n in layer_names(trace, gate)):
        figs[f"{prefix} memory share"] = position_heatmap(
            with_array(trace, "share", memory_share(trace, prefix)),
            "share",
            f"{prefix}: memory share of each head's output",
            "head",
            zmin=0,
            zmax=1,
            colorscale="RdBu_r",
            width=width,
            start=start,
            stop=stop,
        )
    return figs


def delta_rule_rate_heatmaps(
    trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None
) -> dict[str, go.Figure]:
    """A gated delta rule's decay alpha and write strength beta over tokens and heads, per layer
    (`blocks.{l}.attn.hook_alpha` / `hook_beta`: memviz's Gated DeltaNet and the released hybrids'); a decay per
    key channel [pos, head, d_k] gets a row per head and channel."""
    alpha = "blocks.{l}.attn.hook_alpha"
    figs: dict[str, go.Figure] = {}
    for name in layer_names(trace, alpha):
        prefix = layer_prefix(name, alpha)
        layer = prefix.split(".attn")[0]
        for key, hook, title, reduce in (  # a decay's events are its dips, a write's its peaks
            ("alpha", name, "decay alpha (1 keeps the state)", "min"),
            ("beta", f"{prefix}.hook_beta", "write strength beta", "max"),
        ):
            values = trace[hook]
            rows = "head" if values.ndim == 2 else "head x d_k + key channel"  # a decay per key channel: every one
            most = 2 if np.nanmax(values, initial=0) > 1 else 1  # a beta in (0, 2) allows a negative eigenvalue
            figs[f"{layer} {key}"] = position_heatmap(
                trace,
                hook,
                f"{layer}: {title}",
                rows,
                zmin=0,
                zmax=most,
                width=width,
                start=start,
                stop=stop,
                reduce=reduce,
            )
    return figs


def table_figure(columns: dict[str, Sequence], title: str) -> go.Figure:
    """Rows of text and numbers as a plotly table (one entry per column name), sized to its rows."""
    rows = len(next(iter(columns.values()), ()))
    fig = go.Figure(
        go.Table(
            header={"values": list(columns), "align": "left", "fill_color": "#e8eef7"},
            cells={"values": [list(values) for values in columns.values()], "align": "left", "height": 24},
        )
    )
    fig.update_layout(title=title, height=140 + 26 * min(rows, 20), margin={"t": 60, "b": 10})
    return fig
