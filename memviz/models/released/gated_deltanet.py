"""Released models whose memory layers are Gated DeltaNet (Yang, Kautz and Hatamizadeh, arXiv 2412.06464, eq. 10),
traced under memviz's gated_deltanet family's hook names: Qwen3.5, Qwen3-Next, OLMo Hybrid (one module each).

Per value head a state S [d_k, d_v] (the paper's S^T):

  S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

with the models' own parametrisation (transformers' layers): q, k, v = silu(causal depthwise conv over 4 tokens
of the projections), q and k unit-norm (x rsqrt(|x|^2 + 1e-6)) and repeated to the value heads, q scaled by
d_k^-1/2; alpha_t = exp(-exp(A_log) softplus(x w_a + dt_bias)); beta_t = sigmoid(x w_b) (OLMo Hybrid:
2 sigmoid(x w_b) in (0, 2), a negative eigenvalue allowed); the layer's output is the gated RMS norm of o_t.
How this compares with TransformerLens' bridge of the same layers: docs/released.md.
"""

from __future__ import annotations

from typing import Any

from memviz.figure_parts import WIDTH, delta_rule_rate_heatmaps, layer_names, timeline
from memviz.protocol import HookDoc
from memviz.registry import FolderLoader, register_family

from .architecture import Architecture, Claimed
from .loading import load
from .model import BACKBONE_HOOK_DOCS, ReleasedLM

ALPHA, BETA = "blocks.{l}.attn.hook_alpha", "blocks.{l}.attn.hook_beta"
STATE_NORM, MEM_OUT = "blocks.{l}.attn.hook_state_norm", "blocks.{l}.attn.hook_mem_out"

#: model_type -> its architecture; each architecture module adds its own
ARCHITECTURES: dict[str, Architecture] = {}


def released_hook_docs(memory: str, decay: HookDoc, beta: HookDoc) -> dict[str, HookDoc]:
    """The hooks every released model has, `memory` naming its memory layers, with its decay and write strength."""
    return {
        **BACKBONE_HOOK_DOCS,
        ALPHA: decay,
        BETA: beta,
        "blocks.{l}.attn.hook_write_key": HookDoc(
            "[batch, pos, head, d_k]",
            f"{memory} layers: `k_t`, unit-norm after the short convolution (repeated to the value heads where there "
            "are fewer key heads) (read-only)",
        ),
        "blocks.{l}.attn.hook_write_value": HookDoc(
            "[batch, pos, head, d_v]", f"{memory} layers: `v_t` after the short convolution (read-only)"
        ),
        "blocks.{l}.attn.hook_read_query": HookDoc(
            "[batch, pos, head, d_k]", f"{memory} layers: `q_t`, unit-norm and scaled by `d_k^-1/2` (read-only)"
        ),
        "blocks.{l}.attn.hook_read": HookDoc(
            "[batch, pos, head, d_v]", f"{memory} layers: the read `o_t = S_t^T q_t` (read-only)"
        ),
        STATE_NORM: HookDoc(
            "[batch, pos, head]", f"{memory} layers: `||S_t||_F`, the state after the token's write (read-only)"
        ),
        MEM_OUT: HookDoc(
            "[batch, pos, head, d_v]",
            f"{memory} layers: the read after the layer's gated RMS norm, the layer's own value (what a hook returns "
            "replaces it)",
        ),
    }


def rate_and_norm_figures(trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict:
    """The decay alpha and write strength beta over tokens and heads per memory layer; ||S_t||."""
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)  # the figure helpers' keywords
    figs = delta_rule_rate_heatmaps(trace, **zoom)
    norms = layer_names(trace, STATE_NORM)
    if norms:
        figs["state norm"] = timeline(trace, {n: n for n in norms}, "||S_t|| (mean over heads)", **zoom)
    return figs


@register_family(
    "hf_gated_deltanet",
    summary="A released hybrid with Gated DeltaNet layers (Qwen3.5, Qwen3-Next, OLMo Hybrid) loaded through "
    "transformers, under the gated_deltanet hook names",
    matrix_state=("S",),
    figures=rate_and_norm_figures,
    from_config=False,
    readout=True,
    needle_hold=True,
    read_lens=True,
    folders=FolderLoader(Claimed(ARCHITECTURES), load),
)
class GatedDeltaNetLM(ReleasedLM):
    """A transformers hybrid with Gated DeltaNet layers (module docstring)."""

    read_path = ReleasedLM.norm_read_path

    architectures = ARCHITECTURES
    memory_hooks = {ALPHA: "none", BETA: "none", STATE_NORM: "none", MEM_OUT: "norm"}
    hook_docs = released_hook_docs(
        "Gated DeltaNet",
        HookDoc(
            "[batch, pos, head]",
            "Gated DeltaNet layers: decay `alpha_t = exp(-exp(A_log) softplus(x w_a + dt_bias))` per value head "
            "(read-only)",
        ),
        HookDoc(
            "[batch, pos, head]",
            "Gated DeltaNet layers: write strength `beta_t = sigmoid(x w_b)` (OLMo Hybrid: `2 sigmoid(x w_b)`) "
            "(read-only)",
        ),
    )
