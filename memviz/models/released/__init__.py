"""Released hybrid language models with Gated DeltaNet layers (Qwen3.5, Qwen3-Next), loaded through
transformers' own classes and traced under the sixth family's (gated_deltanet) hook names.

A Gated DeltaNet layer (Yang, Kautz and Hatamizadeh, arXiv 2412.06464, eq. 10) keeps per value head
a state S [d_k, d_v] (the paper's S^T):

  S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

with the model's own normalisations (transformers' Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet):
q, k, v = silu(causal depthwise conv over 4 tokens of x W_qkv); q, k scaled to unit norm by
x * rsqrt(|x|^2 + 1e-6), q also by d_k^-1/2; alpha_t = exp(-exp(A_log) softplus(x w_a + dt_bias));
beta_t = sigmoid(x w_b); the layer's output is out_proj(RMSNormGated(o_t, z_t)), z_t = x W_z.

transformers runs the model; memviz only watches it (hooks added for the length of each call) and
carries its cache as a `ModelState`, so a long input streams chunk by chunk and a state can be reset
or patched between chunks. Per Gated DeltaNet layer `blocks.{l}.attn.`: `hook_alpha`, `hook_beta`
[batch, pos, head]; `hook_write_key` [.., head, d_k], `hook_write_value` [.., head, d_v] (k_t, v_t);
`hook_read_query` [.., head, d_k] (q_t); `hook_read` [.., head, d_v] (o_t); `hook_state_norm`
[batch, pos, head] (||S_t||_F after the write); `hook_mem_out` [.., head, d_v] (RMSNormGated(o_t, z_t),
the layer's own value: what a hook returns replaces it). The first seven are recomputed here, in the
model's dtype (float32 at least), from the layer's own projections and the cache it started from
(transformers computes the recurrence in float32 whatever the model's dtype); they are read-only,
and computed only for a call with a hook on one of them (benchmarks/released.py measures the cost). Full-attention
layers: `blocks.{l}.attn.hook_q`, `hook_k` (after q_norm / k_norm, before RoPE), `hook_v`, `hook_z`
(per head, after the output gate, before o_proj). Every layer: `blocks.{l}.hook_resid_pre`,
`hook_attn_out`, `hook_mlp_out`, `hook_resid_post` (what a hook returns replaces the value).

Why not TransformerLens 4.3's bridge: its Gated DeltaNet hooks fire only on a cache-less prefill (it
looks for `cache_params`, which transformers 5.24 passes as `cache`, and given one ignores it), and its
state hook keeps S_t per token.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from memviz.figure_parts import WIDTH, delta_rule_rate_heatmaps, layer_names, timeline
from memviz.files import MAX_CONFIG_BYTES, read_bytes_within
from memviz.layers import LocalCache
from memviz.linear_memory import span_hold, split_read
from memviz.model import BLOCK_HOOK_DOCS, HookDoc, MemoryLM, ModelState, Readout, hooked
from memviz.registry import register_family
from memviz.state import Memory, State
from memviz.tokenizer import TOKENIZER_FILE, Tokenizer
from memviz_kernels.dispatch import linear_memory

if TYPE_CHECKING:  # transformers' classes memviz reads (imported where a checkpoint is loaded)
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5Attention,
        Qwen3_5DecoderLayer,
        Qwen3_5ForCausalLM,
        Qwen3_5GatedDeltaNet,
    )
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextAttention,
        Qwen3NextDecoderLayer,
        Qwen3NextForCausalLM,
        Qwen3NextGatedDeltaNet,
    )

    CausalLM: TypeAlias = Qwen3_5ForCausalLM | Qwen3NextForCausalLM
    DecoderLayer: TypeAlias = Qwen3_5DecoderLayer | Qwen3NextDecoderLayer
    GatedDeltaNet: TypeAlias = Qwen3_5GatedDeltaNet | Qwen3NextGatedDeltaNet

CONFIG_FILE = "config.json"

#: model_type -> what memviz reads of it
SUPPORTED = {
    "qwen3_5": "Qwen3.5 (its language model; a vision tower is left unread)",
    "qwen3_5_text": "Qwen3.5 text",
    "qwen3_next": "Qwen3-Next",
}
ALPHA, BETA = "blocks.{l}.attn.hook_alpha", "blocks.{l}.attn.hook_beta"
STATE_NORM, MEM_OUT = "blocks.{l}.attn.hook_state_norm", "blocks.{l}.attn.hook_mem_out"
GDN_HOOKS = ("alpha", "beta", "write_key", "write_value", "read_query", "read", "state_norm")
DEFAULT_SEGMENT = 512


class DeltaNetState(NamedTuple):
    """A released Gated DeltaNet layer's state: the short convolution's last inputs [B, conv_dim, K] (a
    cache) and the memory S [B, H, d_k, d_v]."""

    conv: Tensor
    S: Memory[Tensor]


class ReleasedCheckpointError(ValueError):
    """A Hugging Face folder memviz cannot load; the message names the file or field (memviz.load raises
    it as a `CheckpointError`)."""


class HFTokenizer(Tokenizer):
    """A checkpoint's own `tokenizer.json` (the `tokenizers` library) behind memviz's tokenizer
    interface; no special tokens are added when encoding."""

    kind = "hf"

    def __init__(self, backend, vocab_size: int, eos_id: int, pad_id: int, bos_id: int) -> None:
        self.backend = backend
        self.text_vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._vocab_size, self._eos, self._pad, self._bos = vocab_size, eos_id, pad_id, bos_id

    vocab_size = property(lambda self: self._vocab_size)
    eos_id = property(lambda self: self._eos)
    pad_id = property(lambda self: self._pad)
    bos_id = property(lambda self: self._bos)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([i for i in self.ids_within(ids) if i < self.text_vocab_size])

    def byte_length(self, ids: Iterable[int]) -> int:
        """UTF-8 bytes of the decoded text (a character cut between the tokens counts as U+FFFD)."""
        return len(self.decode(ids).encode("utf-8"))

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """Each token's text, specials by name; "" for an embedding row past the tokenizer's vocabulary."""
        ids = self.ids_within(ids)
        known = iter(
            self.backend.decode_batch([[i] for i in ids if 0 <= i < self.text_vocab_size], skip_special_tokens=False)
        )
        return [next(known) if 0 <= i < self.text_vocab_size else "" for i in ids]

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        self.backend.save(str(path))
        return path


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
    segment_len: int = DEFAULT_SEGMENT  # where reset and patch act (memviz.interventions)
    family: str = "hf_gated_deltanet"
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


class GDNHooks(nn.Module):
    """The HookPoints of one Gated DeltaNet layer (module docstring)."""

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
        for name in (*GDN_HOOKS, "mem_out"):
            setattr(self, f"hook_{name}", HookPoint())


class AttentionHooks(nn.Module):
    # set by __init__; declared for their type
    hook_q: HookPoint
    hook_k: HookPoint
    hook_v: HookPoint
    hook_z: HookPoint

    def __init__(self) -> None:
        super().__init__()
        for name in ("q", "k", "v", "z"):
            setattr(self, f"hook_{name}", HookPoint())


class LayerHooks(nn.Module):
    # set by __init__; declared for their type
    attn: GDNHooks | AttentionHooks
    hook_resid_pre: HookPoint
    hook_attn_out: HookPoint
    hook_mlp_out: HookPoint
    hook_resid_post: HookPoint

    def __init__(self, linear: bool) -> None:
        super().__init__()
        self.attn = GDNHooks() if linear else AttentionHooks()
        for name in ("resid_pre", "attn_out", "mlp_out", "resid_post"):
            setattr(self, f"hook_{name}", HookPoint())


def unit(x: Tensor) -> Tensor:
    """The layer's l2 normalisation, x rsqrt(|x|^2 + 1e-6)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def rate_and_norm_figures(trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict:
    """The sixth family's views: alpha and beta over tokens and value heads per Gated DeltaNet layer; ||S_t||."""
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)  # the figure helpers' keywords
    figs = delta_rule_rate_heatmaps(trace, **zoom)
    norms = layer_names(trace, STATE_NORM)
    if norms:
        figs["state norm"] = timeline(trace, {n: n for n in norms}, "||S_t|| (mean over heads)", **zoom)
    return figs


