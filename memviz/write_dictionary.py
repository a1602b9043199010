"""A dictionary of rank-1 writes: sparse atoms u w^T that a linear memory's writes are made of (WriteSAE).

"WriteSAE: Sparse Autoencoders for Recurrent State" (arXiv 2605.12770) learns, per layer and head, a sparse
autoencoder whose decoder atoms have the shape of the write itself: Gated DeltaNet, Kimi Delta Attention, Mamba-2 and
mLSTM add a rank-1 matrix W_t = beta_t k_t v_t^T [d_k, d_v] to each head's state at every token (DESIGN.md's
"Released memories"), which no vector atom can stand for. Here, per head h of one layer:

  pre_j(W) = <W, e_j f_j^T>_F + b_j = beta (k . e_j)(v . f_j) + b_j        the paper's bilinear encoder
  a        = TopK(ReLU(pre(W / c_h)))                                     k atoms a write
  W_hat    = c_h sum_j a_j u_j w_j^T,  |u_j| = |w_j| = 1                   rank-1 decoder atoms
  loss     = ||W / c_h - W_hat / c_h||_F^2                                c_h^2 the head's mean ||W||_F^2

A dictionary per head, as the paper's (layer, head) cells: each head writes with its own key and value projections,
so directions carry no shared meaning across heads, and an atom's value direction is read by its own head only.
A write is a sum of rank-1 terms (one for a captured write), so every quantity is computed from the factors:
<W, u w^T>_F = sum_r (k_r . u)(v_r . w), ||W||_F^2 = sum_{r,s} (k_r . k_s)(v_r . v_s); no d_k x d_v matrix is formed
per token. After each Adam step the atoms are renormalised; an atom that fired on no write for `resample_every` steps
is reinitialised to the top singular pair of the worst-reconstructed write's residual (itself a sum of rank-1 terms,
found by power iteration on the factors). `train_dictionary` trains; `save_dictionary` / `load_dictionary` keep one as
safetensors and a card.json; `atom_table` and `atom_figures` say what each atom fires on.
"""

from __future__ import annotations

import inspect
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
import torch.nn.functional as F
from torch import Tensor

from memviz.figure_parts import WIDTH
from memviz.files import atomic_write_bytes, atomic_write_text, check_regular_file
from memviz.protocol import MemoryModel, Progress
from memviz.running import check_progress
from memviz.tracing import MAX_TRACE_TOKENS

#: the hooks (`blocks.{l}.attn.hook_<part>`) a layer's writes are read from: W_t = beta_t k_t v_t^T
WRITE_PARTS = ("write_key", "write_value", "beta")
WEIGHTS_FILE, CARD_FILE = "dictionary.safetensors", "card.json"
#: the tensors of a saved dictionary, each [head, atom, ...]: decoder u, w; encoder e, f; bias b; the writes' scale c
TENSORS = ("u", "w", "encoder_u", "encoder_w", "bias", "scale")
MAX_DICTIONARY_BYTES = 2 * 2**30
#: the largest dictionary trained here: atoms a head
MAX_ATOMS = 65_536


#: writes a head holds back at the least, so that their spread is measured
MIN_HELD_BACK = 8


class WriteDictionaryError(ValueError):
    """A saved dictionary that cannot be read as one; the message names the file and the field."""


@dataclass
class Writes:
    """One layer's writes W_t = strength_t key_t value_t^T over a text: `keys` [pos, head, d_k], `values`
    [pos, head, d_v], `strengths` [pos, head] (beta_t, Mamba's dt_t, mLSTM's i_t), with the text's `tokens` and
    each token's text."""

    keys: Tensor
    values: Tensor
    strengths: Tensor
    tokens: np.ndarray
    token_text: list[str]
    layer: int

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_heads(self) -> int:
        return self.keys.shape[1]

    def factors(self, heads: Sequence[int], start: int = 0, stop: int | None = None) -> tuple[Tensor, Tensor]:
        """The writes at positions [start, stop) of `heads` as one rank-1 term each: key factors
        strength k [head, pos, 1, d_k] and value factors v [head, pos, 1, d_v], in float32."""
        index = list(heads)
        keys = self.keys[start:stop, index] * self.strengths[start:stop, index, None]
        values = self.values[start:stop, index]
        return (
            keys.transpose(0, 1)[:, :, None].float().contiguous(),
            values.transpose(0, 1)[:, :, None].float().contiguous(),
        )


def write_hooks(layer: int) -> list[str]:
    return [f"blocks.{layer}.attn.hook_{part}" for part in WRITE_PARTS]


