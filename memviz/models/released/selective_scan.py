"""Released models whose memory layers are Mamba-1's selective scan (S6; Gu and Dao, arXiv 2312.00752, Algorithm
2), traced under the hook names memviz's linear memories share: Mamba, Falcon Mamba and the hybrid Jamba (one
module each).

Per channel c of the inner width a state h [d_state] with a decay per channel and state dimension and an additive
write:

  h_t = exp(dt_t A_c) o h_{t-1} + dt_t x_t B_t,      y_t = C_t . h_t + D x_t,      output y_t silu(z_t)

with the models' own parametrisation (transformers' MambaMixer): x = silu(causal depthwise conv over `conv_kernel`
tokens of the projection); dt_t = softplus(dt_proj(x w_dt) + dt_proj.bias) per channel, B_t and C_t projections of
x shared by every channel (Falcon Mamba and Jamba RMS-normalise them and dt first); A = -exp(A_log) < 0 per
channel and state dimension. In memviz's terms each channel is a head with d_k = d_state and d_v = 1 and a decay
per key channel (the operator's Kimi-style decay, without the delta rule).

The read `hook_read` is C_t . h_t; the skip D x_t is the token's own input, left out of the read-out. A writer's x_j
and with it B_j and dt_j mix tokens j-K+1..j through the convolution (K = `conv_kernel`, 4 in released models).
transformers' own scan starts every multi-token call from a zero state (its code says so); memviz's starts from the
cached state, so a streamed run equals one pass.
"""

from __future__ import annotations

from memviz.protocol import HookDoc
from memviz.registry import FolderLoader, register_family

from .architecture import Architecture, Claimed
from .gated_deltanet import ALPHA, MEM_OUT, STATE_NORM
from .loading import load
from .model import ReleasedLM
from .ssd import state_space_figures, state_space_hook_docs

#: model_type -> its architecture; each architecture module adds its own
ARCHITECTURES: dict[str, Architecture] = {}


@register_family(
    "hf_mamba",
    summary="A released model with Mamba-1 (selective scan) layers (Mamba, Falcon Mamba, Jamba) loaded through "
    "transformers: a decay per channel and state dimension, under the linear memories' hook names",
    figures=state_space_figures,
    from_config=False,
    readout=True,
    needle_hold=True,
    folders=FolderLoader(Claimed(ARCHITECTURES), load),
)
class SelectiveScanLM(ReleasedLM):
    """A transformers model with Mamba-1 layers (module docstring)."""

    architectures = ARCHITECTURES
    decay_per_channel = True
    delta_rule = False
    read_is = (
        "y_t = C_t . h_t per channel, the scan's read before the skip D x_t and the gate silu(z_t); a writer's x_j, "
        "B_j and dt_j mix tokens j-3..j through the short convolution"
    )
    # a trace keeps each channel's decay averaged over its state dimensions, and the layer's norms: a few numbers
    # a channel and token (a released Mamba has thousands of channels a layer)
    memory_hooks = {ALPHA: "mean", STATE_NORM: "norm", MEM_OUT: "norm"}
    hook_docs = {
        **state_space_hook_docs(
            "Mamba",
            "channel",
            HookDoc(
                "[batch, pos, channel, d_state]",
                "Mamba layers: decay `exp(dt_t A_c)` per channel and state dimension, `A = -exp(A_log)` (read-only; "
                "a trace keeps its mean over d_state)",
            ),
            HookDoc(
                "[batch, pos, channel]",
                "Mamba layers: step `dt_t = softplus(dt_proj(x w_dt) + dt_proj.bias)` per channel, the write "
                "strength (read-only)",
            ),
            "1",
        ),
        MEM_OUT: HookDoc(
            "[batch, pos, channel]",
            "Mamba layers: the layer's `(y_t + D x_t) silu(z_t)`, before `out_proj` (what a hook returns replaces it)",
        ),
    }
