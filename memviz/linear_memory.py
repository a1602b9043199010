"""What a model's linear-memory layers give beyond their hooks, read through the linear-memory operator
(`memviz_kernels.dispatch.linear_memory`): the read at a token split over the tokens that wrote it, and the
part of the state a span wrote, followed over the rest of the input (the needle hold).

Any layer whose memory is S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T and whose read
is o_t = S_t^T q_t qualifies, memviz's own or a released model's, when it passes these through its hooks
(`blocks.{l}.attn.`): `hook_read_query` q_t, `hook_write_key` k_t [batch, pos, head, d_k], `hook_write_value`
v_t [batch, pos, head, d_v], `hook_alpha` [batch, pos, head] or per key channel [batch, pos, head, d_k] and
`hook_beta` [batch, pos, head]. A state-space memory (Mamba-1 and -2) writes without the key removal,
S_t = Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T with beta_t its step dt_t (`delta_rule=False`). S is linear in the
writes with transitions that do not depend on S, so both are exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from memviz.protocol import MemoryModel, Readout
from memviz.running import StreamingLM
from memviz_kernels.dispatch import linear_memory, linear_memory_read_parts

WRITES = ("write_key", "write_value", "alpha", "beta")


def layer_hooks(layer: int, parts: Sequence[str]) -> list[str]:
    return [f"blocks.{layer}.attn.hook_{part}" for part in parts]


def heads_first(t: Tensor) -> Tensor:
    """[pos, head, ...] as the operator's [1, head, pos, ...]."""
    return t.transpose(0, 1)[None]


def log_decay(alpha: Tensor) -> Tensor:
    """log alpha; an alpha that underflowed to 0 forgets (a very negative log, not -inf, whose differences are NaN)."""
    return alpha.clamp_min(1e-300).log()


def operator_writes(k: Tensor, beta: Tensor, delta_rule: bool) -> tuple[Tensor, Tensor | None]:
    """The operator's (k, beta) from the hooks' k_t [pos, head, d_k] and beta_t [pos, head]: as they are for the
    delta rule; without it, beta_t folded into the key (S_t = Diag(alpha_t) S_{t-1} + (beta_t k_t) v_t^T)."""
    return (k, beta.T[None]) if delta_rule else (k * beta[..., None], None)


def split_read(
    model: MemoryModel, tokens, position: int, layers: Sequence[int], what: str, delta_rule: bool = True
) -> Readout:
    """The read o_t = S_t^T q_t at `position` per layer `layers` as a sum over writes: write j gives
    (r_j . k_j) beta_j v_j, r_t = q_t, r_{j-1} = A_j^T r_j (`memviz_kernels.linear_memory.reference.read_parts`);
    `delta_rule` False for an additive write (module docstring)."""
    full = model.as_tokens(tokens)
    if not 0 <= position < full.shape[1]:
        raise ValueError(f"position must lie in [0, {full.shape[1]}), got {position}")
    wanted = ("read_query", *WRITES)
    seen = model.capture(full[:, : position + 1], [n for l in layers for n in layer_hooks(l, wanted)])
    parts = {}
    for layer in layers:
        q, k, v, alpha, beta = (seen[n] for n in layer_hooks(layer, wanted))
        key, strength = operator_writes(k, beta, delta_rule)
        weights = linear_memory_read_parts(q[position][None], heads_first(key), heads_first(log_decay(alpha)), strength)
        parts[f"blocks.{layer}"] = weights[0].T[..., None] * v
    return Readout(position, what, parts)


@torch.no_grad()
def span_hold(
    model: StreamingLM, tokens, span: tuple[int, int], layers: Sequence[int], chunk: int, delta_rule: bool = True
) -> dict[str, np.ndarray]:
    """Per layer, ||S^span_t||_F over its peak (the largest over heads): the part of the state the span's writes
    left, carried by the run's own decays, write strengths and keys, i.e. the operator fed only the span's
    writes, `chunk` tokens a step; `delta_rule` False for an additive write (module docstring)."""
    ids, a, b = model.needle_ids(tokens, span)
    captured: dict[str, Tensor] = {}

    def keep(value: Tensor, hook) -> None:
        captured[hook.name] = value[0].double().cpu()

    hooks = [(n, keep) for l in layers for n in layer_hooks(l, WRITES)]
    parts: dict[int, Tensor | None] = {l: None for l in layers}
    norms: dict[int, list[Tensor]] = {l: [] for l in layers}
    with model.evaluating(), model.hooks(fwd_hooks=hooks):
        for start, logits, _ in model.stream(ids):
            positions = torch.arange(start, start + logits.shape[1])
            in_span = ((positions >= a) & (positions < b)).double()[:, None]
            for l in layers:
                k, v, alpha, beta = (captured[n] for n in layer_hooks(l, WRITES))
                key, strength = operator_writes(k, beta, delta_rule)
                S = parts[l]
                if S is None:
                    S = torch.zeros(1, k.shape[1], k.shape[2], v.shape[2], dtype=torch.float64)
                (_, n), parts[l] = linear_memory(
                    None,
                    heads_first(key),
                    heads_first(v * in_span[..., None]),
                    heads_first(log_decay(alpha)),
                    strength,
                    S,
                    chunk,
                )
                assert n is not None  # the operator gives the norms it is asked for
                norms[l].append(n[0].amax(0))
    hold = {}
    for l in layers:
        values = torch.cat(norms[l]).numpy()
        hold[f"layer {l}: share of the span's write still in the state"] = (values / max(values.max(), 1e-30)).astype(
            np.float32
        )
    return hold
