"""A released language model under memviz's model contract: transformers runs it, memviz watches it.

`ReleasedLM` wraps a transformers causal LM whose memory layers run memviz's linear-memory operator as their
kernel (`recurrence.py`), so one forward computes the layer and the quantities its hooks show, at every token of
prefill, streaming and generation. memviz carries the model's cache as a `ModelState`, so a long input streams
chunk by chunk and a memory can be reset or patched between chunks. The hooks are attached to transformers'
modules only for the length of a call that has hooks (`watching`).

Per memory layer `blocks.{l}.attn.`: `hook_alpha` (the decay, per head or per key channel), `hook_beta`,
`hook_write_key`, `hook_write_value`, `hook_read_query`, `hook_read`, `hook_state_norm` (what the kernel read
and wrote: read-only) and `hook_mem_out` (the read after the layer's norm and gate; what a hook returns replaces
it). Attention layers: the sites their architecture gives (`hook_q`, `hook_k`, `hook_v`, `hook_z`). Every layer:
`blocks.{l}.hook_resid_pre`, `hook_attn_out`, `hook_mlp_out`, `hook_resid_post` (what a hook returns replaces the
value). Each family (`gated_deltanet.py`, `kimi_delta_attention.py`) documents its hooks in its paper's notation.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz.layers import LocalCache
from memviz.linear_memory import span_hold, split_read
from memviz.protocol import ModelState, Readout
from memviz.running import StreamingLM, hooked
from memviz.state import Memory, State
from memviz.tokenizer import Tokenizer

from .architecture import Architecture
from .recurrence import CHANNEL_CHUNK, CHUNK, Watch, install, installed, watch, watching_of

#: what each memory layer's kernel shows (recurrence.Watch), in hook order
MEMORY_HOOKS = ("alpha", "beta", "write_key", "write_value", "read_query", "read", "state_norm")
RESIDUAL_HOOKS = ("resid_pre", "attn_out", "mlp_out", "resid_post")
DEFAULT_SEGMENT = 512


class MemoryLayerState(NamedTuple):
    """A released memory layer's state: the short convolution's last inputs [B, conv_dim, K] (a cache) and the
    memory S [B, H, d_k, d_v]."""

    conv: Tensor
    S: Memory[Tensor]


@dataclass
class ReleasedConfig:
    """What memviz shows of a released model's config (transformers' own is `model.hf.config`)."""

    model_type: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_head: int
    linear_layers: list[int]
    family: str
    segment_len: int = DEFAULT_SEGMENT  # where reset and patch act (memviz.interventions)
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


class MemoryHooks(nn.Module):
    """The HookPoints of one memory layer (module docstring)."""

    # set by __init__; declared for their type
    hook_alpha: HookPoint
    hook_beta: HookPoint
    hook_write_key: HookPoint
    hook_write_value: HookPoint
    hook_read_query: HookPoint
    hook_read: HookPoint
    hook_state_norm: HookPoint
    hook_mem_out: HookPoint

    def __init__(self) -> None:
        super().__init__()
        for name in (*MEMORY_HOOKS, "mem_out"):
            setattr(self, f"hook_{name}", HookPoint())


class AttentionHooks(nn.Module):
    """The HookPoints of one attention layer, those its architecture has sites for."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        for name in names:
            setattr(self, name, HookPoint())


class LayerHooks(nn.Module):
    # set by __init__; declared for their type
    attn: MemoryHooks | AttentionHooks
    hook_resid_pre: HookPoint
    hook_attn_out: HookPoint
    hook_mlp_out: HookPoint
    hook_resid_post: HookPoint

    def __init__(self, attn: MemoryHooks | AttentionHooks) -> None:
        super().__init__()
        self.attn = attn
        for name in RESIDUAL_HOOKS:
            setattr(self, f"hook_{name}", HookPoint())


