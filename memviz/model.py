"""memviz's own language model, which every family built from a `ModelConfig` subclasses.

`MemoryLM` keeps the model contract through `memviz.running.StreamingLM`: embeddings, a stack of blocks, a final
RMSNorm and an unembedding. Each block takes the whole chunk `[batch, pos, d_model]` plus its
own carried state and returns the new state, so every HookPoint fires once per forward with a
`[batch, pos, ...]` tensor and `run_with_cache` / `run_with_hooks` behave as TransformerLens
users expect. A family changes what sits inside the block (a memory beside attention, a
memory instead of attention, a memory layer instead of the FFN); blocks handle segment
boundaries themselves, so feeding an input in one call or in chunks gives the same result.
"""

from __future__ import annotations

import copy
import math
import numbers
import re
from dataclasses import dataclass
from typing import ClassVar, Protocol, cast

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from transformer_lens.hook_points import HookPoint

from memviz.config import ConfigError, ModelConfig
from memviz.heap import allocatable_bytes
from memviz.layers import AttentionSpan, LocalAttention, LocalCache, RMSNorm, SwiGLU
from memviz.options import parse_options
from memviz.protocol import HookDoc, ModelState, Readout
from memviz.running import StreamingLM, hooked
from memviz.state import State
from memviz.tokenizer import ByteTokenizer, Tokenizer

#: what a family's module imports from here (the contract's types also live in memviz.protocol and memviz.running)
__all__ = ["BACKBONE_FIELDS", "BLOCK_HOOK_DOCS", "Block", "HookDoc", "MemoryLM", "ModelState", "Readout", "hooked"]

BACKBONE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "d_head",
    "d_mlp",
    "rope_base",
    "norm_eps",
    "tie_embeddings",
    "embed_scale",
)  # what a backbone's weights mean


#: the hooks of every model built from `Block`s (the hook table's shared rows)
BLOCK_HOOK_DOCS: dict[str, HookDoc] = {
    "hook_embed": HookDoc("[batch, pos, d_model]", "token embeddings"),
    "blocks.{l}.hook_resid_pre": HookDoc("[batch, pos, d_model]", "residual stream entering block `l`"),
    "blocks.{l}.hook_attn_out": HookDoc("[batch, pos, d_model]", "output of the block's attention (or memory mixer)"),
    "blocks.{l}.hook_resid_mid": HookDoc("[batch, pos, d_model]", "residual stream after the attention"),
    "blocks.{l}.hook_mlp_out": HookDoc("[batch, pos, d_model]", "output of the FFN"),
    "blocks.{l}.hook_resid_post": HookDoc("[batch, pos, d_model]", "residual stream leaving block `l`"),
    "blocks.{l}.mlp.hook_post": HookDoc("[batch, pos, d_mlp]", "SwiGLU hidden activation `silu(W_gate x) * W_up x`"),
    "blocks.{l}.attn.hook_q": HookDoc("[batch, pos, head, d_head]", "queries, before rotary embedding"),
    "blocks.{l}.attn.hook_k": HookDoc("[batch, pos, head, d_head]", "keys, before rotary embedding"),
    "blocks.{l}.attn.hook_v": HookDoc("[batch, pos, head, d_head]", "values"),
    "blocks.{l}.attn.hook_z": HookDoc("[batch, pos, head, d_head]", "attention output per head, before `W_O`"),
}


def check_fits_in_memory(cfg: ModelConfig) -> None:
    """Refuse, before any weight is allocated, a config whose backbone's weights alone (in the default dtype) are
    more than this process can still allocate."""
    need = cfg.backbone_parameters * torch.get_default_dtype().itemsize
    have = allocatable_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"this config's backbone has about {cfg.backbone_parameters:.2e} parameters, "
            f"{need / 2**30:,.1f} GiB of weights, more than the {max(have, 0) / 2**30:,.1f} GiB this "
            "process can still allocate (d_model, n_layers, d_mlp); nothing was allocated"
        )


def cache_bytes(state: object) -> int:
    """The bytes of the local attention's cached keys and values (`LocalCache.k`, `.v`) in a state, at any depth
    (a cache's side keys, Titans' retrieved memory tokens, are the memory's)."""
    if isinstance(state, LocalCache):
        return sum(t.numel() * t.element_size() for t in (state.k, state.v))
    children, layout = tree_flatten(state, is_leaf=lambda part: part is not state)  # one level down
    return 0 if layout.is_leaf() else sum(cache_bytes(child) for child in children)


