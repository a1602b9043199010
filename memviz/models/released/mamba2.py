"""Mamba-2 (`mamba2`): every layer a Mamba-2 mixer (`layer.mixer`), no attention and no MLP."""

from __future__ import annotations

from .architecture import Architecture, register
from .ssd import ARCHITECTURES

#: the Mamba-2 layer of every `tiny` model: 4 heads of head_dim 16 in 2 groups, d_state 8
TINY_SSD = dict(num_heads=4, head_dim=16, state_size=8, n_groups=2, expand=2, chunk_size=8)


def config(data: dict):
    from transformers import Mamba2Config

    return Mamba2Config(**data)


def causal_lm():
    from transformers import Mamba2ForCausalLM

    return Mamba2ForCausalLM


def ssd_layer(**overrides) -> dict:
    """The Architecture fields of a transformers Mamba-2 mixer: S [d_state, head_dim] a head, read through the
    mixer's gated norm."""
    return (
        dict(
            state=lambda mixer: (mixer.num_heads, mixer.ssm_state_size, mixer.head_dim),
            read_norm=lambda mixer: mixer.norm,
        )
        | overrides
    )


MAMBA2 = register(
    ARCHITECTURES,
    Architecture(
        model_types={"mamba2": "Mamba-2"},
        config=config,
        causal_lm=causal_lm,
        layers=lambda hf: hf.backbone.layers,
        final_norm=lambda hf: hf.backbone.norm_f,
        memory=lambda layer: layer.mixer,
        attention=lambda layer: None,
        mlp=lambda layer: None,
        is_memory=lambda config, l: True,
        attention_sites=lambda attn: {},
        kv_numbers=lambda config: 0,
        tiny={
            "model_type": "mamba2",
            "vocab_size": 320,
            "hidden_size": 32,
            "num_hidden_layers": 4,
            **TINY_SSD,
            "eos_token_id": 0,
            "pad_token_id": None,
            "bos_token_id": None,
        },
        **ssd_layer(),
    ),
)