class ReleasedLM(StreamingLM):
    """A transformers causal LM with memory layers under memviz's model contract (module docstring); a family
    subclasses it with its hook docs and registers it.

    State: per memory layer a `MemoryLayerState` (the convolution's last inputs and S), per attention layer a
    `LocalCache` of what transformers caches (k, v after RoPE; an MLA layer's compressed latents). Reset and patch
    act on S alone: the convolution's last tokens and the attention caches are kept."""

    cfg: ReleasedConfig
    decay_per_channel = False  # whether alpha_t is a vector over key channels (the family says)
    hf: Any  # transformers' causal LM (its modules are typed loosely)

    def __init__(
        self,
        hf_model: Any,
        tokenizer: Tokenizer,
        cfg: ReleasedConfig,
        arch: Architecture,
        card: dict | None = None,
    ) -> None:
        super().__init__(cfg, tokenizer, card)
        self.hf = hf_model
        self.arch = arch
        self.linear = set(cfg.linear_layers)
        self.blocks = nn.ModuleList(
            LayerHooks(
                MemoryHooks()
                if l in self.linear
                else AttentionHooks(arch.attention_sites(arch.attention(self.decoder_layers[l])))
            )
            for l in range(cfg.n_layers)
        )
        install(self.hf)
        unmapped = [l for l in sorted(self.linear) if len(installed(self.memory_layer(l))) < 2]
        if unmapped:
            import transformers

            raise RuntimeError(
                f"transformers {transformers.__version__} does not send layer {unmapped[0]}'s recurrence through "
                "Hugging Face's kernel mapping (transformers 5.25 with kernels 0.19 does), so memviz cannot read it"
            )
        self.setup()

    @property
    def decoder_layers(self) -> Sequence[Any]:
        return self.hf.model.layers

    def memory_layer(self, l: int) -> Any:
        return self.arch.memory(self.decoder_layers[l])

    # ----- state --------------------------------------------------------------------------
    def init_state(self, batch_size: int = 1) -> ModelState:
        layers: list[State] = []
        for l in range(self.cfg.n_layers):
            if l in self.linear:
                mixer = self.memory_layer(l)
                channels, _, width = mixer.conv1d.weight.shape
                heads, d_k, d_v = self.arch.state(mixer)
                layers.append(
                    MemoryLayerState(
                        conv=torch.zeros(batch_size, channels, width, device=self.device),
                        S=torch.zeros(batch_size, heads, d_k, d_v, device=self.device),
                    )
                )
            else:
                empty = torch.zeros(batch_size, 1, 0, 1, device=self.device)
                layers.append(LocalCache(empty, empty.clone()))
        return ModelState(0, self.in_model_dtype(layers))

    def cache_from(self, state: ModelState):
        """A transformers cache holding copies of `state` (the layers write their cache in place). A part
        that is all zeros is left out, so transformers starts it as its own one-pass forward does."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf.config)
        for l, part in enumerate(state.layers):
            if isinstance(part, LocalCache):
                if part.k.shape[2]:
                    cache.update(part.k, part.v, l)
                continue
            part = cast(MemoryLayerState, part)  # what init_state builds for a memory layer
            if part.conv.any():
                cache.update_conv_state(part.conv.clone(), l)
            if part.S.any():
                cache.update_recurrent_state(part.S.clone(), l)
        return cache

    def state_from(self, cache, before: ModelState) -> list[State]:
        """`before` with what the cache now holds (a layer the chunk did not reach keeps its part)."""
        layers: list[State] = []
        for l, part in enumerate(before.layers):
            if isinstance(part, LocalCache):
                layer = cache.layers[l]
                layers.append(LocalCache(layer.keys, layer.values) if layer.is_initialized else part)
            else:
                part = cast(MemoryLayerState, part)  # what init_state builds for a memory layer
                conv, S = cache.get_conv_state(l), cache.get_recurrent_state(l)
                layers.append(MemoryLayerState(part.conv if conv is None else conv, part.S if S is None else S))
        return layers

    # ----- running ------------------------------------------------------------------------
    def run(self, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], None]:
        cache = self.cache_from(state)
        positions = torch.arange(state.pos, state.pos + tokens.shape[1], device=tokens.device).expand(
            tokens.shape[0], -1
        )
        with self.watching():
            out = self.hf(input_ids=tokens, position_ids=positions, cache=cache, use_cache=True)
        return out.logits, self.state_from(cache, state), None

    @contextmanager
    def watching(self) -> Iterator[None]:
        """transformers hooks, for one call, that pass its values through the HookPoints that have hooks."""
        handles = []

        def add(module: nn.Module, kind: str, fn, **kwargs) -> None:
            handles.append(getattr(module, f"register_forward_{kind}")(fn, **kwargs))

        for l, (layer, points) in enumerate(zip(self.decoder_layers, cast(Iterable[LayerHooks], self.blocks))):
            mixer = self.memory_layer(l) if l in self.linear else self.arch.attention(layer)
            if hooked(points.hook_resid_pre):
                add(layer, "pre_hook", lambda m, args, p=points.hook_resid_pre: (p(args[0]), *args[1:]))
            for module, point in ((layer, points.hook_resid_post), (layer.mlp, points.hook_mlp_out)):
                if hooked(point):
                    add(module, "hook", lambda m, args, out, p=point: p(out))
            if hooked(points.hook_attn_out):
                add(
                    mixer,
                    "hook",
                    lambda m, args, out, p=points.hook_attn_out: (
                        (p(out[0]), *out[1:]) if isinstance(out, tuple) else p(out)
                    ),
                )
            if l in self.linear:
                self.watch_memory(mixer, cast(MemoryHooks, points.attn), add)
            else:
                self.watch_attention(mixer, cast(AttentionHooks, points.attn), add)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for l in self.linear:  # a forward that raised left its layer's watch on
                watch(self.memory_layer(l), None)

    def watch_attention(self, attn: nn.Module, points: AttentionHooks, add) -> None:
        for name, site in self.arch.attention_sites(attn).items():
            point = getattr(points, name)
            if not hooked(point):
                continue

            def heads(value: Tensor, point=point, d=site.head_dim) -> Tensor:
                return point(value.reshape(*value.shape[:2], -1, d)).reshape(value.shape)

            if site.side == "output":
                add(site.module, "hook", lambda m, args, out, f=heads: f(out))
            else:
                add(site.module, "pre_hook", lambda m, args, f=heads: (f(args[0]), *args[1:]))

    def watch_memory(self, mixer: nn.Module, points: MemoryHooks, add) -> None:
        """The memory layer's kernel keeps what it saw while the layer runs (recurrence.Watch); its hooks get it
        when the layer returns. `hook_mem_out` is the read norm's output, cut into heads."""
        wanted = [n for n in MEMORY_HOOKS if hooked(getattr(points, f"hook_{n}"))]
        heads, _, d_v = self.arch.state(mixer)
        shape: dict[str, Any] = {}

        def before(m, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            shape["batch, pos"] = hidden.shape[:2]
            watch(mixer, Watch(frozenset(wanted)) if wanted else None)

        add(mixer, "pre_hook", before, with_kwargs=True)
        if hooked(points.hook_mem_out):
            norm = self.arch.read_norm(mixer)
            add(
                norm,
                "hook",
                lambda m, args, out: points.hook_mem_out(out.reshape(*shape["batch, pos"], heads, d_v)).reshape(
                    out.shape
                ),
            )
        if not wanted:
            return

        def after(m, args, out) -> None:
            kept = watching_of(mixer)
            watch(mixer, None)
            if kept is None or not kept.calls:
                raise RuntimeError(f"{type(mixer).__name__} ran without memviz's kernel; its hooks have nothing")
            seen = kept.seen()
            for name in wanted:
                getattr(points, f"hook_{name}")(seen[name])

        add(mixer, "hook", after)

    def cost(self, n_tokens: int) -> dict[str, int]:
        """Bytes a run over `n_tokens` holds beyond the weights: the attention layers' cache (it grows with the
        input), the memory layers' states (fixed), what a default trace keeps."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, numbers.Integral) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a whole number of tokens, 0 or more; got {n_tokens!r}")
        item, state = torch.finfo(self.dtype).bits // 8, self.init_state(1)
        attention_layers = self.cfg.n_layers - len(self.linear)
        memory = sum(p.S.numel() + p.conv.numel() for p in state.layers if isinstance(p, MemoryLayerState))
        shapes = [self.arch.state(self.memory_layer(l)) for l in self.linear]
        decays = sum(heads * (d_k if self.decay_per_channel else 1) for heads, d_k, _ in shapes)
        # alpha (per head, or per head and key channel), beta, ||S_t|| and |mem_out| per head, the loss: float32
        return {
            "kv_cache": attention_layers * self.arch.kv_numbers(self.hf.config) * n_tokens * item,
            "memory_state": memory * item,
            "trace": 4 * n_tokens * (decays + 3 * sum(heads for heads, _, _ in shapes) + 1),
        }

    # ----- introspection ------------------------------------------------------------------
    def memory_readout(self, tokens, position: int) -> Readout:
        """o_t = S_t^T q_t at `position`, per memory layer, as a sum over writes
        (`memviz.linear_memory.split_read`). The part at j is write j's: its k_j and v_j mix tokens j-3..j
        through the layer's short convolution."""
        what = "o_t = S_t^T q_t, the memory's read before the layer's gated norm"
        return split_read(self, tokens, position, sorted(self.linear), what)

    def needle_hold(self, tokens, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """Per memory layer, the part of the state the span's writes left over its peak
        (`memviz.linear_memory.span_hold`)."""
        return span_hold(self, tokens, span, sorted(self.linear), CHANNEL_CHUNK if self.decay_per_channel else CHUNK)
