"""Released models whose memory layers are Griffin's Real-Gated Linear Recurrent Unit (RG-LRU; De et al., arXiv
2402.19427, Section 2.4, eq. 1-4): RecurrentGemma (`recurrent_gemma.py`; Botev et al., arXiv 2404.07839), traced
under the hook names memviz's linear memories share where the meaning is the same.

Per channel c of the recurrence's width a scalar state h, with a decay per channel and token and an additive,
normalised write (eq. 1-4):

  r_t = sigmoid(W_a x_t + b_a),   i_t = sigmoid(W_x x_t + b_x)                        (1), (2)
  a_t = a^(c r_t),  a = sigmoid(Lambda), c = 8, i.e. log a_t = -8 r_t softplus(-Lambda)   (3)
  h_t = a_t o h_{t-1} + sqrt(1 - a_t^2) o (i_t o x_t)                                  (4)

What transformers computes (`RecurrentGemmaRecurrentBlock`, `RecurrentGemmaRglru`, transformers 5.25), and what
memviz computes here in its place: the block's input u goes two ways, y_t = gelu_tanh(linear_y(u_t)) and
x_t = conv(linear_x(u_t)), a causal depthwise convolution with bias over `conv1d_width` tokens (4); W_a and W_x are
block-diagonal, one [block_width, block_width] matrix per head (`num_attention_heads` blocks), applied as x W + b;
transformers stores `recurrent_param` = -Lambda, so log a_t = -8 r_t softplus(recurrent_param); the block's value
is linear_out(h_t o y_t). A token at position 0 (`position_ids == 0`, a document's start) resets: transformers
multiplies a_t by 0 there and writes i_t o x_t unscaled (multiplier 1). Its scan accumulates h in float32 whatever
the model's dtype (a float64 model's too) and keeps h in the module attribute `rg_lru.recurrent_states`, the
convolution's last `conv1d_width - 1` inputs in `conv1d_state`; a multi-token call restarts its convolution from
zeros (its prefill path ignores `conv1d_state`), so transformers' own chunked forward is not its one pass.

memviz replaces each recurrent block's forward, per model instance (`install`), by `recurrent_block_forward`: the
same computation with the convolution continued from the cached inputs (so a streamed run equals one pass) and the
recurrence (4) run as memviz's linear-memory operator (`memviz_kernels.dispatch.linear_memory`) without the delta
rule. The layout: every channel is a head with d_k = d_v = 1, S_t = h_t, the scalar log decay g_t = log a_t, the
key the write scale sqrt(1 - a_t^2) i_t (the hooks' beta_t times their key 1), the value x_t and the query 1, so
the operator's read o_t = S_t^T q_t is h_t exactly. No layout with fewer heads keeps o_t = h_t: a head's read is
one number per d_v, and a decay per key channel acts on rows of S, so a head holding several channels of h (d_k =
channels, d_v = 1) reads only a weighted sum of them (a one-hot query reads one channel a head, the same number of
heads again). The convolution (transformers' own formula for a one-token step), the projections and the gates'
pre-activations run in the model's dtype, as transformers runs them; the sigmoids, a_t, the write scale and the
recurrence in float32 at least (float64 for a float64 model; transformers computes the first three in the model's
dtype, the same numbers in float32). With d_v = 1 and no delta rule the operator runs this as a diagonal
recurrence, a parallel prefix scan over each chunk's tokens.

A reset mid-call (packed documents) splits the call there, and the rows that reset start from a zero state; at a
reset `hook_alpha` shows transformers' a_t = 0 and the operator gets g = 0 (its incoming state is already zero).
The read `hook_read` is h_t; the read-out splits it over the writers j (weight prod_{s=j+1..t} a_s of write j's
sqrt(1 - a_j^2) i_j x_j), a writer's x_j mixing tokens j-3..j through the convolution. The local attention layers
(a sliding window of `attention_window_size` tokens) and the MLPs are transformers' own.
"""