class Stateful(Protocol):
    """A block or a block's mixer: builds its part of a fresh `ModelState`."""

    def init_state(self, batch: int, device: torch.device, /) -> State: ...


class Block(nn.Module):
    """Pre-norm residual block: x += mixer(norm(x)); x += mlp(norm(x)).

    `attn` is any mixer with `forward(x, state, pos) -> (out, state)` and `init_state`, whose
    state is the block's; `mlp` is a stateless `x -> y` module (SwiGLU, or a memory layer).
    `attn` is None in a block without attention (Titans' LMM), whose own forward mixes.
    """

    def __init__(self, cfg: ModelConfig, attn: nn.Module | None, mlp: nn.Module) -> None:
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = attn
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = mlp
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def init_state(self, batch: int, device: torch.device) -> State:
        return cast(Stateful, self.attn).init_state(batch, device)  # nn.Module types attributes as Tensor | Module

    def forward(self, x: Tensor, state: State, pos: int) -> tuple[Tensor, State]:
        x = self.hook_resid_pre(x)
        assert self.attn is not None  # a block without attention has its own forward
        a, state = self.attn(self.ln1(x), state, pos)
        x = self.hook_resid_mid(x + self.hook_attn_out(a))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln2(x))))
        return x, state


@dataclass
class NoOptions:
    """The baselines take no memory options."""