def layers_with_writes(model: MemoryModel) -> list[int]:
    """The layers whose hooks give a matrix write (`hook_write_key`, `hook_write_value` and `hook_beta`, read from
    the model's `hook_dict`, with d_k and d_v above 1 on a one-token run): an RG-LRU's scalar writes and Mamba-1's
    per-channel vectors have no rank-1 atoms to learn."""
    found = {int(m[1]) for name in model.hook_dict if (m := re.fullmatch(r"blocks\.(\d+)\.attn\.hook_write_key", name))}
    hooked = sorted(l for l in found if all(n in model.hook_dict for n in write_hooks(l)))
    if not hooked:
        return []
    names = [f"blocks.{l}.attn.hook_write_{part}" for l in hooked for part in ("key", "value")]
    shapes = {name: value.shape for name, value in model.capture([[0]], names).items()}
    return [
        l
        for l in hooked
        if shapes[f"blocks.{l}.attn.hook_write_key"][-1] > 1 and shapes[f"blocks.{l}.attn.hook_write_value"][-1] > 1
    ]


def capture_writes(
    model: MemoryModel,
    text: str | Sequence[int],
    layer: int,
    max_tokens: int = MAX_TRACE_TOKENS,
    progress: Progress | None = None,
) -> Writes:
    """`layer`'s writes at every token of `text`, streamed through `memviz.trace` (bounded memory). ValueError for a
    layer without writes, naming those with them."""
    from memviz.tracing import trace

    having = layers_with_writes(model)
    if not having:
        raise ValueError(
            f"this {model.family} model has no layer with writes (hooks blocks.{{l}}.attn.hook_write_key, "
            "hook_write_value and hook_beta)"
        )
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or int(layer) not in having:
        raise ValueError(f"layer must be one of the layers with writes {having}, got {layer!r}")
    names = write_hooks(int(layer))
    tr = trace(model, text, names={n: "none" for n in names}, max_tokens=max_tokens, progress=progress)
    keys, values, strengths = (torch.from_numpy(np.ascontiguousarray(tr[n])) for n in names)
    if keys.dim() != 3 or values.dim() != 3 or strengths.shape != keys.shape[:2] or values.shape[:2] != keys.shape[:2]:
        raise ValueError(
            f"layer {layer}'s write hooks have shapes {tuple(keys.shape)}, {tuple(values.shape)}, "
            f"{tuple(strengths.shape)}, not [pos, head, d_k], [pos, head, d_v], [pos, head]"
        )
    return Writes(keys, values, strengths, tr.tokens, tr.token_text(), int(layer))


