"""A logit lens on memory reads: the logits a memory's read at one token gives alone, pushed through the rest of the
model, and each writer's part of them.

The read at token t of layer l is split exactly over the tokens that wrote it (`memviz.protocol.Readout`, from the
family's `memory_readout`): o_t = sum_j o_t^(j) (+ what the memory's initial state gives). The family's `read_path`
(`memviz.protocol.ReadPath`) gives the path from a read to the logits at t with every scale frozen at t, as
TransformerLens freezes a norm's scale for direct logit attribution (nostalgebraist's logit lens, and Elhage et al.
2021's direct path): the layer's read norm and gates as a diagonal per head, its mix and output projection, the
final norm's scale and the unembedding W_U. The path is then linear, so

    lens(o_t) = W_U (g_final / rms(x_t)) W_out D_t o_t = sum_j lens(o_t^(j)),

each writer's logit shift in closed form (WriteSAE, arXiv 2605.12770, predicts a write's effect the same way), and
the writers' shifts add up to the read's. The lens says what the read pushes the residual stream towards at its
own token; the layers after the memory can still change what the model does with it (this is the direct path
only). Logits are centred over the vocabulary (a softmax ignores a shift shared by every token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from torch import Tensor

from memviz.protocol import MemoryModel, ReadPath, ReadsThrough, Tokens
from memviz.registry import reads_out, reads_through

#: writers a lens lists and draws, by the size of their summed shift on the read's promoted tokens
WRITERS = 12
#: tokens the read promotes that a lens lists
PROMOTED = 10


def frozen_scale(out: Tensor, inp: Tensor) -> Tensor:
    """The diagonal map an elementwise-scaling step (an RMS norm, a gate) applied at one token: out / inp, with the
    scale it computed frozen; 0 where the input is exactly 0 (nothing there to scale)."""
    out, inp = out.double(), inp.double()
    return torch.where(inp != 0, out / torch.where(inp != 0, inp, 1.0), 0.0)


def head_blocks(weight: Tensor, heads: int) -> Tensor:
    """An output projection's weight [d_model, heads * d] as per-head maps [heads, d, d_model]."""
    d_model, inner = weight.shape
    if inner % heads:
        raise ValueError(f"an output projection of {inner} inputs does not split into {heads} heads")
    return weight.detach().to("cpu", torch.float64).T.reshape(heads, inner // heads, d_model)


def check_position(n_tokens: int, position: int) -> None:
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or not 0 <= position < n_tokens:
        raise ValueError(f"position must be a token index in [0, {n_tokens}), got {position!r}")


def captured_at(model: MemoryModel, tokens: Tokens, position: int, names: Sequence[str]) -> dict[str, Tensor]:
    """The hooks `names` at token `position` (float64), from a run over the tokens up to it."""
    ids = model.as_tokens(tokens)
    check_position(ids.shape[1], position)
    return {name: value[position] for name, value in model.capture(ids[:, : position + 1], names).items()}


def last_residual(model: MemoryModel) -> str:
    """The hook of the residual stream the final norm reads."""
    return f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"


def path_reader(model: MemoryModel) -> ReadsThrough:
    """The model as one that gives a read path, or one error saying why it cannot."""
    through = reads_through(model)
    if through is None:
        raise ValueError(
            f"the {model.family} family gives no path from its memory's reads to the logits (Family.read_lens): "
            "its read does not reach the residual stream through a map that a frozen scale makes linear"
        )
    return through


def read_path_of(model: MemoryModel, tokens: Tokens, position: int) -> ReadPath:
    """The model's frozen path at `position` (`ReadsThrough.read_path`), or one error saying why there is none."""
    through = path_reader(model)
    check_position(model.as_tokens(tokens).shape[1], position)
    path = through.read_path(tokens, position)
    if path is None:
        raise ValueError(f"this {model.family} model's setting has no linear path from its read to the logits")
    return path


def read_logits(model: MemoryModel, tokens: Tokens, position: int, layer: int, reads: Tensor) -> Tensor:
    """The logits [n, vocab] that reads [n, head, d_read] at memory layer `layer` give at token `position` of
    `tokens`, through the layer's output path, the final norm frozen at that token, and the unembedding."""
    return read_path_of(model, tokens, position).logits(f"blocks.{layer}", reads)


def logit_shifts(path: ReadPath, layer: str, reads: Tensor, tokens: Tensor, centre: Tensor | None = None) -> Tensor:
    """The centred logit shifts [n, tokens] that reads [n, head, d_read] at `layer` give on the token ids `tokens`;
    `centre` is `path.centre()`, passed where it is already at hand."""
    centre = path.centre() if centre is None else centre
    residual = path.residual(layer, reads)
    return path.unembedded(residual, tokens) - (residual * path.final_scale) @ centre[:, None]


@dataclass
class LayerLens:
    """One memory layer's lens at a token: `logits` [vocab], the read's (centred); `promoted`, the tokens it pushes
    up most (rank, token_id, token, logit); `writers`, the tokens whose writes shift those most (position, token,
    shift: their summed logit shift on the promoted tokens, the largest in size first, read_share: their part of
    the read vector projected on it (mean over heads), promotes: their own top tokens);
    `shifts` [writer row, promoted token], each listed writer's logit shift on each promoted token, with the rest of
    the writers and the initial state as the last two rows, so every column sums to the read's logit."""

    layer: str
    logits: np.ndarray
    promoted: pd.DataFrame
    writers: pd.DataFrame
    shifts: pd.DataFrame


@dataclass
class ReadLens:
    """The lens on every memory layer's read at token `position` of a text."""

    position: int
    token: str
    layers: dict[str, LayerLens]


def token_texts(model: MemoryModel, ids: Sequence[int]) -> list[str]:
    return [model.tokenizer.decode([int(i)]) for i in ids]


def distinct_labels(texts: Sequence[str], ids: Sequence[int]) -> list[str]:
    """Tokens as axis labels, repr'd, with the id beside those whose text another shares (a plotly axis merges
    equal labels)."""
    labels = [repr(t) for t in texts]
    return [f"{label} #{i}" if labels.count(label) > 1 else label for label, i in zip(labels, ids)]


def read_lens(
    model: MemoryModel, tokens: Tokens, position: int, promoted: int = PROMOTED, writers: int = WRITERS
) -> ReadLens:
    """The logit lens on each memory layer's read at token `position` (module docstring): the tokens the read
    promotes, and the writers that push them."""
    for name, value in (("promoted", promoted), ("writers", writers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
    if reads_out(model) is None:
        raise ValueError(f"the {model.family} family does not split its reads over their writers (Family.readout)")
    ids = model.as_tokens(tokens)
    if ids.shape[0] != 1:
        raise ValueError(f"the read lens reads one sequence at a time, got a batch of {ids.shape[0]}")
    path_reader(model)
    check_position(ids.shape[1], position)
    readout = reads_out(model).memory_readout(ids, position)  # type: ignore[union-attr]
    if readout is None:
        raise ValueError(f"this {model.family} model's setting has no exact split of its read over writers")
    path = read_path_of(model, ids, position)
    row = ids[0].tolist()
    centre = path.centre()
    layers = {}
    for layer, parts in readout.parts.items():
        if layer not in path.layers or (not len(parts) and layer not in readout.initial):
            continue  # no write has reached this layer's memory yet, and it starts from nothing
        parts = parts.double()
        initial = readout.initial.get(layer, torch.zeros(parts.shape[1:], dtype=torch.float64)).double()
        read = parts.sum(0) + initial
        logits = path.logits(layer, read[None])[0]
        logits = logits - logits.mean()
        top = torch.topk(logits, min(promoted, logits.numel())).indices
        top_ids = top.tolist()

        shift = logit_shifts(path, layer, parts, top, centre)
        initial_shift = logit_shifts(path, layer, initial[None], top, centre)
        order = torch.argsort(shift.sum(1).abs(), descending=True)[: min(writers, len(shift))]
        rest = torch.ones(len(shift), dtype=torch.bool)
        rest[order] = False
        own = path.logits(layer, parts[order])
        own = own - own.mean(1, keepdim=True)
        shares = readout.shares(layer).double().mean(1) if len(parts) else torch.zeros(0)
        names = token_texts(model, top_ids)
        layers[layer] = LayerLens(
            layer=layer,
            logits=logits.numpy(),
            promoted=pd.DataFrame(
                {"rank": range(1, len(top_ids) + 1), "token_id": top_ids, "token": names, "logit": logits[top].numpy()}
            ),
            writers=pd.DataFrame(
                {
                    "position": order.tolist(),
                    "token": token_texts(model, [row[j] for j in order.tolist()]),
                    "shift": shift[order].sum(1).numpy(),
                    "read_share": shares[order].numpy(),
                    "promotes": [
                        " ".join(repr(t) for t in token_texts(model, torch.topk(o, min(5, len(o))).indices.tolist()))
                        for o in own
                    ],
                }
            ),
            shifts=pd.DataFrame(
                torch.cat([shift[order], shift[rest].sum(0, keepdim=True), initial_shift]).numpy(),
                index=[
                    *(f"{j}: {model.tokenizer.decode([row[j]])!r}" for j in order.tolist()),
                    "every other writer",
                    "the initial state",
                ],
                columns=distinct_labels(names, top_ids),
            ),
        )
    if not layers:
        raise ValueError(
            f"at token {position} no write has reached any memory layer of this {model.family} model yet (a "
            "segment's writes arrive when it completes): pick a later token"
        )
    return ReadLens(position, model.tokenizer.decode([row[position]]), layers)


def read_lens_figure(lens: LayerLens, position: int | None = None) -> go.Figure:
    """Writers (rows) by the tokens the read promotes (columns): each writer's logit shift, the read's own logit
    in the top row; red pushes a token up."""
    shifts = lens.shifts
    z = np.vstack([lens.promoted["logit"].to_numpy()[None], shifts.to_numpy()])
    rows = ["the read (sum of the rows below)", *shifts.index]
    bound = float(np.abs(z).max()) or 1.0
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=list(shifts.columns),
            y=rows,
            zmin=-bound,
            zmax=bound,
            colorscale="RdBu_r",
            colorbar=dict(title="logit"),
            hovertemplate="%{y}<br>token %{x}: %{z:.3f}<extra></extra>",
        )
    )
    at = f" at token {position}" if position is not None else ""
    fig.update_layout(
        title=f"{lens.layer}: what the memory's read{at} promotes, and who wrote it",
        xaxis_title="the tokens the read pushes up most (centred logits through the rest of the model)",
        yaxis=dict(autorange="reversed"),
        height=max(300, 26 * len(rows) + 140),
    )
    return fig


def read_lens_figures(lens: ReadLens) -> dict[str, go.Figure]:
    """`read_lens_figure` per memory layer."""
    return {f"{name} read lens": read_lens_figure(layer, lens.position) for name, layer in lens.layers.items()}
