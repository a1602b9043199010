"""Qwen3-Next (`qwen3_next`): Qwen3.5's layers with a mixture of experts."""

from __future__ import annotations

from .architecture import TINY, Architecture, register
from .gated_deltanet import ARCHITECTURES
from .qwen3_5 import TINY_GATED_DELTANET, gated_deltanet_layer


def config(data: dict):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**data)


def causal_lm():
    from transformers import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM


QWEN3_NEXT = register(
    ARCHITECTURES,
    Architecture(
        model_types={"qwen3_next": "Qwen3-Next"},
        config=config,
        causal_lm=causal_lm,
        tiny={
            "model_type": "qwen3_next",
            **TINY,
            **TINY_GATED_DELTANET,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
        experts=True,
        **gated_deltanet_layer(),
    ),
)
