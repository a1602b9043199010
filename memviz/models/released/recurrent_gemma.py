"""RecurrentGemma (`recurrent_gemma`; Botev et al., arXiv 2404.07839, Griffin's architecture): residual blocks whose
temporal block (`layer.temporal_block`) is an RG-LRU recurrent block or a local multi-query attention over a sliding
window of `attention_window_size` tokens, in the repeating pattern `block_types` (recurrent, recurrent, attention),
each followed by a gated MLP (`layer.mlp_block`). The recurrent blocks run memviz's forward (`rg_lru.py`)."""

from __future__ import annotations

from .architecture import Architecture, cached_keys_and_values, layer_types_say_linear, projection_sites, register
from .rg_lru import ARCHITECTURES


def config(data: dict):
    """transformers' config; refused where its RG-LRU's gates cannot be cut into one block per head."""
    from transformers import RecurrentGemmaConfig

    made = RecurrentGemmaConfig(**data)
    width = made.hidden_size if made.lru_width is None else made.lru_width  # transformers' default
    if width % made.num_attention_heads:
        raise ValueError(
            f"lru_width {width} is not a multiple of num_attention_heads {made.num_attention_heads}: the "
            "RG-LRU's gates are one block of lru_width / num_attention_heads channels a head"
        )
    if made.attention_window_size < 1 or made.conv1d_width < 1:
        raise ValueError(
            f"attention_window_size {made.attention_window_size} and conv1d_width {made.conv1d_width} must be 1 or "
            "more tokens"
        )
    return made


def causal_lm():
    from transformers import RecurrentGemmaForCausalLM

    return RecurrentGemmaForCausalLM


def is_recurrent(block) -> bool:
    return hasattr(block, "rg_lru")


RECURRENT_GEMMA = register(
    ARCHITECTURES,
    Architecture(
        model_types={"recurrent_gemma": "RecurrentGemma"},
        config=config,
        causal_lm=causal_lm,
        memory=lambda layer: layer.temporal_block,
        attention=lambda layer: None if is_recurrent(layer.temporal_block) else layer.temporal_block,
        mlp=lambda layer: layer.mlp_block,
        is_memory=layer_types_say_linear,  # transformers names the recurrent blocks' type "linear_attention"
        state=lambda block: (block.lru_width, 1, 1),
        read_norm=lambda block: None,
        attention_sites=projection_sites,
        kv_numbers=cached_keys_and_values,
        tiny={
            "model_type": "recurrent_gemma",
            "vocab_size": 320,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "block_types": ["recurrent", "recurrent", "attention", "recurrent"],
            "attention_window_size": 8,  # shorter than the tests' inputs, so that streaming crosses it
            "conv1d_width": 4,
            "eos_token_id": 0,
            "pad_token_id": None,
            "bos_token_id": None,
        },
    ),
)