@dataclass
class WriteDictionary:
    """Per head of one layer, `n` rank-1 atoms u_j w_j^T (`u` [head, n, d_k], `w` [head, n, d_v], unit rows), the
    bilinear encoder (`encoder_u` [head, n, d_k], `encoder_w` [head, n, d_v], `bias` [head, n]), the writes' scale c
    [head] and `k` atoms a write (module docstring). `heads` names the layer's heads the rows stand for."""

    u: Tensor
    w: Tensor
    encoder_u: Tensor
    encoder_w: Tensor
    bias: Tensor
    scale: Tensor
    k: int
    heads: list[int]
    card: dict[str, Any] = field(default_factory=dict)

    @property
    def n_atoms(self) -> int:
        return self.u.shape[1]

    def pre_activations(self, keys: Tensor, values: Tensor) -> Tensor:
        """<W / c, e_j f_j^T>_F + b_j [head, write, atom] of writes given as rank-1 terms, keys [head, write, term,
        d_k] and values [head, write, term, d_v]: sum_r (k_r . e_j)(v_r . f_j) / c + b_j."""
        heads, n_writes, terms = keys.shape[:3]
        along_keys = keys.reshape(heads, n_writes * terms, -1) @ self.encoder_u.transpose(1, 2)
        along_values = values.reshape(heads, n_writes * terms, -1) @ self.encoder_w.transpose(1, 2)
        products = (along_keys * along_values).reshape(heads, n_writes, terms, -1).sum(2)
        return products / self.scale[:, None, None] + self.bias[:, None]

    def encode(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The k atoms of each write and their activations TopK(ReLU(pre)): (indices, activations), each [head,
        write, k], largest first. The activations are recomputed from the chosen atoms' encoder rows alone, so a
        gradient flows through k atoms a write, not all of them."""
        with torch.no_grad():
            indices = self.pre_activations(keys, values).topk(self.k, dim=-1).indices
        heads = torch.arange(len(self.heads))[:, None, None]
        e, f = self.encoder_u[heads, indices], self.encoder_w[heads, indices]  # [head, write, k, d]
        chosen = (dots(keys, e) * dots(values, f)).sum(2)
        return indices, F.relu(chosen / self.scale[:, None, None] + self.bias[heads, indices])

    def squared_errors(
        self, keys: Tensor, values: Tensor, indices: Tensor, activations: Tensor, energy: Tensor | None = None
    ) -> Tensor:
        """||W / c - sum_j a_j u_j w_j^T||_F^2 [head, write] from the factors (module docstring); `energy`, the
        writes' ||W||_F^2 [head, write], where known."""
        if energy is None:
            energy = energies(keys, values)
        keys = keys / self.scale[:, None, None, None]
        heads = torch.arange(len(self.heads))[:, None, None]
        u, w = self.u[heads, indices], self.w[heads, indices]  # [head, write, k, d]
        cross = (dots(keys, u) * dots(values, w)).sum(2)  # <W, u_j w_j^T>
        gram = dots(u, u) * dots(w, w)
        fitted = torch.einsum("hbi,hbij,hbj->hb", activations, gram, activations)
        return energy / self.scale[:, None] ** 2 - 2 * (activations * cross).sum(-1) + fitted

    def atoms(self) -> Tensor:
        """The atoms as matrices [head, n, d_k, d_v] (for looking; training never forms them)."""
        return self.u[..., :, None] * self.w[..., None, :]

    def normalise(self) -> None:
        with torch.no_grad():
            self.u.copy_(F.normalize(self.u, dim=-1))
            self.w.copy_(F.normalize(self.w, dim=-1))


def dots(a: Tensor, b: Tensor) -> Tensor:
    """Every row of a [..., m, d] with every row of b [..., n, d]: [..., m, n] (broadcast products summed: a batched
    matrix product of many tiny matrices is many times slower on the CPU)."""
    return (a[..., :, None, :] * b[..., None, :, :]).sum(-1)


def energies(keys: Tensor, values: Tensor) -> Tensor:
    """||W||_F^2 [head, write] of writes given as rank-1 terms."""
    return ((keys @ keys.transpose(-1, -2)) * (values @ values.transpose(-1, -2))).sum((-1, -2))


def top_singular_pairs(
    keys: Tensor, values: Tensor, generator: torch.Generator, iterations: int = 30
) -> tuple[Tensor, Tensor]:
    """The top singular pair (u, w) of each matrix W = sum_r k_r v_r^T given by its factors keys [..., term, d_k]
    and values [..., term, d_v], by power iteration on the factors: u <- W w = sum_r k_r (v_r . w),
    w <- W^T u = sum_r v_r (k_r . u)."""
    w = F.normalize(torch.randn(values.shape[:-2] + values.shape[-1:], generator=generator, dtype=values.dtype), dim=-1)
    u = torch.zeros(keys.shape[:-2] + keys.shape[-1:], dtype=keys.dtype)
    for _ in range(iterations):
        u = F.normalize((keys * (values @ w[..., None])).sum(-2), dim=-1)
        w = F.normalize((values * (keys @ u[..., None])).sum(-2), dim=-1)
    return u, w


@dataclass
class Training:
    """What `train_dictionary` measured: per head, the explained variance 1 - sum ||W - W_hat||^2 / sum ||W - W_mean||^2
    and the relative error sum ||W - W_hat||^2 / sum ||W||^2 on the held-back writes, and the atoms that fire on no
    training write."""

    explained_variance: list[float]
    relative_error: list[float]
    dead_atoms: list[int]
    resampled: int
    held_back_writes: int
    seconds: float
    losses: list[float]


def check_whole(value: Any, name: str, low: int, high: int | None = None) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < low
        or (high is not None and value > high)
    ):
        bound = f"from {low:,} to {high:,}" if high is not None else f"at least {low:,}"
        raise ValueError(f"{name} must be a whole number {bound}, got {value!r}")
    return int(value)


def factor_batches(keys: Tensor, values: Tensor, size: int):
    for start in range(0, keys.shape[1], size):
        yield keys[:, start : start + size], values[:, start : start + size]


@torch.no_grad()
def evaluate(
    dictionary: WriteDictionary, keys: Tensor, values: Tensor, batch: int = 4096
) -> tuple[list[float], list[float]]:
    """Per head, the explained variance and the relative error (`Training`) of the writes keys [head, write, term,
    d_k], values [head, write, term, d_v]."""
    errors = torch.zeros(len(dictionary.heads), dtype=torch.float64)
    energy = torch.zeros(len(dictionary.heads), dtype=torch.float64)
    for k, v in factor_batches(keys, values, batch):
        errors += dictionary.squared_errors(k, v, *dictionary.encode(k, v)).double().clamp_min(0).sum(1)
        energy += energies(k, v).double().sum(1) / dictionary.scale.double() ** 2
    mean = (
        torch.einsum("hbrk,hbrv->hkv", keys.double(), values.double())
        / keys.shape[1]
        / dictionary.scale.double()[:, None, None]
    )
    spread = energy - keys.shape[1] * mean.pow(2).sum((-1, -2))
    explained = [1 - float(e / v) if v > 1e-9 * float(n) else float("nan") for e, v, n in zip(errors, spread, energy)]
    return explained, (errors / energy).tolist()