from __future__ import annotations

import numbers
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz.figure_parts import WIDTH, layer_names, layer_prefix, position_heatmap, timeline
from memviz.layers import LocalCache
from memviz.linear_memory import span_hold
from memviz.protocol import HookDoc, ModelState
from memviz.registry import FolderLoader, register_family
from memviz.running import hooked
from memviz.state import State
from memviz_kernels.dispatch import linear_memory

from .architecture import Architecture, Claimed
from .gated_deltanet import ALPHA, BETA, MEM_OUT, STATE_NORM
from .loading import load
from .model import (
    BACKBONE_HOOK_DOCS,
    MEMORY_HOOKS,
    MemoryHooks,
    MemoryLayerState,
    ReleasedLM,
)
from .recurrence import CHANNEL_CHUNK, Watch, keep

#: model_type -> its architecture; each architecture module adds its own
ARCHITECTURES: dict[str, Architecture] = {}

#: c of eq. 3: log a_t = -c r_t softplus(-Lambda)
RATE = 8.0
#: the RG-LRU's own hooks beside the shared memory hooks: its gates r_t and i_t (eq. 1, 2)
GATE_HOOKS = ("input_gate", "recurrence_gate")
INPUT_GATE, RECURRENCE_GATE = "blocks.{l}.attn.hook_input_gate", "blocks.{l}.attn.hook_recurrence_gate"
#: where a recurrent block keeps its watch (a `recurrence.Watch`) for the forward under way
WATCH = "memviz_watch"


# ----- the recurrence -----------------------------------------------------------------------
def run_rg_lru(
    lru: Any, x: Tensor, position_ids: Tensor, h0: Tensor | None, watch: Watch | None
) -> tuple[Tensor, Tensor]:
    """Eq. 1-4 over x [B, T, W] (after the convolution, in the model's dtype) from h0 [B, W] (None: zeros) as the
    operator (module docstring) -> (h [B, T, W] in x's dtype, the last h [B, W] in the work dtype); with a
    `watch`, what its hooks want is kept in it."""
    B, T, W = x.shape
    work = torch.promote_types(x.dtype, torch.float32)
    blocks = x.reshape(B * T, lru.num_attention_heads, lru.block_width).transpose(0, 1)  # [heads, B T, block]

    def gate(weight: Tensor, bias: Tensor) -> Tensor:  # block-diagonal x W + b, as transformers computes it
        pre = torch.baddbmm(bias[:, None, :], blocks, weight)
        return torch.sigmoid(pre.transpose(0, 1).reshape(B, T, W).to(work))

    i, r = gate(lru.input_gate_weight, lru.input_gate_bias), gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias)
    log_a = -RATE * r * F.softplus(lru.recurrent_param.to(work))  # eq. 3
    reset = (position_ids == 0).expand(B, T)[..., None]  # [B, T, 1]: a document starts here
    beta = torch.where(reset, 1.0, torch.sqrt(1 - torch.exp(2 * log_a))) * i  # eq. 4's write scale
    values = x.to(work)
    S = x.new_zeros(B, W, 1, 1, dtype=work) if h0 is None else h0.to(work).reshape(B, W, 1, 1)

    def heads_first(t: Tensor) -> Tensor:  # [B, T, W] -> the operator's [B, W, T, 1]
        return t.transpose(1, 2)[..., None]

    q, k, v = heads_first(torch.ones_like(beta)), heads_first(beta), heads_first(values)
    g = torch.where(reset, 0.0, log_a).transpose(1, 2)  # a reset row's incoming state is zeroed instead
    later = reset[:, 1:, 0].any(0).nonzero().flatten().add(1).tolist() if T > 1 else []
    starts = [0, *later]
    reads = []
    for start, stop in zip(starts, [*starts[1:], T]):
        S = torch.where(reset[:, start, :, None, None], 0.0, S)
        (o, _), S = linear_memory(
            q[:, :, start:stop],
            k[:, :, start:stop],
            v[:, :, start:stop],
            g[:, :, start:stop],
            None,
            S,
            CHANNEL_CHUNK,
            state_norms=False,
        )
        assert o is not None  # the operator reads with the q it is given
        reads.append(o)
    read = torch.cat(reads, 2)[..., 0].transpose(1, 2)  # [B, T, W]: h_t
    if watch is not None:
        ones = torch.ones_like(values)[..., None]
        keep(
            watch,
            alpha=torch.where(reset, 0.0, log_a.exp()),
            beta=beta,
            write_key=ones,
            write_value=values[..., None],
            read_query=ones,
            read=read[..., None],
            state_norm=read.abs(),
            input_gate=i,
            recurrence_gate=r,
        )
    return read.to(x.dtype), S.reshape(B, W)


