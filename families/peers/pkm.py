"""product-key-memory's `PKM` (0.3.x) as the memory layer of a memviz transformer: family
`product_key_memory`.

The model is memviz's transformer (local attention, SwiGLU) with the peer's `PKM` in place of
the FFN at `layers`, run as the peer writes it (Lample et al., arXiv 1907.05242: per head a
query q split in halves, top-k over each half's sub-keys, the top-k of the k^2 sums, a softmax
over their scores, and the weighted bag of the selected values). The adapter reads the selection
where the peer hands it to its value table and passes it through memviz's memory-layer hooks
(`blocks.{l}.mlp.`):

  hook_topk_indices [batch, pos, head, topk]  value index i * num_keys + j
  hook_topk_weights [batch, pos, head, topk]  the softmax weights (ReLU scores with non_competitive_gates)
  hook_read         [batch, pos, d_model]      the PKM's output

What a hook returns goes back into the peer's bag, so memviz's "silence" intervention (zero the
weights of all or chosen values) acts on the peer's own computation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from einops import rearrange
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz import ConfigError, MemoryLM, register_family
from memviz.config import ModelConfig
from memviz.layers import LocalAttention, SwiGLU
from memviz.model import Block
from memviz.models.memory_layer import (
    TOPK_INDICES,
    TOPK_WEIGHTS,
    memory_layer_figures,
    memory_layer_read_at,
    silence_hooks,
    silence_point,
)
from memviz.options import check_positive
from memviz.protocol import HookDoc

from . import PeerError, require
from .titans import load_peer_weights


@dataclass
class PKMOptions:
    """Which FFNs become a `PKM`, and `PKM`'s keyword arguments (the peer's names and defaults;
    dim = d_model)."""

    layers: list[int] = field(default_factory=lambda: [1])
    heads: int = 4
    num_keys: int = 128
    topk: int = 32
    dim_head: int = 128
    use_layernorm: bool = True
    pre_layernorm: bool = False
    norm_output: bool = False
    non_competitive_gates: bool = False

    def __post_init__(self) -> None:
        check_positive(heads=self.heads, num_keys=self.num_keys, topk=self.topk, dim_head=self.dim_head)
        if self.topk > self.num_keys:
            raise ValueError(f"topk ({self.topk}) cannot exceed num_keys ({self.num_keys})")

    def peer_kwargs(self) -> dict[str, Any]:
        kwargs = asdict(self)
        kwargs.pop("layers")
        return kwargs


class PeerPKM(nn.Module):
    """A peer `PKM` whose selection passes through memviz's HookPoints on its way into the bag."""

    def __init__(self, pkm: nn.Module) -> None:
        super().__init__()
        self.pkm = pkm
        self.hook_topk_indices = HookPoint()  # [batch, pos, head, topk]
        self.hook_topk_weights = HookPoint()  # [batch, pos, head, topk]
        self.hook_read = HookPoint()  # [batch, pos, d_model]
        self.pkm.values.register_forward_pre_hook(self.through_hooks, with_kwargs=True)
        self._shape: tuple[int, int] = (0, 0)

    def through_hooks(self, values: nn.Module, args: tuple, kwargs: dict):
        """The peer calls values(indices [(b t), (h k)], per_sample_weights=weights); both go
        through the hooks as [b, t, h, k] and what the hooks return is what the bag reads."""
        (indices,) = args
        b, t = self._shape
        split = dict(b=b, h=self.pkm.heads)
        indices = self.hook_topk_indices(rearrange(indices, "(b t) (h k) -> b t h k", **split))
        weights = self.hook_topk_weights(rearrange(kwargs["per_sample_weights"], "(b t) (h k) -> b t h k", **split))
        join = "b t h k -> (b t) (h k)"
        # in the table's dtype: under autocast the peer's weights come in bfloat16, which embedding_bag refuses
        weights = rearrange(weights, join).to(values.weight.dtype)
        return (rearrange(indices, join),), {**kwargs, "per_sample_weights": weights}

    def forward(self, x: Tensor) -> Tensor:
        self._shape = tuple(x.shape[:2])
        return self.hook_read(self.pkm(x))


