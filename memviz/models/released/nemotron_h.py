"""Nemotron-H (`nemotron_h`): every layer one mixer (`layer.mixer`), a Mamba-2 mixer, grouped-query attention, an
MLP or a mixture of experts, as `layers_block_type` says; an MLP layer's `hook_mlp_out` is its mixer's output."""

from __future__ import annotations

from .architecture import TINY, Architecture, cached_keys_and_values, projection_sites, register
from .mamba2 import ssd_layer
from .ssd import ARCHITECTURES


def config(data: dict):
    from transformers import NemotronHConfig

    return NemotronHConfig(**data)


def causal_lm():
    from transformers import NemotronHForCausalLM

    return NemotronHForCausalLM


NEMOTRON_H = register(
    ARCHITECTURES,
    Architecture(
        model_types={"nemotron_h": "Nemotron-H"},
        config=config,
        causal_lm=causal_lm,
        final_norm=lambda hf: hf.model.norm_f,
        memory=lambda layer: layer.mixer,
        attention=lambda layer: layer.mixer if layer.block_type == "full_attention" else None,
        mlp=lambda layer: layer.mixer if layer.block_type in ("mlp", "moe") else None,
        is_memory=lambda config, l: config.layers_block_type[l] == "linear_attention",
        attention_sites=projection_sites,
        kv_numbers=cached_keys_and_values,
        tiny={
            "model_type": "nemotron_h",
            **{k: v for k, v in TINY.items() if k not in ("layer_types", "num_hidden_layers")},
            "num_key_value_heads": 1,
            "head_dim": 16,
            "hybrid_override_pattern": "MM*M-",  # memory layers 0, 1, 3, attention at 2, an MLP at 4
            "num_hidden_layers": 5,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "ssm_state_size": 8,
            "n_groups": 2,
            "expand": 2,
            "chunk_size": 8,
        },
        **ssd_layer(),
    ),
)
