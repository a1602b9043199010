"""Released models whose memory layers are xLSTM's mLSTM (Beck et al., arXiv 2405.04517, Section 2.3), traced
under the hook names memviz's linear memories share where the meaning is the same: xLSTM (`xlstm.py`, NX-AI's
xLSTM-7b as transformers' `xLSTMForCausalLM` runs it).

Per head a matrix memory C [d_v, d_k] (memviz keeps S = C^T, [d_k, d_v], the operator's layout), a normaliser
n [d_k], an exponential input gate and a sigmoid forget gate, in the paper's terms (eqs. 19-21, 25-27):

  C_t = f_t C_{t-1} + i_t v_t k_t^T,      n_t = f_t n_{t-1} + i_t k_t,      h~_t = C_t q_t / max(|n_t^T q_t|, 1)
  i_t = exp(i~_t),      f_t = sigmoid(f~_t) = exp(logsigmoid(f~_t)),      h_t = o_t * h~_t

with transformers' parametrisation (`xLSTMLayer`): q, k, v linear maps of the block's RMS-normed input cut into
heads (no convolution, no normalisation of q or k); i~_t = soft_cap(x w_i + b_i), f~_t = soft_cap(x w_f + b_f),
soft_cap(z) = c tanh(z / c) with c the config's `gate_soft_cap` (15 in xLSTM-7b; the input gate is at most e^c);
q scaled by d_k^-1/2 (the paper scales k: the same for C q and n^T q); h~_t through a layer norm per head
(`multihead_norm`), times the output gate o_t = sigmoid(x W_o), then `out_proj`.

transformers' kernels (`wrap_chunkwise_arbitrary_sequence_length`: `mlstm_chunkwise_native_autograd` over whole
chunks of `chunk_size` tokens, `mlstm_recurrent_sequence_native` token by token over the rest,
`mlstm_recurrent_step_native` for a single token) keep the state stabilised, as the paper stabilises its
exponential gates (Section 2.2, eqs. 15-17): a stabiliser m_t = max(logsigmoid(f~_t) + m_{t-1}, i~_t) (m_0 = 0 in
a fresh state) and C, n at scale exp(-m_t), so that every factor is at most 1:

  C_t = exp(log f_t + m_{t-1} - m_t) C_{t-1} + exp(i~_t - m_t) k_t v_t^T       (the same for n with k_t)
  h~_t = (C_t^T q_t) / (max(|n_t^T q_t|, exp(-m_t)) + eps)                        (eps = the config's `eps`, 1e-6)

which in un-stabilised terms is h~_t = C_t q_t / (max(|n_t^T q_t|, 1) + eps e^{m_t}): the eps term is the only
place m_t shows. memviz replaces each layer's `mlstm_backend` module with `MLSTMKernel`, which computes exactly this
through memviz's linear-memory operator (`memviz_kernels.dispatch.linear_memory`) in one call: S = [C^T, n]
[d_k, d_v + 1] (the normaliser as the last column), log decay g_t = log f_t + m_{t-1} - m_t <= 0, key
exp(i~_t - m_t) k_t (never above k_t: no overflow whatever the input gate), value [v_t, 1], query q_t d_k^-1/2, so
the read gives C_t^T q_t and n_t^T q_t at once. m_t itself is a running maximum (`stabiliser`). The state it hands
back is transformers' own (C, n, m); the work is in float32 at least, float64 in a float64 model (transformers'
sequence and step kernels keep their state in the config's `inference_state_dtype`, float32, whatever the model's).

The hooks give the paper's un-stabilised quantities (the stabilised ones times e^{m_t}): i_t, C_t q_t, n_t^T q_t,
||C_t||_F. They overflow a float32 only past e^88, an input gate's pre-activation above 88, which the soft cap of a
released model (15) rules out; the layer's own computation stays finite either way. So the read-out splits C_t q_t
over the writes i_j (q_t . k_j) prod_{s=j+1..t} f_s v_j, additive as a state-space model's (`delta_rule=False`), and
a write is its own token's alone (no convolution mixes tokens before the memory).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz.figure_parts import WIDTH, layer_names, layer_prefix, position_heatmap, timeline, with_array
from memviz.protocol import HookDoc, ModelState, ReadPath
from memviz.read_lens import captured_at, frozen_scale, head_blocks, last_residual
from memviz.registry import FolderLoader, register_family
from memviz.running import hooked
from memviz.state import Memory, State
from memviz_kernels.dispatch import linear_memory

from .architecture import Architecture, Claimed
from .gated_deltanet import ALPHA, BETA, MEM_OUT, STATE_NORM
from .loading import ReleasedCheckpointError, load
from .model import BACKBONE_HOOK_DOCS, MEMORY_HOOKS, MemoryHooks, ReleasedLM
from .recurrence import CHUNK, Watch, keep

#: model_type -> its architecture; each architecture module adds its own
ARCHITECTURES: dict[str, Architecture] = {}

NORMALISER = "blocks.{l}.attn.hook_normaliser"
#: what an mLSTM layer's kernel shows, in hook order: the linear memories' and the normaliser's read
MLSTM_HOOKS = (*MEMORY_HOOKS, "normaliser")


class MLSTMLayerState(NamedTuple):
    """An mLSTM layer's state as transformers' kernels keep it, stabilised: C [B, H, d_k, d_v] (the paper's C^T
    times e^{-m}), the normaliser n [B, H, d_k] (times e^{-m}) and the stabiliser m [B, H, 1]. All three are memory:
    a reset gives a fresh state's (zeros, m = 0, as transformers starts), a patch takes the donor's three together
    (C and n mean nothing without their m)."""

    C: Memory[Tensor]
    n: Memory[Tensor]
    m: Memory[Tensor]


def stabiliser(log_f: Tensor, i_pre: Tensor, m0: Tensor) -> Tensor:
    """m_t = max(log f_t + m_{t-1}, i~_t) from m_0, as a running maximum: with b_t = sum_{s<=t} log f_s,
    m_t = b_t + max(m_0, max_{j<=t} (i~_j - b_j)). log_f, i_pre [B, H, T], m0 [B, H, 1] -> [B, H, T] in float64
    (b_t grows with the input; m_t stays within the input gates' range, so its differences are exact)."""
    b = log_f.double().cumsum(-1)
    return b + torch.maximum((i_pre.double() - b).cummax(-1).values, m0.double())


def run_mlstm(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    i_pre: Tensor,
    f_pre: Tensor,
    state: tuple[Tensor | None, Tensor | None, Tensor | None],
    eps: float,
    watch: Watch | None,
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """The mLSTM cell over a chunk through the operator (module docstring): q, k [B, H, T, d_k], v [B, H, T, d_v],
    the gates' pre-activations i~, f~ [B, H, T] (after the soft cap), the state (C, n, m) or Nones (a fresh one)
    -> (h~ [B, H, T, d_v] in q's dtype, the state after the chunk). With a `watch`, what its hooks want is kept in
    it, un-stabilised, [B, T, H, ...]."""
    work = torch.promote_types(value.dtype, torch.float32)
    B, H, T, d_k = key.shape
    d_v = value.shape[-1]
    # copies: transformers writes the new state into the cache's tensors, these, in place (a gradient needs them)
    C0, n0, m0 = state
    C0 = key.new_zeros(B, H, d_k, d_v, dtype=work) if C0 is None else C0.to(work, copy=True)
    n0 = key.new_zeros(B, H, d_k, dtype=work) if n0 is None else n0.to(work, copy=True)
    m0 = key.new_zeros(B, H, 1, dtype=work) if m0 is None else m0.to(work, copy=True)
    log_f = F.logsigmoid(f_pre.double())
    m = stabiliser(log_f, i_pre, m0)  # float64
    g = (log_f + torch.cat([m0.double(), m[..., :-1]], -1) - m).to(work)  # log f_t + m_{t-1} - m_t <= 0
    written = key.to(work) * (i_pre.double() - m).exp().to(work)[..., None]  # exp(i~_t - m_t) k_t
    q = query.to(work) * d_k**-0.5
    (o, _), S = linear_memory(
        q,
        written,
        torch.cat([value.to(work), value.new_ones(B, H, T, 1, dtype=work)], -1),
        g,
        None,
        torch.cat([C0, n0[..., None]], -1),
        CHUNK,
        state_norms=False,
    )
    assert o is not None  # the operator reads with the q it is given
    numerator, normaliser = o[..., :d_v], o[..., d_v]
    h = numerator / (torch.maximum(normaliser.abs(), (-m).exp().to(work)) + eps)[..., None]
    if watch is not None:
        scale = m.exp().to(work)  # e^{m_t}: the stabilised quantities back to the paper's
        quantities = dict(
            alpha=log_f.exp().to(work),
            beta=i_pre.to(work).exp(),
            write_key=key.to(work),
            write_value=value.to(work),
            read_query=q,
            read=numerator * scale[..., None],
            normaliser=normaliser * scale,
        )
        if "state_norm" in watch.wanted:  # ||C_t||_F: the operator once more, over the values alone
            (_, norms), _ = linear_memory(None, written, value.to(work), g, None, C0, CHUNK, state_norms=True)
            assert norms is not None  # the operator gives the norms it is asked for
            quantities["state_norm"] = norms * scale
        keep(watch, **{name: t.transpose(1, 2) for name, t in quantities.items()})
    return h.to(query.dtype), (S[..., :d_v], S[..., d_v], m[..., -1:].to(work))


class MLSTMKernel(nn.Module):
    """An mLSTM layer's `mlstm_backend` (transformers' `xLSTMBackend`, its signature) computed by `run_mlstm`
    whatever the config's `mode`: the hidden read h~ and the last state (C, n, m), always. `native` keeps
    transformers' own backend (not a submodule)."""

    watching: Watch | None = None  # what the layer's hooks want of the coming forward (`MLSTMLM.watch_memory`)

    def __init__(self, native: nn.Module) -> None:
        super().__init__()
        self.eps = float(getattr(getattr(native, "config", None), "eps", 1e-6))
        self.__dict__["native"] = native

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        igate: Tensor,
        fgate: Tensor,
        c_initial: Tensor | None = None,
        n_initial: Tensor | None = None,
        m_initial: Tensor | None = None,
        return_last_states: bool | None = None,
        mode: str | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        return run_mlstm(query, key, value, igate, fgate, (c_initial, n_initial, m_initial), self.eps, self.watching)


class MLSTMHooks(MemoryHooks):
    """The HookPoints of one mLSTM layer: the linear memories' and `hook_normaliser`."""

    hook_normaliser: HookPoint

    def __init__(self) -> None:
        super().__init__()
        self.hook_normaliser = HookPoint()


def carried_cache(config: Any, layers: list[State], device: torch.device) -> Any:
    """transformers' `xLSTMCache` holding copies of the layers' states (xLSTMModel writes its cache in place),
    without the zeros its constructor would allocate for every layer first."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    cache = xLSTMCache.__new__(xLSTMCache)
    parts = [cast(MLSTMLayerState, part) for part in layers]
    cache.seqlen_offset = torch.tensor([0], dtype=torch.long, device=device)
    cache.dtype = parts[0].C.dtype if parts else torch.float32
    cache.config = config
    cache.rnn_state = {l: (part.C.clone(), part.n.clone(), part.m.clone()) for l, part in enumerate(parts)}
    return cache


def mlstm_figures(trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict:
    """Per mLSTM layer the forget gate f_t, the input gate's log i~_t and the normaliser's read |n_t^T q_t| over
    tokens and heads; ||C_t||."""
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)  # the figure helpers' keywords
    figs = {}
    for name in layer_names(trace, ALPHA):
        prefix = layer_prefix(name, ALPHA)
        layer = prefix.split(".attn")[0]
        figs[f"{layer} alpha"] = position_heatmap(
            trace, name, f"{layer}: forget gate f_t (1 keeps the memory)", "head", zmin=0, zmax=1, reduce="min", **zoom
        )
        if f"{prefix}.hook_beta" in trace.names:
            log_gate = np.log(np.maximum(trace[f"{prefix}.hook_beta"], np.finfo(np.float64).tiny))
            figs[f"{layer} beta"] = position_heatmap(
                with_array(trace, f"{prefix}.log_input_gate", log_gate),
                f"{prefix}.log_input_gate",
                f"{layer}: input gate, log i_t = i~_t (how strongly a token writes)",
                "head",
                reduce="max",
                **zoom,
            )
        if f"{prefix}.hook_normaliser" in trace.names:
            reach = np.log10(np.maximum(np.abs(trace[f"{prefix}.hook_normaliser"]), 1e-30))
            figs[f"{layer} normaliser"] = position_heatmap(
                with_array(trace, f"{prefix}.log_normaliser", reach),
                f"{prefix}.log_normaliser",
                f"{layer}: log10 |n_t^T q_t| (below 0 the read is divided by 1, above by |n_t^T q_t|)",
                "head",
                colorscale="RdBu_r",
                reduce="max",
                **zoom,
            )
    norms = layer_names(trace, STATE_NORM)
    if norms:
        figs["state norm"] = timeline(trace, {n: n for n in norms}, "||C_t|| (mean over heads)", **zoom)
    return figs


@register_family(
    "hf_mlstm",
    summary="A released model with mLSTM layers (xLSTM) loaded through transformers: a matrix memory with an "
    "exponential input gate, a forget gate and a normaliser, under the linear memories' hook names",
    matrix_state=("C",),
    figures=mlstm_figures,
    from_config=False,
    readout=True,
    needle_hold=True,
    read_lens=True,
    folders=FolderLoader(Claimed(ARCHITECTURES), load),
)
class MLSTMLM(ReleasedLM):
    """A transformers model with mLSTM layers (module docstring). Its state is transformers' `xLSTMCache` taken
    apart: per layer an `MLSTMLayerState` (C, n, m), in float32 at least (a bfloat16 model's too), every part of it
    memory. Each chunk runs through a cache holding copies of it. Its `hook_mem_out` is the input of the layer's
    `out_proj`: the output gate times the per-head norm of h~_t."""

    architectures = ARCHITECTURES
    delta_rule = False
    read_is = (
        "C_t q_t, the mLSTM's read before the layer divides it by max(|n_t^T q_t|, 1): a writer j's part is "
        "i_j (q_t . k_j) f_{j+1} ... f_t v_j, token j's own write (no convolution before the memory)"
    )
    memory_hooks = {ALPHA: "none", BETA: "none", NORMALISER: "none", STATE_NORM: "none", MEM_OUT: "norm"}
    hook_docs = {
        **{name: doc for name, doc in BACKBONE_HOOK_DOCS.items() if ".attn." not in name},
        ALPHA: HookDoc(
            "[batch, pos, head]",
            "mLSTM layers: forget gate `f_t = sigmoid(f~_t)`, `f~_t = soft_cap(x w_f + b_f)` (read-only)",
        ),
        BETA: HookDoc(
            "[batch, pos, head]",
            "mLSTM layers: input gate `i_t = exp(i~_t)`, `i~_t = soft_cap(x w_i + b_i)`, un-stabilised (read-only)",
        ),
        "blocks.{l}.attn.hook_write_key": HookDoc(
            "[batch, pos, head, d_k]", "mLSTM layers: `k_t`, the projection cut into heads (read-only)"
        ),
        "blocks.{l}.attn.hook_write_value": HookDoc(
            "[batch, pos, head, d_v]", "mLSTM layers: `v_t`, the projection cut into heads (read-only)"
        ),
        "blocks.{l}.attn.hook_read_query": HookDoc(
            "[batch, pos, head, d_k]",
            "mLSTM layers: `q_t`, the projection cut into heads, times `d_k^-1/2` (read-only)",
        ),
        "blocks.{l}.attn.hook_read": HookDoc(
            "[batch, pos, head, d_v]",
            "mLSTM layers: the read `C_t q_t` (`S_t^T q_t`), un-stabilised, before the layer divides it by "
            "`max(|n_t^T q_t|, 1) + eps e^{m_t}` (read-only)",
        ),
        NORMALISER: HookDoc(
            "[batch, pos, head]",
            "mLSTM layers: the normaliser's read `n_t^T q_t`, `n_t = f_t n_{t-1} + i_t k_t` un-stabilised (read-only)",
        ),
        STATE_NORM: HookDoc(
            "[batch, pos, head]", "mLSTM layers: `||C_t||_F`, un-stabilised, after the token's write (read-only)"
        ),
        MEM_OUT: HookDoc(
            "[batch, pos, head, d_v]",
            "mLSTM layers: `o_t` times the per-head norm of `h~_t = C_t q_t / max(|n_t^T q_t|, 1)`, the input of "
            "`out_proj` (what a hook returns replaces it)",
        ),
    }

    def memory_points(self, l: int) -> MemoryHooks:
        return MLSTMHooks()

    def read_path(self, tokens, position: int) -> ReadPath:
        """The path from each mLSTM layer's read C_t q_t to the logits at `position` (`memviz.protocol.ReadPath`),
        every scale frozen at the token: the division h~_t = C_t q_t / (max(|n_t^T q_t|, 1) + eps e^{m_t}) (as
        h~_t / C_t q_t), the per-head layer norm's spread (its centring is linear and stays; its bias is the token's
        own, no writer's), the output gate, `out_proj`; then the final norm, the unembedding and the logits' soft cap
        (as its slope cap tanh(z / cap) / z at each logit z)."""
        names = [*(f"blocks.{l}.attn.hook_read" for l in sorted(self.linear)), last_residual(self)]
        seen: dict[tuple[int, str], Tensor] = {}

        def keep_last(l: int, part: str):
            def hook(module, args, out) -> None:
                seen[(l, part)] = args[0][0, -1].detach()  # chunk by chunk: the last chunk's last token is `position`
                if part == "norm":
                    seen[(l, "normed")] = out[0, -1].detach()

            return hook

        layers = {l: self.memory_layer(l) for l in sorted(self.linear)}
        handles = [
            module.register_forward_hook(keep_last(l, part))
            for l, layer in layers.items()
            for part, module in (("norm", layer.multihead_norm), ("gated", layer.out_proj))
        ]
        try:
            at = captured_at(self, tokens, position, names)
        finally:
            for handle in handles:
                handle.remove()
        paths = {}
        for l, layer in layers.items():
            norm, heads = layer.multihead_norm, layer.config.num_heads
            read = at[f"blocks.{l}.attn.hook_read"]  # [head, d_v]
            divided = seen[(l, "norm")].to("cpu", torch.float64).reshape(read.shape)  # h~_t
            d_v = read.shape[-1]
            spread = (divided.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
            weight = torch.ones(heads * d_v) if norm.weight is None else norm.weight.detach()
            gate = frozen_scale(seen[(l, "gated")].cpu(), seen[(l, "normed")].cpu()).reshape(read.shape)  # o_t
            scale = weight.to("cpu", torch.float64).reshape(read.shape) * gate / spread  # [head, d_v]
            centring = torch.eye(d_v, dtype=torch.float64) - 1 / d_v
            per_head = frozen_scale(divided, read)[..., None] * centring * scale[:, None, :]  # [head, d_v, d_v]
            paths[f"blocks.{l}"] = per_head @ head_blocks(layer.out_proj.weight, heads)
        return ReadPath(position, paths, *self.unembedding_at(at[last_residual(self)]))

    def unembedding_at(self, residual: Tensor) -> tuple[Tensor, Tensor]:
        """`ReleasedLM.unembedding_at`, with the logits' soft cap frozen at the token: each row of the unembedding
        times cap tanh(z / cap) / z at its logit z (1 at z = 0)."""
        final_scale, unembed = super().unembedding_at(residual)
        cap = self.hf.config.output_logit_soft_cap
        if cap is None:
            return final_scale, unembed
        logits = unembed.double() @ (final_scale * residual.to("cpu", torch.float64))
        slope = torch.where(logits != 0, cap * torch.tanh(logits / cap) / torch.where(logits != 0, logits, 1.0), 1.0)
        return final_scale, (slope[:, None] * unembed.double()).to(unembed.dtype)

    def install_memory(self) -> None:
        """Each mLSTM layer's backend module replaced by memviz's kernel (an mLSTM layer has no transformers kernel
        function to map), after refusing head counts that do not divide the layers' widths."""
        for l in sorted(self.linear):
            layer = self.memory_layer(l)
            heads = layer.config.num_heads
            if layer.qk_dim % heads or layer.v_dim % heads:
                raise ReleasedCheckpointError(
                    f"{self.cfg.name or 'the model'}: config.json's num_heads ({heads}) must divide the query and key "
                    f"width hidden_size x qk_dim_factor ({layer.qk_dim}) and the value width hidden_size x "
                    f"v_dim_factor ({layer.v_dim})"
                )
            if not isinstance(layer.mlstm_backend, MLSTMKernel):
                layer.mlstm_backend = MLSTMKernel(layer.mlstm_backend)

    def kernel(self, l: int) -> MLSTMKernel:
        return cast(MLSTMKernel, self.memory_layer(l).mlstm_backend)

    # ----- state --------------------------------------------------------------------------
    def init_state(self, batch_size: int = 1) -> ModelState:
        dtype = self.state_dtype  # transformers' inference state is float32
        layers: list[State] = []
        for l in range(self.cfg.n_layers):
            heads, d_k, d_v = self.arch.state(self.memory_layer(l))
            layers.append(
                MLSTMLayerState(
                    C=torch.zeros(batch_size, heads, d_k, d_v, device=self.device, dtype=dtype),
                    n=torch.zeros(batch_size, heads, d_k, device=self.device, dtype=dtype),
                    m=torch.zeros(batch_size, heads, 1, device=self.device, dtype=dtype),
                )
            )
        return ModelState(0, layers, owner=self.state_owner)

    def run(self, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], None]:
        cache = carried_cache(self.hf.config, state.layers, tokens.device)
        with self.watching():
            out = self.hf(input_ids=tokens, cache=cache, use_cache=True)
        layers: list[State] = [MLSTMLayerState(*cache.rnn_state[l]) for l in range(len(state.layers))]
        return out.logits, layers, None

    # ----- hooks --------------------------------------------------------------------------
    @contextmanager
    def watching(self) -> Iterator[None]:
        try:
            with super().watching():
                yield
        finally:  # a forward that raised left its layer's watch on
            for l in self.linear:
                self.kernel(l).watching = None

    def watch_memory(self, mixer: nn.Module, points: MemoryHooks, add) -> None:
        """The layer's kernel keeps what its hooks want while the layer runs; they get it when the layer returns.
        `hook_mem_out` is `out_proj`'s input cut into heads."""
        kernel = cast(MLSTMKernel, mixer.mlstm_backend)
        if hooked(points.hook_mem_out):
            heads = cast(Any, mixer).config.num_heads

            def gated(m, args, point=points.hook_mem_out):
                value = args[0]
                return (point(value.reshape(*value.shape[:-1], heads, -1)).reshape(value.shape), *args[1:])

            add(cast(Any, mixer).out_proj, "pre_hook", gated)
        wanted = frozenset(n for n in MLSTM_HOOKS if hooked(getattr(points, f"hook_{n}")))
        if not wanted:
            return

        def before(m, args, kwargs) -> None:
            kernel.watching = Watch(wanted)

        def after(m, args, out) -> None:
            kept, kernel.watching = kernel.watching, None
            if kept is None or not kept.calls:
                raise RuntimeError(f"{type(mixer).__name__} ran without memviz's mLSTM kernel; its hooks have nothing")
            seen = kept.seen()
            for name in MLSTM_HOOKS:
                if name in wanted:
                    getattr(points, f"hook_{name}")(seen[name])

        add(mixer, "pre_hook", before, with_kwargs=True)
        add(mixer, "hook", after)

    def cost(self, n_tokens: int) -> dict[str, int]:
        """No attention cache; the mLSTM states (C, n, m per layer, float32 at least), whatever the length; what a
        default trace keeps."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, numbers.Integral) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a whole number of tokens, 0 or more; got {n_tokens!r}")
        state = self.init_state(1)
        return {
            "kv_cache": 0,
            "memory_state": sum(t.numel() * t.element_size() for part in state.layers for t in cast(tuple, part)),
            "trace": 4 * n_tokens * (self.trace_floats_per_token() + 1),  # float32, and the loss
        }
