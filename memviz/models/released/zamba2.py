"""Zamba2 (`zamba2`): every layer a Mamba-2 mixer; a "hybrid" layer (`layers_block_type`) first runs a shared
transformer block (`layer.shared_transformer`: attention over the concatenation of the hidden state and the token
embeddings, then an MLP) whose output, through `layer.linear`, is added to its Mamba mixer's input.

The shared block's weights are tied across the hybrid layers (every `num_mem_blocks`-th shares one), but each
hybrid layer holds its own module instance, so its hooks fire at that layer alone. Where the config turns on
`use_shared_attention_adapter` (Zamba2-1.2B), per-layer low-rank adapters are added to the query, key and value
projections after they run, so `hook_q`, `hook_k` and `hook_v` would miss them: such a model hooks only `hook_z`
(the heads' output before `o_proj`). `hook_mlp_out` is the shared block's MLP output, which reaches the residual
stream only through `layer.linear` and the Mamba mixer."""

from __future__ import annotations

from .architecture import TINY, Architecture, AttentionSite, projection_sites, register
from .mamba2 import ssd_layer
from .ssd import ARCHITECTURES


def config(data: dict):
    from transformers import Zamba2Config

    return Zamba2Config(**data)


def causal_lm():
    from transformers import Zamba2ForCausalLM

    return Zamba2ForCausalLM


def is_hybrid(layer) -> bool:
    return hasattr(layer, "shared_transformer")


def attention_sites(attn) -> dict[str, AttentionSite]:
    """The projections' sites where they give the attention's queries, keys and values (no adapters added after
    them), else the heads' output before `o_proj` alone."""
    sites = projection_sites(attn)
    return {"hook_z": sites["hook_z"]} if attn.config.use_shared_attention_adapter else sites


ZAMBA2 = register(
    ARCHITECTURES,
    Architecture(
        model_types={"zamba2": "Zamba2"},
        config=config,
        causal_lm=causal_lm,
        final_norm=lambda hf: hf.model.final_layernorm,
        memory=lambda layer: layer.mamba_decoder.mamba if is_hybrid(layer) else layer.mamba,
        attention=lambda layer: layer.shared_transformer.self_attn if is_hybrid(layer) else None,
        mlp=lambda layer: layer.shared_transformer.feed_forward if is_hybrid(layer) else None,
        is_memory=lambda config, l: True,
        attention_sites=attention_sites,
        kv_numbers=lambda config: 2 * config.num_key_value_heads * config.attention_head_dim,
        tiny={
            "model_type": "zamba2",
            **{k: v for k, v in TINY.items() if k != "layer_types"},
            # memory layers 0-3, the shared block at 2 and 3 (tied: one memory block), with adapters
            "layers_block_type": ["mamba", "mamba", "hybrid", "hybrid"],
            "num_key_value_heads": 2,  # transformers' adapters are as wide as the queries, so the keys must be too
            "num_mem_blocks": 1,
            "use_shared_attention_adapter": True,
            "adapter_rank": 8,
            "use_mem_rope": True,
            "n_mamba_heads": 4,
            "mamba_headdim": 16,
            "mamba_d_state": 8,
            "mamba_ngroups": 2,
            "mamba_expand": 2,
            "chunk_size": 8,
        },
        **ssd_layer(),
    ),
)
