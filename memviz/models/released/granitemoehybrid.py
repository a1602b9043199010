"""Granite 4.0-H (`granitemoehybrid`): Bamba's layers (`layer.mamba`, `layer.self_attn`) with a shared MLP after
each, and in the mixture-of-experts sizes experts beside it; `hook_mlp_out` is the shared MLP's output where a
layer has no experts, and absent where it has (its output is the sum of both)."""

from __future__ import annotations

from .architecture import TINY_LAYERS, Architecture, register
from .bamba import TINY_HYBRID, TINY_MAMBA, ssd_hybrid
from .ssd import ARCHITECTURES


def config(data: dict):
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(**data)


def causal_lm():
    from transformers import GraniteMoeHybridForCausalLM

    return GraniteMoeHybridForCausalLM


GRANITE_MOE_HYBRID = register(
    ARCHITECTURES,
    Architecture(
        model_types={"granitemoehybrid": "Granite 4.0-H"},
        config=config,
        causal_lm=causal_lm,
        residual_scale=lambda config: config.residual_multiplier,
        logit_scale=lambda config: 1 / config.logits_scaling,
        tiny={
            "model_type": "granitemoehybrid",
            **TINY_HYBRID,
            **TINY_MAMBA,
            "layer_types": TINY_LAYERS,
            "num_local_experts": 0,
        },
        **ssd_hybrid(mlp=lambda layer: None if layer.has_experts else layer.shared_mlp),
    ),
)
