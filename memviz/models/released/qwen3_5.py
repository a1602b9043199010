"""Qwen3.5 (`qwen3_5`, its published vision-language form, whose language model memviz reads, and
`qwen3_5_text`): Gated DeltaNet layers and gated full-attention layers (q_norm, k_norm, an output gate)."""

from __future__ import annotations

from .architecture import TINY, Architecture, AttentionSite, cached_keys_and_values, layer_types_say_linear, register
from .gated_deltanet import ARCHITECTURES

#: the Gated DeltaNet layer of every `tiny` model: 2 key heads, 4 value heads, d_k = d_v = 8
TINY_GATED_DELTANET = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8
)


def config(data: dict):
    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    return Qwen3_5Config(**data).text_config if data["model_type"] == "qwen3_5" else Qwen3_5TextConfig(**data)


def causal_lm():
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM


def attention_sites(attn) -> dict[str, AttentionSite]:
    """Queries and keys after their norms, values, and the gated output before o_proj, per head."""
    d = attn.head_dim
    return {
        "hook_q": AttentionSite(attn.q_norm, "output", d),
        "hook_k": AttentionSite(attn.k_norm, "output", d),
        "hook_v": AttentionSite(attn.v_proj, "output", d),
        "hook_z": AttentionSite(attn.o_proj, "input", d),
    }


def gated_deltanet_layer(**overrides) -> dict:
    """The Architecture fields of a transformers Gated DeltaNet layer kept as `layer.linear_attn` (Qwen3.5's
    names, which Qwen3-Next and OLMo Hybrid share)."""
    return (
        dict(
            memory=lambda layer: layer.linear_attn,
            attention=lambda layer: getattr(layer, "self_attn", None),  # on attention layers only
            is_memory=layer_types_say_linear,
            state=lambda gdn: (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim),
            read_norm=lambda gdn: gdn.norm,
            attention_sites=attention_sites,
            kv_numbers=cached_keys_and_values,
        )
        | overrides
    )


QWEN3_5 = register(
    ARCHITECTURES,
    Architecture(
        model_types={
            "qwen3_5": "Qwen3.5 (its language model; a vision tower is left unread)",
            "qwen3_5_text": "Qwen3.5 text",
        },
        config=config,
        causal_lm=causal_lm,
        tiny={"model_type": "qwen3_5_text", **TINY, **TINY_GATED_DELTANET, "num_key_value_heads": 1, "head_dim": 16},
        **gated_deltanet_layer(),
    ),
)