def recurrent_block_forward(
    block: Any, input_states: Tensor, position_ids: Tensor, attention_mask: Any = None, use_cache: bool = True, **kw
) -> tuple[Tensor, None]:
    """transformers' `RecurrentGemmaRecurrentBlock.forward` (its signature) with its convolution continued from
    `conv1d_state` on every call and its RG-LRU through `run_rg_lru` (module docstring). With `use_cache` the block
    reads and leaves its state in its module attributes (`conv1d_state`, `rg_lru.recurrent_states`), as
    transformers' block does; without, it starts from zeros and keeps nothing."""
    B, T, _ = input_states.shape
    width, K = block.lru_width, block.conv1d_width
    y = block.act_fn(block.linear_y(input_states))
    x = block.linear_x(input_states).transpose(1, 2)  # [B, W, T]
    if use_cache and (block.conv1d_state is None or block.conv1d_state.shape[:2] != (B, width)):
        block.conv1d_state = x.new_zeros(B, width, K - 1)
        block.rg_lru.recurrent_states = x.new_zeros(B, width, dtype=torch.promote_types(x.dtype, torch.float32))
    past = block.conv1d_state.to(x.dtype) if use_cache else x.new_zeros(B, width, K - 1)
    joined = torch.cat([past, x], -1)
    if T == 1:  # transformers' decoding step, its formula
        x = ((joined * block.conv_1d.weight[:, 0, :]).sum(-1) + block.conv_1d.bias)[:, None]  # [B, 1, W]
    else:
        x = F.conv1d(joined, block.conv_1d.weight, block.conv_1d.bias, groups=width).transpose(1, 2)  # [B, T, W]
    h0 = block.rg_lru.recurrent_states if use_cache else None
    h, last = run_rg_lru(block.rg_lru, x, position_ids, h0, block.__dict__.get(WATCH))
    if use_cache:
        block.conv1d_state = joined[:, :, joined.shape[-1] - (K - 1) :].clone()
        block.rg_lru.recurrent_states = last
    else:
        block.conv1d_state = block.rg_lru.recurrent_states = None
    return block.linear_out(h * y), None


def recurrent_blocks(hf: Any) -> list[Any]:
    """The recurrent blocks of a transformers RecurrentGemma (the temporal blocks with an RG-LRU)."""
    return [layer.temporal_block for layer in hf.model.layers if hasattr(layer.temporal_block, "rg_lru")]


def install(hf: Any) -> None:
    """Give every recurrent block of this model instance memviz's forward (`recurrent_block_forward`)."""
    for block in recurrent_blocks(hf):
        block.forward = types.MethodType(recurrent_block_forward, block)


def uninstall(hf: Any) -> None:
    """Give this model instance's recurrent blocks transformers' own forward back."""
    for block in recurrent_blocks(hf):
        block.__dict__.pop("forward", None)
        block.__dict__.pop(WATCH, None)


def installed(block: Any) -> bool:
    """Whether a recurrent block runs memviz's forward."""
    return getattr(block.__dict__.get("forward"), "__func__", None) is recurrent_block_forward


