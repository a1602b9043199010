"""Released models whose memory layers are Kimi Delta Attention (Kimi Linear, arXiv 2510.26692, eq. 1), traced
under memviz's gated_deltanet hook names where the meaning is the same: Kimi Linear and Ling 3.0 (one module each).

Per head a state S [d_k, d_v] (the paper's S^T), with a decay per key channel:

  S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

with the model's own parametrisation (transformers' KimiLinearDeltaAttention): q, k, v = silu(causal depthwise
conv over 4 tokens of the projections), q and k unit-norm, q scaled by d_k^-1/2; alpha_t = exp(g_t) with
g_t = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias), a vector over the head's d_k key channels (computed in
float32 by the layer); beta_t = sigmoid(x w_b); the output is the RMS norm of o_t times sigmoid(g_b(g_a(x))).

Where it differs from Gated DeltaNet: `hook_alpha` is [batch, pos, head, d_k] (a decay per key channel, kept whole
in a trace, so its figures show every channel), and the decay comes before the key removal (for a scalar decay
the two orders are the same map). Kimi Linear's attention layers are multi-head latent attention without RoPE;
their hooks are `hook_q` (the queries per head) and `hook_z` (the output per head before `o_proj`).
"""

from __future__ import annotations

from memviz.protocol import HookDoc
from memviz.registry import FolderLoader, register_family

from .architecture import Architecture, Claimed
from .gated_deltanet import ALPHA, BETA, MEM_OUT, STATE_NORM, rate_and_norm_figures, released_hook_docs
from .loading import load
from .model import ReleasedLM

#: model_type -> its architecture; each architecture module adds its own
ARCHITECTURES: dict[str, Architecture] = {}


@register_family(
    "hf_kimi_delta_attention",
    summary="A released hybrid with Kimi Delta Attention layers (Kimi Linear, Ling 3.0) loaded through transformers: a "
    "delta rule with a decay per key channel, under the gated_deltanet hook names",
    matrix_state=("S",),
    figures=rate_and_norm_figures,
    from_config=False,
    readout=True,
    needle_hold=True,
    read_lens=True,
    folders=FolderLoader(Claimed(ARCHITECTURES), load),
)
class KimiDeltaAttentionLM(ReleasedLM):
    """A transformers hybrid with Kimi Delta Attention layers (module docstring)."""

    read_path = ReleasedLM.norm_read_path

    architectures = ARCHITECTURES
    decay_per_channel = True
    memory_hooks = {ALPHA: "none", BETA: "none", STATE_NORM: "none", MEM_OUT: "norm"}
    hook_docs = {
        name: doc
        for name, doc in released_hook_docs(
            "Kimi Delta Attention",
            HookDoc(
                "[batch, pos, head, d_k]",
                "Kimi Delta Attention layers: decay per key channel `alpha_t = exp(g_t)`; Kimi Linear "
                "`g_t = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)`, Ling 3.0 "
                "`g_t = -5 sigmoid(exp(A_log) (f(x) + dt_bias))` (read-only)",
            ),
            HookDoc(
                "[batch, pos, head]",
                "Kimi Delta Attention layers: write strength `beta_t = sigmoid(x w_b)` (read-only)",
            ),
        ).items()
        if name not in ("blocks.{l}.attn.hook_k", "blocks.{l}.attn.hook_v")  # MLA: no per-head keys or values
    }
