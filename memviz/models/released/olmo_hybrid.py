"""OLMo Hybrid (`olmo_hybrid`): Gated DeltaNet layers (beta = 2 sigmoid(x w_b), a negative eigenvalue allowed)
and full-attention layers whose q_norm and k_norm act on the whole projection. Its attention layers are post-norm:
`hook_attn_out` is the attention's output before `post_attention_layernorm`."""

from __future__ import annotations

from .architecture import TINY, Architecture, register
from .gated_deltanet import ARCHITECTURES
from .qwen3_5 import TINY_GATED_DELTANET, gated_deltanet_layer


def config(data: dict):
    from transformers import OlmoHybridConfig

    return OlmoHybridConfig(**data)


def causal_lm():
    from transformers import OlmoHybridForCausalLM

    return OlmoHybridForCausalLM


OLMO_HYBRID = register(
    ARCHITECTURES,
    Architecture(
        model_types={"olmo_hybrid": "OLMo Hybrid"},
        config=config,
        causal_lm=causal_lm,
        tiny={"model_type": "olmo_hybrid", **TINY, **TINY_GATED_DELTANET, "num_key_value_heads": 1},
        **gated_deltanet_layer(read_norm=lambda gdn: gdn.o_norm, out_projection=lambda gdn: gdn.o_proj),
    ),
)
