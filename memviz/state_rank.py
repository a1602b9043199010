"""How many directions a matrix memory uses as it reads a text: the effective and stable rank of each head's state.

"State Rank Dynamics in Linear Attention LLMs" (arXiv 2602.02195) follows the rank of Qwen3-Next's delta-rule states
over tokens and finds its heads split into low-rank and high-rank groups. Here, for every family that declares its
matrix memories (`Family.matrix_state`: Gated DeltaNet's and Kimi's S, Mamba-2's S, mLSTM's C, Infini-attention's M,
LM2's slot bank, Titans' memory weights), the state after each `every` tokens of a stream, per layer and head:

* effective rank (Roy and Vetterli 2007): exp(H(p)) with p_i = sigma_i / sum_j sigma_j, the singular values'
  entropy; r for r equal singular values, between 1 and min(rows, columns) otherwise, 0 for a zero state;
* stable rank: ||S||_F^2 / ||S||_2^2 = sum_i sigma_i^2 / sigma_1^2, which no small singular value can inflate.

Both from the singular values in float64 (NaN for a head whose state is not finite). `state_ranks(model, text)`
gives one row per (position, layer, memory, head); `memviz.viz.state_rank_figures` draws them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from torch.utils._pytree import GetAttrKey, MappingKey, SequenceKey, tree_flatten_with_path

from memviz.protocol import MemoryModel, ModelState, Progress
from memviz.registry import get_family
from memviz.running import announce_cost, check_progress
from memviz.tracing import MAX_TRACE_TOKENS, token_ids

COLUMNS = ["position", "layer", "memory", "head", "effective_rank", "stable_rank"]


def singular_values(states: Tensor) -> Tensor:
    """The singular values of each matrix in `states` [..., rows, columns], in float64 on the CPU, largest first."""
    return torch.linalg.svdvals(states.detach().to("cpu", torch.float64))


def ranks_from(sigma: Tensor) -> tuple[Tensor, Tensor]:
    """The effective and the stable rank [...] of matrices whose singular values are `sigma` [..., k] (0 for a zero
    matrix)."""
    total = sigma.sum(-1, keepdim=True)
    p = sigma / torch.where(total > 0, total, 1.0)
    entropy = -(p * torch.log(torch.where(p > 0, p, 1.0))).sum(-1)
    top = sigma[..., 0] ** 2
    effective = torch.where(total[..., 0] > 0, entropy.exp(), 0.0)
    stable = torch.where(top > 0, (sigma**2).sum(-1) / torch.where(top > 0, top, 1.0), 0.0)
    return effective, stable


def effective_rank(states: Tensor) -> Tensor:
    """exp of the entropy of each matrix's normalised singular values [...] (0 for a zero matrix)."""
    return ranks_from(singular_values(states))[0]


def stable_rank(states: Tensor) -> Tensor:
    """sum sigma_i^2 / sigma_1^2 of each matrix [...] (0 for a zero matrix)."""
    return ranks_from(singular_values(states))[1]


def path_name(path: Sequence) -> str:
    """A state leaf's path as the registry writes it: fields, keys and indices joined by dots ("memory.params.W")."""
    parts = []
    for key in path:
        if isinstance(key, GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(key))
    return ".".join(parts)


def matrix_memories(layer_state: object, paths: Sequence[str]) -> Iterator[tuple[str, Tensor]]:
    """The tensors of a layer's state under the declared `paths` (a path or any path below it; "" is every one), as
    (path, tensor)."""
    leaves, _ = tree_flatten_with_path(layer_state)
    for path, leaf in leaves:
        name = path_name(path)
        if isinstance(leaf, Tensor) and any(p == "" or name == p or name.startswith(p + ".") for p in paths):
            yield name, leaf


def ranks_of(state: ModelState, paths: Sequence[str]) -> list[dict]:
    """One row per (layer, memory, head) of the state's matrix memories: its effective and stable rank (NaN for a
    head whose state is not finite: a diverged memory has no rank)."""
    rows = []
    for layer, layer_state in enumerate(state.layers):
        for name, tensor in matrix_memories(layer_state, paths):
            if tensor.dim() < 3:  # [batch, rows, columns] at least
                raise ValueError(
                    f"blocks.{layer} state {name!r} has shape {tuple(tensor.shape)}, not a matrix per batch row"
                )
            matrices = tensor[0].detach().to("cpu", torch.float64).reshape(-1, *tensor.shape[-2:])  # a matrix a head
            finite = torch.isfinite(matrices).flatten(1).all(1)
            effective, stable = ranks_from(singular_values(torch.where(finite[:, None, None], matrices, 0.0)))
            nan = torch.tensor(float("nan"), dtype=torch.float64)
            effective, stable = torch.where(finite, effective, nan), torch.where(finite, stable, nan)
            for head, (er, sr) in enumerate(zip(effective.tolist(), stable.tolist())):
                rows.append(
                    {
                        "position": state.pos,
                        "layer": f"blocks.{layer}",
                        "memory": name,
                        "head": head,
                        "effective_rank": er,
                        "stable_rank": sr,
                    }
                )
    return rows


def state_ranks(
    model: MemoryModel,
    text: str | Sequence[int],
    every: int | None = None,
    max_tokens: int = MAX_TRACE_TOKENS,
    progress: Progress | None = None,
) -> pd.DataFrame:
    """The effective and stable rank of each matrix memory's heads after every `every` tokens of `text` (default:
    the model's chunk) and after the last: columns position (tokens read), layer, memory (its path in the layer's
    state), head, effective_rank, stable_rank. ValueError for a family with no matrix memory declared."""
    family = get_family(model.family)
    if not family.matrix_state:
        raise ValueError(
            f"the {family.name} family declares no matrix memory (Family.matrix_state), so it has no state rank"
        )
    if every is not None and (isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1):
        raise ValueError(f"every must be a positive whole number of tokens, got {every!r}")
    ids = (
        model.tokenizer.encode_within(text, max_tokens, limit="trace limit")
        if isinstance(text, str)
        else token_ids(text)
    )
    if len(ids) > max_tokens:
        raise ValueError(f"input has {len(ids):,} tokens, over the limit of {max_tokens:,}")
    if not ids:
        raise ValueError("empty input: there is no state to measure")
    check_progress(progress)
    announce_cost(model, len(ids), "measuring state rank over", parts=("kv_cache", "memory_state"))
    rows: list[dict] = []
    with model.evaluating(), torch.no_grad():
        for _, _, state in model.stream(torch.tensor([ids]), int(every) if every else None):
            measured = ranks_of(state, family.matrix_state)
            if not measured:
                leaves = sorted({name for layer in state.layers for name, _ in matrix_memories(layer, [""])})
                raise ValueError(
                    f"the {family.name} family's matrix memories {list(family.matrix_state)} match nothing in its "
                    f"state after {state.pos} tokens; its layers' state paths are {leaves[:20]}"
                )
            rows += measured
            if progress is not None:
                progress(state.pos, len(ids))
    return pd.DataFrame(rows, columns=COLUMNS)
