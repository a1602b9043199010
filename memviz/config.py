"""Model configuration: one dataclass, validated, round-tripping through JSON.

Family-specific settings live in `memory` (a plain dict) and are validated by the family's
own options dataclass (see `memviz.registry`), so an unknown key or value is caught at load
time with the family's name in the message.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


INIT_SCHEMES = ("gpt2", "fan_in")


class ConfigError(ValueError):
    """A configuration that cannot build a model."""


@dataclass
class ModelConfig:
    family: str = ""  # a registered family's name (`python -m memviz families`)
    vocab_size: int = 259
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_head: int = 0  # 0 means d_model // n_heads
    d_mlp: int = 0  # SwiGLU hidden width; 0 means 8/3 * d_model rounded up to 32
    window: int | None = None  # sliding-window width of local attention; None is full causal
    segment_len: int | None = None  # memory segment length for families that carry state
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    embed_scale: float = 1.0  # input embeddings are multiplied by this (sqrt(d_model) in Vaswani et al. 3.4)
    init: str = "gpt2"  # "gpt2": every weight N(0, 0.02); "fan_in": N(0, 1/fan_in), see MemoryLM.reset_parameters
    memory: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def __post_init__(self) -> None:
        if self.d_head == 0 and self.n_heads > 0:
            self.d_head = self.d_model // self.n_heads
        if self.d_mlp == 0:
            self.d_mlp = -(-self.d_model * 8 // 3 // 32) * 32
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ConfigError(f"config field 'family' must name a model family (python -m memviz families), got {self.family!r}")
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "d_head", "d_mlp")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.d_head % 2:
            raise ConfigError(f"d_head must be even for rotary embeddings, got {self.d_head}")
        for name in ("window", "segment_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"config field {name!r} must be a positive integer or null, got {value!r}")
        if isinstance(self.embed_scale, bool) or not isinstance(self.embed_scale, (int, float)) or not self.embed_scale > 0:
            raise ConfigError(f"config field 'embed_scale' must be a positive number, got {self.embed_scale!r}")
        if self.init not in INIT_SCHEMES:
            raise ConfigError(f"config field 'init' must be one of {list(INIT_SCHEMES)}, got {self.init!r}")
        if not isinstance(self.memory, dict):
            raise ConfigError(f"config field 'memory' must be an object, got {type(self.memory).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known fields are {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "ModelConfig":
        return ModelConfig.from_dict({**self.to_dict(), **changes})
