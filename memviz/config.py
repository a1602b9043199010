"""Model configuration: one dataclass, validated, round-tripping through JSON.

Family-specific settings live in `memory` (a plain dict) and are validated by the family's
own options dataclass (see `memviz.registry`), so an unknown key or value is caught at load
time with the family's name in the message. What a token's local attention sees is one option,
`attention` ({"kind": "causal" | "window" | "segment", "span": tokens}, `memviz.layers.AttentionSpan`);
`segment_len` is the memory's segment. Configs written before `attention` existed spelled it
`window` (a sliding window) or a family's `memory.local`; they are read into `attention` here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import InitVar, dataclass, field
from typing import Any

INIT_SCHEMES = ("gpt2", "fan_in")
#: the largest model a config may describe, checked before any weight is allocated (memviz is for
#: small models; 2e9 float32 parameters is 8 GB)
MAX_PARAMETERS = 2_000_000_000
#: the longest segment or attention span a config may give: far past any input the workbench streams
MAX_SPAN = 2**24


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
    attention: dict[str, Any] | None = None  # the local attention (module docstring); None: the family's default
    segment_len: int | None = None  # memory segment length for families that carry state
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    embed_scale: float = 1.0  # input embeddings are multiplied by this (sqrt(d_model) in Vaswani et al. 3.4)
    init: str = "gpt2"  # "gpt2": every weight N(0, 0.02); "fan_in": N(0, 1/fan_in), see MemoryLM.reset_parameters
    memory: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    window: InitVar[int | None] = None  # older spelling of attention {"kind": "window", "span": window}

    def __post_init__(self, window: int | None) -> None:
        self.attention = upgraded_attention(self, window)
        if self.d_head == 0 and self.n_heads > 0:
            self.d_head = self.d_model // self.n_heads
        if self.d_mlp == 0:
            self.d_mlp = -(-self.d_model * 8 // 3 // 32) * 32
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise ConfigError(
                f"config field 'family' must name a model family (python -m memviz families), got {self.family!r}"
            )
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "d_head", "d_mlp")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"config field 'tie_embeddings' must be true or false, got {self.tie_embeddings!r}")
        if not isinstance(self.name, str):
            raise ConfigError(f"config field 'name' must be a string, got {self.name!r}")
        if self.d_head % 2:
            raise ConfigError(f"d_head must be even for rotary embeddings, got {self.d_head}")
        if self.segment_len is not None and (
            not isinstance(self.segment_len, int)
            or isinstance(self.segment_len, bool)
            or not 0 < self.segment_len <= MAX_SPAN
        ):
            raise ConfigError(
                f"config field 'segment_len' must be a whole number of tokens from 1 to {MAX_SPAN:,} or null, "
                f"got {self.segment_len!r}"
            )
        if self.attention is not None and (
            not isinstance(self.attention, dict) or set(self.attention) - {"kind", "span"}
        ):
            raise ConfigError(
                f"config field 'attention' must be an object with 'kind' and 'span', got {self.attention!r}"
            )
        if (
            isinstance(self.embed_scale, bool)
            or not isinstance(self.embed_scale, (int, float))
            or not self.embed_scale > 0
        ):
            raise ConfigError(f"config field 'embed_scale' must be a positive number, got {self.embed_scale!r}")
        if self.init not in INIT_SCHEMES:
            raise ConfigError(f"config field 'init' must be one of {list(INIT_SCHEMES)}, got {self.init!r}")
        if not isinstance(self.memory, dict):
            raise ConfigError(f"config field 'memory' must be an object, got {type(self.memory).__name__}")
        for name in ("rope_base", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"config field {name!r} must be a positive finite number, got {value!r}")
        if self.embed_scale == float("inf"):
            raise ConfigError("config field 'embed_scale' must be finite, got inf")
        backbone = self.backbone_parameters
        if backbone > MAX_PARAMETERS:
            raise ConfigError(
                f"this config describes about {backbone:.2e} parameters before any memory (d_model "
                f"{self.d_model}, n_layers {self.n_layers}, d_mlp {self.d_mlp}), over memviz's cap of "
                f"{MAX_PARAMETERS:.0e}; nothing was allocated"
            )

    @property
    def backbone_parameters(self) -> int:
        """About the parameters the config describes before any memory: the embedding, and per layer the attention
        and the MLP."""
        return self.vocab_size * self.d_model + self.n_layers * (
            4 * self.d_model * self.n_heads * self.d_head + 3 * self.d_model * self.d_mlp
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} | {"window"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known fields are {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(str(exc)) from exc

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested past Python's stack
            raise ConfigError(f"config is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with `changes` applied (an `attention` change replaces the attention)."""
        return ModelConfig.from_dict({**self.to_dict(), **changes})


def upgraded_attention(cfg: ModelConfig, window: int | None) -> dict[str, Any] | None:
    """`cfg.attention`, or what an older config's `window` or `memory.local` meant by it (the
    latter is taken out of `cfg.memory`): local "segment" attends within `segment_len`, local
    "window" over the config's window, else over the last `segment_len` tokens."""
    attention = cfg.attention
    if window is not None:
        if attention is not None:
            raise ConfigError("give 'attention' or the older 'window', not both")
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ConfigError(f"config field 'window' must be a positive integer or null, got {window!r}")
        attention = {"kind": "window", "span": window}
    if not isinstance(cfg.memory, dict) or "local" not in cfg.memory:
        return attention
    cfg.memory = dict(cfg.memory)
    local = cfg.memory.pop("local")
    if local not in ("segment", "window"):
        raise ConfigError(
            f"memory option 'local' (an older spelling of 'attention') must be 'segment' or 'window', got {local!r}"
        )
    if local == "window" and attention is not None:
        return attention
    if cfg.segment_len is None:
        raise ConfigError(
            f"memory option local={local!r} attends over config.segment_len; set it (or give 'attention')"
        )
    if local == "segment" and attention is not None:
        raise ConfigError("memory option local='segment' attends within the segment; give it or 'window', not both")
    return {"kind": local, "span": cfg.segment_len}