class MemoryLM(StreamingLM):
    """Base language model, the full-causal transformer as it stands; a family subclasses it
    and registers (`memviz.registry.register_family`)."""

    cfg: ModelConfig
    #: a model without memory (what a memory family can start from, `warm_start`)
    is_baseline = False
    Options: type = NoOptions
    hook_docs: ClassVar[dict[str, HookDoc]] = BLOCK_HOOK_DOCS
    #: weights (regular expressions over state_dict names) that an option adds: a warm start from a
    #: checkpoint of the same family without them keeps their fresh init (`warm_start`)
    option_weights: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: ModelConfig, tokenizer: Tokenizer | None = None, card: dict | None = None) -> None:
        cfg = copy.deepcopy(cfg)  # completed below (options, attention); the caller's stays as given
        super().__init__(cfg, None, card)
        cfg.memory = self.upgrade_options(cfg)
        self.options = parse_options(self.Options, self.family, cfg.memory)
        spec = cfg.attention if cfg.attention is not None else self.default_attention()
        #: what a token's local attention sees (None for a model without attention)
        self.attention = None if spec is None else AttentionSpan.parse(spec)
        cfg.attention = self.attention.to_dict() if self.attention is not None else None
        self.check_config()
        if tokenizer is None and cfg.vocab_size == ByteTokenizer().vocab_size:
            tokenizer = ByteTokenizer()
        if tokenizer is not None and tokenizer.vocab_size != cfg.vocab_size:
            raise ConfigError(f"tokenizer has {tokenizer.vocab_size} ids but config.vocab_size is {cfg.vocab_size}")
        self._tokenizer = tokenizer
        check_fits_in_memory(cfg)
        self.build_embeddings()
        self.build()
        self.reset_parameters()
        self.setup()

    # ----- construction, overridden by families -------------------------------------------
    def upgrade_options(self, cfg: ModelConfig) -> dict:
        """The config's `memory` options, with what an older config spelled otherwise rewritten
        (a family that renamed an option overrides this, so old checkpoints keep loading)."""
        return cfg.memory

    def default_attention(self) -> dict | None:
        """The attention a config that names none gets (`memviz.layers.AttentionSpan`)."""
        return {"kind": "causal"}

    def check_config(self) -> None:
        """Raise ConfigError for settings the family cannot build."""

    def build_embeddings(self) -> None:
        """The token embedding, the final norm and the unembedding (`run`). A family that wraps a
        whole outside language model (an adapter) has its own and overrides this with nothing."""
        cfg = self.cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.ln_final = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.unembed.weight = self.embed.weight

    def build(self) -> None:
        self.blocks = nn.ModuleList(self.make_block(layer) for layer in range(self.cfg.n_layers))

    def make_block(self, layer: int) -> nn.Module:
        cfg = self.cfg
        assert self.attention is not None  # default_attention is causal
        return Block(cfg, LocalAttention(cfg, self.attention), SwiGLU(cfg.d_model, cfg.d_mlp))

    def reset_parameters(self) -> None:
        """Weights N(0, std^2), output projections' std scaled by 1/sqrt(2 n_layers) (GPT-2).

        init "gpt2": std 0.02 everywhere, embeddings included (the GPT-2 value for d_model 768).
        init "fan_in": std 1/sqrt(fan_in) for linear maps and 1/sqrt(d_model) for the embedding;
        with embed_scale sqrt(d_model) the token embedding then dominates the residual stream at
        initialisation, which small models need to learn to bind facts (see README, qa1).
        """
        out_scale = 1 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02 if self.cfg.init == "gpt2" else module.weight.shape[1] ** -0.5  # [out, in] or [vocab, d]
                if name.endswith(("W_O", "W_down", "W_mem_out", "W_2")):
                    std *= out_scale
                nn.init.normal_(module.weight, std=std)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    nn.init.zeros_(bias)
        for module in self.modules():
            reset = getattr(module, "reset_memory_parameters", None)
            if module is not self and reset is not None:
                reset()

    # ----- running ------------------------------------------------------------------------
    def init_state(self, batch_size: int = 1) -> ModelState:
        """A fresh state in the model's dtype (blocks build theirs in the default dtype), so that
        `model.to(torch.float64)` or `.to(torch.bfloat16)` runs every family."""
        states = [cast(Stateful, block).init_state(batch_size, self.device) for block in self.blocks]
        return ModelState(0, self.in_model_dtype(states), owner=self.state_owner)

    @property
    def unembeds_last(self) -> bool:
        """Whether the logits are `unembed(ln_final(blocks' output))`, as `run` makes them (a family that
        overrides `run` makes them its own way)."""
        return type(self).run is MemoryLM.run

    def run(self, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], State]:
        """A chunk's logits, each layer's new state and the new shared state."""
        x, layer_states, shared = self.run_residual(tokens, state)
        return self.unembed(x), layer_states, shared

    def run_residual(self, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], State]:
        """`run` but for the unembedding: the final normalised residual stream [batch, pos, d_model]."""
        x, layer_states, shared = self.run_blocks(self.embedded(tokens), tokens, state)
        return self.ln_final(x), layer_states, shared

    def unembedding_at(self, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The final norm's scale frozen at a residual stream [d_model] (g / rms(x)) and the unembedding
        [vocab, d_model], float64: the last steps of a `memviz.protocol.ReadPath`."""
        x = residual.to("cpu", torch.float64)
        weight = self.ln_final.weight.detach().to("cpu", torch.float64)
        return weight * torch.rsqrt(x.pow(2).mean() + self.ln_final.eps), self.unembed.weight.detach().cpu()

    def embedded(self, tokens: Tensor) -> Tensor:
        """The residual stream's input: scaled token embeddings (hook_embed)."""
        return self.hook_embed(self.embed(tokens) * self.cfg.embed_scale)

    def run_blocks(self, x: Tensor, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], State]:
        """The blocks over a chunk: (output, each layer's new state, the new shared state)."""
        new_states = []
        for block, layer_state in zip(self.blocks, state.layers):
            x, layer_state = block(x, layer_state, state.pos)
            new_states.append(layer_state)
        return x, new_states, state.shared

    @property
    def attention_span(self) -> int | None:
        """The local attention's span (a window's or a segment's); None under full causal attention or none."""
        return self.attention.span if self.attention is not None else None

    @property
    def segment(self) -> int | None:
        """The memory's segment, else the local attention's span (a window's)."""
        return self.cfg.segment_len or self.attention_span

    def cost(self, n_tokens: int) -> dict[str, int]:
        """Bytes a run over `n_tokens` holds beyond the weights: the local attention's keys and values (at most its
        span, or the whole input under full attention), the rest of the state at its largest over a stream of
        `measured_tokens` (the memory and what a segment keeps pending; a state that keeps growing past them says
        so in its family's own `cost`), and what a default trace keeps (float32 per token: the hooks and the loss)."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, numbers.Integral) or n_tokens < 0:
            raise ValueError(f"n_tokens must be a whole number of tokens, 0 or more; got {n_tokens!r}")
        item = torch.finfo(self.dtype).bits // 8
        attention_layers = sum(isinstance(m, LocalAttention) for m in self.modules())
        span = self.attention.span if self.attention is not None else 0
        kept = n_tokens if span is None else min(n_tokens, span)
        return {
            "kv_cache": attention_layers * 2 * self.cfg.n_heads * self.cfg.d_head * kept * item,
            "memory_state": self.carried_bytes(),
            "trace": 4 * n_tokens * (self.trace_floats_per_token() + 1),  # and the loss
        }

    @property
    def measured_tokens(self) -> int:
        """Tokens `carried_bytes` streams: two chunks, so that a segment's pending writes are in."""
        return 2 * self.chunk_len

    def carried_bytes(self) -> int:
        """The most the state holds besides the local attention's caches over a stream of `measured_tokens` tokens
        (id 0), in chunks that end a token before a segment does (its pending writes at their most), measured
        once for the model's dtype."""
        measured = self.__dict__.setdefault("_carried_bytes", {})
        if self.dtype not in measured:
            most = 0
            with self.evaluating(), torch.no_grad():
                ids = torch.zeros(1, self.measured_tokens, dtype=torch.long, device=self.device)
                for _, _, state in self.stream(ids, chunk_len=max(1, self.chunk_len - 1)):  # ends a token short
                    most = max(most, state.nbytes() - cache_bytes([state.layers, state.shared]))
            measured[self.dtype] = most
        return measured[self.dtype]

    def value_tables(self) -> list[nn.Parameter]:
        """Tables read a few rows at a time, so each row is trained only when selected (memory
        layers' values); `optim.memory_value_lr` trains them at their own lr without decay."""
        return []

    def warm_start(self, base: MemoryLM) -> None:
        """Start from a trained model `base` (a training config's `init_from`): the same family
        with weights of the same names and shapes (a second training stage, which may change
        options that hold no weights, e.g. a window or a memory's update rule, or that add the
        `option_weights`, which keep their fresh init), or a baseline
        of the same shape, whose attention and MLP weights become this model's backbone while
        the memory keeps its fresh init (the continual pre-training of Munkhdalai et al. 2024,
        §4); LongMem overrides this. Raises ConfigError saying how the two differ."""
        if base.is_baseline and not self.is_baseline:
            self._load_baseline_backbone(base)
        else:
            ours, theirs = self.state_dict(), base.state_dict()
            added = {k for k in ours.keys() - theirs.keys() if any(re.fullmatch(p, k) for p in self.option_weights)}
            same_names = ours.keys() - added == theirs.keys()
            same_weights = same_names and all(ours[k].shape == theirs[k].shape for k in theirs)
            same_kind = base.family == self.family or (base.is_baseline and self.is_baseline)  # a window is no weight
            if not same_kind or not same_weights:
                base_cfg = base.cfg.to_dict()
                differ = sorted(k for k, v in self.cfg.to_dict().items() if k != "name" and v != base_cfg.get(k))
                raise ConfigError(
                    f"init_from needs a {self.family} checkpoint with weights of the same shapes; "
                    f"it is a {base.family} model differing in {differ or 'family'}"
                )
            self.load_state_dict(theirs, strict=not added)
        self._tokenizer = base.tokenizer

    def _load_baseline_backbone(self, base: MemoryLM) -> None:
        mismatch = [f for f in BACKBONE_FIELDS if getattr(base.cfg, f) != getattr(self.cfg, f)]
        ours = self.state_dict()
        theirs = {k: v for k, v in base.state_dict().items() if not self.replaces_baseline_weight(k)}
        missing = [k for k, v in theirs.items() if k not in ours or ours[k].shape != v.shape]
        if mismatch or missing:
            raise ConfigError(
                f"a {self.family} model can start from a {base.family} baseline only with "
                f"the same shape; they differ in {mismatch or missing[:5]}"
            )
        self.load_state_dict(theirs, strict=False)

    def replaces_baseline_weight(self, name: str) -> bool:
        """Whether a baseline's weight `name` has no counterpart here because the memory takes
        its place (a memory layer in place of an FFN); such weights are left out of a warm start."""
        return False
