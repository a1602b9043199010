"""Falcon Mamba (`falcon_mamba`): Mamba's blocks with B, C and dt RMS-normalised before the scan."""

from __future__ import annotations

from .architecture import register
from .mamba import mamba_only
from .selective_scan import ARCHITECTURES


def config(data: dict):
    from transformers import FalconMambaConfig

    return FalconMambaConfig(**data)


def causal_lm():
    from transformers import FalconMambaForCausalLM

    return FalconMambaForCausalLM


FALCON_MAMBA = register(ARCHITECTURES, mamba_only("falcon_mamba", config, causal_lm))
