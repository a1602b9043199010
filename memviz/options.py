"""A family's memory options: the dataclass a config's `memory` dict fills (`parse_options`), and the checks
its `__post_init__` runs on each value, each error naming the option."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from memviz.config import ConfigError


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