# ----- the family ---------------------------------------------------------------------------
class RGLRUHooks(MemoryHooks):
    """An RG-LRU layer's HookPoints: the memory hooks every released model has and its gates."""

    hook_input_gate: HookPoint
    hook_recurrence_gate: HookPoint

    def __init__(self) -> None:
        super().__init__(f"hook_{name}" for name in GATE_HOOKS)


def rg_lru_figures(trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict:
    """Per RG-LRU layer its decay a_t over tokens and channels (which channels keep: rows near 1); the write
    scale sqrt(1 - a_t^2) i_t averaged over channels; ||h_t||."""
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)  # the figure helpers' keywords
    figs = {}
    for name in layer_names(trace, ALPHA):
        layer = layer_prefix(name, ALPHA).split(".attn")[0]
        figs[f"{layer} alpha"] = position_heatmap(
            trace, name, f"{layer}: decay a_t per channel (1 keeps the state)", "channel", zmin=0, zmax=1,
            reduce="min", **zoom,
        )  # fmt: skip
    scales = layer_names(trace, BETA)
    if scales:
        figs["write scale"] = timeline(
            trace, {n: n for n in scales}, "write scale sqrt(1 - a_t^2) i_t (mean over channels)", **zoom
        )
    norms = layer_names(trace, STATE_NORM)
    if norms:
        figs["state norm"] = timeline(trace, {n: n for n in norms}, "||h_t|| (over the layer's channels)", **zoom)
    return figs


