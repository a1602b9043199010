"""Released models whose memory layers are Mamba-2's state space duality (SSD; Dao and Gu, arXiv 2405.21060),
traced under the hook names memviz's linear memories share where the meaning is the same: Mamba-2 and the
hybrids Bamba, Granite 4.0-H (`granitemoehybrid`), Nemotron-H, Falcon-H1 and Zamba2 (one module each).

Per head a state h [head_dim, d_state] (memviz keeps S = h^T, [d_state, head_dim], the operator's layout), with a
scalar decay per head and token and an additive write:

  h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,      y_t = h_t C_t + D x_t

with the models' own parametrisation (transformers' Mamba2Mixer): x, B, C = silu(causal depthwise conv over
`conv_kernel` tokens of the projections), B and C shared by the heads of a group; dt_t = softplus(x w_dt + dt_bias)
clamped to `time_step_limit`; A = -exp(A_log) < 0 per head; the layer's output is the gated RMS norm of y_t,
RMSNorm(y_t silu(z_t)) per group, then `out_proj`.

The read `hook_read` is h_t C_t; the skip D x_t is the token's own input and no memory, so the read-out splits
h_t C_t over the writers and leaves D x_t out. A writer j's x_j, B_j and dt_j mix tokens j-K+1..j through the
convolution (K = `conv_kernel`, 4 in every released model). How this compares with TransformerLens' bridge of
the same layers: docs/released.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from memviz.figure_parts import WIDTH, layer_names, layer_prefix, position_heatmap, timeline
from memviz.protocol import HookDoc
from memviz.registry import FolderLoader, register_family

from .architecture import Architecture, Claimed
from .gated_deltanet import ALPHA, BETA, MEM_OUT, STATE_NORM
from .loading import load
from .model import BACKBONE_HOOK_DOCS, ReleasedLM

#: model_type -> its architecture; each architecture module adds its own
ARCHITECTURES: dict[str, Architecture] = {}


def state_space_hook_docs(memory: str, per: str, decay: HookDoc, step: HookDoc, state: str) -> dict[str, HookDoc]:
    """The hooks of a released model with state-space memory layers named `memory`, whose state has a head per
    `per` (a head or a channel), with its decay, step and state."""
    return {
        **BACKBONE_HOOK_DOCS,
        ALPHA: decay,
        BETA: step,
        "blocks.{l}.attn.hook_write_key": HookDoc(
            f"[batch, pos, {per}, d_state]",
            f"{memory} layers: `B_t` after the short convolution, the key the step `dt_t` writes along "
            "(the write is `dt_t B_t x_t^T`) (read-only)",
        ),
        "blocks.{l}.attn.hook_write_value": HookDoc(
            f"[batch, pos, {per}, {state}]", f"{memory} layers: `x_t` after the short convolution (read-only)"
        ),
        "blocks.{l}.attn.hook_read_query": HookDoc(
            f"[batch, pos, {per}, d_state]", f"{memory} layers: `C_t` after the short convolution (read-only)"
        ),
        "blocks.{l}.attn.hook_read": HookDoc(
            f"[batch, pos, {per}, {state}]",
            f"{memory} layers: the read `h_t C_t` (`S_t^T C_t`), without the skip `D x_t` (read-only)",
        ),
        STATE_NORM: HookDoc(
            f"[batch, pos, {per}]", f"{memory} layers: `||h_t||_F`, the state after the token's write (read-only)"
        ),
    }


def state_space_figures(trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict:
    """Per memory layer the decay exp(dt_t A) and the step dt_t over tokens and heads (or channels); ||h_t||."""
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)  # the figure helpers' keywords
    figs = {}
    for name in layer_names(trace, ALPHA):
        prefix = layer_prefix(name, ALPHA)
        layer = prefix.split(".attn")[0]
        rows = "head" if trace[name].ndim == 2 else "channel"
        figs[f"{layer} alpha"] = position_heatmap(
            trace, name, f"{layer}: decay exp(dt_t A) (1 keeps the state)", rows, zmin=0, zmax=1, reduce="min", **zoom
        )
        if f"{prefix}.hook_beta" in trace.names:
            figs[f"{layer} dt"] = position_heatmap(
                trace,
                f"{prefix}.hook_beta",
                f"{layer}: step dt_t (how much a token writes and forgets)",
                rows,
                zmin=0,
                reduce="max",
                **zoom,
            )
    norms = layer_names(trace, STATE_NORM)
    if norms:
        figs["state norm"] = timeline(trace, {n: n for n in norms}, "||h_t|| (mean over heads)", **zoom)
    return figs


@register_family(
    "hf_mamba2",
    summary="A released model with Mamba-2 (SSD) layers (Mamba-2, Bamba, Granite 4.0-H, Nemotron-H) loaded through "
    "transformers: a scalar decay per head and an additive write, under the linear memories' hook names",
    matrix_state=("S",),
    figures=state_space_figures,
    from_config=False,
    readout=True,
    needle_hold=True,
    read_lens=True,
    folders=FolderLoader(Claimed(ARCHITECTURES), load),
)
class SSDLM(ReleasedLM):
    """A transformers model with Mamba-2 layers (module docstring)."""

    read_path = ReleasedLM.norm_read_path
    norm_input_hooks = ("write_value",)

    def norm_input(self, layer: int, read: Tensor, seen: Mapping[str, Tensor]) -> Tensor:
        """The gated norm's input y_t + D x_t: the read and the skip, x_t being the layer's write value."""
        skip = self.memory_layer(layer).D.detach().to(read.device, read.dtype)
        return read + skip[:, None] * seen[f"blocks.{layer}.attn.hook_write_value"]

    architectures = ARCHITECTURES
    delta_rule = False
    read_is = (
        "y_t = h_t C_t, the scan's read before the skip D x_t and the gated norm; a writer's x_j, B_j and dt_j "
        "mix tokens j-3..j through the short convolution"
    )
    memory_hooks = {ALPHA: "none", BETA: "none", STATE_NORM: "none", MEM_OUT: "norm"}
    hook_docs = {
        **state_space_hook_docs(
            "Mamba-2",
            "head",
            HookDoc(
                "[batch, pos, head]", "Mamba-2 layers: decay `exp(dt_t A)` per head, `A = -exp(A_log)` (read-only)"
            ),
            HookDoc(
                "[batch, pos, head]",
                "Mamba-2 layers: step `dt_t = softplus(x w_dt + dt_bias)` clamped to `time_step_limit`, the write "
                "strength (read-only)",
            ),
            "head_dim",
        ),
        MEM_OUT: HookDoc(
            "[batch, pos, head, head_dim]",
            "Mamba-2 layers: the layer's gated RMS norm of `y_t + D x_t`, before `out_proj` (what a hook returns "
            "replaces it)",
        ),
    }