@register_family(
    "hf_gated_deltanet",
    summary="A released hybrid (Qwen3.5, Qwen3-Next) loaded through transformers: its "
    "Gated DeltaNet layers under the gated_deltanet hook names",
    figures=rate_and_norm_figures,
    from_config=False,
    cost=True,
    readout=True,
)
class ReleasedLM(MemoryLM):
    """A transformers Qwen3.5 / Qwen3-Next causal LM under memviz's model contract (module docstring).

    State: per Gated DeltaNet layer a `DeltaNetState` (the convolution's last inputs and S), per
    full-attention layer a `LocalCache` (k, v [B, H_kv, pos, d_head], after RoPE). Reset and patch act
    on S alone: the convolution's last tokens and the attention caches are kept."""

    memory_hooks = {ALPHA: "none", BETA: "none", STATE_NORM: "none", MEM_OUT: "norm"}
    hook_docs = {
        **{  # the decoder layer's residual hooks (LayerHooks), as memviz's own blocks have them
            f"blocks.{{l}}.hook_{name}": BLOCK_HOOK_DOCS[f"blocks.{{l}}.hook_{name}"]
            for name in ("resid_pre", "attn_out", "mlp_out", "resid_post")
        },
        "blocks.{l}.attn.hook_q": HookDoc(
            "[batch, pos, head, d_head]", "full-attention layers: queries after `q_norm`, before RoPE"
        ),
        "blocks.{l}.attn.hook_k": HookDoc(
            "[batch, pos, head, d_head]", "full-attention layers: keys after `k_norm`, before RoPE"
        ),
        "blocks.{l}.attn.hook_v": HookDoc("[batch, pos, head, d_head]", "full-attention layers: values"),
        "blocks.{l}.attn.hook_z": HookDoc(
            "[batch, pos, head, d_head]",
            "full-attention layers: output per head after the output gate, before `o_proj`",
        ),
        ALPHA: HookDoc(
            "[batch, pos, head]",
            "Gated DeltaNet layers: decay `alpha_t = exp(-exp(A_log) softplus(x w_a + dt_bias))` per value head "
            "(read-only)",
        ),
        BETA: HookDoc(
            "[batch, pos, head]", "Gated DeltaNet layers: write strength `beta_t = sigmoid(x w_b)` (read-only)"
        ),
        "blocks.{l}.attn.hook_write_key": HookDoc(
            "[batch, pos, head, d_k]",
            "Gated DeltaNet layers: `k_t`, unit-norm after the short convolution, repeated to the value heads "
            "(read-only)",
        ),
        "blocks.{l}.attn.hook_write_value": HookDoc(
            "[batch, pos, head, d_v]", "Gated DeltaNet layers: `v_t` after the short convolution (read-only)"
        ),
        "blocks.{l}.attn.hook_read_query": HookDoc(
            "[batch, pos, head, d_k]", "Gated DeltaNet layers: `q_t`, unit-norm and scaled by `d_k^-1/2` (read-only)"
        ),
        "blocks.{l}.attn.hook_read": HookDoc(
            "[batch, pos, head, d_v]", "Gated DeltaNet layers: the read `o_t = S_t^T q_t` (read-only)"
        ),
        STATE_NORM: HookDoc(
            "[batch, pos, head]", "Gated DeltaNet layers: `||S_t||_F`, the state after the token's write (read-only)"
        ),
        MEM_OUT: HookDoc(
            "[batch, pos, head, d_v]",
            "Gated DeltaNet layers: `RMSNormGated(o_t, z_t)`, the layer's own value (what a hook returns replaces it)",
        ),
    }
    cfg: ReleasedConfig  # type: ignore[assignment]  # not a ModelConfig: MemoryLM's methods it keeps read fields both have

    def __init__(self, hf_model: CausalLM, tokenizer: Tokenizer, cfg: ReleasedConfig, card: dict | None = None) -> None:
        HookedRootModule.__init__(self)
        self.hf = hf_model
        self.cfg, self._tokenizer, self.card = cfg, tokenizer, dict(card or {})
        self.attention = None
        self.linear = set(cfg.linear_layers)
        self.blocks = nn.ModuleList(LayerHooks(l in self.linear) for l in range(cfg.n_layers))
        self.setup()

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return self.hf.model.layers

    # ----- state --------------------------------------------------------------------------
    def init_state(self, batch_size: int = 1) -> ModelState:
        layers: list[State] = []
        for l, layer in enumerate(self.decoder_layers):
            if l in self.linear:
                g = layer.linear_attn
                layers.append(
                    DeltaNetState(
                        conv=torch.zeros(batch_size, g.conv_dim, g.conv_kernel_size, device=self.device),
                        S=torch.zeros(batch_size, g.num_v_heads, g.head_k_dim, g.head_v_dim, device=self.device),
                    )
                )
            else:
                a = layer.self_attn
                empty = torch.zeros(batch_size, self.hf.config.num_key_value_heads, 0, a.head_dim, device=self.device)
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
            part = cast(DeltaNetState, part)  # what init_state builds for a Gated DeltaNet layer
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
                part = cast(DeltaNetState, part)  # what init_state builds for a Gated DeltaNet layer
                conv, S = cache.get_conv_state(l), cache.get_recurrent_state(l)
                layers.append(DeltaNetState(part.conv if conv is None else conv, part.S if S is None else S))
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
            mixer = layer.linear_attn if l in self.linear else layer.self_attn
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
                self.watch_gdn(layer.linear_attn, cast(GDNHooks, points.attn), add)
            else:
                self.watch_attention(layer.self_attn, cast(AttentionHooks, points.attn), add)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def watch_attention(self, attn: Qwen3_5Attention | Qwen3NextAttention, points: AttentionHooks, add) -> None:
        def heads(point: HookPoint):
            return lambda m, args, out: point(out.reshape(*out.shape[:2], -1, attn.head_dim)).reshape(out.shape)

        for module, point in ((attn.q_norm, points.hook_q), (attn.k_norm, points.hook_k), (attn.v_proj, points.hook_v)):
            if hooked(point):
                add(module, "hook", heads(point))
        if hooked(points.hook_z):
            add(attn.o_proj, "pre_hook", lambda m, args: (heads(points.hook_z)(m, (), args[0]), *args[1:]))

    def watch_gdn(self, gdn: GatedDeltaNet, points: GDNHooks, add) -> None:
        derived = any(hooked(getattr(points, f"hook_{n}")) for n in GDN_HOOKS)
        if not derived and not hooked(points.hook_mem_out):
            return
        seen: dict[str, Any] = {}

        def before(m, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen["shape"], seen["dtype"] = hidden.shape[:2], hidden.dtype
            if derived:  # None where the layer starts from zeros
                conv, S = (
                    kwargs["cache"].get_conv_state(gdn.layer_idx),
                    kwargs["cache"].get_recurrent_state(gdn.layer_idx),
                )
                seen["conv"], seen["S"] = (None if t is None else t.clone() for t in (conv, S))

        add(gdn, "pre_hook", before, with_kwargs=True)
        if hooked(points.hook_mem_out):  # the layer calls its norm on [B * T * H, d_v]
            add(
                gdn.norm,
                "hook",
                lambda m, args, out: points.hook_mem_out(out.reshape(*seen["shape"], -1, gdn.head_v_dim)).reshape(
                    out.shape
                ),
            )
        if not derived:
            return

        def keep(name: str):
            def hook(m, args, out):
                seen[name] = out

            return hook

        for name in ("in_proj_qkv", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba"):
            if hasattr(gdn, name):
                add(getattr(gdn, name), "hook", keep(name))
        add(gdn, "hook", lambda m, args, out: self.recompute(gdn, points, seen))

    def projections(self, gdn: GatedDeltaNet, seen: dict) -> tuple[Tensor, Tensor, Tensor]:
        """(the convolution's input [B, T, conv_dim] in q, k, v order, b, a) from the layer's own projections."""
        if "in_proj_qkvz" in seen:  # Qwen3-Next interleaves q, k, v, z per key head; its own method splits them
            qwen3_next = cast("Qwen3NextGatedDeltaNet", gdn)  # the layer with in_proj_qkvz
            q, k, v, _, b, a = qwen3_next.fix_query_key_value_ordering(seen["in_proj_qkvz"], seen["in_proj_ba"])
            return torch.cat([t.flatten(2) for t in (q, k, v)], -1), b, a
        return seen["in_proj_qkv"], seen["in_proj_b"], seen["in_proj_a"]

    def recompute(self, gdn: GatedDeltaNet, points: GDNHooks, seen: dict) -> None:
        """The Gated DeltaNet quantities of the call, from its projections and starting cache (module docstring)."""
        work = torch.promote_types(seen["dtype"], torch.float32)  # no triangular solve in half precision
        mixed, b, a = (t.to(work) for t in self.projections(gdn, seen))
        B, T, _ = mixed.shape
        conv = seen["conv"] if seen["conv"] is not None else mixed.new_zeros(B, gdn.conv_dim, gdn.conv_kernel_size)
        window = torch.cat([conv.to(mixed.dtype), mixed.transpose(1, 2)], -1)  # [B, conv_dim, K + T]
        conv = F.silu(F.conv1d(window, gdn.conv1d.weight.to(mixed.dtype), groups=gdn.conv_dim)[..., 1:]).transpose(1, 2)
        q, k, v = conv.split([gdn.key_dim, gdn.key_dim, gdn.value_dim], -1)
        read = hooked(points.hook_read)

        def heads(t: Tensor) -> Tensor:  # per key head, unit norm, repeated to the value heads
            return unit(t.reshape(B, T, -1, gdn.head_k_dim)).repeat_interleave(gdn.num_v_heads // gdn.num_k_heads, 2)

        q = points.hook_read_query(heads(q) * gdn.head_k_dim**-0.5) if read or hooked(points.hook_read_query) else None
        k = points.hook_write_key(heads(k))
        v = points.hook_write_value(v.reshape(B, T, -1, gdn.head_v_dim))
        log_alpha = -gdn.A_log.to(work).exp() * F.softplus(a + gdn.dt_bias.to(work))
        points.hook_alpha(log_alpha.exp())
        beta = points.hook_beta(b.sigmoid())
        if read or hooked(points.hook_state_norm):
            S = seen["S"] if seen["S"] is not None else k.new_zeros(B, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
            k_t, v_t, log_alpha_t, beta_t = (t.transpose(1, 2) for t in (k, v, log_alpha, beta))
            (o, norms), _ = linear_memory(
                q.transpose(1, 2) if read and q is not None else None,  # q is computed for a read
                k_t,
                v_t,
                log_alpha_t,
                beta_t,
                S.to(k.dtype),
            )
            if read:
                assert o is not None  # the operator reads with the q it is given
                points.hook_read(o.transpose(1, 2))
            assert norms is not None  # and gives the norms by default
            points.hook_state_norm(norms.transpose(1, 2))

    def cost(self, n_tokens: int) -> dict[str, int]:
        """Bytes a run over `n_tokens` holds beyond the weights: the full-attention layers' key/value cache
        (it grows with the input), the Gated DeltaNet layers' states (fixed), what a default trace keeps."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, numbers.Integral) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a whole number of tokens, 0 or more; got {n_tokens!r}")
        item, state = torch.finfo(self.dtype).bits // 8, self.init_state(1)
        kv = sum(2 * p.k.shape[1] * p.k.shape[3] for p in state.layers if isinstance(p, LocalCache))
        memory = sum(p.S.numel() + p.conv.numel() for p in state.layers if isinstance(p, DeltaNetState))
        heads = sum(self.decoder_layers[l].linear_attn.num_v_heads for l in self.linear)
        # alpha, beta, ||S_t|| and |mem_out| per head, and the loss, as float32
        return {
            "kv_cache": kv * n_tokens * item,
            "memory_state": memory * item,
            "trace": 4 * n_tokens * (4 * heads + 1),
        }

    # ----- introspection ------------------------------------------------------------------
    def gdn_names(self, layer: int, names: Iterable[str]) -> list[str]:
        return [f"blocks.{layer}.attn.hook_{n}" for n in names]

    def memory_readout(self, tokens, position: int) -> Readout:
        """o_t = S_t^T q_t at `position`, per Gated DeltaNet layer, as a sum over writes
        (`memviz.linear_memory.split_read`). The part at j is write j's: its k_j and v_j mix tokens j-3..j
        through the short convolution."""
        what = "o_t = S_t^T q_t, the Gated DeltaNet state's read before the gated norm"
        return split_read(self, tokens, position, sorted(self.linear), what)

    def needle_hold(self, tokens, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """Per Gated DeltaNet layer, the part of the state the span's writes left over its peak
        (`memviz.linear_memory.span_hold`)."""
        return span_hold(self, tokens, span, sorted(self.linear), 64)


# ----- loading --------------------------------------------------------------------------------
def read_json(path: Path) -> dict:
    try:
        data = json.loads(read_bytes_within(path, MAX_CONFIG_BYTES, "config file").decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError and the size check too
        raise ReleasedCheckpointError(f"{path}: not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ReleasedCheckpointError(f"{path}: a config must be a JSON object")
    return data


def text_config(directory: Path, data: dict):
    """transformers' config of the language model the folder holds, or ReleasedCheckpointError naming the field."""
    where = directory / CONFIG_FILE
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        what = "a vision-language checkpoint" if "vision_config" in data else "a model type memviz does not read"
        raise ReleasedCheckpointError(
            f"{where}: field 'model_type' is {model_type!r}, {what}; memviz loads "
            + ", ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
        )
    try:
        if model_type == "qwen3_next":
            from transformers import Qwen3NextConfig

            return Qwen3NextConfig(**data)
        from transformers import Qwen3_5Config, Qwen3_5TextConfig

        if model_type == "qwen3_5":
            return Qwen3_5Config(**data).text_config
        return Qwen3_5TextConfig(**data)
    except Exception as exc:  # transformers' and huggingface_hub's validators raise their own types
        raise ReleasedCheckpointError(
            f"{where}: not a {model_type} config transformers accepts ({type(exc).__name__}: {exc})"
        ) from exc


def check_text_config(where: Path, config) -> None:
    """Refuse the values transformers accepts but memviz cannot run by: special ids outside the vocabulary
    (or an empty list of them), and a number that is not finite (an rms_norm_eps of NaN)."""
    for field in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(config, field)
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if (isinstance(value, list) and not value) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < config.vocab_size for i in ids
        ):
            raise ReleasedCheckpointError(
                f"{where}: field {field!r} is {value!r}; give a token id (or a non-empty list of them) "
                f"in [0, {config.vocab_size}), or leave it out"
            )
    for field, value in config.to_dict().items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ReleasedCheckpointError(f"{where}: field {field!r} is {value}, not a finite number")


def check_size(directory: Path, config, stored: int | None) -> None:
    """Refuse, before anything is allocated, a config that makes a model far larger than the `stored` numbers of
    the weights beside it (a config missing its sizes gets transformers' defaults, a 9-billion-parameter model):
    the parameter count is read from the model built on the meta device. None: a file safetensors cannot open,
    left for transformers to name."""
    if stored is None:
        return
    try:
        with torch.device("meta"):
            wanted = sum(p.numel() for p in hf_class(config.model_type)(config).parameters())
    except Exception as exc:  # transformers' and torch's own types, from the config's values
        raise ReleasedCheckpointError(
            f"{directory / CONFIG_FILE}: transformers could not build a model from it ({type(exc).__name__}: {exc})"
        ) from exc
    if wanted > 2 * stored:
        raise ReleasedCheckpointError(
            f"{directory / CONFIG_FILE} describes a model of {wanted:,} parameters, but its *.safetensors hold "
            f"{stored:,} numbers (missing sizes take transformers' defaults); nothing was allocated"
        )


def hf_class(model_type: str):
    from transformers import Qwen3_5ForCausalLM, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM if model_type == "qwen3_next" else Qwen3_5ForCausalLM


def special_ids(config, backend) -> tuple[int, int, int]:
    """(eos, pad, bos): the config's ids, else the tokenizer's <|endoftext|>; pad and bos (never
    generated) fall back to the last embedding row, a padding row in the released vocabularies."""

    def first(value):
        return value[0] if isinstance(value, list) else value

    eos = first(config.eos_token_id)
    if eos is None:
        eos = backend.token_to_id("<|endoftext|>")
    last = config.vocab_size - 1
    pad = first(config.pad_token_id)
    pad = last if pad is None or pad == eos else pad
    bos = first(config.bos_token_id)
    bos = pad if bos is None or bos == eos else bos
    return (last if eos is None else eos), pad, bos


def stored_numbers(directory: Path) -> int | None:
    """How many numbers the folder's *.safetensors hold, read from their headers; refuse weights stored as
    integers (a quantised checkpoint: transformers would read their codes as the weights themselves). None where
    safetensors cannot open a file, which transformers names below."""
    from safetensors import safe_open

    stored: int | None = 0
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(path, "pt") as weights:
                slices = [weights.get_slice(name) for name in weights.keys()]
                kinds = {part.get_dtype() for part in slices}
                stored = None if stored is None else stored + sum(math.prod(part.get_shape()) for part in slices)
        except Exception:  # safetensors raises its own types
            stored = None
            continue
        quantised = sorted(kind for kind in kinds if not kind.startswith(("F", "BF")))
        if quantised:
            raise ReleasedCheckpointError(
                f"{path}: weights stored as {', '.join(quantised)}: a quantised checkpoint, which memviz does not "
                "read (give one in float32, float16 or bfloat16)"
            )
    return stored


def load(directory: str | Path, device: str | torch.device = "cpu", **overrides: Any) -> ReleasedLM:
    """Load a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json) of a model_type
    in `SUPPORTED` through transformers' own class, in eval mode. Overrides: `dtype` ("float32",
    "float64", "bfloat16") and `segment_len` (where reset and patch act, default 512 tokens)."""
    from tokenizers import Tokenizer as Backend

    directory = Path(directory)
    unknown = sorted(set(overrides) - {"dtype", "segment_len"})
    if unknown:
        raise ReleasedCheckpointError(
            f"{directory}: a Hugging Face checkpoint takes the overrides dtype and segment_len, not {unknown}"
        )
    dtype, segment_len = overrides.get("dtype", "float32"), overrides.get("segment_len", DEFAULT_SEGMENT)
    data = read_json(directory / CONFIG_FILE)
    config = text_config(directory, data)
    check_text_config(directory / CONFIG_FILE, config)
    if not list(directory.glob("*.safetensors")):
        raise ReleasedCheckpointError(
            f"{directory}: no *.safetensors weights beside {CONFIG_FILE} (memviz reads safetensors only)"
        )
    if not (directory / TOKENIZER_FILE).is_file():
        raise ReleasedCheckpointError(
            f"{directory / TOKENIZER_FILE}: missing; memviz needs the checkpoint's own tokenizer.json"
        )
    check_size(directory, config, stored_numbers(directory))
    torch_dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None or not isinstance(segment_len, int) or isinstance(segment_len, bool) or segment_len < 1:
        raise ReleasedCheckpointError(
            f"{directory}: dtype must be float32, float64 or bfloat16 and segment_len a positive "
            f"integer, got {dtype!r} and {segment_len!r}"
        )
    try:
        backend = Backend.from_file(str(directory / TOKENIZER_FILE))
    except Exception as exc:  # the tokenizers library raises its own Exception type
        raise ReleasedCheckpointError(f"{directory / TOKENIZER_FILE}: not a tokenizers file: {exc}") from exc
    try:
        # Qwen3-Next's experts: torch's grouped_mm takes no float64, the eager loop does
        experts = (
            {"experts_implementation": "eager"} if config.model_type == "qwen3_next" and dtype == "float64" else {}
        )
        hf, info = hf_class(config.model_type).from_pretrained(
            directory,
            config=config,
            dtype=torch_dtype,
            output_loading_info=True,
            use_safetensors=True,
            ignore_mismatched_sizes=True,
            **experts,
        )  # so that the mismatches come back in `info`, named
    except Exception as exc:  # safetensors', transformers' and torch's own types, from the files or the config's values
        raise ReleasedCheckpointError(
            f"{directory}: transformers could not build the model from {CONFIG_FILE} or read its weights "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    bad = [
        f"tensor {k!r} is {tuple(theirs)} but {CONFIG_FILE} makes it {tuple(ours)}"
        for k, theirs, ours in sorted(info.get("mismatched_keys", ()))
    ] + [f"tensor {k!r} is missing" for k in sorted(info.get("missing_keys", ()))]
    bad += [  # a block the config leaves out would be dropped without a word
        f"tensor {k!r} belongs to a layer past the config's num_hidden_layers ({config.num_hidden_layers})"
        for k in sorted(info.get("unexpected_keys", ()))
        if (layer := re.search(r"(?:^|\.)layers\.(\d+)\.", k)) and int(layer[1]) >= config.num_hidden_layers
    ]
    if bad:
        files = ", ".join(sorted(p.name for p in directory.glob("*.safetensors")))
        raise ReleasedCheckpointError(
            f"{directory}: the weights ({files}) do not fit {CONFIG_FILE}: {'; '.join(bad[:3])}"
            + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")
        )
    broken = [k for k, p in hf.named_parameters() if not torch.isfinite(p).all()]
    if broken:
        raise ReleasedCheckpointError(
            f"{directory}: tensor {broken[0]!r} holds NaN or infinity"
            + (f" (and {len(broken) - 1} more)" if len(broken) > 1 else "")
            + "; a corrupt checkpoint"
        )
    card = {"path": str(directory), "model_type": data["model_type"]}
    return from_transformers(hf, backend, directory.name, segment_len, card).to(device)


def from_transformers(
    hf: CausalLM, backend, name: str = "", segment_len: int = DEFAULT_SEGMENT, card: dict | None = None
) -> ReleasedLM:
    """A loaded transformers Qwen3_5ForCausalLM / Qwen3NextForCausalLM and its `tokenizers.Tokenizer`
    as a memviz model, in eval mode."""
    config = hf.config
    assert config.layer_types is not None  # the Qwen3.5 / Qwen3-Next configs fill it
    linear = [l for l, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    cfg = ReleasedConfig(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        d_head=config.head_dim,
        linear_layers=linear,
        segment_len=segment_len,
        name=name,
    )
    tokenizer = HFTokenizer(backend, config.vocab_size, *special_ids(config, backend))
    return ReleasedLM(hf, tokenizer, cfg, card=card).eval()
