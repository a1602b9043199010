"""Mamba (`mamba`): every layer a Mamba-1 mixer (`layer.mixer`), no attention and no MLP."""

from __future__ import annotations

from .architecture import Architecture, register
from .selective_scan import ARCHITECTURES

#: the Mamba-1 layer of every `tiny` model: an inner width of 64 channels, d_state 8
TINY_SCAN = dict(state_size=8, expand=2, conv_kernel=4)


def config(data: dict):
    from transformers import MambaConfig

    return MambaConfig(**data)


def causal_lm():
    from transformers import MambaForCausalLM

    return MambaForCausalLM


def selective_scan_layer(**overrides) -> dict:
    """The Architecture fields of a transformers Mamba-1 mixer: a head per channel, S [d_state, 1], its kernel's
    gated output the layer's value."""
    return (
        dict(
            state=lambda mixer: (mixer.intermediate_size, mixer.ssm_state_size, 1),
            read_norm=lambda mixer: None,
        )
        | overrides
    )


def mamba_only(model_type: str, config, causal_lm) -> Architecture:
    """A model of Mamba-1 blocks alone (`backbone.layers[l].mixer`): Mamba and Falcon Mamba."""
    return Architecture(
        model_types={model_type: {"mamba": "Mamba", "falcon_mamba": "Falcon Mamba"}[model_type]},
        config=config,
        causal_lm=causal_lm,
        layers=lambda hf: hf.backbone.layers,
        memory=lambda layer: layer.mixer,
        attention=lambda layer: None,
        mlp=lambda layer: None,
        is_memory=lambda config, l: True,
        attention_sites=lambda attn: {},
        kv_numbers=lambda config: 0,
        tiny={
            "model_type": model_type,
            "vocab_size": 320,
            "hidden_size": 32,
            "num_hidden_layers": 4,
            **TINY_SCAN,
            "eos_token_id": 0,
            "pad_token_id": None,
            "bos_token_id": None,
        },
        **selective_scan_layer(),
    )


MAMBA = register(ARCHITECTURES, mamba_only("mamba", config, causal_lm))