@register_family(
    "hf_rg_lru",
    summary="A released model with Griffin's RG-LRU layers (RecurrentGemma) loaded through transformers: a decay "
    "per channel and an additive, normalised write, under the linear memories' hook names",
    figures=rg_lru_figures,
    from_config=False,
    readout=True,
    needle_hold=True,
    folders=FolderLoader(Claimed(ARCHITECTURES), load),
)
class RGLRULM(ReleasedLM):
    """A transformers model with RG-LRU layers (module docstring).

    State: per recurrent layer a `MemoryLayerState`, the convolution's last `conv1d_width - 1` inputs [B, W, K-1]
    (in the model's dtype, as transformers keeps them) and S = h [B, W, 1, 1] (a head per channel; float32 at
    least, as transformers keeps it); per local attention layer a `LocalCache` of its last `attention_window_size
    - 1` keys (after RoPE) and values. Reset and patch act on h alone."""

    architectures = ARCHITECTURES
    delta_rule = False
    read_is = (
        "h_t per channel, the RG-LRU's read before the gelu branch multiplies it; a writer's x_j mixes tokens "
        "j-3..j through the short convolution"
    )
    # a trace keeps the decay a channel and, a layer, the mean write scale and the norms of h_t and the output
    memory_hooks = {ALPHA: "none", BETA: "mean", STATE_NORM: "norm", MEM_OUT: "norm"}
    hook_docs = {
        **BACKBONE_HOOK_DOCS,
        ALPHA: HookDoc(
            "[batch, pos, channel]",
            "RG-LRU layers: decay `a_t = exp(-8 r_t softplus(-Lambda))` per channel (eq. 3); 0 at position 0, where "
            "transformers resets (read-only)",
        ),
        BETA: HookDoc(
            "[batch, pos, channel]",
            "RG-LRU layers: write scale `sqrt(1 - a_t^2) i_t` (eq. 4; `i_t` at position 0), the write is it times "
            "`x_t` (read-only)",
        ),
        "blocks.{l}.attn.hook_write_key": HookDoc(
            "[batch, pos, channel, 1]",
            "RG-LRU layers: 1, the key of a head per channel (the write `beta_t x_t` is the write scale times the "
            "value) (read-only)",
        ),
        "blocks.{l}.attn.hook_write_value": HookDoc(
            "[batch, pos, channel, 1]", "RG-LRU layers: `x_t` after the short convolution (read-only)"
        ),
        "blocks.{l}.attn.hook_read_query": HookDoc(
            "[batch, pos, channel, 1]", "RG-LRU layers: 1, the query of a head per channel (read-only)"
        ),
        "blocks.{l}.attn.hook_read": HookDoc(
            "[batch, pos, channel, 1]", "RG-LRU layers: the read `h_t` (eq. 4), before the gelu branch (read-only)"
        ),
        STATE_NORM: HookDoc(
            "[batch, pos, channel]", "RG-LRU layers: `|h_t|`, a channel's state after the token's write (read-only)"
        ),
        INPUT_GATE: HookDoc(
            "[batch, pos, channel]", "RG-LRU layers: input gate `i_t = sigmoid(x_t W_x + b_x)` (eq. 2) (read-only)"
        ),
        RECURRENCE_GATE: HookDoc(
            "[batch, pos, channel]",
            "RG-LRU layers: recurrence gate `r_t = sigmoid(x_t W_a + b_a)` (eq. 1) (read-only)",
        ),
        MEM_OUT: HookDoc(
            "[batch, pos, channel]",
            "RG-LRU layers: the block's `h_t gelu(linear_y(u_t))`, before `linear_out` (what a hook returns "
            "replaces it)",
        ),
    }

    def memory_points(self, l: int) -> MemoryHooks:
        return RGLRUHooks()

    def install_memory(self) -> None:
        install(self.hf)  # the RG-LRU has no transformers kernel to map: its blocks' forward is replaced

    @property
    def attention_span(self) -> int | None:
        return int(self.hf.config.attention_window_size)

    # ----- state --------------------------------------------------------------------------
    def init_state(self, batch_size: int = 1) -> ModelState:
        layers: list[State] = []
        for l in range(self.cfg.n_layers):
            if l in self.linear:
                block = self.memory_layer(l)
                width = block.lru_width
                layers.append(
                    MemoryLayerState(
                        conv=torch.zeros(
                            batch_size, width, block.conv1d_width - 1, device=self.device, dtype=self.dtype
                        ),
                        S=torch.zeros(batch_size, width, 1, 1, device=self.device, dtype=self.state_dtype),
                    )
                )
            else:
                layers.append(self.empty_cache(l, batch_size))
        return ModelState(0, layers, owner=self.state_owner)

    def cache_from(self, state: ModelState):
        """A transformers cache holding the attention layers' keys and values (counting `state.pos` tokens seen,
        which its sliding-window mask reads), and the recurrent blocks' module attributes set to the state."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicSlidingWindowLayer

        cache = DynamicCache(config=self.hf.config)
        for l, part in enumerate(state.layers):
            if isinstance(part, LocalCache):
                if part.k.shape[2]:
                    cache.update(part.k, part.v, l)
                    layer = cache.layers[l]
                    if isinstance(layer, DynamicSlidingWindowLayer):  # it holds the last window - 1 tokens
                        layer.cumulative_length = state.pos
            else:
                memory = cast(MemoryLayerState, part)  # what init_state builds for a recurrent layer
                block = self.memory_layer(l)
                block.conv1d_state, block.rg_lru.recurrent_states = memory.conv, memory.S.flatten(1)
        return cache

    def state_from(self, cache, before: ModelState) -> list[State]:
        """`before` with what the cache and the recurrent blocks now hold."""
        layers: list[State] = []
        for l, part in enumerate(before.layers):
            if isinstance(part, LocalCache):
                layer = cache.layers[l]
                kept = getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None
                layers.append(LocalCache(layer.keys, layer.values) if kept else part)
            else:
                block = self.memory_layer(l)
                conv, h = block.conv1d_state, block.rg_lru.recurrent_states
                memory = cast(MemoryLayerState, part)
                S = memory.S if h is None else h.to(memory.S.dtype).reshape(memory.S.shape)
                layers.append(MemoryLayerState(memory.conv if conv is None else conv, S))
        return layers

    def forget(self) -> None:
        """The recurrent blocks' module attributes back to None (transformers' state before any call)."""
        for l in self.linear:
            block = self.memory_layer(l)
            block.conv1d_state = block.rg_lru.recurrent_states = None
            block.__dict__.pop(WATCH, None)

    # ----- running ------------------------------------------------------------------------
    def run(self, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], None]:
        rows = {cast(MemoryLayerState, state.layers[l]).S.shape[0] for l in self.linear} - {tokens.shape[0]}
        if rows:
            raise ValueError(
                f"the state holds {rows.pop()} sequence(s) but the tokens {tokens.shape[0]}: give a state made for "
                "this batch (init_state(batch_size))"
            )
        unmapped = [l for l in sorted(self.linear) if not installed(self.memory_layer(l))]
        if unmapped:
            raise RuntimeError(
                f"layer {unmapped[0]}'s recurrent block runs transformers' own forward (rg_lru.uninstall?), not "
                "memviz's: rg_lru.install(model.hf) gives it back"
            )
        try:
            return super().run(tokens, state)
        finally:
            self.forget()

    @contextmanager
    def watching(self) -> Iterator[None]:
        try:
            with super().watching():
                yield
        finally:  # a forward that raised left its watch on
            for l in self.linear:
                self.memory_layer(l).__dict__.pop(WATCH, None)

    def watch_memory(self, mixer: nn.Module, points: MemoryHooks, add) -> None:
        """The block keeps what its hooks want while it runs (a `recurrence.Watch`); they get it when the block
        returns. `hook_mem_out` is `linear_out`'s input."""
        if hooked(points.hook_mem_out):
            linear_out = cast(nn.Module, mixer.linear_out)
            add(linear_out, "pre_hook", lambda m, args: (points.hook_mem_out(args[0]), *args[1:]))
        wanted = [n for n in (*MEMORY_HOOKS, *GATE_HOOKS) if hooked(getattr(points, f"hook_{n}"))]
        if not wanted:
            return

        def before(m, args) -> None:
            mixer.__dict__[WATCH] = Watch(frozenset(wanted))

        def after(m, args, out) -> None:
            kept = mixer.__dict__.pop(WATCH, None)
            if kept is None or not kept.calls:
                raise RuntimeError(f"{type(mixer).__name__} ran without memviz's forward; its hooks have nothing")
            seen = kept.seen()
            for name in wanted:
                getattr(points, f"hook_{name}")(seen[name])

        add(mixer, "pre_hook", before)
        add(mixer, "hook", after)

    def cost(self, n_tokens: int) -> dict[str, int]:
        """Bytes a run over `n_tokens` carries beyond the weights: the local attention's cache (at most
        `attention_window_size - 1` tokens a layer), the recurrent layers' states (fixed), what a default trace
        keeps."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, numbers.Integral) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a whole number of tokens, 0 or more; got {n_tokens!r}")
        item, state = torch.finfo(self.dtype).bits // 8, self.init_state(1)
        config = self.hf.config
        attention_layers = sum(1 for part in state.layers if isinstance(part, LocalCache))
        cached = min(int(n_tokens), config.attention_window_size - 1)
        memory = sum(
            t.numel() * t.element_size() for p in state.layers if isinstance(p, MemoryLayerState) for t in (p.conv, p.S)
        )
        return {
            "kv_cache": attention_layers * self.arch.kv_numbers(config) * cached * item,
            "memory_state": memory,
            "trace": 4 * n_tokens * (self.trace_floats_per_token() + 1),  # float32, and the loss
        }

    def needle_hold(self, tokens, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """Per RG-LRU layer, the part of h the span's writes left over its peak, the largest over channels
        (`memviz.linear_memory.span_hold`)."""
        return span_hold(self, tokens, span, sorted(self.linear), CHANNEL_CHUNK, self.delta_rule)