def check_settings(
    n_atoms: Any, k: Any, steps: Any, batch: Any, lr: Any, held_back: Any, resample_every: Any, progress: Any
) -> tuple[int, int, int, int, int]:
    """`train_dictionary`'s settings, each refused by name when out of range; the whole numbers among them as ints
    (n_atoms, k, steps, batch, resample_every)."""
    n_atoms = check_whole(n_atoms, "n_atoms", 1, MAX_ATOMS)
    whole = (n_atoms, check_whole(k, "k", 1, n_atoms), check_whole(steps, "steps", 1), check_whole(batch, "batch", 1))
    resample_every = check_whole(resample_every, "resample_every", 1)
    check_progress(progress)
    if isinstance(held_back, bool) or not isinstance(held_back, (int, float)) or not 0 < held_back < 1:
        raise ValueError(f"held_back must be a share between 0 and 1, got {held_back!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < 1:
        raise ValueError(f"lr must be a positive learning rate below 1, got {lr!r}")
    return (*whole, resample_every)


def train_dictionary(
    keys: Tensor,
    values: Tensor,
    n_atoms: int = 256,
    k: int = 4,
    steps: int = 2000,
    batch: int = 1024,
    lr: float = 3e-3,
    held_back: float = 0.1,
    resample_every: int = 200,
    seed: int = 0,
    heads: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> tuple[WriteDictionary, Training]:
    """Train a dictionary of `n_atoms` rank-1 atoms a head, `k` of them a write, on writes given as rank-1 terms:
    keys [head, write, term, d_k] and values [head, write, term, d_v] (`Writes.factors`; a planted test's writes
    have several terms). The last `held_back` share of the writes (the end of the text) is kept out of training and
    measured. `heads` names the layer's heads the rows are (default 0, 1, ...). `progress(step, steps)`."""
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(
            f"keys and values must be [head, write, term, d_k] and [head, write, term, d_v] with the same first three "
            f"sizes, got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    n_heads, n_writes, _, d_k = keys.shape
    d_v = values.shape[-1]
    if d_k * d_v < 2:
        raise ValueError(f"the writes are scalars (d_k = {d_k}, d_v = {d_v}): there is no matrix to factor")
    n_atoms, k, steps, batch, resample_every = check_settings(
        n_atoms, k, steps, batch, lr, held_back, resample_every, progress
    )
    n_train = n_writes - math.ceil(held_back * n_writes)
    if n_train < k or n_train < 1 or n_writes - n_train < MIN_HELD_BACK:
        raise ValueError(
            f"{n_writes:,} writes leave {n_train:,} to train on and {n_writes - n_train:,} to measure after holding "
            f"back {held_back:.0%}: too few (at least k = {k} and {MIN_HELD_BACK}): give a longer text"
        )
    heads = list(range(n_heads)) if heads is None else [int(h) for h in heads]
    if len(heads) != n_heads:
        raise ValueError(f"heads names {len(heads)} heads for writes of {n_heads}")
    keys, values = keys.float(), values.float()
    if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
        raise ValueError("the writes are not all finite: a diverged memory has no dictionary")
    train_k, train_v = keys[:, :n_train], values[:, :n_train]
    train_energy = energies(train_k, train_v)
    scale = train_energy.mean(1).sqrt().clamp_min(1e-30)
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    # atoms start as the top singular pairs of random training writes (for a rank-1 write, its own k and v)
    first = torch.randint(n_train, (n_heads, n_atoms), generator=generator)
    picked = torch.arange(n_heads)[:, None]
    u, w = top_singular_pairs(train_k[picked, first], train_v[picked, first], generator)
    dictionary = WriteDictionary(
        u.clone().requires_grad_(),
        w.clone().requires_grad_(),
        u.clone().requires_grad_(),
        w.clone().requires_grad_(),
        torch.zeros(n_heads, n_atoms, requires_grad=True),
        scale,
        k,
        heads,
    )
    parameters = [dictionary.u, dictionary.w, dictionary.encoder_u, dictionary.encoder_w, dictionary.bias]
    optimizer = torch.optim.Adam(parameters, lr=lr)
    last_fired = torch.zeros(n_heads, n_atoms, dtype=torch.long)
    resampled, losses = 0, []
    for step in range(1, steps + 1):
        rows = torch.randint(n_train, (n_heads, min(batch, n_train)), generator=generator)
        k_batch, v_batch = train_k[picked, rows], train_v[picked, rows]
        indices, activations = dictionary.encode(k_batch, v_batch)
        errors = dictionary.squared_errors(k_batch, v_batch, indices, activations, train_energy[picked, rows])
        loss = errors.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        dictionary.normalise()
        losses.append(loss.item())
        last_fired[firings(indices, activations, n_atoms) > 0] = step
        if step % resample_every == 0 and step < steps:
            dead = last_fired <= step - resample_every
            resampled += resample(
                dictionary, optimizer, dead, k_batch, v_batch, indices, activations, errors, generator
            )
            last_fired[dead] = step  # a fresh atom gets a whole window to fire
        if progress is not None:
            progress(step, steps)
    u, w, encoder_u, encoder_w, bias = (t.detach().clone() for t in parameters)
    final = WriteDictionary(u, w, encoder_u, encoder_w, bias, scale, k, heads)
    explained, relative = evaluate(final, keys[:, n_train:], values[:, n_train:])
    unused = dead_atoms(final, train_k, train_v)
    seconds = time.perf_counter() - started
    return final, Training(explained, relative, unused, resampled, n_writes - n_train, seconds, losses)


@torch.no_grad()
def resample(
    dictionary: WriteDictionary,
    optimizer: torch.optim.Adam,
    dead_rows: Tensor,
    keys: Tensor,
    values: Tensor,
    indices: Tensor,
    activations: Tensor,
    errors: Tensor,
    generator: torch.Generator,
) -> int:
    """Point each atom marked in `dead_rows` [head, atom] at the top singular pair of the residual
    W - sum_j a_j u_j w_j^T of one of the batch's worst-reconstructed writes (a sum of rank-1 terms); its encoder
    the same, its bias and Adam moments zero. How many were reinitialised."""
    count = 0
    for h in range(len(dictionary.heads)):
        dead = dead_rows[h].nonzero()[:, 0]
        if len(dead) == 0:
            continue
        worst = errors[h].argsort(descending=True)[: len(dead)]
        dead = dead[: len(worst)]
        chosen = indices[h, worst]
        residual_keys = torch.cat(
            [keys[h, worst] / dictionary.scale[h], -activations[h, worst, :, None] * dictionary.u[h, chosen]], 1
        )
        residual_values = torch.cat([values[h, worst], dictionary.w[h, chosen]], 1)
        u, w = top_singular_pairs(residual_keys, residual_values, generator)
        for tensor, new in ((dictionary.u, u), (dictionary.encoder_u, u), (dictionary.w, w), (dictionary.encoder_w, w)):
            tensor[h, dead] = new
        dictionary.bias[h, dead] = 0
        for parameter in (dictionary.u, dictionary.w, dictionary.encoder_u, dictionary.encoder_w, dictionary.bias):
            for moment in optimizer.state.get(parameter, {}).values():
                if isinstance(moment, Tensor) and moment.dim() > 0:
                    moment[h, dead] = 0
        count += len(dead)
    return count


@torch.no_grad()
def dead_atoms(dictionary: WriteDictionary, keys: Tensor, values: Tensor, batch: int = 4096) -> list[int]:
    """Per head, how many atoms fire (a positive activation) on none of the writes."""
    counts = sum(firings(*dictionary.encode(k, v), dictionary.n_atoms) for k, v in factor_batches(keys, values, batch))
    return (torch.as_tensor(counts) == 0).sum(1).tolist()


def firings(indices: Tensor, activations: Tensor, n_atoms: int) -> Tensor:
    """How many writes each atom fires on (a positive activation) [head, atom], from encodings [head, write, k]."""
    counts = torch.zeros(indices.shape[0], n_atoms, dtype=torch.long)
    return counts.scatter_add_(1, indices.flatten(1), (activations.flatten(1) > 0).long())


def check_fits(dictionary: WriteDictionary, writes: Writes) -> None:
    """ValueError naming the field where `dictionary` was not made for writes of `writes`' shape."""
    where = f" ({dictionary.card['path']})" if dictionary.card.get("path") else ""
    if dictionary.u.shape[-1] != writes.keys.shape[-1] or dictionary.w.shape[-1] != writes.values.shape[-1]:
        raise ValueError(
            f"the dictionary{where} has atoms of d_k = {dictionary.u.shape[-1]}, d_v = {dictionary.w.shape[-1]}; "
            f"layer {writes.layer}'s writes have d_k = {writes.keys.shape[-1]}, d_v = {writes.values.shape[-1]}"
        )
    layer = dictionary.card.get("layer")
    if layer is not None and layer != writes.layer:
        raise ValueError(
            f"the dictionary{where} was trained on layer {layer}'s writes (card.json's layer), not {writes.layer}'s"
        )
    if max(dictionary.heads) >= writes.n_heads:
        raise ValueError(
            f"the dictionary{where}'s heads {dictionary.heads} are not all among layer {writes.layer}'s "
            f"{writes.n_heads} heads"
        )


@torch.no_grad()
def encode_writes(dictionary: WriteDictionary, writes: Writes, batch: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Each write's k atoms and activations: (indices, activations), each [pos, head, k] over `dictionary.heads`."""
    check_fits(dictionary, writes)
    indices, activations = [], []
    for start in range(0, len(writes), batch):
        keys, values = writes.factors(dictionary.heads, start, start + batch)
        i, a = dictionary.encode(keys, values)
        indices.append(i.transpose(0, 1).numpy().astype(np.int32))
        activations.append(a.transpose(0, 1).numpy())
    return np.concatenate(indices), np.concatenate(activations)


def in_context(token_text: Sequence[str], position: int, before: int = 6, after: int = 2) -> str:
    """The token at `position` in brackets between a few of its neighbours' text."""
    left = "".join(token_text[max(0, position - before) : position])
    right = "".join(token_text[position + 1 : position + 1 + after])
    return " ".join(f"{left}[{token_text[position]}]{right}".split())


def atom_table(
    dictionary: WriteDictionary, writes: Writes, codes: tuple[np.ndarray, np.ndarray] | None = None, top: int = 5
) -> pd.DataFrame:
    """One row a (head, atom): `frequency` (the share of the writes it fires on), `mean_activation` (where it fires),
    the `top` writes that fire it most (`top_positions`, `top_activations`; `fires_on`, each token in brackets in
    its context with its activation), most frequent first within a head."""
    top = check_whole(top, "top", 1, 1000)
    indices, activations = encode_writes(dictionary, writes) if codes is None else codes
    rows = []
    for row, head in enumerate(dictionary.heads):
        fired = activations[:, row] > 0
        positions, slots = np.nonzero(fired)
        atoms, values = indices[positions, row, slots], activations[positions, row, slots]
        order = np.lexsort((-values, atoms))  # by atom, strongest first
        atoms, values, positions = atoms[order], values[order], positions[order]
        starts = np.searchsorted(atoms, np.arange(dictionary.n_atoms))
        ends = np.searchsorted(atoms, np.arange(dictionary.n_atoms), side="right")
        for atom in range(dictionary.n_atoms):
            a, b = starts[atom], ends[atom]
            chosen = positions[a : min(b, a + top)]
            rows.append(
                {
                    "head": head,
                    "atom": atom,
                    "frequency": (b - a) / len(writes),
                    "mean_activation": float(values[a:b].mean()) if b > a else 0.0,
                    "top_positions": chosen.tolist(),
                    "top_activations": [round(float(v), 4) for v in values[a : min(b, a + top)]],
                    "fires_on": "  |  ".join(
                        f"{in_context(writes.token_text, int(p))} {v:.2f}" for p, v in zip(chosen, values[a:b])
                    ),
                }
            )
    table = pd.DataFrame(rows)
    return table.sort_values(["head", "frequency"], ascending=[True, False], kind="stable", ignore_index=True)


def atom_activations(
    codes: tuple[np.ndarray, np.ndarray], dictionary: WriteDictionary, head: int, atom: int
) -> np.ndarray:
    """Atom `atom` of head `head`'s activation at every write [pos] (0 where it is not among the write's k)."""
    if head not in dictionary.heads:
        raise ValueError(f"head must be one of the dictionary's heads {dictionary.heads}, got {head!r}")
    check_whole(atom, "atom", 0, dictionary.n_atoms - 1)
    indices, activations = codes
    row = dictionary.heads.index(head)
    return np.where(indices[:, row] == atom, activations[:, row], 0).sum(1)


def atom_figures(
    dictionary: WriteDictionary,
    writes: Writes,
    table: pd.DataFrame,
    codes: tuple[np.ndarray, np.ndarray],
    atom: tuple[int, int] | None = None,
    width: int = WIDTH,
) -> dict[str, go.Figure]:
    """How often each atom fires (each head's atoms, most frequent first, on a log scale), and one atom's
    activation over the text (head, atom; default the most frequent atom of the first head), max-pooled to about
    `width` columns with the true token positions on the axis."""
    from memviz.trace import bin_size

    frequency = go.Figure()
    for head, part in table.groupby("head", sort=True):
        frequency.add_trace(
            go.Scatter(
                x=np.arange(1, len(part) + 1),
                y=part["frequency"].to_numpy(),
                mode="lines",
                name=f"head {head}",
                customdata=part["atom"].to_numpy(),
                hovertemplate=f"head {head} atom %{{customdata}}<br>fires on %{{y:.2%}} of writes<extra></extra>",
            )
        )
    frequency.update_layout(
        title=f"layer {writes.layer}: how often each atom fires ({dictionary.n_atoms} atoms a head, "
        f"k = {dictionary.k})",
        xaxis_title="atom, most frequent first",
        yaxis={"title": "share of writes it fires on", "type": "log"},
        height=420,
    )
    head, index = (
        atom
        if atom is not None
        else (dictionary.heads[0], int(table[table["head"] == dictionary.heads[0]].iloc[0]["atom"]))
    )
    values = atom_activations(codes, dictionary, head, index)
    size = bin_size(len(values), width)
    starts = np.arange(0, len(values), size)
    pooled = np.maximum.reduceat(values, starts) if len(values) else values
    peaks = starts + np.array([int(np.argmax(values[s : s + size])) for s in starts], dtype=int)
    activation = go.Figure(
        go.Scatter(
            x=starts,
            y=pooled,
            mode="lines" if len(starts) > 300 else "lines+markers",
            customdata=[in_context(writes.token_text, int(p)) for p in peaks],
            hovertemplate="token %{x}<br>activation %{y:.3f}<br>%{customdata}<extra></extra>",
        )
    )
    activation.update_layout(
        title=f"layer {writes.layer} head {head} atom {index}: its activation at each write",
        xaxis_title="token position" + (f" (each point the largest of {size} tokens)" if size > 1 else ""),
        yaxis_title="activation",
        height=360,
    )
    return {"atom frequency": frequency, "atom activation": activation}


def save_dictionary(dictionary: WriteDictionary, folder: str | Path, card: Mapping[str, Any] | None = None) -> Path:
    """Write `dictionary` as folder/dictionary.safetensors (u, w, encoder_u, encoder_w, bias, scale) and
    folder/card.json (its k and heads, with `card`: what it was trained on and what it measured)."""
    from safetensors.torch import save

    folder = Path(folder)
    tensors = {name: getattr(dictionary, name).detach().float().contiguous() for name in TENSORS}
    atomic_write_bytes(folder / WEIGHTS_FILE, save(tensors))
    written = {
        **dictionary.card,
        **(card or {}),
        "k": dictionary.k,
        "heads": dictionary.heads,
        "atoms": dictionary.n_atoms,
    }
    written.pop("path", None)
    atomic_write_text(folder / CARD_FILE, json.dumps(written, indent=2) + "\n")
    return folder


def load_dictionary(folder: str | Path) -> WriteDictionary:
    """A dictionary `save_dictionary` wrote; WriteDictionaryError naming the file and the field for one that is
    missing, corrupt or does not fit together."""
    from safetensors.torch import load

    folder = Path(folder)
    weights_path, card_path = folder / WEIGHTS_FILE, folder / CARD_FILE
    try:
        check_regular_file(weights_path, MAX_DICTIONARY_BYTES, "dictionary file")
        check_regular_file(card_path, 2**20, "dictionary card")
        data = weights_path.read_bytes()
        card_text = card_path.read_text(encoding="utf-8")
    except (ValueError, OSError) as exc:
        raise WriteDictionaryError(str(exc)) from exc
    try:
        tensors = load(data)
    except Exception as exc:  # safetensors' own error type for a corrupt file
        raise WriteDictionaryError(f"{weights_path}: not a safetensors file ({exc})") from exc
    try:
        card = json.loads(card_text)
    except ValueError as exc:
        raise WriteDictionaryError(f"{card_path}: not JSON ({exc})") from exc
    if not isinstance(card, dict):
        raise WriteDictionaryError(f"{card_path}: not a JSON object")
    missing = [name for name in TENSORS if name not in tensors]
    if missing:
        raise WriteDictionaryError(
            f"{weights_path}: no tensor {missing[0]!r} (a dictionary holds {', '.join(TENSORS)})"
        )
    u = tensors["u"]
    if u.dim() != 3:
        raise WriteDictionaryError(f"{weights_path}: u has shape {tuple(u.shape)}, not [head, atom, d_k]")
    n_heads, n_atoms, _ = u.shape
    d_v = tensors["w"].shape[-1] if tensors["w"].dim() == 3 else -1
    expected = {
        "w": (n_heads, n_atoms, d_v),
        "encoder_u": tuple(u.shape),
        "encoder_w": (n_heads, n_atoms, d_v),
        "bias": (n_heads, n_atoms),
        "scale": (n_heads,),
    }
    for name, shape in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape or d_v < 1:
            raise WriteDictionaryError(
                f"{weights_path}: {name} has shape {tuple(tensor.shape)}, not {shape} to match u {tuple(u.shape)}"
            )
    for name in TENSORS:
        if not tensors[name].is_floating_point() or not torch.isfinite(tensors[name]).all():
            raise WriteDictionaryError(f"{weights_path}: {name} is not all finite floating-point numbers")
    if not (tensors["scale"] > 0).all():
        raise WriteDictionaryError(f"{weights_path}: scale must be positive")
    heads = card.get("heads")
    if (
        not isinstance(heads, list)
        or not heads
        or len(heads) != n_heads
        or len(set(heads)) != len(heads)
        or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in heads)
    ):
        raise WriteDictionaryError(f"{card_path}: heads must list {n_heads} distinct head numbers, got {heads!r}")
    k = card.get("k")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_atoms:
        raise WriteDictionaryError(f"{card_path}: k must be a whole number from 1 to {n_atoms}, got {k!r}")
    u, w, encoder_u, encoder_w, bias, scale = (tensors[name].float() for name in TENSORS)
    return WriteDictionary(u, w, encoder_u, encoder_w, bias, scale, k, heads, {**card, "path": str(folder)})


def train_on_text(
    model: MemoryModel,
    text: str | Sequence[int],
    layer: int,
    heads: Sequence[int] | None = None,
    max_tokens: int = MAX_TRACE_TOKENS,
    progress: Progress | None = None,
    **training: Any,
) -> tuple[WriteDictionary, Writes]:
    """Capture `layer`'s writes over `text` and train a dictionary on `heads` (default all) with `training`'s
    settings (`train_dictionary`); its card says what it was trained on and what it measured on the held-back
    writes (the end of the text). Bad settings are refused before the capture, which is the slow part."""
    try:
        settings = inspect.signature(train_dictionary).bind(None, None, progress=progress, **training)
    except TypeError as exc:
        raise ValueError(f"train_on_text's settings are train_dictionary's: {exc}") from exc
    settings.apply_defaults()
    given = settings.arguments
    check_settings(*(given[name] for name in inspect.signature(check_settings).parameters))
    writes = capture_writes(model, text, layer, max_tokens)
    heads = list(range(writes.n_heads)) if heads is None else list(heads)
    bad = [
        h for h in heads if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or not 0 <= h < writes.n_heads
    ]
    if bad or not heads or len(set(heads)) != len(heads):
        raise ValueError(f"heads must name distinct heads of layer {layer}'s {writes.n_heads}, got {heads!r}")
    keys, values = writes.factors(heads)
    dictionary, measured = train_dictionary(keys, values, heads=heads, progress=progress, **training)
    dictionary.card = {
        "model": model.cfg.name or model.card.get("name", ""),
        "family": model.family,
        "layer": int(layer),
        "tokens": len(writes),
        "held_back_tokens": measured.held_back_writes,
        "d_k": writes.keys.shape[-1],
        "d_v": writes.values.shape[-1],
        "settings": {k: v for k, v in training.items() if isinstance(v, (int, float, str))},
        "wall_time_s": round(measured.seconds, 2),
        "explained_variance": [None if math.isnan(v) else round(v, 4) for v in measured.explained_variance],
        "relative_error": [round(v, 4) for v in measured.relative_error],
        "dead_atoms": measured.dead_atoms,
        "resampled": measured.resampled,
    }
    return dictionary, writes


def logit_effects(
    model: MemoryModel,
    dictionary: WriteDictionary,
    writes: Writes,
    table: pd.DataFrame,
    atoms: Sequence[tuple[int, int]],
    promoted: int = 8,
) -> pd.DataFrame:
    """Each atom's logit effect, at the token that fires it most: the logits that the read a_j c_h w_j gives (what a
    query along u_j reads back from the atom's write there) through its head's output path, the final norm frozen
    at that token and the unembedding (`memviz.read_lens.read_logits`; the direct path only), centred over the
    vocabulary. One row an atom: head, atom, position, the `promoted` tokens it pushes up most and their logits.
    A forward pass over the text up to each atom's token, so ask for a few atoms."""
    from memviz.read_lens import read_logits

    check_fits(dictionary, writes)
    promoted = check_whole(promoted, "promoted", 1, 1000)
    rows: list[dict[str, Any]] = []
    strongest = table.set_index(["head", "atom"])
    for head, atom in atoms:
        if (head, atom) not in strongest.index:
            raise ValueError(f"no atom {atom} of head {head} in the table")
        listed = strongest.loc[(head, atom)]
        if not listed["top_positions"]:
            rows.append({"head": head, "atom": atom, "position": None, "promoted": "", "logits": []})
            continue
        position = int(listed["top_positions"][0])
        row = dictionary.heads.index(head)
        reads = torch.zeros(1, writes.n_heads, writes.values.shape[-1], dtype=torch.float64)
        reads[0, head] = float(listed["top_activations"][0]) * dictionary.scale[row].double() * dictionary.w[row, atom]
        ids = torch.as_tensor(writes.tokens[: position + 1], dtype=torch.long)[None]
        logits = read_logits(model, ids, position, writes.layer, reads)[0].double()
        logits = logits - logits.mean()
        top = torch.topk(logits, min(promoted, logits.numel()))
        names = model.tokenizer.token_strings(top.indices.tolist())
        rows.append(
            {
                "head": head,
                "atom": atom,
                "position": position,
                "promoted": "  ".join(f"{n!r} {v:+.2f}" for n, v in zip(names, top.values.tolist())),
                "logits": [round(v, 4) for v in top.values.tolist()],
            }
        )
    return pd.DataFrame(rows, columns=["head", "atom", "position", "promoted", "logits"])
