"""Bamba (`bamba`): Mamba-2 layers (`layer.mamba`) and grouped-query attention layers (`layer.self_attn`), each
followed by an MLP (`layer.feed_forward`); `attn_layer_indices` says which layers attend."""

from __future__ import annotations

from .architecture import (
    TINY,
    Architecture,
    cached_keys_and_values,
    layer_types_say_linear,
    projection_sites,
    register,
)
from .mamba2 import ssd_layer
from .ssd import ARCHITECTURES

#: the Mamba-2 layer of every hybrid `tiny` model (Bamba's and Granite's field names)
TINY_MAMBA = dict(
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_expand=2, mamba_chunk_size=8
)
#: TINY without its layer_types (the hybrids give the attention layers their own way)
TINY_HYBRID = {k: v for k, v in TINY.items() if k != "layer_types"} | {"num_key_value_heads": 1}


def config(data: dict):
    from transformers import BambaConfig

    return BambaConfig(**data)


def causal_lm():
    from transformers import BambaForCausalLM

    return BambaForCausalLM


def ssd_hybrid(**overrides) -> dict:
    """The Architecture fields of a hybrid keeping its Mamba-2 mixer as `layer.mamba` and its attention as
    `layer.self_attn` (Bamba's names, which Granite 4.0-H shares)."""
    return (
        dict(
            memory=lambda layer: layer.mamba,
            attention=lambda layer: getattr(layer, "self_attn", None),
            is_memory=layer_types_say_linear,
            attention_sites=projection_sites,
            kv_numbers=cached_keys_and_values,
            mlp=lambda layer: layer.feed_forward,
            **ssd_layer(),
        )
        | overrides
    )


BAMBA = register(
    ARCHITECTURES,
    Architecture(
        model_types={"bamba": "Bamba"},
        config=config,
        causal_lm=causal_lm,
        final_norm=lambda hf: hf.model.final_layernorm,
        tiny={"model_type": "bamba", **TINY_HYBRID, **TINY_MAMBA, "attn_layer_indices": [2]},
        **ssd_hybrid(),
    ),
)
