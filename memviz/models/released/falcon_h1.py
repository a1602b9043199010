"""Falcon-H1 (`falcon_h1`): every layer a Mamba-2 mixer (`layer.mamba`) and a grouped-query attention
(`layer.self_attn`) side by side on the same input, their outputs scaled and summed, then an MLP
(`layer.feed_forward`). Each layer carries a state and an attention cache; `hook_attn_out` is the attention
branch's output and `hook_mem_out` the Mamba branch's: its gated norm's output, or, in the released models, which
have none (`mamba_rms_norm` off), y_t + D x_t before the gate."""

from __future__ import annotations

from .architecture import TINY, Architecture, cached_keys_and_values, projection_sites, register
from .mamba2 import ssd_layer
from .ssd import ARCHITECTURES


def config(data: dict):
    from transformers import FalconH1Config

    return FalconH1Config(**data)


def causal_lm():
    from transformers import FalconH1ForCausalLM

    return FalconH1ForCausalLM


FALCON_H1 = register(
    ARCHITECTURES,
    Architecture(
        model_types={"falcon_h1": "Falcon-H1"},
        config=config,
        causal_lm=causal_lm,
        read_lens="Falcon-H1 gates its read inline without a norm (mamba_rms_norm false), and its multipliers "
        "(ssm_out_multiplier, lm_head_multiplier) are not yet on the path",
        final_norm=lambda hf: hf.model.final_layernorm,
        memory=lambda layer: layer.mamba,
        attention=lambda layer: layer.self_attn,
        mlp=lambda layer: layer.feed_forward,
        is_memory=lambda config, l: True,
        attention_sites=projection_sites,
        kv_numbers=cached_keys_and_values,
        tiny={
            "model_type": "falcon_h1",
            **{k: v for k, v in TINY.items() if k != "layer_types"},
            "num_key_value_heads": 1,
            "head_dim": 16,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_d_state": 8,
            "mamba_n_groups": 2,
            "mamba_expand": 2,
            "mamba_chunk_size": 8,
        },
        **ssd_layer(read_norm=lambda mixer: mixer.norm if mixer.mamba_rms_norm else None),
    ),
)
