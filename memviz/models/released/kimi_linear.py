"""Kimi Linear (`kimi_linear`): Kimi Delta Attention layers and multi-head latent attention (MLA, without RoPE),
every mixer kept as `layer.self_attn`, with a mixture of experts. MLA caches its compressed latents: kv_lora_rank
and qk_rope_head_dim numbers a token."""

from __future__ import annotations

from .architecture import TINY, Architecture, AttentionSite, layer_types_say_linear, register
from .kimi_delta_attention import ARCHITECTURES


def config(data: dict):
    from transformers import KimiLinearConfig

    return KimiLinearConfig(**data)


def causal_lm():
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM


def attention_sites(mla) -> dict[str, AttentionSite]:
    """The queries per head (q_proj's output, or q_b_proj's with a low-rank query) and the output per head
    before o_proj."""
    queries = mla.q_proj if mla.q_lora_rank is None else mla.q_b_proj
    return {
        "hook_q": AttentionSite(queries, "output", mla.qk_head_dim),
        "hook_z": AttentionSite(mla.o_proj, "input", mla.v_head_dim),
    }


KIMI_LINEAR = register(
    ARCHITECTURES,
    Architecture(
        model_types={"kimi_linear": "Kimi Linear"},
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
            "model_type": "kimi_linear",
            **TINY,
            "num_key_value_heads": 2,
            "kv_lora_rank": 16,
            "q_lora_rank": None,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "linear_num_heads": 4,
            "linear_head_dim": 8,
            "moe_intermediate_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
        },
        experts=True,
    ),
)
