"""Ling 3.0 (`bailing_hybrid`, Ling-3.0-tiny and -flash): Kimi Delta Attention layers whose decay is bounded,
g_t = kda_lower_bound sigmoid(exp(A_log) (f(x) + dt_bias)) in (-5, 0) per key channel (or Kimi Linear's
parametrisation with `kda_safe_gate` off), and multi-head latent attention with RoPE and an output gate; every
mixer kept as `layer.self_attn`, as Kimi Linear keeps them."""

from __future__ import annotations

from .architecture import TINY, Architecture, layer_types_say_linear, register
from .kimi_delta_attention import ARCHITECTURES
from .kimi_linear import attention_sites


def config(data: dict):
    from transformers import BailingHybridConfig

    return BailingHybridConfig(**data)


def causal_lm():
    from transformers import BailingHybridForCausalLM

    return BailingHybridForCausalLM


BAILING_HYBRID = register(
    ARCHITECTURES,
    Architecture(
        model_types={"bailing_hybrid": "Ling 3.0 (bailing_hybrid)"},
        config=config,
        causal_lm=causal_lm,
        memory=lambda layer: layer.self_attn,
        attention=lambda layer: layer.self_attn if layer.block_type == "full_attention" else None,
        is_memory=layer_types_say_linear,
        state=lambda kda: (kda.num_heads, kda.head_dim, kda.head_dim),
        read_norm=lambda kda: kda.o_norm,
        out_projection=lambda kda: kda.o_proj,
        attention_sites=attention_sites,
        kv_numbers=lambda config: config.kv_lora_rank + config.qk_rope_head_dim,
        tiny={
            "model_type": "bailing_hybrid",
            **TINY,
            "num_attention_heads": 4,  # the memory layers' heads too
            "num_key_value_heads": 4,
            "head_dim": 8,  # the memory layers' d_k = d_v
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
        },
        experts=True,
    ),
)
