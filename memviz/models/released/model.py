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
`blocks.{l}.hook_resid_pre`, `hook_attn_out`, `hook_resid_post`, and `hook_mlp_out` where the layer has an MLP
(what a hook returns replaces the value). Each family (`gated_deltanet.py`, `kimi_delta_attention.py`, `ssd.py`,
`selective_scan.py`) documents its hooks in its paper's notation.
"""

from __future__ import annotations

import functools
import json
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz.layers import LocalCache
from memviz.linear_memory import layer_hooks, span_hold, split_read
from memviz.model import BLOCK_HOOK_DOCS
from memviz.protocol import HookDoc, ModelState, Readout, ReadPath
from memviz.read_lens import captured_at, frozen_scale, head_blocks, last_residual
from memviz.running import StreamingLM, hooked
from memviz.state import Memory, State
from memviz.tokenizer import Tokenizer

from .architecture import Architecture
from .recurrence import CHANNEL_CHUNK, CHUNK, Watch, install, installed, memory_kernels, watch, watching_of

#: what each memory layer's kernel shows (recurrence.Watch), in hook order
MEMORY_HOOKS = ("alpha", "beta", "write_key", "write_value", "read_query", "read", "state_norm")
RESIDUAL_HOOKS = ("resid_pre", "attn_out", "mlp_out", "resid_post")
DEFAULT_SEGMENT = 512

#: the hooks of a released model outside its memory layers: the decoder layers' residual hooks, as memviz's own
#: blocks have them, and the attention layers' sites
BACKBONE_HOOK_DOCS = {
    **{f"blocks.{{l}}.hook_{name}": BLOCK_HOOK_DOCS[f"blocks.{{l}}.hook_{name}"] for name in RESIDUAL_HOOKS},
    "blocks.{l}.attn.hook_q": HookDoc(
        "[batch, pos, head, d_head]", "attention layers: queries (after q_norm where there is one), before RoPE"
    ),
    "blocks.{l}.attn.hook_k": HookDoc(
        "[batch, pos, head, d_head]", "attention layers: keys (after k_norm where there is one), before RoPE"
    ),
    "blocks.{l}.attn.hook_v": HookDoc("[batch, pos, head, d_head]", "attention layers: values"),
    "blocks.{l}.attn.hook_z": HookDoc(
        "[batch, pos, head, d_head]", "attention layers: output per head (after an output gate), before `o_proj`"
    ),
}


class MemoryLayerState(NamedTuple):
    """A released memory layer's state: the short convolution's last inputs [B, conv_dim, K] (a cache), the
    memory S [B, H, d_k, d_v] and, in a layer that also attends beside its memory (Falcon-H1), that attention's
    cache."""

    conv: Tensor
    S: Memory[Tensor]
    attention: LocalCache | None = None


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

    def __init__(self, attention_sites: Iterable[str] = ()) -> None:
        super().__init__()
        for name in (*MEMORY_HOOKS, "mem_out"):
            setattr(self, f"hook_{name}", HookPoint())
        for name in attention_sites:  # a layer that also attends beside its memory (Falcon-H1)
            setattr(self, name, HookPoint())


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

    def __init__(self, attn: MemoryHooks | AttentionHooks, has_mlp: bool) -> None:
        super().__init__()
        self.attn = attn
        for name in RESIDUAL_HOOKS:
            if name != "mlp_out" or has_mlp:
                setattr(self, f"hook_{name}", HookPoint())


class ReleasedLM(StreamingLM):
    """A transformers causal LM with memory layers under memviz's model contract (module docstring); a family
    subclasses it with its hook docs and registers it.

    State: per memory layer a `MemoryLayerState` (the convolution's last inputs and S, in `state_dtype`), per
    attention layer a `LocalCache` of what transformers caches (k, v after RoPE; an MLA layer's compressed latents).
    Reset and patch act on S alone: the convolution's last tokens and the attention caches are kept."""

    cfg: ReleasedConfig
    decay_per_channel = False  # whether alpha_t is a vector over key channels (the family says)
    delta_rule = True  # whether a write removes along its key first (the state-space memories' do not)
    read_is = "o_t = S_t^T q_t, the memory's read before the layer's gated norm"  # what `memory_readout` splits
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
                self.memory_points(l) if l in self.linear else AttentionHooks(self.attention_sites(l)),
                arch.mlp(layer) is not None,
            )
            for l, layer in enumerate(self.decoder_layers)
        )
        self.install_memory()
        self.setup()
        self.cache_layout = self.read_cache_layout()

    def memory_points(self, l: int) -> MemoryHooks:
        """Memory layer l's HookPoints (a family whose layers show more gives its own)."""
        return MemoryHooks(self.attention_sites(l))

    def install_memory(self) -> None:
        """Map the memory layers' kernels to memviz's operator (`recurrence.install`), refusing a layer transformers
        does not send through one; a family whose layers have no kernel to map (the RG-LRU) installs its own."""
        install(self.hf)
        unmapped = [
            l
            for l in sorted(self.linear)
            if not installed(self.memory_layer(l))
            or installed(self.memory_layer(l)) != memory_kernels(self.memory_layer(l))
        ]
        if unmapped:
            import transformers

            raise RuntimeError(
                f"transformers {transformers.__version__} does not send layer {unmapped[0]}'s recurrence through "
                "Hugging Face's kernel mapping (transformers 5.25 with kernels 0.19 does), so memviz cannot read it"
            )

    @property
    def decoder_layers(self) -> Sequence[Any]:
        return self.arch.layers(self.hf)

    def attention_sites(self, l: int) -> dict[str, Any]:
        """Decoder layer l's attention hook sites (none in a layer without attention)."""
        attention = self.arch.attention(self.decoder_layers[l])
        return {} if attention is None else self.arch.attention_sites(attention)

    def memory_layer(self, l: int) -> Any:
        return self.arch.memory(self.decoder_layers[l])

    # ----- state --------------------------------------------------------------------------
    def read_cache_layout(self) -> dict[int, tuple[tuple[int, int], tuple[int, int]]]:
        """Per attention layer, the (heads, size) of the keys and of the values transformers caches (grouped-query
        heads, or an MLA layer's latents: its choice), read off one token run at construction, before any hook."""
        with torch.no_grad():
            _, layers, _ = self.run(torch.zeros(1, 1, dtype=torch.long, device=self.device), self.init_state(1))
        caches = [
            (l, part if isinstance(part, LocalCache) else getattr(part, "attention", None))
            for l, part in enumerate(layers)
        ]
        return {
            l: ((c.k.shape[1], c.k.shape[3]), (c.v.shape[1], c.v.shape[3]))
            for l, c in caches
            if c is not None and c.k.shape[2]
        }

    def empty_cache(self, l: int, batch_size: int) -> LocalCache:
        """Attention layer l's cache before its first token, shaped as transformers caches it (a layer without
        keys, or any before `read_cache_layout` has run, a [batch, 1, 0, 1] placeholder)."""
        (kh, kd), (vh, vd) = getattr(self, "cache_layout", {}).get(l, ((1, 1), (1, 1)))
        zeros = functools.partial(torch.zeros, device=self.device, dtype=self.dtype)
        return LocalCache(zeros(batch_size, kh, 0, kd), zeros(batch_size, vh, 0, vd))

    def init_state(self, batch_size: int = 1) -> ModelState:
        layers: list[State] = []
        for l in range(self.cfg.n_layers):
            if l in self.linear:
                mixer = self.memory_layer(l)
                channels, _, width = mixer.conv1d.weight.shape
                heads, d_k, d_v = self.arch.state(mixer)
                layers.append(
                    MemoryLayerState(
                        conv=torch.zeros(batch_size, channels, width, device=self.device, dtype=self.dtype),
                        S=torch.zeros(batch_size, heads, d_k, d_v, device=self.device, dtype=self.state_dtype),
                        attention=self.empty_cache(l, batch_size) if self.attention_sites(l) else None,
                    )
                )
            else:
                layers.append(self.empty_cache(l, batch_size))
        return ModelState(0, layers, owner=self.state_owner)

    @property
    def state_dtype(self) -> torch.dtype:
        """S's dtype: the kernel's, float32 at least (a bfloat16 model's state stays float32 between chunks; Kimi's
        float32 single-token step in a float64 model is widened back)."""
        return torch.promote_types(self.dtype, torch.float32)

    def cache_from(self, state: ModelState):
        """A transformers cache holding copies of `state` (the layers write their cache in place). A part
        that is all zeros is left out, so transformers starts it as its own one-pass forward does."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf.config)
        for l, part in enumerate(state.layers):
            attention = part if isinstance(part, LocalCache) else cast(MemoryLayerState, part).attention
            if attention is not None and attention.k.shape[2]:
                cache.update(attention.k, attention.v, l)
            if isinstance(part, LocalCache):
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

        def attended(l: int, part: LocalCache) -> LocalCache:
            layer = cache.layers[l]  # a layer without attention has a placeholder that holds no keys
            kept = getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None
            return LocalCache(layer.keys, layer.values) if kept else part

        for l, part in enumerate(before.layers):
            if isinstance(part, LocalCache):
                layers.append(attended(l, part))
            else:
                part = cast(MemoryLayerState, part)  # what init_state builds for a memory layer
                conv, S = cache.get_conv_state(l), cache.get_recurrent_state(l)
                layers.append(
                    MemoryLayerState(
                        part.conv if conv is None else conv,
                        part.S if S is None else S.to(self.state_dtype),
                        None if part.attention is None else attended(l, part.attention),
                    )
                )
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
            attention = self.arch.attention(layer)
            if hooked(points.hook_resid_pre):
                add(layer, "pre_hook", lambda m, args, p=points.hook_resid_pre: (p(args[0]), *args[1:]))
            ends = [(layer, points.hook_resid_post)]
            if hasattr(points, "hook_mlp_out"):
                ends.append((self.arch.mlp(layer), points.hook_mlp_out))
            mixer = attention if attention is not None else self.memory_layer(l) if l in self.linear else None
            if mixer is not None:  # the attention's output where there is one, else the memory layer's
                ends.append((mixer, points.hook_attn_out))
            for module, point in ends:
                if hooked(point):  # a module may return its value first in a tuple (a layer's, an attention's)
                    add(
                        module,
                        "hook",
                        lambda m, args, out, p=point: (p(out[0]), *out[1:]) if isinstance(out, tuple) else p(out),
                    )
            if l in self.linear:
                self.watch_memory(self.memory_layer(l), cast(MemoryHooks, points.attn), add)
            if attention is not None:
                self.watch_attention(attention, points.attn, add)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for l in self.linear:  # a forward that raised left its layer's watch on
                watch(self.memory_layer(l), None)

    def watch_attention(self, attn: nn.Module, points: nn.Module, add) -> None:
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
        when the layer returns. `hook_mem_out` is the read norm's output, cut into heads, or, in a layer without
        one, the kernel's own output (the kernel passes it through the watch)."""
        wanted = [n for n in MEMORY_HOOKS if hooked(getattr(points, f"hook_{n}"))]
        heads, _, d_v = self.arch.state(mixer)
        shape: dict[str, Any] = {}
        norm = self.arch.read_norm(mixer)
        out = points.hook_mem_out if norm is None and hooked(points.hook_mem_out) else None

        def before(m, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            shape["batch, pos"] = hidden.shape[:2]
            watch(mixer, Watch(frozenset(wanted), out=out) if wanted or out else None)

        add(mixer, "pre_hook", before, with_kwargs=True)
        if norm is not None and hooked(points.hook_mem_out):
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
        attention_layers = sum(1 for l in range(self.cfg.n_layers) if self.attention_sites(l))
        memory = sum(p.S.numel() + p.conv.numel() for p in state.layers if isinstance(p, MemoryLayerState))
        return {
            "kv_cache": attention_layers * self.arch.kv_numbers(self.hf.config) * n_tokens * item,
            "memory_state": memory * item,
            "trace": 4 * n_tokens * (self.trace_floats_per_token() + 1),  # float32, and the loss
        }

    # ----- introspection ------------------------------------------------------------------
    def memory_readout(self, tokens, position: int) -> Readout:
        """o_t = S_t^T q_t at `position`, per memory layer, as a sum over writes
        (`memviz.linear_memory.split_read`). The part at j is write j's: its k_j and v_j mix tokens j-3..j
        through the layer's short convolution."""
        return split_read(self, tokens, position, sorted(self.linear), self.read_is, self.delta_rule)

    def unembedding_at(self, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The final norm's scale frozen at a residual stream [d_model] (its output over its input) and the
        unembedding [vocab, d_model], float64: the last steps of a `memviz.protocol.ReadPath`."""
        x = residual.to("cpu", torch.float64)
        x = torch.where(x == 0, torch.finfo(self.dtype).tiny ** 0.5, x)  # a zero channel still has its scale
        with torch.no_grad():
            normed = self.arch.final_norm(self.hf)(x.to(self.device, self.dtype)[None, None])[0, 0]
        unembed, scale = self.hf.get_output_embeddings().weight.detach().cpu(), self.arch.logit_scale(self.hf.config)
        return frozen_scale(normed.cpu(), x), unembed if scale == 1 else unembed * scale  # no copy of W_U at 1

    #: the hooks besides the read that `norm_input` takes (a skip's input)
    norm_input_hooks: tuple[str, ...] = ()

    def norm_input(self, layer: int, read: Tensor, seen: Mapping[str, Tensor]) -> Tensor:
        """What `layer`'s read norm takes at the token, from its read and `norm_input_hooks` captured there (`seen`):
        the read itself, unless a family adds a skip to it."""
        return read

    def norm_read_path(self, tokens, position: int) -> ReadPath:
        """The path from each memory layer's read o_t to the logits at `position` (`memviz.protocol.ReadPath`) for a
        layer whose read passes through its read norm, then its output projection, straight into the residual
        stream: the norm's scale and gate frozen at the token as the diagonal hook_mem_out / `norm_input` (a channel
        whose input is exactly 0 gets 0: its writers' parts there cancel, and each is left out)."""
        if self.arch.read_lens is not None:
            raise ValueError(f"no read lens for {self.cfg.name or self.family}: {self.arch.read_lens}")
        names = {l: layer_hooks(l, ("read", "mem_out", *self.norm_input_hooks)) for l in sorted(self.linear)}
        at = captured_at(self, tokens, position, [*(n for hooks in names.values() for n in hooks), last_residual(self)])
        layers = {}
        for l, (read, out, *_) in names.items():
            mixer = self.memory_layer(l)
            heads = self.arch.state(mixer)[0]
            diagonal = frozen_scale(at[out], self.norm_input(l, at[read], at))  # [head, d_v]
            projection = head_blocks(self.arch.out_projection(mixer).weight, heads)
            layers[f"blocks.{l}"] = diagonal[..., None] * projection * self.arch.residual_scale(self.hf.config)
        return ReadPath(position, layers, *self.unembedding_at(at[last_residual(self)]))

    def needle_hold(self, tokens, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """Per memory layer, the part of the state the span's writes left over its peak
        (`memviz.linear_memory.span_hold`)."""
        chunk = CHANNEL_CHUNK if self.decay_per_channel else CHUNK
        return span_hold(self, tokens, span, sorted(self.linear), chunk, self.delta_rule)