@register_family(
    "product_key_memory",
    summary="product-key-memory 0.3's PKM (an adapter) as the memory layer of a "
    "memviz transformer: its top-k selections under memviz's memory-layer hook names",
    figures=memory_layer_figures,
    read_at=memory_layer_read_at,
    figure_settings=lambda model: {"n_values": model.options.num_keys**2},
    interventions={"silence": silence_point("the PKM's")},
    quick={
        "attention": {"kind": "window", "span": 32},
        "memory": {"layers": [1], "heads": 2, "num_keys": 16, "topk": 4, "dim_head": 16},
    },
    tiny={
        "attention": {"kind": "window", "span": 8},
        "memory": {"layers": [1], "heads": 2, "num_keys": 8, "topk": 4, "dim_head": 16},
    },
)
class ProductKeyMemoryLM(MemoryLM):
    """A memviz transformer with product-key-memory's `PKM` in place of some FFNs."""

    Options = PKMOptions
    memory_hooks = {TOPK_INDICES: "none", TOPK_WEIGHTS: "none"}
    hook_docs = {
        **MemoryLM.hook_docs,
        TOPK_INDICES: HookDoc(
            "[batch, pos, head, topk]", "the peer PKM's selected value indices `i * num_keys + j`; only in PKM blocks"
        ),
        TOPK_WEIGHTS: HookDoc(
            "[batch, pos, head, topk]",
            "their weights (softmax, or ReLU with `non_competitive_gates`); what a hook returns is what the peer's "
            "bag reads",
        ),
        "blocks.{l}.mlp.hook_read": HookDoc("[batch, pos, d_model]", "the PKM's output"),
    }

    def default_attention(self) -> dict | None:
        return {"kind": "window", "span": 64}

    def check_config(self) -> None:
        bad = [i for i in self.options.layers if not 0 <= i < self.cfg.n_layers]
        if bad or not self.options.layers:
            raise ConfigError(
                f"product_key_memory layers {self.options.layers} must be a non-empty list in "
                f"0..{self.cfg.n_layers - 1}"
            )

    def build(self) -> None:
        PKM = require("product-key-memory", "product_key_memory").PKM
        cfg = self.cfg
        self.memory_layers = sorted(set(self.options.layers))
        self.blocks = nn.ModuleList(
            Block(
                cfg,
                LocalAttention(cfg, self.attention),
                PeerPKM(PKM(cfg.d_model, **self.options.peer_kwargs()))
                if layer in self.memory_layers
                else SwiGLU(cfg.d_model, cfg.d_mlp),
            )
            for layer in range(cfg.n_layers)
        )

    def reset_parameters(self) -> None:
        """memviz's initialisation for the transformer; the peer's own for each PKM."""
        peers = {
            layer: {k: v.clone() for k, v in self.blocks[layer].mlp.pkm.state_dict().items()}
            for layer in self.memory_layers
        }
        super().reset_parameters()
        for layer, weights in peers.items():
            self.blocks[layer].mlp.pkm.load_state_dict(weights)

    def silence_hooks(self, layer: int, values=None) -> list:
        """memviz's "silence" intervention on the PKM at layer `layer`."""
        if layer not in self.memory_layers:
            raise ValueError(f"layer {layer} has no PKM; the PKM layers are {self.memory_layers}")
        return silence_hooks(layer, values)

    def value_tables(self) -> list[nn.Parameter]:
        return [self.blocks[layer].mlp.pkm.values.weight for layer in self.memory_layers]

    def replaces_baseline_weight(self, name: str) -> bool:
        return any(name.startswith(f"blocks.{layer}.mlp.") for layer in self.memory_layers)


def pkm_options(pkm: nn.Module) -> dict[str, Any]:
    """The keyword arguments a `PKM` was built with, read off the module."""
    if pkm.concat_values_and_combine or pkm.differentiable_topk:
        raise PeerError(
            "the product_key_memory adapter supports PKM without concat_values_and_combine and differentiable_topk"
        )
    return dict(
        heads=pkm.heads,
        num_keys=pkm.num_keys,
        topk=pkm.topk,
        dim_head=pkm.keys.shape[-1],
        use_layernorm=pkm.use_layernorm,
        pre_layernorm=isinstance(pkm.pre_layernorm, nn.LayerNorm),
        norm_output=isinstance(pkm.output_norm, nn.LayerNorm),
        non_competitive_gates=isinstance(pkm.gate_activation, nn.ReLU),
    )


def adapt_pkm(
    pkms: dict[int, nn.Module | dict[str, Tensor]], backbone: MemoryLM | None = None, **config: Any
) -> ProductKeyMemoryLM:
    """A memviz transformer with the given PKMs ({layer: module or its state dict}) in place of
    those layers' FFNs. The PKM's settings are read off a module (a state dict needs them as
    `memory` options in `config`); `config` holds ModelConfig fields (d_model must be the PKM's
    dim); `backbone`, a memviz baseline of the same shape, gives the other weights."""
    pkm_module = require("product-key-memory", "product_key_memory")
    if not pkms:
        raise PeerError("adapt_pkm needs at least one PKM, as {layer: module or state dict}")
    memory = dict(config.pop("memory", {}))
    for layer, pkm in pkms.items():
        if isinstance(pkm, nn.Module):
            if not isinstance(pkm, pkm_module.PKM):
                raise PeerError(
                    f"adapt_pkm takes product_key_memory.PKM modules or their state dicts, not "
                    f"{type(pkm).__module__}.{type(pkm).__name__} (layer {layer})"
                )
            found = pkm_options(pkm)
            clash = {k: (memory[k], v) for k, v in found.items() if k in memory and memory[k] != v}
            if clash:
                raise PeerError(f"the PKM at layer {layer} was built with other settings than given: {clash}")
            memory.update(found)
        elif not isinstance(pkm, dict):
            raise PeerError(f"adapt_pkm takes PKM modules or state dicts, not {type(pkm).__name__} (layer {layer})")
    if backbone is not None:
        config = {
            **{
                k: getattr(backbone.cfg, k)
                for k in (
                    "vocab_size",
                    "d_model",
                    "n_layers",
                    "n_heads",
                    "d_head",
                    "d_mlp",
                    "attention",
                    "rope_base",
                    "norm_eps",
                    "tie_embeddings",
                    "embed_scale",
                )
            },
            **config,
        }
    cfg = ModelConfig(family="product_key_memory", **config, memory={**memory, "layers": sorted(pkms)})
    model = ProductKeyMemoryLM(cfg, tokenizer=backbone.tokenizer if backbone is not None else None)
    if backbone is not None:
        model.warm_start(backbone)
    for layer, pkm in pkms.items():
        weights = pkm.state_dict() if isinstance(pkm, nn.Module) else pkm
        load_peer_weights(model.blocks[layer].mlp.pkm, weights, f"PKM with these settings (layer {layer})")
    return model.eval()
