"""Jamba (`jamba`): Mamba-1 layers (`layer.mamba`, with B, C and dt RMS-normalised) and grouped-query attention
layers (`layer.self_attn`) every `attn_layer_period` layers, each followed by an MLP or a mixture of experts
(`layer.feed_forward`)."""

from __future__ import annotations

from .architecture import (
    TINY,
    Architecture,
    cached_keys_and_values,
    layer_types_say_linear,
    projection_sites,
    register,
)
from .mamba import selective_scan_layer
from .selective_scan import ARCHITECTURES


def config(data: dict):
    from transformers import JambaConfig

    return JambaConfig(**data)


def causal_lm():
    from transformers import JambaForCausalLM

    return JambaForCausalLM


JAMBA = register(
    ARCHITECTURES,
    Architecture(
        model_types={"jamba": "Jamba"},
        config=config,
        causal_lm=causal_lm,
        memory=lambda layer: layer.mamba,
        attention=lambda layer: getattr(layer, "self_attn", None),
        mlp=lambda layer: layer.feed_forward,
        is_memory=layer_types_say_linear,
        attention_sites=projection_sites,
        kv_numbers=cached_keys_and_values,
        tiny={
            "model_type": "jamba",
            **{k: v for k, v in TINY.items() if k != "layer_types"},
            "num_key_value_heads": 1,
            "attn_layer_period": 4,
            "attn_layer_offset": 2,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 8,
            "mamba_expand": 2,
            "mamba_d_conv": 4,
        },
        experts=True,
        **selective_scan_layer(),
    ),
)
