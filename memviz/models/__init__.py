"""The built-in families, one module or package each beside this file; importing this package imports
every one of them (found, not listed), which registers each with `memviz.registry`. A new family is a
new folder here and needs no edit to this file.

A family defined elsewhere (a user's file) registers itself the same way, with
`memviz.registry.register_family`, and then works everywhere a built-in one does."""

from __future__ import annotations

from typing import Any, cast

from memviz.config import ConfigError, ModelConfig
from memviz.model import MemoryLM
from memviz.registry import get_family, import_family_folders
from memviz.registry import registered as families  # noqa: F401  (every family in registration order, installed packages' last)


def build_model(cfg: ModelConfig, **kwargs: Any) -> MemoryLM:
    """A fresh model of `cfg.family` (kwargs: tokenizer, card)."""
    family = get_family(cfg.family)
    if not family.from_config:
        raise ConfigError(
            f"family {cfg.family!r} is not built from a config: its models are loaded from a checkpoint "
            "folder (memviz.load)"
        )
    return cast(type[MemoryLM], family.model)(cfg, **kwargs)


import_family_folders(__name__, __path__)
