"""Family registry: a config's `family` names a model class; its `memory` dict fills the
family's options dataclass. Families register themselves when `memviz.models` is imported."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from memviz.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from memviz.model import MemoryLM

FAMILIES: dict[str, type["MemoryLM"]] = {}
M = TypeVar("M", bound=type)


def register_family(name: str) -> Callable[[M], M]:
    def decorate(cls: M) -> M:
        if name in FAMILIES:
            raise ValueError(f"family {name!r} registered twice")
        cls.family = name
        FAMILIES[name] = cls
        return cls

    return decorate


def family_class(name: str) -> type["MemoryLM"]:
    import memviz.models  # noqa: F401  (registers the families)

    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known families are {sorted(FAMILIES)}")
    return FAMILIES[name]


def build_model(cfg: ModelConfig, **kwargs: Any) -> "MemoryLM":
    return family_class(cfg.family)(cfg, **kwargs)


def parse_options(options_cls: type, family: str, data: dict[str, Any]):
    """Fill a family's options dataclass from the config's `memory` dict, naming bad keys."""
    known = {f.name for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown {family} memory options {unknown}; known options are {sorted(known)}")
    try:
        options = options_cls(**data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad {family} memory options: {exc}") from exc
    return options


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_positive(**values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")


def check_finite(**values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
